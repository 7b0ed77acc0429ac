"""Memory and step time over a long run (issue 25: does the default stay flat?): trains a
models.py workload (llama, cnn, mlp, gpt2) for STEPS steps (argument, default 1800), each step
synchronized, and prints one line per WINDOW steps (env, default 100):

    workload=MODEL window=K first=A last=B step_ms=M reserved_MB=R max_reserved_MB=X
        allocated_MB=C device_allocs=D device_frees=F

`step_ms`: the window's median step; `reserved_MB`/`allocated_MB`: PyTorch's counters at the
window's end; `max_reserved_MB`: the peak so far; `device_allocs`/`device_frees`: the window's
`num_device_alloc`/`num_device_free` (under the shim: segments, maps and unmaps; a map that moves
memory counts as one). A last line `workload=MODEL summary=1 …` compares the last window with
the first one after the warm-up (window 1): their reserved bytes and median steps.

The Llama's expandable segments drift through their address range every cycle of sequence
lengths (design.md, "Recycling drifts on variable shapes"); this run is long enough to reach the
range's end, where a fresh range is reserved, and shows whether reserved memory or the step
changes there. Run natively for the reference (no preload)."""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import build, timed  # noqa: E402

MODEL = sys.argv[1]
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 1800
WINDOW = int(os.environ.get("WINDOW", "100"))
MB = 1 << 20


def counters():
    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", 0), stats.get("num_device_free", 0)


torch.manual_seed(0)
step, model = build(MODEL)
windows = []
times = []
allocs0, frees0 = counters()
for i in range(STEPS):
    times.append(timed(step, i))
    if len(times) == WINDOW:
        allocs, frees = counters()
        window = {
            "window": len(windows),
            "first": i + 1 - WINDOW,
            "last": i,
            "step_ms": statistics.median(times),
            "reserved_MB": torch.cuda.memory_reserved() / MB,
            "max_reserved_MB": torch.cuda.max_memory_reserved() / MB,
            "allocated_MB": torch.cuda.memory_allocated() / MB,
            "device_allocs": allocs - allocs0,
            "device_frees": frees - frees0,
        }
        windows.append(window)
        allocs0, frees0 = allocs, frees
        times = []
        fields = " ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in window.items()
        )
        print(f"workload={MODEL} {fields}", flush=True)
if len(windows) >= 3:
    first, last = windows[1], windows[-1]
    print(
        f"workload={MODEL} summary=1 windows={len(windows)} "
        f"reserved_first_MB={first['reserved_MB']:.1f} reserved_last_MB={last['reserved_MB']:.1f} "
        f"max_reserved_MB={last['max_reserved_MB']:.1f} "
        f"step_first_ms={first['step_ms']:.3f} step_last_ms={last['step_ms']:.3f} "
        f"step_ratio={last['step_ms'] / first['step_ms']:.4f}"
    )
