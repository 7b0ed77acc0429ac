"""Summarize the run lines of scripts/gpu/expandable.sh: per workload and label, the medians of
step time, peak reserved and peak allocated (PyTorch's counters for native runs, the pool's for
the shim's), reserved/allocated, and step time against native.
Usage: python3 expandable_summary.py LOG [LOG...]"""
import re, statistics, sys

rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for path in sys.argv[1:] for line in open(path)]
def med(w, label, key):
    vals = [float(r[key]) for r in rows if r.get("workload") == w and r.get("label") == label and key in r]
    return statistics.median(vals) if vals else float("nan")
for w in dict.fromkeys(r.get("workload") for r in rows if r.get("workload")):
    native_step = med(w, "native", "step_ms")
    labels = dict.fromkeys(r.get("label") for r in rows if r.get("workload") == w and r.get("label"))
    for label in labels:
        shim = label.startswith("shim")
        reserved = med(w, label, "cachealloc_peak_reserved_MB" if shim else "torch_max_reserved_MB")
        allocated = med(w, label, "cachealloc_peak_alloc_MB" if shim else "torch_max_alloc_MB")
        step = med(w, label, "step_ms")
        losses = sorted({r.get("loss") for r in rows if r.get("workload") == w and r.get("label") == label})
        print(f"summary workload={w} label={label} step_ms={step:.3f} vs_native={step / native_step:.3f} "
              f"peak_reserved_MB={reserved:.1f} peak_allocated_MB={allocated:.1f} "
              f"reserved_over_allocated={reserved / allocated:.3f} "
              f"torch_reserved_MB={med(w, label, 'torch_max_reserved_MB'):.1f} "
              f"device_used_at_exit_MB={med(w, label, 'device_used_at_exit_MB'):.1f} losses={','.join(losses)}")
