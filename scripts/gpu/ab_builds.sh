#!/usr/bin/env bash
# Two builds of the shim and PyTorch native, alternated round by round in one command:
#   scripts/gpu/ab_builds.sh OLD_LIBDIR NEW_LIBDIR WORKLOADS [ROUNDS] [SCRIPTS]
# Each round runs every script of SCRIPTS (default "mlp_train.py") three ways — native, the old
# build, the new build (default configuration) — in a rotating order, so that drift in the
# machine falls on all three alike. Writes $OUT/ab_builds.log (`workload=… label=… step_ms=…`
# lines) and prints scripts/gpu/ratio_ci.py's paired ratios: new/old (a regression check) and
# new/native, for step time and for peak reserved memory.
set -uo pipefail
OLD="$(realpath "$1")/libcachealloc.so"; NEW="$(realpath "$2")/libcachealloc.so"
WORK="$(realpath "$3")"; ROUNDS=${4:-8}; SCRIPTS=${5:-mlp_train.py}
OUT=${OUT:-./out}; mkdir -p "$OUT"; LOG="$OUT/ab_builds.log"; : > "$LOG"
run() {  # run LABEL SCRIPT [LD_PRELOAD]
    local label=$1 script=$2 lib=${3:-}
    local path="$WORK/$script"; [ -f "$path" ] || path="scripts/gpu/$script"
    if [ -n "$lib" ]; then
        LABEL=$label CACHEALLOC_CONF=log:quiet LD_PRELOAD="$lib" python3 "$path" 2>/dev/null | grep '^workload=' >> "$LOG"
    else
        LABEL=$label python3 "$path" 2>/dev/null | grep '^workload=' >> "$LOG"
    fi
}
for r in $(seq 1 "$ROUNDS"); do
    for s in $SCRIPTS; do
        case $((r % 3)) in
            0) run native "$s"; run old "$s" "$OLD"; run new "$s" "$NEW";;
            1) run old "$s" "$OLD"; run new "$s" "$NEW"; run native "$s";;
            2) run new "$s" "$NEW"; run native "$s"; run old "$s" "$OLD";;
        esac
    done
done
for pair in "old new" "native new"; do
    python3 scripts/gpu/ratio_ci.py "$LOG" $pair step_ms
    python3 scripts/gpu/ratio_ci.py "$LOG" $pair torch_max_reserved_MB
done
