"""Where the category hooks' time goes (a diagnostic for issue 23's cost target): variants of
the hooks alternated round by round within one process, on the Llama of categories.py, under
the shim; each round runs one step of each variant, the same step. Prints
`workload=llama label=VARIANT step_ms=X` lines for ratio_ci.py.
Usage: categories_cost.py ROUNDS LOG"""
import os
import sys
import time

import torch
import torch.nn.modules.module as module_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cachealloc_categories as cc  # noqa: E402
import categories  # noqa: E402

ROUNDS, LOG = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
model, batch, loss_of = categories.llama()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
step = categories.step_fn(model, batch, loss_of, opt)
def empty_hooks(on):
    """Global hooks that do nothing: the cost of Module.__call__'s slow path alone."""
    handles = []
    if on:
        handles.append(module_module.register_module_forward_pre_hook(lambda m, a: None))
        handles.append(
            module_module.register_module_forward_hook(lambda m, a, o: None, always_call=True)
        )
    return handles


def variant(name):
    cc.enable(name not in ("off", "empty"))
    cc._state.backward_scopes = name != "no_backward_scopes"
    return empty_hooks(name == "empty")


VARIANTS = ["off", "empty", "no_backward_scopes", "full"]
for i in range(6):
    step(i)
with open(LOG, "a") as log:
    for r in range(ROUNDS):
        # Each variant runs the same step (the same sequence length), in alternating order.
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for name in order:
            handles = variant(name)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(r)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1000
            for h in handles:
                h.remove()
            print(f"workload=llama label={name} round={r} step_ms={ms:.4f}", file=log)
cc.enable(True)
import cProfile  # noqa: E402
import pstats  # noqa: E402

profile = cProfile.Profile()
profile.enable()
for i in range(3):
    step(i)
torch.cuda.synchronize()
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(18)
print("OK categories_cost")
