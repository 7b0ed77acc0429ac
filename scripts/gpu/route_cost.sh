#!/usr/bin/env bash
# Where an allocation-heavy training step goes (issue 25): scripts/gpu/train_models.py MODEL in
# separate processes, five configurations in a rotating order, ROUNDS rounds:
#   native    PyTorch's caching allocator
#   async     PyTorch's own backend:cudaMallocAsync (the route the shim rides), no shim
#   shim_min  the shim with trace:off,python:off (its allocator behind PyTorch's backend)
#   shim_py   the shim with trace:off (the Python integration on)
#   shim      the shim's default
#     scripts/gpu/route_cost.sh LIBDIR [MODEL] [ROUNDS]
# (a round of the Llama takes about 100 s: a device call of 10 minutes holds about 5 rounds)
# Writes $OUT/route_cost.log (one train_models.py line per process) and prints each
# configuration's ratio to native, and the shim's bare allocator against PyTorch's backend,
# with 95 % bootstrap intervals (ratio_ci.py). Then route_micro.py, the host cost of one
# allocation and free by size, for native, async and shim_min in the same rotation
# ($OUT/route_micro.log).
set -u
LIB="$(realpath "$1")/libcachealloc.so"
MODEL=${2:-llama}
ROUNDS=${3:-6}
OUT=${OUT:-./out}
mkdir -p "$OUT"
LOG=$OUT/route_cost.log
cd "$(dirname "$0")" || exit 1
labels=(native async shim_min shim_py shim)
for r in $(seq 1 "$ROUNDS"); do
    for k in 0 1 2 3 4; do
        l=${labels[$(( (k + r) % 5 ))]}
        case $l in
            native) LABEL=$l python3 train_models.py "$MODEL" ;;
            async) LABEL=$l PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python3 train_models.py "$MODEL" ;;
            shim_min) LABEL=$l CACHEALLOC_CONF=trace:off,python:off LD_PRELOAD=$LIB python3 train_models.py "$MODEL" ;;
            shim_py) LABEL=$l CACHEALLOC_CONF=trace:off LD_PRELOAD=$LIB python3 train_models.py "$MODEL" ;;
            shim) LABEL=$l LD_PRELOAD=$LIB python3 train_models.py "$MODEL" ;;
        esac 2>/dev/null | grep workload= | tee -a "$LOG"
    done
done
for l in async shim_min shim_py shim; do python3 ratio_ci.py "$LOG" native "$l"; done
python3 ratio_ci.py "$LOG" async shim_min
MICRO=$OUT/route_micro.log
micro=(native async shim_min)
for r in $(seq 1 "$ROUNDS"); do
    for k in 0 1 2; do
        l=${micro[$(( (k + r) % 3 ))]}
        case $l in
            native) LABEL=$l python3 route_micro.py ;;
            async) LABEL=$l PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python3 route_micro.py ;;
            shim_min) LABEL=$l CACHEALLOC_CONF=trace:off,python:off LD_PRELOAD=$LIB python3 route_micro.py ;;
        esac 2>/dev/null | grep workload= | tee -a "$MICRO"
    done
done
for l in async shim_min; do python3 ratio_ci.py "$MICRO" native "$l" us_per_pair; done
