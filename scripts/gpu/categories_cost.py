"""Where the category hooks' time goes (a diagnostic for issue 23's cost target): variants of
the hooks alternated within one process, on a model of models.py, under the shim; each
round runs one step of each variant, the same step, after an untimed one (switching patches
classes, which costs Python's attribute caches a step to re-warm). Prints `workload=MODEL label=VARIANT
step_ms=X` lines for ratio_ci.py, then a profile of three steps with the hooks on.
Variants: off; empty (global module hooks that do nothing: PyTorch's slow path alone); full;
no_backward_scopes; no_tags and no_phases (the library's calls replaced by a Python no-op);
only_modules, only_optimizer (the other part's hooks off; backward's phase and gradients stay);
no_backward (no backward phase, no gradients' tags).
Usage: categories_cost.py MODEL ROUNDS LOG [VARIANT,VARIANT,...]"""
import os
import sys

import torch
import torch.nn.modules.module as module_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cachealloc_categories as cc  # noqa: E402
import models  # noqa: E402

MODEL, ROUNDS, LOG = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
step, model = models.build(MODEL)
def empty_hooks(on):
    """Global hooks that do nothing: the cost of Module.__call__'s slow path alone."""
    handles = []
    if on:
        handles.append(module_module.register_module_forward_pre_hook(lambda m, a: None))
        handles.append(
            module_module.register_module_forward_hook(lambda m, a, o: None, always_call=True)
        )
    return handles


api = cc._state.api
real_phase, real_tag = api.phase, api._tag
real_backward_begin = cc.backward_begin


def nothing(*args):
    return 0


def variant(name):
    parts = {"only_modules": ["module"], "only_optimizer": ["optimizer"]}.get(name)
    cc.enable(name not in ("off", "empty"), parts)
    cc._state.backward_scopes = name != "no_backward_scopes"
    api.phase = nothing if name == "no_phases" else real_phase
    api._tag = nothing if name == "no_tags" else real_tag
    cc.backward_begin = (lambda: None) if name == "no_backward" else real_backward_begin
    return empty_hooks(name == "empty")


VARIANTS = sys.argv[4].split(",") if len(sys.argv) > 4 else [
    "off", "empty", "no_backward_scopes", "no_tags", "no_phases", "full"]
for i in range(6):
    step(i)


def switch(name):
    handles = variant(name)
    return lambda: [h.remove() for h in handles]


with open(LOG, "a") as log:
    models.alternate(step, ROUNDS, VARIANTS, switch, log, MODEL)
cc.enable(True)
import cProfile  # noqa: E402
import pstats  # noqa: E402

profile = cProfile.Profile()
profile.enable()
for i in range(3):
    step(i)
torch.cuda.synchronize()
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(25)
print("OK categories_cost")
