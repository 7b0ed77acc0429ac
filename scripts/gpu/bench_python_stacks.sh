#!/usr/bin/env bash
# Python stacks on a real GPU (run on the GPU machine from the repository root):
#   scripts/gpu/bench_python_stacks.sh LIBDIR WORKLOADS [REPEATS]
# 1. The added cost per allocation of stacks:python (and native, all) at Python depth 30:
#    scripts/bench_python_stacks.py under the shim over the real runtime.
# 2. mlp_train.py and gpt2_train.py step time: PyTorch native caching (the anchor), PyTorch with
#    its own recorder on (_record_memory_history(stacks="python")), and the shim with its trace
#    and stacks:python, and with stacks:none; alternating, REPEATS times; medians and ratios.
set -uo pipefail
LIBDIR="$(realpath "$1")"
WORK="$(realpath "$2")"
REPEATS=${3:-3}
LIB="$LIBDIR/libcachealloc.so"
TRACE=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'
CUDART=$(python3 -c 'import glob, os, site; print(next(iter(sorted(glob.glob(os.path.join(site.getsitepackages()[0], "nvidia", "**", "libcudart.so.13"), recursive=True))), ""))')
echo "== per-allocation cost at depth 30"
LD_LIBRARY_PATH="$(dirname "$CUDART")" CACHEALLOC_LIB="$LIB" scripts/bench-python-stacks
echo "== training"
LOG=$(mktemp)
for r in $(seq "$REPEATS"); do
    for w in mlp_train gpt2_train; do
        LABEL=native python3 "$WORK/$w.py" 2>&1 | grep workload= | tee -a "$LOG"
        LABEL=torch-history python3 scripts/gpu/with_history.py "$WORK/$w.py" 2>&1 | grep workload= | tee -a "$LOG"
        LABEL=shim-python CACHEALLOC_CONF="log:quiet,stacks:python,trace_dir:$TRACE/p$r" LD_PRELOAD="$LIB" \
            python3 "$WORK/$w.py" 2>&1 | grep workload= | tee -a "$LOG"
        LABEL=shim-nostacks CACHEALLOC_CONF="log:quiet,stacks:none,trace_dir:$TRACE/n$r" LD_PRELOAD="$LIB" \
            python3 "$WORK/$w.py" 2>&1 | grep workload= | tee -a "$LOG"
    done
done
du -sh "$TRACE"/*
python3 scripts/gpu/medians.py "$LOG" native torch-history shim-python shim-nostacks
