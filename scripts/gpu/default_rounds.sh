#!/usr/bin/env bash
# The shim's default against PyTorch's on the allocation-heavy models (issue 25): per round, for
# each of the Llama and the CNN of models.py (scripts/gpu/train_models.py), three processes in a
# rotating order — native (PyTorch's caching allocator), shim (the shim's default: trace, Python
# stacks, categories, expandable segments for stream-ordered allocations) and shim_fixed
# (`expandable_segments:False`) — until ROUNDS rounds or BUDGET seconds (default 520) are done:
#     [LABELS="native shim shim_notrace"] [MODELS=llama] scripts/gpu/default_rounds.sh LIBDIR [ROUNDS]
# LABELS picks and orders the processes (shim_notrace: the default with `trace:off`, which also
# leaves stacks and the category hooks out: the route and the pools alone); MODELS the models.
# CPUS (e.g. 2-9) runs every process on that fixed set of CPUs (`taskset -c`), the same for
# every label: the process-to-process noise is then not where the scheduler put each process.
# Writes $OUT/models.log (one train_models.py line per process) and prints, for each shim label,
# the median step and peak reserved against native's with the paired rounds' 95 % interval
# (ratio_ci.py), and the spread of each label's steps across its processes.
set -u
LIB="$(realpath "$1")/libcachealloc.so"
ROUNDS=${2:-4}
OUT=${OUT:-./out}
mkdir -p "$OUT"
LOG=$OUT/models.log
read -r -a labels <<< "${LABELS:-native shim shim_fixed}"
n=${#labels[@]}
PIN=()
[ -n "${CPUS:-}" ] && PIN=(taskset -c "$CPUS")
one() {
    case $1 in
        native) LABEL=native "${PIN[@]}" python3 scripts/gpu/train_models.py "$2" ;;
        shim) LABEL=shim CACHEALLOC_CONF=log:quiet LD_PRELOAD=$LIB "${PIN[@]}" python3 scripts/gpu/train_models.py "$2" ;;
        shim_fixed) LABEL=shim_fixed CACHEALLOC_CONF=log:quiet,expandable_segments:False LD_PRELOAD=$LIB \
            "${PIN[@]}" python3 scripts/gpu/train_models.py "$2" ;;
        shim_notrace) LABEL=shim_notrace CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD=$LIB \
            "${PIN[@]}" python3 scripts/gpu/train_models.py "$2" ;;
    esac 2>&1 | grep '^workload=' | tee -a "$LOG"
}
end=$((SECONDS + ${BUDGET:-520}))
for r in $(seq 0 $((ROUNDS - 1))); do
    for m in ${MODELS:-llama cnn}; do
        for i in $(seq 0 $((n - 1))); do
            [ $SECONDS -lt $end ] && one "${labels[$(((i + r) % n))]}" "$m"
        done
    done
done
for l in "${labels[@]:1}"; do
    for f in step_ms torch_max_reserved_MB; do
        python3 scripts/gpu/ratio_ci.py "$LOG" native "$l" "$f"
    done
done
# Each label's steps across its processes (min, median, max): the noise the rounds average out.
python3 - "$LOG" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(sys.argv[1])]
for key in dict.fromkeys((r["workload"], r["label"]) for r in rows if "step_ms" in r):
    steps = sorted(float(r["step_ms"]) for r in rows if (r["workload"], r["label"]) == key)
    sums = sorted({r["param_sum"] for r in rows if (r["workload"], r["label"]) == key and "param_sum" in r})
    print(f"spread {key[0]} {key[1]}: n={len(steps)} min={steps[0]:.3f} median={statistics.median(steps):.3f} "
          f"max={steps[-1]:.3f} param_sum={','.join(sums)}")
PY
