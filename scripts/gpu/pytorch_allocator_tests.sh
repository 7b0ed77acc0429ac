#!/usr/bin/env bash
# PyTorch's own allocator, graph and MemPool tests from its test/test_cuda.py, natively and under
# the shim, each test in its own process (an abort kills only that test):
#   scripts/gpu/pytorch_allocator_tests.sh TEST_CUDA_PY LIBDIR [JOBS]
# TEST_CUDA_PY is PyTorch's test/test_cuda.py (at the machine's torch version where it can be
# had); LIBDIR holds the release libcachealloc.so and the cachealloc binary. Selection: every
# test of TestCudaMallocAsync, TestBlockStateAbsorption and TestMemPool, TestCudaOptims' graph
# tests, and TestCuda's tests whose names concern device memory (memory, oom, out_of_memory,
# fraction, record_stream, graph, cublas_workspace, caching, allocator, empty_cache, snapshot,
# mem_get_info, expandable), not host (pinned) memory; SELECT=EXPR replaces that pytest -k
# expression; IDS=FILE (an absolute path) keeps only the selected tests FILE lists, one pytest
# id (`test_cuda.py::Class::test`) a line. Writes $OUT/pytorch_tests.tsv (test, native,
# shim) and prints the table's counts last. Outcomes: pass, fail, skip, abort (killed by a
# signal), timeout (TEST_TIMEOUT seconds a test's process, 150 by default; PyTorch's slow tests,
# run with PYTORCH_TEST_WITH_SLOW=1, take longer on both sides: test_multiprocessing.py's
# test_cuda_send_many ~140 s). Tests PyTorch marks serial (they read the whole device's memory or
# set the process's memory fraction) run after the rest, nothing else on their GPU, each in a
# process of its own, one at a time a GPU. (Run in one process a side, ten of test_cuda.py's 22
# changed outcome on both sides: a memory fraction one test set, memory another kept.) Their
# processes take longer than the tests: test_cuda.py's 22 a side took 481 s on two GPUs, the
# other 132 ~250 s, so the whole selection takes two device commands: SERIAL=skip runs all but
# the serial tests, SERIAL=only the serial tests alone. The whole run stops after DEADLINE
# seconds (520), so that it fits one device command; the table then has what finished. GPUS=N
# (1) spreads the tests over the machine's
# first N GPUs, each process seeing one of them (CUDA_VISIBLE_DEVICES by the job's slot): JOBS
# run at once in all, and the serial tests' processes one a GPU (the first N of
# CUDA_VISIBLE_DEVICES when it is set). SIDES="shim" (default "native shim") runs one side only:
# a build's check against the native column of an earlier run on the same kind of machine (native
# outcomes do not depend on the build); NATIVE_FROM=TSV (an earlier run's pytorch_tests.tsv,
# absolute path) then fills the native column, and the counts compare with it.
# BATCH=N runs the selected tests in N pytest processes a side instead, as PyTorch's CI runs a
# file (for test/inductor/test_cudagraph_trees.py, whose tests compile for a minute each in a
# process of their own): round-robin over the GPUs, outcomes read from pytest's -v lines, a
# test that dies names itself (abort, timeout); after an abort the rest of its shard runs in
# another process (a timeout ends the shard: the deadline has come); each process's output stays
# in $OUT/batch_SIDE_K.log (then batch_SIDE_K.1.log, …). The device returns few files: callers
# should pack $OUT into one archive.
set -uo pipefail
TEST="$(realpath "$1")"
LIB="$(realpath "$2")/libcachealloc.so"
JOBS=${3:-6}
export TEST_TIMEOUT=${TEST_TIMEOUT:-150}
OUT=${OUT:-./out}
mkdir -p "$OUT"
[ -f "$LIB" ] || { echo "no $LIB"; exit 1; }
cd "$(dirname "$TEST")" || exit 1
start=$SECONDS  # DEADLINE counts from here: collecting the tests takes its share
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
EXPR=${SELECT:-'TestCudaMallocAsync or TestBlockStateAbsorption or TestMemPool or (TestCudaOptims and graph) or (TestCuda and (memory or oom or out_of_memory or fraction or record_stream or graph or cublas_workspace or caching or allocator or empty_cache or snapshot or mem_get_info or expandable) and not pinned and not host)'}
python3 -m pytest --collect-only -q -p no:cacheprovider "$(basename "$TEST")" -k "$EXPR" 2>/dev/null \
    | grep '::' > "$OUT/selected.txt"
