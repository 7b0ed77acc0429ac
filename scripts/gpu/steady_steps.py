"""Steady training steps of models.py's Llama (MODEL: another of its workloads) for a profiler
to attach to (issue 25: where the trace's time goes). Under the shim: after 8 warm-up steps,
PAUSE=trace pauses the allocation records and their stacks (`cachealloc_trace_pause`),
PAUSE=stacks the stack capture alone (`cachealloc_stacks_pause`), PAUSE=categories takes the
category hooks off (`cachealloc_categories.enable(False)`), PAUSE=none leaves everything on
(natively, without the shim, only none); 4 more steps, then the file READY is created and
STEPS steps run (default 800). On SIGTERM (or at the end) it prints
`steady pause=P steps=N median_ms=X`: N, the steps since READY, turns a profiler's samples
into samples per step. Run by scripts/gpu/trace_profile.sh and thread_profile.sh."""
import ctypes
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

lib = ctypes.CDLL(None)
what = os.environ.get("PAUSE", "none")
torch.manual_seed(0)
step, model = models.build(os.environ.get("MODEL", "llama"))
for i in range(8):
    step(i)
if what == "trace":
    lib.cachealloc_trace_pause(1)
elif what == "stacks":
    lib.cachealloc_stacks_pause(1)
elif what == "categories":
    import cachealloc_categories

    cachealloc_categories.enable(False)
for i in range(4):
    step(i)
torch.cuda.synchronize()
open(os.environ["READY"], "w").close()
times = []


def report(*_):
    t = sorted(times)
    print(f"steady pause={what} steps={len(t)} median_ms={t[len(t) // 2]:.3f}", flush=True)
    os._exit(0)


signal.signal(signal.SIGTERM, report)
for i in range(int(os.environ.get("STEPS", "800"))):
    t0 = time.perf_counter()
    step(i)
    torch.cuda.synchronize()
    times.append((time.perf_counter() - t0) * 1e3)
report()
