#!/usr/bin/env bash
# The cached alloc/free pair through each door, trace off, pinned to one CPU (the pair is a few
# hundred ns: a migration between cores shows in its median), ROUNDS rounds alternating:
#   scripts/gpu/door_pairs.sh LIBDIR [ROUNDS]
# - runtime door: bench_pair.c over a shared cudart (cudaMalloc/cudaFree interposed);
# - static cudart: bench_pair.c as nvcc builds it by default; the runtime's own cudaMalloc
#   reaches our entry-point wrappers (its per-call work is part of the figure);
# - symbols / dlsym / entry: driver_doors.cu calling cuMemAlloc_v2/cuMemFree_v2 through libcuda's
#   symbols, dlsym, and cudaGetDriverEntryPoint (the door's own cost, 1 MiB).
# Raw cudaMalloc/cudaFree once for scale. Prints one line per run; medians are read from them.
set -uo pipefail
LIB="$(realpath "$1")/libcachealloc.so"
ROUNDS=${2:-3}
BIN=$(mktemp -d)
PIN=""; command -v taskset >/dev/null && PIN="taskset -c 3"
nvcc -cudart shared -O2 -o "$BIN/pair_shared" scripts/gpu/bench_pair.c
nvcc -O2 -o "$BIN/pair_static" scripts/gpu/bench_pair.c
nvcc -O2 -o "$BIN/driver_doors" scripts/gpu/driver_doors.cu -lcuda -ldl
echo "== pair latency (ns), pinned: ${PIN:-no}"
$PIN "$BIN/pair_shared" sync 2000 | sed 's/^/raw cudaMalloc+cudaFree /'
export CACHEALLOC_CONF=log:quiet,trace:off
for r in $(seq "$ROUNDS"); do
    LD_PRELOAD="$LIB" $PIN "$BIN/pair_shared" sync 200000 | sed "s/^/r$r runtime door /"
    LD_PRELOAD="$LIB" $PIN "$BIN/pair_static" sync 200000 | sed "s/^/r$r static cudart (entry-point door) /"
    for mode in symbols dlsym entry; do
        LD_PRELOAD="$LIB" $PIN "$BIN/driver_doors" "$mode" | grep '^OK' | sed "s/^/r$r $mode door (1 MiB) /"
    done
done
