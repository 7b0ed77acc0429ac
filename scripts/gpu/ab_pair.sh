#!/usr/bin/env bash
# A/B of two builds of libcachealloc.so on the interposed pair, in one run on one machine:
#   scripts/gpu/ab_pair.sh OLD_LIBDIR NEW_LIBDIR
# Alternates the builds three times (trace off), then the new build with its trace on, paced.
set -uo pipefail
OLD="$(realpath "$1")/libcachealloc.so"; NEW="$(realpath "$2")/libcachealloc.so"
BIN=$(mktemp -d)
nvcc -cudart shared -O2 -o "$BIN/bench_pair" scripts/gpu/bench_pair.c
for r in 1 2 3; do
    CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$OLD" "$BIN/bench_pair" sync 200000 | sed "s/^/old r$r /"
    CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$NEW" "$BIN/bench_pair" sync 200000 | sed "s/^/new r$r /"
done
CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$NEW" "$BIN/bench_pair" sync 100000 paced | sed "s/^/new /"
CACHEALLOC_CONF=log:quiet,trace_dir:/tmp/ab-trace LD_PRELOAD="$NEW" "$BIN/bench_pair" sync 100000 paced | sed "s/^/new+trace /"
