#!/usr/bin/env bash
# mlp_train.py with 300 steps (the 50-step default is too short on a noisy machine) and the
# runtime-door pair, A/B of two builds, alternating five times in one run:
#   scripts/gpu/doors_mlp_ab.sh OLD_LIBDIR NEW_LIBDIR WORKLOADS
# Labels: native, old, new, new with driver_doors:off. Medians are read from the lines.
set -uo pipefail
OLD=$(realpath "$1")/libcachealloc.so; NEW=$(realpath "$2")/libcachealloc.so; WORK=$(realpath "$3")
BIN=$(mktemp -d)
nvcc -cudart shared -O2 -o "$BIN/pair_shared" scripts/gpu/bench_pair.c
for r in 1 2 3 4 5; do
  CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$OLD" "$BIN/pair_shared" sync 200000 | sed "s/^/pair old r$r /"
  CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$NEW" "$BIN/pair_shared" sync 200000 | sed "s/^/pair new r$r /"
done
for r in 1 2 3 4 5; do
  STEPS=300 LABEL=native python3 "$WORK/mlp_train.py"
  STEPS=300 LABEL=old CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$OLD" python3 "$WORK/mlp_train.py"
  STEPS=300 LABEL=new CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$NEW" python3 "$WORK/mlp_train.py"
  STEPS=300 LABEL=new_nodoors CACHEALLOC_CONF=log:quiet,trace:off,driver_doors:off LD_PRELOAD="$NEW" python3 "$WORK/mlp_train.py"
done
