#!/usr/bin/env bash
# Multi-GPU DDP under the shim against PyTorch native (run on a machine with 2 GPUs, from the
# repository root):   scripts/gpu/ddp.sh LIBDIR WORKLOADS [REPEATS]
# Runs WORKLOADS/ddp_gpt2.py with torchrun on 2 ranks, native and under the shim alternating,
# REPEATS times; prints each run's line, then median step time and peak reserved (rank 0, as
# torch reports it: under the shim, its pools' peak through the default pool's attributes)
# and their ratios, and whether the losses agree. With EXPANDABLE=1, a third run per round,
# shim_exp, has CACHEALLOC_CONF=expandable_segments:True.
set -uo pipefail
LIB="$(realpath "$1")/libcachealloc.so"
WORK="$(realpath "$2")"
REPEATS=${3:-3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
LOG=$(mktemp)
for r in $(seq "$REPEATS"); do
    LABEL=native torchrun --nproc_per_node=2 "$WORK/ddp_gpt2.py" 2>&1 | grep '^workload=' | tee -a "$LOG"
    LABEL=shim CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$LIB" torchrun --nproc_per_node=2 "$WORK/ddp_gpt2.py" 2>&1 \
        | grep '^workload=' | tee -a "$LOG"
    if [ "${EXPANDABLE:-0}" = 1 ]; then
        LABEL=shim_exp CACHEALLOC_CONF=log:quiet,trace:off,expandable_segments:True LD_PRELOAD="$LIB" \
            torchrun --nproc_per_node=2 "$WORK/ddp_gpt2.py" 2>&1 | grep '^workload=' | tee -a "$LOG"
    fi
done
LABELS=(shim); [ "${EXPANDABLE:-0}" = 1 ] && LABELS+=(shim_exp)
python3 scripts/gpu/medians.py "$LOG" native "${LABELS[@]}"
python3 - "$LOG" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(sys.argv[1])]
labels = [l for l in ("native", "shim", "shim_exp") if any(r.get("label") == l for r in rows)]
def med(label):
    return statistics.median(float(r["torch_max_reserved_MB"]) for r in rows if r.get("label") == label)
losses = {label: {r["loss_sum"] for r in rows if r.get("label") == label} for label in labels}
for label in labels[1:]:
    print(f"memory workload=ddp_gpt2 label={label} native_reserved_MB={med('native'):.1f} "
          f"{label}_reserved_MB={med(label):.1f} reserved_ratio={med(label) / med('native'):.3f} "
          f"losses_equal={losses['native'] == losses[label]}")
PY
