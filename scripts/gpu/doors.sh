#!/usr/bin/env bash
# The shim's doors on a real GPU (run on the GPU machine from the repository root):
#   scripts/gpu/doors.sh LIBDIR
# LIBDIR holds a release libcachealloc.so. For each kind of program — nvcc's default build
# (the CUDA runtime linked statically), a program linked with libcuda, one that looks the driver
# up with dlsym, CuPy with its pool off, JAX with XLA's platform allocator, PyTorch — runs it
# with and without the shim and prints one row of the coverage table: which door its
# allocations came through (the exit summary's door line), whether they were pooled, whether
# the results were correct (the program's own check, or the same checksum/loss as native).
# Then the latency of an interposed cached alloc/free pair through each door (trace off), with
# raw cudaMalloc/cudaFree in the same run. Prints PASS/FAIL lines and exits non-zero on a FAIL.
set -uo pipefail
LIB="$(realpath "$1")/libcachealloc.so"
BIN=$(mktemp -d)
FAILED=0
TABLE=$(mktemp)
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; FAILED=1; }
doors() { echo "$1" | sed -n 's/.*allocations by door: //p' | tail -1; }
pooled() { grep -q "allocations served from the cache" <<< "$1" && echo yes || echo no; }
row() { echo "| $1 | $2 | $3 | $4 |" >> "$TABLE"; }

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nvcc --version | tail -1

# --- nvcc's default build: the runtime linked statically --------------------------------------
for name in basic race threads oom stream_ordered graph_capture meminfo badfree; do
    nvcc -O2 -Itests/programs -o "$BIN/${name}_static" "tests/programs/$name.c" tests/programs/slow_fill.cu -lpthread \
        || fail "build ${name}_static"
done
if ldd "$BIN/basic_static" | grep -q cudart; then fail "basic_static links a shared cudart"; fi
# run_static NAME ARGS...: under the shim; expects "OK NAME" and the entry-point door.
run_static() {
    local name=$1; shift
    local out; out=$(LD_PRELOAD="$LIB" timeout 120 "$BIN/${name}_static" "$@" 2>&1)
    local ok=no; grep -q "^OK $name" <<< "$out" && ok=yes
    local d; d=$(doors "$out")
    row "nvcc default (static cudart): $name $*" "${d:-none}" "$(pooled "$out")" "$ok"
    if [ "$ok" = yes ] && grep -q "driver entry points" <<< "$d"; then pass "static $name $*"; else fail "static $name $*"; echo "$out" | tail -4; fi
}
run_static basic
run_static race nonblocking
run_static race blocking
run_static race nonblocking late
run_static threads 8 300
CACHEALLOC_CONF=per_process_memory_fraction:0.001 run_static oom
run_static stream_ordered
run_static graph_capture
run_static meminfo
run_static badfree
out=$(CACHEALLOC_CONF=reuse:immediate LD_PRELOAD="$LIB" timeout 120 "$BIN/race_static" nonblocking 2>&1)
if grep -q "overwritten by the old work" <<< "$out"; then pass "static race control (reuse:immediate is caught)"; else fail "static race control"; fi

# --- the driver API: linked with libcuda, and looked up with dlsym ----------------------------
nvcc -O2 -o "$BIN/driver_doors" scripts/gpu/driver_doors.cu -lcuda -ldl || fail "build driver_doors"
for mode in symbols dlsym entry; do
    out=$(LD_PRELOAD="$LIB" timeout 120 "$BIN/driver_doors" "$mode" 2>&1)
    ok=no; grep -q "^OK driver_doors" <<< "$out" && ok=yes
    d=$(doors "$out")
    row "driver API ($mode)" "${d:-none}" "$(pooled "$out")" "$ok"
    case "$mode" in symbols) want="driver symbols";; dlsym) want="dlsym";; *) want="driver entry points";; esac
    if [ "$ok" = yes ] && grep -q "$want" <<< "$d"; then pass "driver_doors $mode"; else fail "driver_doors $mode"; echo "$out" | tail -4; fi
done

# --- Python libraries: same checksum or loss with and without the shim -----------------------
# compare LABEL KEY COMMAND...: native run, shim run; the KEY= values must agree to 1e-6.
compare() {
    local label=$1 key=$2; shift 2
    local native shim a b d ok=no
    native=$(timeout 300 "$@" 2>&1)
    shim=$(LD_PRELOAD="$LIB" timeout 300 "$@" 2>&1)
    a=$(echo "$native" | sed -n "s/.*$key=\([0-9.e+-]*\).*/\1/p" | tail -1)
    b=$(echo "$shim" | sed -n "s/.*$key=\([0-9.e+-]*\).*/\1/p" | tail -1)
    if [ -n "$a" ] && [ -n "$b" ] && python3 -c "import sys; a, b = $a, $b; sys.exit(0 if abs(a - b) <= 1e-6 * max(1.0, abs(a)) else 1)"; then ok=yes; fi
    d=$(doors "$shim")
    row "$label" "${d:-none}" "$(pooled "$shim")" "$ok ($key $a vs $b)"
    echo "native: $(echo "$native" | grep '^workload=' | tail -1)"
    echo "shim:   $(echo "$shim" | grep -E '^(workload=|cachealloc:)' | tail -4 | paste -sd' ')"
    if [ "$ok" = yes ] && [ -n "$d" ]; then pass "$label"; else fail "$label"; echo "$shim" | tail -5; fi
}
if python3 -c "import cupy" 2>/dev/null; then
    compare "CuPy $(python3 -c 'import cupy; print(cupy.__version__)'), set_allocator(None)" checksum python3 scripts/gpu/cupy_workload.py
else
    row "CuPy" "not installed" "-" "-"
fi
if python3 -c "import jax" 2>/dev/null; then
    # XLA maps its arrays with CUDA's virtual memory API (cuMemCreate/cuMemMap), which no door
    # serves: only the runtime allocations of its libraries (workspaces) reach the shim.
    compare "JAX $(python3 -c 'import jax; print(jax.__version__)'), XLA_PYTHON_CLIENT_ALLOCATOR=platform (arrays: CUDA VMM, not reached)" \
        checksum python3 scripts/gpu/jax_workload.py
else
    row "JAX" "not installed" "-" "-"
fi
if [ -n "${WORKLOADS:-}" ] && [ -f "$WORKLOADS/mlp_train.py" ]; then
    compare "PyTorch $(python3 -c 'import torch; print(torch.__version__)') mlp_train.py" loss python3 "$WORKLOADS/mlp_train.py"
fi

# --- what a cached pair costs through each door -----------------------------------------------
bash scripts/gpu/door_pairs.sh "$(dirname "$LIB")" 3

echo "== coverage"
echo "| program | door (allocation requests) | pooled | correct |"
echo "|---|---|---|---|"
cat "$TABLE"
[ "$FAILED" = 0 ] && echo "ALL PASSED" || echo "SOME FAILED"
exit "$FAILED"
