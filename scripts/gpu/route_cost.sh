#!/usr/bin/env bash
# Where an allocation-heavy training step goes (issue 25): scripts/gpu/train_models.py MODEL in
# separate processes, five configurations in a rotating order, ROUNDS rounds:
#   native    PyTorch's caching allocator
#   async     PyTorch's own backend:cudaMallocAsync (the route the shim rides), no shim
#   shim_min  the shim with trace:off,python:off (its allocator behind PyTorch's backend)
#   shim_py   the shim with trace:off (the Python integration on)
#   shim      the shim's default
#   pluggable the shim with trace and Python off, PyTorch's tensors entering it through
#             PyTorch's CUDAPluggableAllocator instead of the cudaMallocAsync backend (pluggable.py)
#     [LABELS="native async ..."] scripts/gpu/route_cost.sh LIBDIR [MODEL] [ROUNDS]
# (a round of the Llama takes about 100 s: a device call of 10 minutes holds about 5 rounds)
# Writes $OUT/route_cost.log (one train_models.py line per process) and prints each
# configuration's ratio to native, and the shim's bare allocator against PyTorch's backend,
# with 95 % bootstrap intervals (ratio_ci.py). Then route_micro.py, the host cost of one
# allocation and free by size, for MICRO_LABELS (default: native async shim_min) in the same
# rotation, MICRO_ROUNDS rounds (default ROUNDS) ($OUT/route_micro.log).
set -u
LIB="$(realpath "$1")/libcachealloc.so"
MODEL=${2:-llama}
ROUNDS=${3:-6}
OUT=${OUT:-./out}
mkdir -p "$OUT"
LOG=$OUT/route_cost.log
cd "$(dirname "$0")" || exit 1
read -r -a labels <<< "${LABELS:-native async shim_min shim_py shim}"
n=${#labels[@]}
# One configuration's process: run_as LABEL SCRIPT [ARGS]
run_as() {
    local l=$1
    shift
    case $l in
        native) LABEL=$l python3 "$@" ;;
        async) LABEL=$l PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python3 "$@" ;;
        shim_min) LABEL=$l CACHEALLOC_CONF=trace:off,python:off LD_PRELOAD=$LIB python3 "$@" ;;
        shim_py) LABEL=$l CACHEALLOC_CONF=trace:off LD_PRELOAD=$LIB python3 "$@" ;;
        shim) LABEL=$l LD_PRELOAD=$LIB python3 "$@" ;;
        pluggable) LABEL=$l ROUTE=pluggable CACHEALLOC_CONF=trace:off,python:off,torch_caching:keep \
            LD_PRELOAD=$LIB python3 "$@" ;;
    esac
}
for r in $(seq 1 "$ROUNDS"); do
    for k in $(seq 0 $((n - 1))); do
        l=${labels[$(( (k + r) % n ))]}
        run_as "$l" train_models.py "$MODEL" 2>/dev/null | grep workload= | tee -a "$LOG"
    done
done
for l in "${labels[@]}"; do [ "$l" != native ] && python3 ratio_ci.py "$LOG" native "$l"; done
python3 ratio_ci.py "$LOG" async shim_min
MICRO=$OUT/route_micro.log
read -r -a micro <<< "${MICRO_LABELS:-native async shim_min}"
m=${#micro[@]}
for r in $(seq 1 "${MICRO_ROUNDS:-$ROUNDS}"); do
    for k in $(seq 0 $((m - 1))); do
        l=${micro[$(( (k + r) % m ))]}
        run_as "$l" route_micro.py 2>/dev/null | grep workload= | tee -a "$MICRO"
    done
done
for l in "${micro[@]}"; do [ "$l" != native ] && python3 ratio_ci.py "$MICRO" native "$l" us_per_pair; done