if [ -n "${IDS:-}" ]; then  # only the tests listed in the file IDS (one pytest id a line)
    grep -xFf "$IDS" "$OUT/selected.txt" > "$OUT/listed.txt"; mv "$OUT/listed.txt" "$OUT/selected.txt"
fi
echo "selected $(wc -l < "$OUT/selected.txt") tests"
if [ ! -s "$OUT/selected.txt" ]; then
    # Collection failed, usually for a module the file imports (PyTorch's tests need
    # `expecttest` and `pytest`, which its wheels do not bring): say why.
    python3 -m pytest --collect-only -q -p no:cacheprovider "$(basename "$TEST")" -k "$EXPR" 2>&1 | tail -15
    exit 1
fi

# one ID LABEL: run one test, print "ID<TAB>LABEL<TAB>OUTCOME".
one() {
    local id=$1 label=$2 log rc outcome
    log=$(mktemp)
    # xargs numbers its running jobs 0..P-1 (SLOT): each slot keeps one GPU.
    # The GPUs are the first GPUS of CUDA_VISIBLE_DEVICES' list when it is set (so that the
    # tests can share a host with other work), else of the machine's.
    if [ "${GPUS:-1}" -gt 1 ]; then
        local list=(${GPU_LIST//,/ })
        export CUDA_VISIBLE_DEVICES=${list[$(( SLOT % GPUS ))]:-$(( SLOT % GPUS ))}
    fi
    # Tests that build a C++ extension (TestMemPool's `dummy_allocator`) build it where no
    # process running at the same time does: one folder a side and slot (`batch`: a shard).
    export TORCH_EXTENSIONS_DIR="$EXTENSIONS/${label}_${SLOT:-0}"
    if [ "$label" = shim ]; then
        CACHEALLOC_CONF=log:quiet LD_PRELOAD="$LIB" timeout "$TEST_TIMEOUT" python3 -m pytest -q -x -p no:cacheprovider "$id" > "$log" 2>&1
    else
        timeout "$TEST_TIMEOUT" python3 -m pytest -q -x -p no:cacheprovider "$id" > "$log" 2>&1
    fi
    rc=$?
    if [ $rc -eq 124 ]; then outcome=timeout
    elif [ $rc -gt 128 ] || grep -qE "Fatal Python error|core dumped|terminate called" "$log"; then outcome=abort
    elif [ $rc -eq 0 ] && grep -qE "[0-9]+ (passed|xpassed)" "$log"; then outcome=pass
    # An expected failure (pytest's "xfailed": PyTorch marks a test so where it knows the
    # test fails) counts as a skip, as `batch` reads it.
    elif [ $rc -eq 0 ] && grep -qE "[0-9]+ (skipped|xfailed)" "$log"; then outcome=skip
    else outcome=fail
    fi
    printf '%s\t%s\t%s\n' "$id" "$label" "$outcome"
    if [ "$outcome" != pass ] && [ "$outcome" != skip ]; then
        # The assertion and the error lines (pytest's "E " lines and the failing test's own
        # source line), then the end: the tail alone is mostly warnings' summary.
        { echo "=== $id $label $outcome"; grep -E '^(E  |>  )' "$log" | head -40; echo "--- end:"; tail -15 "$log"; } \
            >> "$OUT/failures_$label.log"
    fi
    rm -f "$log"
}
export -f one
# The shim's first PyTorch process on a machine builds the integration's C++ allocator for
# PyTorch (once, cached; the processes starting meanwhile wait for it): build it now, so that no
# test's own time counts it.
if [[ " ${SIDES:-native shim} " == *" shim "* ]]; then
    CACHEALLOC_CONF=log:quiet LD_PRELOAD="$LIB" timeout 300 \
        python3 -c 'import torch; torch.zeros(1, device="cuda")' > /dev/null 2>&1
fi
# Where the tests' C++ extensions are built: outside $OUT, which callers pack and send back.
EXTENSIONS=$(mktemp -d)
trap 'rm -rf "$EXTENSIONS"' EXIT
export LIB OUT EXTENSIONS GPUS=${GPUS:-1} GPU_LIST=${CUDA_VISIBLE_DEVICES:-}
# batch SIDE SHARD: run the tests of $OUT/shard_SHARD.txt in one pytest process on one GPU, as
# PyTorch's CI runs a file, and print "ID<TAB>SIDE<TAB>OUTCOME" for each test it reached, read
# from pytest's -v lines as they were written: a test whose line has no outcome when the process
# died aborted it, and the shard's tests after it run in another process (until DEADLINE).
batch() {
    local side=$1 shard=$2 list=(${GPU_LIST//,/ }) tests="$OUT/shard_$2.txt" part=0 log rc left
    export CUDA_VISIBLE_DEVICES=${list[$(( shard % GPUS ))]:-$(( shard % GPUS ))}
    export TORCH_EXTENSIONS_DIR="$EXTENSIONS/${side}_${shard}"
    while [ -s "$tests" ]; do
        log="$OUT/batch_${side}_${shard}.log"; [ $part -gt 0 ] && log="$OUT/batch_${side}_${shard}.$part.log"
        left=$(( ${DEADLINE:-520} - (SECONDS - start) )); [ "$left" -gt 10 ] || break
        if [ "$side" = shim ]; then
            CACHEALLOC_CONF=log:quiet LD_PRELOAD="$LIB" timeout "$left" python3 -m pytest -v -p no:cacheprovider $(cat "$tests") > "$log" 2>&1
        else
            timeout "$left" python3 -m pytest -v -p no:cacheprovider $(cat "$tests") > "$log" 2>&1
        fi
        rc=$?
        batch_outcomes "$log" "$side" "$rc" > "$OUT/outcomes_${side}_${shard}.$part.tsv"
        cat "$OUT/outcomes_${side}_${shard}.$part.tsv"
        # A test that killed its process leaves the tests after it unrun: they go on in another.
        grep -q "	abort$" "$OUT/outcomes_${side}_${shard}.$part.tsv" || break
        cut -f1 "$OUT/outcomes_${side}_${shard}.$part.tsv" | grep -vxFf - "$tests" > "$OUT/rest_${side}_${shard}.$part.txt"
        tests="$OUT/rest_${side}_${shard}.$part.txt"
        part=$(( part + 1 ))
    done
}
# batch_outcomes LOG SIDE RC: "ID<TAB>SIDE<TAB>OUTCOME" for each test a pytest -v log reached.
batch_outcomes() {
    local log=$1 side=$2 rc=$3
    python3 - "$log" "$side" "$rc" <<'PY'
import re, sys
log, side, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
rank = {"pass": 0, "skip": 0, "fail": 1, "abort": 2, "timeout": 2}
seen, last, done = {}, None, True
for line in open(log, errors="replace"):
    # The reports after the tests (failures, warnings by test, the summary) name tests too.
    if re.match(r"^=+ (FAILURES|ERRORS|warnings summary|short test summary info|PASSES) =+$", line):
        break
    # "-v" writes a test's id when it starts and its outcome, with the progress, when it ends
    # (output the test writes past pytest's capture can come between them).
    start = re.match(r"^(\S+\.py::\S+)", line)
    if start:
        last, done = start.group(1), False
    end = re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b[^\[]*\[\s*\d+%\]", line)
    if end and last is not None:
        outcome = {"PASSED": "pass", "XPASS": "pass", "SKIPPED": "skip", "XFAIL": "skip"}.get(end.group(1), "fail")
        if rank[outcome] >= rank.get(seen.get(last), -1):
            seen[last] = outcome
        done = True
if last is not None and not done and rc != 0:
    seen[last] = "timeout" if rc == 124 else "abort"
for test, outcome in seen.items():
    print(f"{test}\t{side}\t{outcome}")
PY
}
export -f batch batch_outcomes
if [ -n "${BATCH:-}" ]; then
    # BATCH=N: the selected tests in N pytest processes a side (every test compiles with
    # inductor, seconds each, so a process per test would not fit), round-robin over the GPUs.
    awk -v n="$BATCH" -v out="$OUT" '{ print > (out "/shard_" ((NR - 1) % n) ".txt") }' "$OUT/selected.txt"
    for side in ${SIDES:-native shim}; do
        for (( k = 0; k < BATCH && k < $(wc -l < "$OUT/selected.txt"); k++ )); do
            batch "$side" "$k" > "$OUT/raw_${side}_$k.tsv" &
        done
    done
    wait
    cat "$OUT"/raw_*_*.tsv > "$OUT/raw.tsv"
    SKIP_SINGLE=1
fi
# PyTorch's @serialTest() tests (pytest mark "serial") measure the whole device
# (`mem_get_info`): they run one at a time after the others, with nothing else on the GPU.
[ -z "${SKIP_SINGLE:-}" ] && python3 -m pytest --collect-only -q -p no:cacheprovider "$(basename "$TEST")" -k "$EXPR" -m serial 2>/dev/null \
    | grep '::' | grep -xFf "$OUT/selected.txt" > "$OUT/serial.txt"
case "${SERIAL:-}" in
    skip) grep -vxFf "$OUT/serial.txt" "$OUT/selected.txt" > "$OUT/listed.txt"; mv "$OUT/listed.txt" "$OUT/selected.txt"
          : > "$OUT/serial.txt" ;;
    only) cp "$OUT/serial.txt" "$OUT/selected.txt" ;;
    "") ;;
    *) echo "SERIAL=$SERIAL: expected skip or only"; exit 1 ;;
esac
[ -z "${SKIP_SINGLE:-}" ] && echo "running $(wc -l < "$OUT/selected.txt") tests, $(wc -l < "$OUT/serial.txt") of them serial"
SIDES=${SIDES:-native shim}
pairs() { while read -r id; do for side in $SIDES; do printf '%s %s\n' "$id" "$side"; done; done; }
left() { local l=$(( ${DEADLINE:-520} - (SECONDS - start) )); echo $(( l > 1 ? l : 1 )); }
if [ -z "${SKIP_SINGLE:-}" ]; then
    # The serial tests keep a third of the time left (when there are any).
    reserve=0; [ -s "$OUT/serial.txt" ] && reserve=$(( $(left) / 3 ))
    grep -vxFf "$OUT/serial.txt" "$OUT/selected.txt" | pairs \
        | timeout "$(( $(left) - reserve ))" xargs -r -P "$JOBS" --process-slot-var=SLOT -L 1 bash -c 'one "$0" "$1"' > "$OUT/raw.tsv"
    pairs < "$OUT/serial.txt" | timeout "$(left)" xargs -r -P "$GPUS" --process-slot-var=SLOT -L 1 bash -c 'one "$0" "$1"' >> "$OUT/raw.tsv"
fi
python3 - "$OUT/raw.tsv" "$OUT/pytorch_tests.tsv" "${NATIVE_FROM:-}" <<'PY'
import collections, sys
rows = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    test, label, outcome = line.rstrip("\n").split("\t")
    rows[test][label] = outcome
if sys.argv[3]:  # NATIVE_FROM: the native column of an earlier run, for the tests run now
    for line in list(open(sys.argv[3]))[1:]:
        test, native, _ = line.rstrip("\n").split("\t")
        if test in rows and "native" not in rows[test] and native != "-":
            rows[test]["native"] = native
with open(sys.argv[2], "w") as f:
    f.write("test\tnative\tshim\n")
    for test in sorted(rows):
        f.write(f"{test}\t{rows[test].get('native', '-')}\t{rows[test].get('shim', '-')}\n")
native = collections.Counter(r.get("native") for r in rows.values())
shim = collections.Counter(r.get("shim") for r in rows.values())
both = sum(1 for r in rows.values() if r.get("native") == "pass" and r.get("shim") == "pass")
lost = sorted(t for t, r in rows.items() if r.get("native") == "pass" and r.get("shim") != "pass")
print("lost (native pass, shim not):")
for t in lost:
    print(f"  {t.split('::', 1)[1]}: {rows[t].get('shim', 'not run')}")
print(f"tests={len(rows)} native={dict(native)} shim={dict(shim)}")
print(f"pass natively={native['pass']} pass under the shim={shim['pass']} both={both} aborts under the shim={shim['abort']}")
PY
