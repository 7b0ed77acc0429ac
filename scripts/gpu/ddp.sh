#!/usr/bin/env bash
# Multi-GPU DDP under the shim against PyTorch native (run on a machine with 2 GPUs, from the
# repository root):   scripts/gpu/ddp.sh LIBDIR WORKLOADS [ROUNDS]
# Runs WORKLOADS/ddp_gpt2.py with torchrun on 2 ranks (through ddp_per_rank.py, which adds each
# rank's peaks), each configuration of LABELS in its own job, ROUNDS rounds in a rotating
# order. Labels: native (PyTorch's caching allocator); shim (the shim's default configuration:
# trace on, Python stacks, categories, expandable segments); shim_fixed
# (`expandable_segments:False`); shim_notrace (`trace:off`); shim_nocat (`categories:off`);
# native_exp (PyTorch's own `expandable_segments:True`, no shim); shim_b (the default
# configuration with the library in the folder LIB_B: another build, to compare two). Prints the lines, then for each
# shim label the median step time and rank 0's peak reserved against native's with the paired
# rounds' 95 % interval (ratio_ci.py), each rank's median peaks, and whether the losses equal
# native's. LOG=FILE keeps the lines.
set -uo pipefail
LIB="$(realpath "$1")/libcachealloc.so"
WORK="$(realpath "$2")"
ROUNDS=${3:-3}
read -r -a LABELS <<< "${LABELS:-native shim shim_fixed}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
LOG=${LOG:-$(mktemp)}
TRACES=$(mktemp -d)
conf() {
    case $1 in
        shim|shim_b) echo "log:quiet,trace_dir:$TRACES";;
        shim_fixed) echo "log:quiet,trace_dir:$TRACES,expandable_segments:False";;
        shim_notrace) echo "log:quiet,trace:off";;
        shim_nocat) echo "log:quiet,trace_dir:$TRACES,categories:off";;
        shim_exp) echo "log:quiet,trace_dir:$TRACES,expandable_segments:True";;
    esac
}
n=${#LABELS[@]}
for r in $(seq 0 $((ROUNDS - 1))); do
    for i in $(seq 0 $((n - 1))); do
        label=${LABELS[$(((i + r) % n))]}
        if [ "${label%_exp}" = native ]; then
            [ "$label" = native_exp ] && export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
            LABEL=$label torchrun --nproc_per_node=2 scripts/gpu/ddp_per_rank.py "$WORK/ddp_gpt2.py" 2>&1 \
                | grep -E '^(workload=|rank_peak )' | tee -a "$LOG"
            unset PYTORCH_CUDA_ALLOC_CONF
        else
            lib=$LIB; [ "$label" = shim_b ] && lib="$(realpath "$LIB_B")/libcachealloc.so"
            LABEL=$label CACHEALLOC_CONF=$(conf "$label") LD_PRELOAD="$lib" \
                torchrun --nproc_per_node=2 scripts/gpu/ddp_per_rank.py "$WORK/ddp_gpt2.py" 2>&1 \
                | grep -E '^(workload=|rank_peak |cachealloc: .*(error|failed))' | tee -a "$LOG"
        fi
        rm -rf "${TRACES:?}"/*
    done
done
for label in "${LABELS[@]}"; do
    [ "$label" = native ] && continue
    python3 scripts/gpu/ratio_ci.py "$LOG" native "$label"
    python3 scripts/gpu/ratio_ci.py "$LOG" native "$label" torch_max_reserved_MB
done
python3 - "$LOG" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(sys.argv[1])]
steps = [r for r in rows if "step_ms" in r]
peaks = [r for r in rows if "rank" in r]
labels = list(dict.fromkeys(r["label"] for r in steps))
for label in labels:
    for rank in sorted({r["rank"] for r in peaks}):
        mine = [r for r in peaks if r["label"] == label and r["rank"] == rank]
        if mine:
            print(f"rank_peaks label={label} rank={rank} runs={len(mine)} "
                  f"reserved_MB={statistics.median(float(r['torch_max_reserved_MB']) for r in mine):.1f} "
                  f"allocated_MB={statistics.median(float(r['torch_max_allocated_MB']) for r in mine):.1f}")
losses = {label: {r["loss_sum"] for r in steps if r["label"] == label} for label in labels}
for label in labels:
    if label != "native" and "native" in losses:
        print(f"losses label={label} equal_to_native={losses[label] == losses['native']} {sorted(losses[label])}")
PY
