"""What the trace's Python stacks cost a training step (issue 25), measured within one process:
the Llama or the CNN of models.py trained under the shim (trace on), step by step with
stack capture on and paused (`cachealloc_stacks_pause`; records go on, with no stack), each
round running the same step both ways in alternating order, each timed step after an untimed
one. Prints `workload=MODEL label=stacks|nostacks step_ms=X` lines for ratio_ci.py, and the
allocations per step.
Usage: recorder_cost.py MODEL ROUNDS LOG"""
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

MODEL, ROUNDS, LOG = sys.argv[1], int(sys.argv[2]), sys.argv[3]
pause = ctypes.CDLL(None).cachealloc_stacks_pause
pause.argtypes = [ctypes.c_int]
pause.restype = ctypes.c_int
torch.manual_seed(0)
model, batch, loss_of = models.llama() if MODEL == "llama" else models.cnn()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
step = models.step_fn(model, batch, loss_of, opt)
for i in range(6):
    step(i)
before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
step(0)
per_step = torch.cuda.memory_stats().get("allocation.all.allocated", 0) - before


def switch(label):
    pause(label == "nostacks")


with open(LOG, "a") as log:
    models.alternate(step, ROUNDS, ["stacks", "nostacks"], switch, log, MODEL)
pause(0)
print(f"OK recorder_cost {MODEL}: {ROUNDS} rounds, {per_step} allocations a step")
