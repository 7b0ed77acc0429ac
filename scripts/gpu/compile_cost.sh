#!/usr/bin/env bash
# What the shim costs torch.compile's compilation (issue 25), in alternating rounds of fresh
# processes, each with an empty Inductor cache:
#   scripts/gpu/compile_cost.sh LIBDIR [ROUNDS]
# Labels: native, shim (the default: trace, Python stacks, categories), shim_nostacks
# (`stacks:none`), shim_notrace (`trace:off`); LABELS="…" picks some. Prints each run's line
# (scripts/gpu/compile_cost.py) and, per label, the median and the paired ratio to native with
# its bootstrap interval (ratio_ci.py). AT_ONCE=1 runs every process at once instead, each
# pinned to a core of its own (ROUNDS × labels cores, shared when fewer; round r's processes
# pair up).
# PROFILE=perf|pyspy then profiles one more run of the default under `perf record -g` or `py-spy record --native` (installed from the carried
# wheels: `python3 -m pip install --no-index --find-links .whl py-spy`), into $OUT.
set -uo pipefail
LIB="$(realpath "$1")/libcachealloc.so"
ROUNDS=${2:-4}
OUT=${OUT:-./out}
mkdir -p "$OUT"
LOG="$OUT/compile_cost.log"
: > "$LOG"
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
LABELS=${LABELS:-native shim shim_nostacks shim_notrace}
one() {
    local label=$1 cache
    cache=$(mktemp -d)
    case $label in
        native) ${PIN:-} env LABEL=$label TORCHINDUCTOR_CACHE_DIR="$cache" python3 scripts/gpu/compile_cost.py ;;
        shim) ${PIN:-} env LABEL=$label TORCHINDUCTOR_CACHE_DIR="$cache" CACHEALLOC_CONF=log:quiet,trace_dir:$cache/trace LD_PRELOAD="$LIB" python3 scripts/gpu/compile_cost.py ;;
        shim_nostacks) ${PIN:-} env LABEL=$label TORCHINDUCTOR_CACHE_DIR="$cache" CACHEALLOC_CONF=log:quiet,stacks:none,trace_dir:$cache/trace LD_PRELOAD="$LIB" python3 scripts/gpu/compile_cost.py ;;
        shim_notrace) ${PIN:-} env LABEL=$label TORCHINDUCTOR_CACHE_DIR="$cache" CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$LIB" python3 scripts/gpu/compile_cost.py ;;
    esac 2>/dev/null | grep '^workload='
    rm -rf "$cache"
}
if [ -n "${AT_ONCE:-}" ]; then
    # Every process at once, each on a core of its own: round r's labels side by side, so that
    # a round's pair shares the machine's state (what the twenty-fourth session ran).
    core=0
    for r in $(seq "$ROUNDS"); do
        for label in $LABELS; do
            ( PIN="taskset -c $((core % $(nproc)))" one "$label" | sed "s/^/round=$r /" \
                > "$OUT/compile_cost_${r}_$label.log" ) &
            core=$((core + 1))
        done
    done
    wait
    for r in $(seq "$ROUNDS"); do cat "$OUT"/compile_cost_"${r}"_*.log; done | tee -a "$LOG"
else
    for r in $(seq "$ROUNDS"); do
        # Rotate the order, so that no label always runs first.
        set -- $LABELS
        for _ in $(seq $(( (r - 1) % $# ))); do set -- "${@:2}" "$1"; done
        for label in "$@"; do one "$label" | tee -a "$LOG"; done
    done
fi
for label in $LABELS; do
    [ "$label" = native ] && continue
    python3 scripts/gpu/ratio_ci.py "$LOG" native "$label" compile_s
done
case ${PROFILE:-} in
    perf)
        cache=$(mktemp -d)
        LABEL=shim TORCHINDUCTOR_CACHE_DIR="$cache" CACHEALLOC_CONF=log:quiet,trace_dir:$cache/trace LD_PRELOAD="$LIB" \
            perf record -g -o "$OUT/compile_cost.perf" python3 scripts/gpu/compile_cost.py 2>/dev/null | grep '^workload='
        perf report -i "$OUT/compile_cost.perf" --no-children --sort dso,symbol --stdio 2>/dev/null | head -80 > "$OUT/compile_cost_perf.txt"
        ;;
    pyspy)
        cache=$(mktemp -d)
        LABEL=shim TORCHINDUCTOR_CACHE_DIR="$cache" CACHEALLOC_CONF=log:quiet,trace_dir:$cache/trace LD_PRELOAD="$LIB" \
            py-spy record --native --format raw -o "$OUT/compile_cost.pyspy" -- python3 scripts/gpu/compile_cost.py 2>/dev/null | grep '^workload='
        ;;
esac
