#!/usr/bin/env bash
# What the driver's doors cost, A/B against the build before them, in one run on one machine:
#   scripts/gpu/doors_cost.sh OLD_LIBDIR NEW_LIBDIR WORKLOADS [REPEATS]
# 1. The cached cudaMalloc+cudaFree pair (trace off): the runtime door (shared cudart) of the old
#    and the new build, and the entry-point door (nvcc's static cudart) of the new one,
#    alternating REPEATS times.
# 2. PyTorch training step time and peak reserved: native, old shim, new shim, alternating
#    REPEATS times on gpt2_train.py and mlp_train.py; medians and ratios.
set -uo pipefail
OLD="$(realpath "$1")/libcachealloc.so"; NEW="$(realpath "$2")/libcachealloc.so"
WORK="$(realpath "$3")"; REPEATS=${4:-3}
BIN=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nvcc -cudart shared -O2 -o "$BIN/pair_shared" scripts/gpu/bench_pair.c
nvcc -O2 -o "$BIN/pair_static" scripts/gpu/bench_pair.c
for r in $(seq "$REPEATS"); do
    CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$OLD" "$BIN/pair_shared" sync 200000 | sed "s/^/pair old runtime-door r$r /"
    CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$NEW" "$BIN/pair_shared" sync 200000 | sed "s/^/pair new runtime-door r$r /"
    CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$NEW" "$BIN/pair_static" sync 200000 | sed "s/^/pair new entry-point-door r$r /"
done
LOG=$(mktemp)
for r in $(seq "$REPEATS"); do
    for w in gpt2_train mlp_train; do
        LABEL=native python3 scripts/gpu/with_stats.py "$WORK/$w.py" 2>&1 | paste -sd' ' | tee -a "$LOG"
        LABEL=old CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$OLD" python3 scripts/gpu/with_stats.py "$WORK/$w.py" 2>&1 | paste -sd' ' | tee -a "$LOG"
        LABEL=new CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$NEW" python3 scripts/gpu/with_stats.py "$WORK/$w.py" 2>&1 | paste -sd' ' | tee -a "$LOG"
    done
done
python3 - "$LOG" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(sys.argv[1])]
for w in ("gpt2", "mlp"):
    def med(label, key):
        vals = [float(r[key]) for r in rows if r.get("workload") == w and r.get("label") == label and key in r]
        return statistics.median(vals) if vals else float("nan")
    n, o, s = med("native", "step_ms"), med("old", "step_ms"), med("new", "step_ms")
    print(f"summary workload={w} native_step_ms={n:.3f} old_step_ms={o:.3f} new_step_ms={s:.3f} "
          f"new_vs_native={s / n:.3f} new_vs_old={s / o:.3f} "
          f"old_reserved_MB={med('old', 'cachealloc_peak_reserved_MB'):.1f} new_reserved_MB={med('new', 'cachealloc_peak_reserved_MB'):.1f}")
PY
