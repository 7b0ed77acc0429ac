#!/usr/bin/env bash
# Where each configuration's step goes, by thread (issue 25: what the default costs a step, part
# by part): `perf` with call graphs over SECONDS_PER_RUN (12) s of steady steps of models.py's
# MODEL (llama) in one process per configuration, pinned to CPUS (4-5, as lockstep.py runs):
#     PERF=DIR scripts/gpu/thread_profile.sh LIBDIR [LABEL=CONF ...]
# Each LABEL=CONF is a process: `native` (no preload), or the shim with CACHEALLOC_CONF=CONF
# (`default=` for the default). Default list: native= default= notrace=trace:off
# nocategories=categories:off fixed=trace:off,expandable_segments:False. LIBDIR holds a
# libcachealloc.so with its symbols (`strip --strip-debug`, not `strip`: a stripped library's
# samples have no names). DIR is a perf carried to the machine (trace_profile.sh says how to
# make it). Python runs with `-X perf` (3.12: each Python function named in the call graphs).
# Writes $OUT/profile_LABEL.json (scripts/gpu/perf_threads.py's counters) and each thread's CPU
# time a step ($OUT/threads.txt, from /proc: exact where samples are not), then prints
# perf_threads.py's report of them all. Processes of one configuration differ by several per
# cent as a whole: the tables say where a cost is, not how much it is to 1 %.
set -uo pipefail
LIB=$(realpath "$1")/libcachealloc.so
shift
CONFIGS=("$@")
[ ${#CONFIGS[@]} -eq 0 ] && CONFIGS=(native= default= notrace=trace:off nocategories=categories:off
    fixed=trace:off,expandable_segments:False)
OUT=${OUT:-./out}
PERF_DIR=$(realpath "${PERF:?PERF=DIR of a carried perf}")
PERF_CMD="$PERF_DIR/ld-linux-x86-64.so.2 --library-path $PERF_DIR $PERF_DIR/perf"
HERE=$(dirname "$(realpath "$0")")
SECS=${SECONDS_PER_RUN:-12}
RATE=1999
mkdir -p "$OUT"
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/cache}
# The shim's first run builds its C++ pieces for this PyTorch: not inside a profile.
CACHEALLOC_CONF=log:quiet LD_PRELOAD=$LIB STEPS=2 python3 "$HERE/train_models.py" mlp > /dev/null 2>&1
for _ in $(seq 90); do pgrep -f cc1plus > /dev/null || break; sleep 1; done
cpu_times() {  # thread name and CPU ticks of each thread of process $2, prefixed by $1
    for t in /proc/$2/task/*; do
        echo "$1 $(cat "$t/comm" 2>/dev/null | tr ' ' _) $(awk '{print $14 + $15}' "$t/stat" 2>/dev/null)"
    done
}
for config in "${CONFIGS[@]}"; do
    label=${config%%=*}
    conf=${config#*=}
    envs=(PAUSE=none READY=/tmp/ready STEPS=1000000 MODEL=${MODEL:-llama})
    [ "$label" != native ] && envs+=(LD_PRELOAD=$LIB CACHEALLOC_CONF="log:quiet${conf:+,$conf}")
    rm -f /tmp/ready
    env "${envs[@]}" taskset -c "${CPUS:-4-5}" python3 -X perf "$HERE/steady_steps.py" \
        > "/tmp/steady_$label.txt" 2>&1 &
    pid=$!
    while [ ! -e /tmp/ready ] && kill -0 $pid 2> /dev/null; do sleep 0.1; done
    start=$(date +%s.%N)
    cpu_times "$label before" $pid >> "$OUT/threads.txt"
    $PERF_CMD record -q -g -F $RATE -p $pid -o /tmp/thread_profile.data -- sleep "$SECS" 2>&1 | tail -2
    cpu_times "$label after" $pid >> "$OUT/threads.txt"
    kill $pid
    wait $pid
    end=$(date +%s.%N)
    line=$(tail -1 "/tmp/steady_$label.txt")
    echo "$label: $line"
    # The steps the samples cover: those since READY, scaled to the recorded seconds.
    steps=$(python3 -c "import sys; n = int('$line'.split('steps=')[1].split()[0]);
print(round(n * $SECS / ($end - $start)))")
    echo "$label steps_in_window=$steps all_steps=${line#*steps=}" >> "$OUT/threads.txt"
    $PERF_CMD script -i /tmp/thread_profile.data -F comm,tid,ip,sym,dso 2> /dev/null |
        python3 "$HERE/perf_threads.py" aggregate "$label" "$steps" > "$OUT/profile_$label.json"
    rm -f /tmp/thread_profile.data
done
python3 "$HERE/perf_threads.py" report $(python3 -c "print($RATE / 1000)") \
    $(for config in "${CONFIGS[@]}"; do echo "$OUT/profile_${config%%=*}.json"; done)
