#!/usr/bin/env bash
# Expandable segments against PyTorch, in one command on one machine:
#   scripts/gpu/expandable.sh LIBDIR WORKLOADS [REPEATS] [WORKLOAD...]
# For each workload (default: gpt2_train infer_varbatch mlp_train; looked up in WORKLOADS, then
# in scripts/gpu), REPEATS alternating rounds (default 3) of four runs:
#   native      PyTorch's caching allocator, default settings
#   torch_exp   PyTorch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#   shim        libcachealloc.so with its default configuration
#   shim_exp    libcachealloc.so with CACHEALLOC_CONF=expandable_segments:True
# RUNS (default "native torch_exp shim shim_exp") picks the runs; with OLD_LIB (a folder holding
# another build's libcachealloc.so), "shim_exp_old" runs that build with expandable segments, to
# compare two builds in one command.
# Prints each run's line (also appended to $LOG when set: rounds run in separate commands add up,
# and scripts/gpu/expandable_summary.py LOG... summarizes them), then per workload and label the
# medians of step time, peak reserved and peak allocated (PyTorch's own counters for native
# runs, the pool's for the shim's: every allocation of the process), reserved/allocated, and
# step time against native.
set -uo pipefail
LIB="$(realpath "$1")/libcachealloc.so"; WORK="$(realpath "$2")"; REPEATS=${3:-3}
shift 3 2>/dev/null || shift $#
WORKLOADS=("$@"); [ ${#WORKLOADS[@]} -gt 0 ] || WORKLOADS=(gpt2_train infer_varbatch mlp_train)
HERE="$(dirname "$(realpath "$0")")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
LOG=${LOG:-$(mktemp)}
for r in $(seq "$REPEATS"); do
    for w in "${WORKLOADS[@]}"; do
        script="$WORK/$w.py"; [ -f "$script" ] || script="$HERE/$w.py"
        for run in ${RUNS:-native torch_exp shim shim_exp}; do
            case $run in
            native) LABEL=native python3 "$HERE/with_stats.py" "$script" ;;
            torch_exp) LABEL=torch_exp PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
                python3 "$HERE/with_stats.py" "$script" ;;
            shim) LABEL=shim CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$LIB" \
                python3 "$HERE/with_stats.py" "$script" ;;
            shim_exp) LABEL=shim_exp CACHEALLOC_CONF=log:quiet,trace:off,expandable_segments:True \
                LD_PRELOAD="$LIB" python3 "$HERE/with_stats.py" "$script" ;;
            shim_exp_old) LABEL=shim_exp_old \
                CACHEALLOC_CONF=log:quiet,trace:off,expandable_segments:True \
                LD_PRELOAD="$(realpath "${OLD_LIB:?OLD_LIB names the other build}")/libcachealloc.so" \
                python3 "$HERE/with_stats.py" "$script" ;;
            *) echo "unknown run $run" >&2; exit 2 ;;
            esac 2>&1 | paste -sd' ' | tee -a "$LOG"
        done
    done
done
python3 "$HERE/expandable_summary.py" "$LOG"
