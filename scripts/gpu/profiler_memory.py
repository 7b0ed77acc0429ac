"""PyTorch's profiler's view of CUDA memory, natively and under the shim (same command; issue
22): `torch.profiler.profile(profile_memory=True)` gets its memory events from the allocator,
and PyTorch's `cudaMallocAsync` backend, which the shim runs under, reports none; the shim
reports them as PyTorch's native allocator does.

* `op_memory`: `torch.rand(1024, 1024)` in a profile shows 4 MiB of device memory on its
  operator, and freeing it within the profile brings the profile's net to zero.
* `memory_timeline`: `export_memory_timeline` of one training step of a small MLP (JSON:
  times and bytes by category) shows the parameters' bytes, and its peak holds the step's
  gradients too.
* `profile_to_snapshot`: `torch.cuda._memory_viz._profile_to_snapshot` (what PyTorch's own
  `test_memory_profiler_viz` renders) has the profile's allocations with this file's frames.
* `out_of_memory`: an allocation beyond the device's memory within a profile raises
  `OutOfMemoryError`, and the profile still exports.

Prints `profiler_memory label=L check=NAME ok=True|False detail=...` per check and a last
`profiler_memory label=L passed=N/M`.
"""
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402

checks = Checks("profiler_memory")
MIB = 1 << 20


def profile(fn):
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
        profile_memory=True,
        record_shapes=True,
        with_stack=True,
    ) as prof:
        fn()
    return prof


def device_memory(event):
    return getattr(event, "self_device_memory_usage", None) or getattr(event, "self_cuda_memory_usage", 0)


def op_memory():
    def work():
        x = torch.rand(1024, 1024, device="cuda")
        del x

    prof = profile(work)
    rand = [e for e in prof.key_averages() if e.key == "aten::rand"]
    net = sum(device_memory(e) for e in prof.key_averages())
    made = sum(device_memory(e) for e in rand)
    empty = [e for e in prof.key_averages() if e.key == "aten::empty"]
    made = made or sum(device_memory(e) for e in empty)
    return made == 4 * MIB and net == 0, f"rand's device memory {made} B, the profile's net {net} B"


def training_step_profile():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 1024, device="cuda")

    def step():
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    return profile(step), sum(p.numel() * p.element_size() for p in model.parameters())


def memory_timeline():
    prof, parameter_bytes = training_step_profile()
    path = os.path.join(tempfile.mkdtemp(), "timeline.json")
    prof.export_memory_timeline(path, device="cuda:0")
    with open(path) as f:
        times, sizes = json.load(f)
    # Each row: the bytes of each category at that time.
    peak = max(sum(row) for row in sizes) if sizes else 0
    most_in_one = max((max(row) for row in sizes), default=0)
    ok = len(times) > 0 and peak >= 2 * parameter_bytes and most_in_one >= parameter_bytes * 0.99
    return ok, f"{len(times)} times, peak {peak / MIB:.1f} MiB, largest category {most_in_one / MIB:.1f} MiB, parameters {parameter_bytes / MIB:.1f} MiB"


def profile_to_snapshot():
    from torch.cuda._memory_viz import _profile_to_snapshot

    prof, _ = training_step_profile()
    snapshot = _profile_to_snapshot(prof)
    text = json.dumps(snapshot)
    traces = [e for t in snapshot.get("device_traces", []) for e in t]
    allocs = [e for e in traces if e.get("action") == "alloc"]
    ok = len(allocs) > 0 and "profiler_memory.py" in text and "category" in text
    return ok, f"{len(allocs)} allocations in the snapshot's trace"


def out_of_memory():
    free, total = torch.cuda.mem_get_info()
    raised = []

    def work():
        try:
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            raised.append(True)

    prof = profile(work)
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    return bool(raised) and os.path.getsize(path) > 0, f"raised {bool(raised)}"


checks.check("op_memory", op_memory)
checks.check("memory_timeline", memory_timeline)
checks.check("profile_to_snapshot", profile_to_snapshot)
checks.check("out_of_memory", out_of_memory)
checks.summary()
