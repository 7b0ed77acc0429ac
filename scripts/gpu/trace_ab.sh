#!/usr/bin/env bash
# The trace's cost within one process (recorder_cost.py with SWITCH=trace: the records and
# their stacks on and paused step by step; SWITCH=stacks or history for the other parts
# recorder_cost.py measures) for two builds, their processes alternating:
#   scripts/gpu/trace_ab.sh OLD_LIBDIR|- NEW_LIBDIR ROUNDS PROCESSES MODEL...
# MODEL: llama, cnn, mlp, gpt2 (models.py). Each process runs ROUNDS rounds; the builds take
# turns first. `-` for OLD_LIBDIR measures NEW alone. Stops starting processes after BUDGET
# seconds (540). Writes $OUT/trace_old.log and $OUT/trace_new.log and prints ratio_ci.py's
# on/off ratio per build and model, for the step's wall time and for the Python
# thread's CPU time (main_ms). Each process names its lines (`set=`), so the interval resamples
# the processes, then their rounds (before the sixteenth session it resampled rounds alone, and
# read tighter than what processes of one build differ by).
set -uo pipefail
OLD=-; [ "$1" != - ] && OLD="$(realpath "$1")/libcachealloc.so"
NEW="$(realpath "$2")/libcachealloc.so"; ROUNDS=$3; PROCESSES=$4; shift 4
OUT=${OUT:-./out}; mkdir -p "$OUT"; BUDGET=${BUDGET:-540}; start=$SECONDS; SWITCH=${SWITCH:-trace}
builds() { if [ "$OLD" = - ]; then echo new; elif [ $(($1 % 2)) -eq 1 ]; then echo old new; else echo new old; fi; }
for p in $(seq 1 "$PROCESSES"); do
    for model in "$@"; do
        for build in $(builds "$p"); do
            [ $((SECONDS - start)) -lt "$BUDGET" ] || break 3
            lib=$NEW; [ "$build" = old ] && lib=$OLD
            echo "process $p $model $build: $(SWITCH=$SWITCH CACHEALLOC_CONF=log:quiet LD_PRELOAD="$lib" \
                python3 scripts/gpu/recorder_cost.py "$model" "$ROUNDS" "$OUT/trace_$build.log" 2>&1 | tail -1)"
        done
    done
done
for build in old new; do
    [ -f "$OUT/trace_$build.log" ] || continue
    echo "== $build"
    python3 scripts/gpu/ratio_ci.py "$OUT/trace_$build.log" "no$SWITCH" "$SWITCH"
    python3 scripts/gpu/ratio_ci.py "$OUT/trace_$build.log" "no$SWITCH" "$SWITCH" main_ms
done
