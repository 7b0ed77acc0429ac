"""The first snapshot of a long run: a program that turns its memory history on, trains, then
asks for `torch.cuda.memory._snapshot()` (what `_dump_snapshot` pickles) and
`torch.cuda.memory_snapshot()`, as users do at the end of a run or when it runs out of memory.
Natively PyTorch answers from its allocator; under the shim the snapshot server has followed
the trace since the history call (design.md, Departures: "A snapshot is walked from the
trace"). Prints the training's step time, each snapshot's seconds (the first and a second),
and what the snapshot holds, on one line.

Usage: python3 late_snapshot.py MODEL STEPS  (a model of models.py: llama, gpt2, mlp, cnn)"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

name, steps = sys.argv[1], int(sys.argv[2])
step, _ = models.build(name)
for i in range(3):
    step(i)
torch.cuda.memory._record_memory_history(max_entries=100_000)
torch.cuda.synchronize()
t0 = time.perf_counter()
for i in range(steps):
    step(i)
torch.cuda.synchronize()
step_ms = (time.perf_counter() - t0) / steps * 1000
times = {}
for label in ("first", "second"):
    t = time.perf_counter()
    snapshot = torch.cuda.memory._snapshot()
    times[label] = time.perf_counter() - t
t = time.perf_counter()
segments = torch.cuda.memory_snapshot()
segments_s = time.perf_counter() - t
events = sum(len(trace) for trace in snapshot["device_traces"])
blocks = [b for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
with_frames = sum(1 for b in blocks if b.get("frames"))
event_frames = sum(1 for trace in snapshot["device_traces"] for e in trace if e.get("frames"))
allocated = sum(b["size"] for b in blocks)
# The events without frames, by action (natively only the first has none).
bare = {}
for trace in snapshot["device_traces"]:
    for e in trace:
        if not e.get("frames"):
            bare[e["action"]] = bare.get(e["action"], 0) + 1
print(
    f"late_snapshot model={name} steps={steps} step_ms={step_ms:.2f} first_s={times['first']:.3f} "
    f"second_s={times['second']:.3f} segments_s={segments_s:.3f} events={events} "
    f"event_frames={event_frames} blocks={len(blocks)} blocks_with_frames={with_frames} "
    f"allocated_mb={allocated / 2**20:.1f} torch_allocated_mb={torch.cuda.memory_allocated() / 2**20:.1f} "
    f"segments_equal={segments == snapshot['segments']} "
    f"no_frames={','.join(f'{a}:{n}' for a, n in sorted(bare.items())) or '-'}",
    flush=True,
)
