"""Run a Python workload (path and arguments as given) in this process, then print one line with
its peak allocated and peak reserved memory on the current device, from torch's counters:
natively PyTorch's, under the shim the library's (the Python integration serves
`memory_stats`), and the peak of active memory (allocated, plus blocks freed while other
streams' recorded work still uses them). Issue 25's "peak reserved <= 1.05x peak allocated" is
read from it:
    python3 scripts/gpu/peaks.py WORKLOAD.py [ARGS...]
    LD_PRELOAD=.gpu/lib/libcachealloc.so python3 scripts/gpu/peaks.py WORKLOAD.py [ARGS...]"""
import os
import runpy
import sys

path = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(path, run_name="__main__")

import torch  # noqa: E402  (the workload imported it already)

mb = 1 << 20
allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
# Active: allocated, plus blocks freed by the program whose memory other streams' recorded work
# still uses (`record_stream`): memory no allocator may hand out yet, so reserved's floor.
active = torch.cuda.memory_stats().get("active_bytes.all.peak", allocated)
print(
    f"peaks workload={os.path.basename(path)} {' '.join(sys.argv[1:])} "
    f"label={os.environ.get('LABEL', '-')} allocated_MB={allocated / mb:.1f} "
    f"reserved_MB={reserved / mb:.1f} active_MB={active / mb:.1f} "
    f"reserved_over_allocated={reserved / max(allocated, 1):.3f} "
    f"reserved_over_active={reserved / max(active, 1):.3f}",
    flush=True,
)
