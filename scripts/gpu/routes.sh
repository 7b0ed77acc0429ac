#!/usr/bin/env bash
# How PyTorch's tensors should reach the pools, measured (run on the GPU machine from the
# repository root):   scripts/gpu/routes.sh LIBDIR WORKLOADS [REPEATS]
# For mlp_train.py, gpt2_train.py and scripts/gpu/multistream.py, alternating REPEATS times:
#   native        PyTorch's own caching allocator (the anchor)
#   torch_async   PyTorch's backend:cudaMallocAsync without the shim (the driver's pools)
#   shim_async    the shim, torch_caching:async (the default route: cudaMallocAsync per tensor)
#   shim_uncached the shim, torch_caching:uncached (PYTORCH_NO_CUDA_MEMORY_CACHING=1)
# Prints each run's line, then per workload the median step time and peak reserved per route
# and their ratios to native, and whether every route's loss equals native's.
set -uo pipefail
LIB="$(realpath "$1")/libcachealloc.so"
WORK="$(realpath "$2")"
REPEATS=${3:-3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
LOG=$(mktemp)
Q=log:quiet,trace:off
for r in $(seq "$REPEATS"); do
    for w in "$WORK/mlp_train.py" "$WORK/gpt2_train.py" scripts/gpu/multistream.py; do
        LABEL=native python3 scripts/gpu/with_stats.py "$w" 2>&1 | paste -sd' ' | tee -a "$LOG"
        LABEL=torch_async PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python3 scripts/gpu/with_stats.py "$w" 2>&1 \
            | paste -sd' ' | tee -a "$LOG"
        LABEL=shim_async CACHEALLOC_CONF=$Q LD_PRELOAD="$LIB" python3 scripts/gpu/with_stats.py "$w" 2>&1 \
            | paste -sd' ' | tee -a "$LOG"
        LABEL=shim_uncached CACHEALLOC_CONF=$Q,torch_caching:uncached LD_PRELOAD="$LIB" \
            python3 scripts/gpu/with_stats.py "$w" 2>&1 | paste -sd' ' | tee -a "$LOG"
    done
done
python3 scripts/gpu/medians.py "$LOG" native torch_async shim_async shim_uncached
python3 - "$LOG" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(sys.argv[1])]
for w in dict.fromkeys(r["workload"] for r in rows if "workload" in r):
    def med(label, key):
        vals = [float(r[key]) for r in rows if r.get("workload") == w and r.get("label") == label and key in r]
        return statistics.median(vals) if vals else float("nan")
    def losses(label):
        return {r["loss"] for r in rows if r.get("workload") == w and r.get("label") == label}
    native = med("native", "torch_max_reserved_MB")
    parts = [f"native_reserved_MB={native:.1f}"]
    for label in ("torch_async", "shim_async", "shim_uncached"):
        # Under the shim, its own pool's peak (torch's counter is blind on the uncached route).
        key = "cachealloc_peak_reserved_MB" if label.startswith("shim") else "torch_max_reserved_MB"
        v = med(label, key)
        parts.append(f"{label}_reserved_MB={v:.1f} {label}_reserved_ratio={v / native:.3f}")
        parts.append(f"{label}_loss_equal={losses(label) == losses('native')}")
    print(f"memory workload={w} " + " ".join(parts))
PY
