"""What the trace costs a training step (issue 25), measured within one process: a workload of
models.py (llama, cnn, mlp, gpt2) trained under the shim (trace on), step by step with one part of the
trace on and paused, each round running the same step both ways in alternating order, each
timed step after an untimed one. SWITCH (env) says which part:
  stacks (default)  stack capture (`cachealloc_stacks_pause`; records go on, with no stack):
                    labels stacks|nostacks
  trace             the allocation records themselves, stacks included
                    (`cachealloc_trace_pause`): labels trace|notrace
  history           PyTorch's memory history, `_record_memory_history(stacks="python")` and
                    `(None)` (under the shim: the trace's settings and PyTorch's own recorder,
                    Note [PyTorch's own contexts]; natively PyTorch's recorder): labels
                    history|nohistory
Prints `workload=MODEL label=L step_ms=X` lines for ratio_ci.py, and the allocations per step.
Usage: [SWITCH=trace] recorder_cost.py MODEL ROUNDS LOG"""
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

MODEL, ROUNDS, LOG = sys.argv[1], int(sys.argv[2]), sys.argv[3]
SWITCH = os.environ.get("SWITCH", "stacks")
LABELS = [SWITCH, "no" + SWITCH]
if SWITCH == "history":
    def pause(off):
        torch.cuda.memory._record_memory_history(None if off else "all", stacks="python")
else:
    pause = getattr(ctypes.CDLL(None), "cachealloc_stacks_pause" if SWITCH == "stacks" else "cachealloc_trace_pause")
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
torch.manual_seed(0)
step, model = models.build(MODEL)
for i in range(6):
    step(i)
before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
step(0)
per_step = torch.cuda.memory_stats().get("allocation.all.allocated", 0) - before


def switch(label):
    pause(label == LABELS[1])


with open(LOG, "a") as log:
    models.alternate(step, ROUNDS, LABELS, switch, log, MODEL)
pause(0)
print(f"OK recorder_cost {MODEL} {SWITCH}: {ROUNDS} rounds, {per_step} allocations a step")
