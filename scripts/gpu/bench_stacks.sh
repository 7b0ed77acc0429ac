#!/usr/bin/env bash
# Cost of native stack capture on the interposed pair (paced, so the trace writer keeps up):
#   scripts/gpu/bench_stacks.sh LIBDIR
set -uo pipefail
LIB="$(realpath "$1")/libcachealloc.so"
BIN=$(mktemp -d)
nvcc -cudart shared -O2 -o "$BIN/bench_pair" scripts/gpu/bench_pair.c
CACHEALLOC_CONF=log:quiet,trace_dir:/tmp/st0 LD_PRELOAD="$LIB" "$BIN/bench_pair" sync 100000 paced | sed 's/^/trace /'
CACHEALLOC_CONF=log:quiet,trace_dir:/tmp/st1,stacks:native,stack_depth:64 LD_PRELOAD="$LIB" "$BIN/bench_pair" sync 100000 paced | sed 's/^/trace+native64 /'
