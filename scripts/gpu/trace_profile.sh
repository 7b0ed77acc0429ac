#!/usr/bin/env bash
# Where the trace's time goes on the GPU machine (issue 25): `perf` over SECONDS_PER_RUN (20) s of steady
# Llama steps (steady_steps.py), attached after warm-up, in separate processes with the trace
# on (label `none`: nothing paused) and paused (`trace`), ROUNDS (2) pairs:
#     PERF=DIR scripts/gpu/trace_profile.sh LIBDIR [ROUNDS]
# The GPU machine has no perf: DIR holds one carried there with its libraries and loader,
# made here with
#     mkdir -p .gpu/perf && cp /usr/bin/perf .gpu/perf/ &&
#     for l in $(ldd /usr/bin/perf | awk '/=>/{print $3} /ld-linux/{print $1}'); do cp -L $l .gpu/perf/; done
# and run through that loader. Writes $OUT/dso_P_R.txt and $OUT/csym_P_R.txt (samples by thread
# and library, and by thread, library and symbol) and prints each process's steps since
# warm-up: samples per step is a file's count over that. PAUSES (default "none trace") names the
# processes of a pair (steady_steps.py's PAUSE: none, trace, stacks, categories); PYFLAGS (e.g.
# "-X perf", Python 3.12+) is given to Python, whose perf trampolines then name each Python
# function in the reports (`py::name:file`). A stripped library shows as addresses: map them
# with `addr2line -f -C -i -e UNSTRIPPED.so ADDR+D` on the same build (the same build ID), D
# being the executable LOAD segment's VirtAddr minus its Offset (`readelf -lW`).
set -uo pipefail
LIB=$(realpath "$1")/libcachealloc.so
ROUNDS=${2:-2}
OUT=${OUT:-./out}
PERF_DIR=$(realpath "${PERF:?PERF=DIR of a carried perf}")
PERF_CMD="$PERF_DIR/ld-linux-x86-64.so.2 --library-path $PERF_DIR $PERF_DIR/perf"
HERE=$(dirname "$(realpath "$0")")
mkdir -p "$OUT"
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/cache}
for round in $(seq 1 "$ROUNDS"); do
    for p in ${PAUSES:-none trace}; do
        rm -f /tmp/ready
        PAUSE=$p READY=/tmp/ready STEPS=1200 CACHEALLOC_CONF=log:quiet LD_PRELOAD=$LIB \
            python3 ${PYFLAGS:-} "$HERE/steady_steps.py" > /tmp/steady_$p.txt 2>&1 &
        pid=$!
        while [ ! -e /tmp/ready ] && kill -0 $pid 2>/dev/null; do sleep 0.2; done
        $PERF_CMD record -F 2999 -p $pid -o /tmp/p_$p.data -- sleep "${SECONDS_PER_RUN:-20}" 2>&1 | tail -1
        kill $pid
        wait $pid
        tail -1 /tmp/steady_$p.txt
        $PERF_CMD report -i /tmp/p_$p.data --no-children --sort comm,dso -g none -n 2>&1 |
            grep -v "^#" | grep -v "^$" | head -60 > "$OUT/dso_${p}_$round.txt"
        $PERF_CMD report -i /tmp/p_$p.data --no-children --sort comm,dso,sym -g none -n 2>&1 |
            grep -v "^#" | grep -v "^$" | head -1500 > "$OUT/csym_${p}_$round.txt"
    done
done
