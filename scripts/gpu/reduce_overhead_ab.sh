#!/usr/bin/env bash
# torch.compile(mode="reduce-overhead") on the transformers GPT-2 (compile_reduce_overhead.py),
# PyTorch's native allocator against the shim, graph trees on both sides, alternated process by
# process on every GPU of the machine at once (from the repository root):
#   scripts/gpu/reduce_overhead_ab.sh LIBDIR [SECONDS]
# Each GPU runs native/shim pairs until SECONDS (default 430) have passed; even GPUs start with
# native, odd ones with the shim, so that order falls on both alike. A pair always runs on one
# GPU. Each process times 10 rounds of 50 calls (ROUNDS, CALLS override). Writes
# $OUT/reduce_overhead.log (pairs of `workload=compile_gpt2 label=… step_ms=… peak_reserved_mb=…`
# lines, one GPU after the other) and prints scripts/gpu/ratio_ci.py's paired ratios for time
# and peak reserved, and whether every checksum agrees.
set -uo pipefail
LIB="$(realpath "$1")/libcachealloc.so"
BUDGET=${2:-430}
OUT=${OUT:-./out}; mkdir -p "$OUT"
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/cache}
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
start=$SECONDS
one() {  # one GPU LABEL
    local lib=""; [ "$2" = shim ] && lib=$LIB
    CUDA_VISIBLE_DEVICES=$1 LABEL=$2 ROUNDS=${ROUNDS:-10} CALLS=${CALLS:-50} CACHEALLOC_CONF=log:quiet \
        LD_PRELOAD=$lib timeout 80 python3 scripts/gpu/compile_reduce_overhead.py 2>/dev/null | grep '^workload='
}
pairs() {  # pairs GPU FIRST SECOND: keep only whole pairs
    while [ $((SECONDS - start)) -lt "$BUDGET" ]; do
        a=$(one "$1" "$2"); b=$(one "$1" "$3")
        [ -n "$a" ] && [ -n "$b" ] && printf '%s\n%s\n' "$a" "$b" >> "$OUT/ro$1.log"
    done
}
for g in $(seq 0 $((GPUS - 1))); do
    : > "$OUT/ro$g.log"
    if [ $((g % 2)) = 0 ]; then pairs "$g" native shim & else pairs "$g" shim native & fi
done
wait
cat "$OUT"/ro[0-9]*.log > "$OUT/reduce_overhead.log"
cat "$OUT/reduce_overhead.log"
python3 scripts/gpu/ratio_ci.py "$OUT/reduce_overhead.log" native shim
python3 scripts/gpu/ratio_ci.py "$OUT/reduce_overhead.log" native shim peak_reserved_mb
echo "checksums: $(sed -n 's/.*checksum=\([^ ]*\).*/\1/p' "$OUT/reduce_overhead.log" | sort -u | tr '\n' ' ')"
