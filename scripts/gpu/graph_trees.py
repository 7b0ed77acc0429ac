"""CUDA graph trees (torch.compile(mode="reduce-overhead")'s default), natively and under the
shim, where cachealloc's C++ allocator serves them (Note [Graph trees under the shim]). Checks,
one line each (`graph_trees check=NAME ok=BOOL ...`), then `graph_trees label=L passed=N/M`:

  trees       Inductor keeps graph trees on (the integration turns them off only when its
              allocator is not installed), and the backend PyTorch reports
  branches    three functions compiled with reduce-overhead, called as f->g in one step and
              f->h in the next: h is recorded after replaying f, so the graph pool is put back
              to the checkpoint taken after f; every output equals eager's, over several steps
  checkpoint  that restore happened (the tree manager's checkpoint counter)
  training    a small MLP trained with a reduce-overhead step function (forward and backward
              graphs of one tree, optimizer outside): its losses equal eager training's
  live        an output of a replay kept across later replays is not overwritten while held
              (cloned values compared), and the pool's live blocks match graph trees' own
              accounting (`check_memory_pool`)
  frames      a graph break inside a module: Dynamo compiles as many frames with the shim's
              module wrappers (memory by category) as without them
"""
import os
import sys
import warnings

import torch

warnings.simplefilter("ignore")
label = os.environ.get("LABEL", "-")
results = []


def check(name, ok, detail=""):
    results.append(bool(ok))
    print(f"graph_trees check={name} ok={bool(ok)} {detail}".rstrip(), flush=True)


def check_compiled_frames(x):
    """A graph break inside a module: Dynamo compiles as many frames with the shim's module
    wrappers (memory by category) as without them (`cachealloc_categories.enable(False)`;
    natively both runs are PyTorch's own)."""
    from torch._dynamo.utils import counters

    class Branching(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(x.shape[1], 16, device=x.device)
            self.second = torch.nn.Linear(16, 16, device=x.device)

        def forward(self, inp):
            y = self.first(inp)
            y = y + 1 if y.sum() > 0 else y - 1  # data-dependent: a graph break
            return self.second(y)

    model = Branching()

    def frames():
        torch._dynamo.reset()
        counters.clear()
        torch.compile(model, backend="eager")(x)
        return counters["frames"]["ok"]

    categories = sys.modules.get("cachealloc_categories")
    with_wrappers = frames()
    if categories is not None:
        categories.enable(False)
    without = frames()
    if categories is not None:
        categories.enable(True)
    check("frames", with_wrappers == without, f"frames={with_wrappers} without_wrappers={without}")


def main():
    import torch._inductor.config as inductor_config

    inductor_config.triton.slow_path_cudagraph_asserts = True  # check_memory_pool on restores
    trees = inductor_config.triton.cudagraph_trees
    check("trees", trees, f"backend={torch.cuda.get_allocator_backend()}")

    dev = "cuda"
    torch.manual_seed(0)
    x = torch.randn(256, 256, device=dev)

    def f(x):
        return (x @ x).relu() + 1

    def g(y):
        return (y * 2).sin()

    def h(y):
        return (y - 3).cos() * y

    cf, cg, ch = (torch.compile(fn, mode="reduce-overhead") for fn in (f, g, h))
    worst = 0.0
    for step in range(6):
        torch.compiler.cudagraph_mark_step_begin()
        a = cf(x)
        b = cg(a)
        expect_b = g(f(x))
        worst = max(worst, (b - expect_b).abs().max().item())
        torch.compiler.cudagraph_mark_step_begin()
        a = cf(x)
        c = ch(a)
        expect_c = h(f(x))
        worst = max(worst, (c - expect_c).abs().max().item())
    check("branches", worst < 1e-3, f"max_err={worst:.2e}")

    counter = None
    try:
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
        counter = manager.debug_checkpointing_counter if manager is not None else None
    except Exception as e:
        print(f"graph_trees note: no tree manager: {e}", flush=True)
    check("checkpoint", counter is not None and counter >= 1, f"checkpoints={counter}")

    # Training: the same initial weights, eager and compiled.
    def make():
        torch.manual_seed(1)
        return torch.nn.Sequential(
            torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)
        ).to(dev)

    data = [torch.randn(64, 512, device=dev) for _ in range(4)]
    target = [torch.randn(64, 512, device=dev) for _ in range(4)]

    def losses(model, compiled):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        def step_fn(inp, tgt):
            return torch.nn.functional.mse_loss(model(inp), tgt)

        step = torch.compile(step_fn, mode="reduce-overhead") if compiled else step_fn
        out = []
        for i in range(12):
            torch.compiler.cudagraph_mark_step_begin()
            loss = step(data[i % 4], target[i % 4])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        return out

    eager_losses = losses(make(), False)
    compiled_losses = losses(make(), True)
    diff = max(abs(a - b) for a, b in zip(eager_losses, compiled_losses))
    check("training", diff < 1e-3, f"max_loss_diff={diff:.2e} last={compiled_losses[-1]:.4f}")

    # A replay's output held across later replays of another graph keeps its values.
    torch.compiler.cudagraph_mark_step_begin()
    held = cf(x)
    held_value = held.clone()
    other = cg(held)
    again = ch(held)
    del other, again
    ok = torch.equal(held, held_value)
    check("live", ok)

    check_compiled_frames(x)

    passed = sum(results)
    print(f"graph_trees label={label} passed={passed}/{len(results)}", flush=True)
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
