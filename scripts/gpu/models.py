"""The allocation-heavy training workloads of issues 23 and 25, trained under bf16 autocast
with fused AdamW by `step_fn`:

* `llama()`: a transformers Llama, 8 layers x 1024 (16 heads, MLP 2816, vocabulary 32 000),
  random weights, batch 8, sequence lengths cycling 256..1024 — about 1 200 allocations a
  step;
* `cnn()`: residual blocks with batch norm (64 to 512 channels), channels_last, batch 64,
  images cycling 128..224 pixels — about 460 allocations a step;
* `mlp()` and `gpt2()`: the public workloads `mlp_train.py` and `gpt2_train.py` of
  `../shared/gpu/` (the same models, batches and losses, fp32 with unfused AdamW), so that
  their allocation-light steps can be measured within one process too.

`build(name)` gives a workload's step function with its optimizer and precision.

`alternate` is the within-process benchmark those scripts share. Used by categories.py,
categories_cost.py, recorder_cost.py and train_models.py (import this module)."""
import time
import uuid

import torch
import torch.nn as nn

dev = torch.device("cuda")


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048,
    )
    model = LlamaForCausalLM(config).to(dev)
    lengths = [256, 512, 384, 1024, 640, 768]

    def batch(step):
        ids = torch.randint(0, 32000, (8, lengths[step % len(lengths)]), device=dev)
        return (ids,), {"labels": ids}

    def loss_of(out, target):
        return out.loss

    return model, batch, loss_of


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        layers = [nn.Conv2d(3, 64, 7, stride=2, padding=3), nn.BatchNorm2d(64), nn.ReLU()]
        c = 64
        for stage in range(4):
            layers += [Block(c), Block(c)]
            if stage < 3:
                layers += [nn.Conv2d(c, c * 2, 3, stride=2, padding=1), nn.BatchNorm2d(c * 2)]
                c *= 2
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, 1000)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def cnn():
    model = Cnn().to(dev).to(memory_format=torch.channels_last)
    sizes = [128, 160, 192, 224]

    def batch(step):
        s = sizes[step % len(sizes)]
        x = torch.randn(64, 3, s, s, device=dev).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (64,), device=dev)
        return (x,), {"target": y}

    return model, batch, None


def mlp():
    block = lambda: nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024), nn.LayerNorm(1024))
    model = nn.Sequential(*[block() for _ in range(8)]).to(dev)

    def batch(step):
        bs = 64 * (1 + step % 4)
        return (torch.randn(bs, 1024, device=dev),), {"target": torch.randn(bs, 1024, device=dev)}

    return model, batch, lambda out, target: nn.functional.mse_loss(out, target)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=6, n_embd=768, n_head=12, vocab_size=32000, n_positions=1024,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(dev)
    lengths = [128, 512, 256, 1024, 384]

    def batch(step):
        ids = torch.randint(0, 32000, (8, lengths[step % len(lengths)]), device=dev)
        return (), {"input_ids": ids, "labels": ids}

    return model, batch, lambda out, target: out.loss


def build(name):
    """`(step, model)` for the workload `name` (llama, cnn, mlp, gpt2): the allocation-heavy
    ones under bf16 autocast with fused AdamW, mlp and gpt2 as their public scripts train
    them (fp32, AdamW unfused)."""
    heavy = name in ("llama", "cnn")
    model, batch, loss_of = {"llama": llama, "cnn": cnn, "mlp": mlp, "gpt2": gpt2}[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=heavy)
    return step_fn(model, batch, loss_of, opt, autocast=heavy), model


def step_fn(model, batch, loss_of, opt, autocast=True):
    """One training step `step(i)` on batch `i`: forward under bf16 autocast unless `autocast`
    is False (the loss kept,
    the model's outputs dropped, as transformers' Trainer does), backward, the optimizer's
    step, `zero_grad(set_to_none=True)`. With `pack`, the forward runs under
    `saved_tensors_hooks(pack, …)` (pack must return its tensor); with `at`, `at(name, i, args)`
    is called after the forward, the backward and the optimizer's step."""

    def step(i, pack=None, at=None):
        args, kwargs = batch(i)
        target = kwargs.pop("target", None)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            if pack is not None:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(*args, **kwargs)
                    loss = loss_of(out, target) if loss_of else nn.functional.cross_entropy(out, target)
            else:
                out = model(*args, **kwargs)
                loss = loss_of(out, target) if loss_of else nn.functional.cross_entropy(out, target)
        # The loss is kept, the outputs dropped, as transformers' Trainer does.
        del out
        if at:
            at("after_forward", i, args)
        loss.backward()
        if at:
            at("after_backward", i, args)
        opt.step()
        if at:
            at("after_optimizer", i, args)
        opt.zero_grad(set_to_none=True)
        del loss

    return step


def timed(step, i):
    """Run `step(i)` between two synchronizations; its wall time in ms."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000


def alternate(step, rounds, labels, switch, log, workload):
    """Time `step` under each of `labels` within one process, one step at a time: round `r`
    runs step `r` (the same batch) once per label, in the labels' order on even rounds and the
    reverse on odd ones; `switch(label)` sets the label's configuration (and may return a
    function to call after the timed step); each timed step follows an untimed one (a switch
    can cost the next step: patched classes make Python's attribute caches re-warm). Writes
    `workload=… label=… round=… step_ms=… main_ms=… set=…` lines to `log` for ratio_ci.py
    (`main_ms`: the calling thread's CPU time in the timed step, which tells its own work from
    waiting and from other threads' interference; `set`: this process, a random name, so that
    ratio_ci.py's interval over a log of several processes resamples the processes before their
    rounds: processes of one build differ by more than their rounds say)."""
    process = uuid.uuid4().hex[:8]
    for r in range(rounds):
        for label in labels if r % 2 == 0 else labels[::-1]:
            done = switch(label)
            step(r)
            torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.thread_time()
            step(r)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1000
            main_ms = (time.thread_time() - c0) * 1000
            if done is not None:
                done()
            print(
                f"workload={workload} label={label} round={r} step_ms={ms:.4f} main_ms={main_ms:.4f}"
                f" set={process}",
                file=log,
            )
