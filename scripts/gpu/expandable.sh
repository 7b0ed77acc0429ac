#!/usr/bin/env bash
# Expandable segments against PyTorch, in one command on one machine:
#   scripts/gpu/expandable.sh LIBDIR WORKLOADS [REPEATS] [WORKLOAD...]
# For each workload (default: gpt2_train infer_varbatch mlp_train; looked up in WORKLOADS, then
# in scripts/gpu), REPEATS alternating rounds (default 3) of four runs:
#   native      PyTorch's caching allocator, default settings
#   torch_exp   PyTorch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#   shim        libcachealloc.so with its default configuration
#   shim_exp    libcachealloc.so with CACHEALLOC_CONF=expandable_segments:True
# Prints each run's line, then per workload and label the medians of step time, peak reserved
# and peak allocated (PyTorch's own counters for native runs, the pool's for the shim's: every
# allocation of the process), reserved/allocated, and step time against native.
set -uo pipefail
LIB="$(realpath "$1")/libcachealloc.so"; WORK="$(realpath "$2")"; REPEATS=${3:-3}
shift 3 2>/dev/null || shift $#
WORKLOADS=("$@"); [ ${#WORKLOADS[@]} -gt 0 ] || WORKLOADS=(gpt2_train infer_varbatch mlp_train)
HERE="$(dirname "$(realpath "$0")")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
LOG=$(mktemp)
for r in $(seq "$REPEATS"); do
    for w in "${WORKLOADS[@]}"; do
        script="$WORK/$w.py"; [ -f "$script" ] || script="$HERE/$w.py"
        LABEL=native python3 "$HERE/with_stats.py" "$script" 2>&1 | paste -sd' ' | tee -a "$LOG"
        LABEL=torch_exp PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
            python3 "$HERE/with_stats.py" "$script" 2>&1 | paste -sd' ' | tee -a "$LOG"
        LABEL=shim CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$LIB" \
            python3 "$HERE/with_stats.py" "$script" 2>&1 | paste -sd' ' | tee -a "$LOG"
        LABEL=shim_exp CACHEALLOC_CONF=log:quiet,trace:off,expandable_segments:True LD_PRELOAD="$LIB" \
            python3 "$HERE/with_stats.py" "$script" 2>&1 | paste -sd' ' | tee -a "$LOG"
    done
done
python3 - "$LOG" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(sys.argv[1])]
def med(w, label, key):
    vals = [float(r[key]) for r in rows if r.get("workload") == w and r.get("label") == label and key in r]
    return statistics.median(vals) if vals else float("nan")
for w in dict.fromkeys(r.get("workload") for r in rows if r.get("workload")):
    native_step = med(w, "native", "step_ms")
    for label in ("native", "torch_exp", "shim", "shim_exp"):
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
PY
