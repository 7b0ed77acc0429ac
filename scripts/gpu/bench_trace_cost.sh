#!/usr/bin/env bash
# Cost of the trace (no stacks) on the interposed pair, paced so the writer keeps up, twice each,
# alternating:  scripts/gpu/bench_trace_cost.sh LIBDIR
set -uo pipefail
LIB="$(realpath "$1")/libcachealloc.so"
BIN=$(mktemp -d)
nvcc -cudart shared -O2 -o "$BIN/bench_pair" scripts/gpu/bench_pair.c
for r in 1 2; do
    CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$LIB" "$BIN/bench_pair" sync 100000 paced | sed "s/^/r$r shim /"
    CACHEALLOC_CONF=log:quiet,trace_dir:/tmp/tc$r LD_PRELOAD="$LIB" "$BIN/bench_pair" sync 100000 paced | sed "s/^/r$r shim+trace /"
done
