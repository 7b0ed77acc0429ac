#!/usr/bin/env bash
# Native stacks in PyTorch (run on the GPU machine from the repository root):
#   scripts/gpu/bench_native_stacks.sh LIBDIR WORKLOADS [REPEATS]
# mlp_train.py and gpt2_train.py step time: PyTorch native caching (the anchor) against the shim
# with stacks:all (native frames through libtorch, then Python's), alternating, REPEATS times;
# medians and ratios. Then the deepest recorded stack of a gpt2 run, to show what is captured.
set -uo pipefail
LIBDIR="$(realpath "$1")"
WORK="$(realpath "$2")"
REPEATS=${3:-3}
LIB="$LIBDIR/libcachealloc.so"
TRACE=$(mktemp -d)
LOG=$(mktemp)
for r in $(seq "$REPEATS"); do
    for w in mlp_train gpt2_train; do
        LABEL=native python3 "$WORK/$w.py" 2>&1 | grep workload= | tee -a "$LOG"
        LABEL=shim-all CACHEALLOC_CONF="log:quiet,stacks:all,trace_dir:$TRACE/a$r$w" LD_PRELOAD="$LIB" \
            python3 "$WORK/$w.py" 2>&1 | grep workload= | tee -a "$LOG"
    done
done
python3 scripts/gpu/medians.py "$LOG" native shim-all
"$LIBDIR/cachealloc" peak "$TRACE/a1gpt2_train" --top 1 | head -60
