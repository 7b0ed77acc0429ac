#!/usr/bin/env bash
# Correctness on a real GPU (run on the GPU machine from the repository root):
#   scripts/gpu/check.sh LIBDIR WORKLOADS
# LIBDIR holds a release libcachealloc.so and the cachealloc binary built on the development
# machine; WORKLOADS holds
# mlp_train.py and gpt2_train.py. Builds the C test programs of tests/programs with
# `nvcc -cudart shared` (the runtime's door; scripts/gpu/doors.sh covers nvcc's static default
# and the driver's doors), runs them under the shim with fixed segments, with the default
# (expandable segments for stream-ordered allocations) and with expandable_segments:True (CUDA
# virtual memory for every allocation), then runs the training workloads (and infer_varbatch.py)
# natively and under the shim, with the default and with fixed segments, and checks that the
# losses agree to 1e-6.
# Prints one PASS/FAIL line per check and exits non-zero if any failed. PARTS (default: all of
# "programs python tools torch multi categories compile training") picks the sections to run, so that
# they can be split over device calls; the multi-GPU checks skip themselves on one GPU.
# PROGRAMS (default: all) names the C programs the programs part builds and runs, e.g.
# PROGRAMS="cuda_ipc_handles ipc" to check a change to them alone.
set -uo pipefail
PARTS=${PARTS:-programs python tools torch multi categories compile training}
part() { [[ " $PARTS " == *" $1 "* ]]; }
LIB="$(realpath "$1")/libcachealloc.so"
WORK="$(realpath "$2")"
[ -f "$LIB" ] || { echo "FAIL no $LIB (was the folder carried to this machine?)"; exit 1; }
BIN=$(mktemp -d)
FAILED=0
pass() { echo "PASS $*"; }
chosen() { [ -z "${PROGRAMS:-}" ] || [[ " $PROGRAMS " == *" $1 "* ]]; }
fail() { echo "FAIL $*"; FAILED=1; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

# judge NAME LABEL OUTPUT: passes when the output has "OK NAME" and the shim's exit summary (a
# program that passes without the shim loaded proves nothing), or says it skipped.
judge() {
    local name=$1 label=$2 out=$3
    if grep -q "^OK $name (skipped" <<< "$out"; then
        pass "$label (skipped)"
    elif grep -q "^OK $name" <<< "$out" && grep -q "^cachealloc: " <<< "$out"; then
        pass "$label"
    else
        fail "$label"; echo "$out" | tail -5
    fi
}

# run NAME [ENV...] -- ARGS: the C program NAME under the shim.
run() {
    local name=$1; shift
    chosen "$name" || return 0
    local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    local out
    out=$(env "${envs[@]}" LD_PRELOAD="$LIB" timeout 120 "$BIN/$name" "$@" 2>&1)
    judge "$name" "$name $*" "$out"
    echo "$out" | grep "^cachealloc:" | tail -2
}

# run_py SCRIPT CONF: the Python check scripts/gpu/SCRIPT under the shim with CACHEALLOC_CONF.
run_py() {
    local out
    out=$(CACHEALLOC_CONF=$2 LD_PRELOAD="$LIB" timeout 300 python3 "scripts/gpu/$1" 2>&1)
    judge "$1" "$1 $2" "$out"
}

# BOTH_ENV (words VAR=VALUE) goes to both runs, NATIVE_ENV to the native one.
both() {
    local script=$1 tag=$2; shift 2
    local native shim
    native=$(env LABEL=native ${BOTH_ENV:-} ${NATIVE_ENV:-} timeout 300 python3 "scripts/gpu/$script" 2>&1 | grep -E "^$tag .*passed=")
    shim=$(env LABEL=shim ${BOTH_ENV:-} "$@" LD_PRELOAD="$LIB" timeout 300 python3 "scripts/gpu/$script" 2>&1 | grep -E "^$tag |^cachealloc:")
    echo "native: $native"; echo "$shim" | grep -v "ok=True"
    local n s
    n=$(sed -n 's/.*passed=\([0-9]*\/[0-9]*\).*/\1/p' <<< "$native")
    s=$(sed -n 's/.*passed=\([0-9]*\/[0-9]*\).*/\1/p' <<< "$shim" | tail -1)
    if [ -n "$s" ] && [ "$n" = "$s" ] && [ "${s%/*}" = "${s#*/}" ]; then pass "$script ${BOTH_ENV:-} $* $s"; else fail "$script ${BOTH_ENV:-} $* native=$n shim=$s"; fi
}

FIXED=CACHEALLOC_CONF=expandable_segments:False
EXP=CACHEALLOC_CONF=expandable_segments:True

if part programs || part multi; then
for src in tests/programs/*.c; do
    name=$(basename "$src" .c)
    [ "$name" = slow_fill_fake ] && continue  # fakecuda's slow_fill; slow_fill.cu replaces it
    case "$name" in
        lib*) continue;;                            # helper libraries of the Python tests
        driver_*|dlsym_next|map_race) continue;;    # fakecuda-only (host writes to device memory; preloaded helpers; fakecuda's timing)
        mem_pools) continue;;                       # its use_on_oom part needs fakecuda's device-wide capacity; mem_pools.py covers MemPool here
    esac
    if ! part programs; then case "$name" in multi_gpu|peer_access) ;; *) continue;; esac; fi
    chosen "$name" || continue
    nvcc -cudart shared -O2 -Itests/programs -o "$BIN/$name" "$src" tests/programs/slow_fill.cu -lpthread \
        || fail "build $name"
done
fi

if part programs; then


# Fixed segments (`cudaMalloc`'s), named: the default maps stream-ordered allocations.
run basic "$FIXED" --
run race "$FIXED" -- nonblocking
run race "$FIXED" -- blocking
run race "$FIXED" -- nonblocking late
# Control (the race program is built with the programs): without fences the race must be caught.
if chosen race; then
out=$(CACHEALLOC_CONF=reuse:immediate,expandable_segments:False LD_PRELOAD="$LIB" timeout 120 "$BIN/race" nonblocking 2>&1)
if grep -q "overwritten by the old work" <<< "$out"; then pass "race control (reuse:immediate is caught)"; else fail "race control"; echo "$out" | tail -3; fi
fi
run threads "$FIXED" -- 8 300
run oom CACHEALLOC_CONF=expandable_segments:False,per_process_memory_fraction:0.001 --
run badfree "$FIXED" --
run meminfo "$FIXED" --
run fork "$FIXED" --
run exit_nofree "$FIXED" --
run ipc "$FIXED" --
run ipc_share "$FIXED" --
run ipc_share "$FIXED" -- desc
run cuda_ipc_handles "$FIXED" --
run device_reset "$FIXED" --
run stream_ordered "$FIXED" --
run graph_capture "$FIXED" --
run capture_pools "$FIXED" --
run capture_streams "$FIXED" --
run capture_reclaim "$FIXED" --
run allocator_settings "$FIXED" --
run entry_point "$FIXED" --
run load "$FIXED" -- 4 300 1
run exit_paths "$FIXED" -- thread
run exit_paths "$FIXED" -- signals
# The C API's pieces of PyTorch's allocator: graph pools held by the program's references,
# pool checkpoints (graph trees), frees held for record_stream's work.
run graph_pool_refs "$FIXED" --
run pool_checkpoints "$FIXED" --
run held_free "$FIXED" --
run segment_trackers X=1 --
# The default: expandable segments for stream-ordered allocations, fixed segments for cudaMalloc
# (whose pointers keep answering the driver as a cudaMalloc's: IPC handles, contexts).
run basic X=1 --
run ipc X=1 --
run ipc_share X=1 --
run cuda_ipc_handles X=1 --
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    run cuda_ipc_handles RECEIVER_DEVICE=1 --
elif chosen cuda_ipc_handles; then
    echo "SKIP cuda_ipc_handles RECEIVER_DEVICE=1 (one GPU: the receiver on another device needs two)"
fi
run stream_ordered X=1 --
run graph_capture X=1 --
run capture_streams X=1 --
run capture_reclaim X=1 --
run fork X=1 --
# Expandable segments (CUDA's virtual memory): the same programs, pooled by mapping.
run basic "$EXP" --
run race "$EXP" -- nonblocking
run threads "$EXP" -- 8 300
run load "$EXP" -- 4 300 1
run stream_ordered "$EXP" --
run graph_capture "$EXP" --
run capture_streams "$EXP" --
run ipc_share "$EXP" -- desc
run ipc_share "$EXP" -- desc big
run cuda_ipc_handles "$EXP" --
run device_reset "$EXP" --
run fork "$EXP" --
run oom CACHEALLOC_CONF=expandable_segments:True,per_process_memory_fraction:0.001 --
if chosen threads; then
out=$(CACHEALLOC_CONF=expandable_segments:True LD_PRELOAD="$LIB" "$BIN/threads" 4 100 2>&1)
if grep -q "maps into expandable segments" <<< "$out"; then pass "expandable segments engaged"; else fail "expandable segments engaged"; echo "$out" | tail -3; fi
fi

fi

if part python; then

# Python through ctypes: the runtime PyTorch ships.
CUDART=$(python3 -c 'import glob, os, site; print(next(iter(sorted(glob.glob(os.path.join(site.getsitepackages()[0], "nvidia", "**", "libcudart.so.13"), recursive=True))), ""))')
if [ -n "$CUDART" ]; then
    out=$(LD_LIBRARY_PATH="$(dirname "$CUDART")" LD_PRELOAD="$LIB" timeout 120 python3 tests/programs/ctypes_test.py 2>&1)
    if grep -q "^OK ctypes" <<< "$out"; then pass "ctypes"; else fail "ctypes"; echo "$out" | tail -5; fi
else
    fail "ctypes (libcudart.so.13 not found in site-packages)"
fi

# Python stacks on this machine's CPython, over the real runtime, checked through the tools:
# the snapshot pickle's frames must be what Python saw (scripts/gpu/check_python_stacks.py).
CA="$(dirname "$LIB")/cachealloc"
if [ -n "$CUDART" ] && [ -x "$CA" ]; then
    PS=$(mktemp -d)
    out=$(cd "$PS" && LD_LIBRARY_PATH="$(dirname "$CUDART")" CACHEALLOC_CONF=log:quiet,trace_dir:"$PS/trace" \
        LD_PRELOAD="$LIB" timeout 120 python3 "$OLDPWD/tests/programs/python_stacks.py" "$PS/expected.json" 2>&1)
    if grep -q "^OK python_stacks" <<< "$out" && "$CA" snapshot "$PS/trace" --at-peak -o "$PS/snap.pickle" >/dev/null \
        && python3 scripts/gpu/check_python_stacks.py "$PS/expected.json" "$PS/snap.pickle"; then
        pass "python stacks ($(python3 -c 'import sys; print(sys.version.split()[0])'))"
    else
        fail "python stacks"; echo "$out" | tail -5
    fi
else
    fail "python stacks (no libcudart.so.13 or no cachealloc binary in $(dirname "$LIB"))"
fi

fi

if part tools; then
# The tools on a PyTorch run's trace: summary, and a snapshot PyTorch's own viewer code reads.
# (_memory_viz's `segments` and `memory` download flamegraph.pl, which this machine cannot.)
if [ -x "$CA" ]; then
    TT=$(mktemp -d)
    (cd "$TT" && CACHEALLOC_CONF=log:quiet,trace_dir:"$TT/trace" LD_PRELOAD="$LIB" python3 "$WORK/mlp_train.py" >/dev/null 2>&1)
    if "$CA" summary "$TT/trace" > "$TT/summary.txt" && grep -q "mlp_train.py" "$TT/summary.txt" \
        && "$CA" snapshot "$TT/trace" --at-peak -o "$TT/snap.pickle" >/dev/null \
        && python3 -m torch.cuda._memory_viz stats "$TT/snap.pickle" > "$TT/stats.txt" \
        && python3 -m torch.cuda._memory_viz trace "$TT/snap.pickle" > "$TT/trace.txt" \
        && python3 -m torch.cuda._memory_viz trace_plot "$TT/snap.pickle" -o "$TT/trace.html" \
        && python3 -m torch.cuda._memory_viz segment_plot "$TT/snap.pickle" -o "$TT/segments.html" \
        && python3 -c "import pickle, sys; from torch.cuda._memory_viz import segsum; print(segsum(pickle.load(open(sys.argv[1], 'rb'))))" \
            "$TT/snap.pickle" > "$TT/segsum.txt"; then
        pass "tools on a PyTorch trace (summary; torch.cuda._memory_viz stats, trace, trace_plot, segment_plot, segsum read our snapshot)"
        sed -n '1,25p' "$TT/summary.txt"; head -4 "$TT/stats.txt"; head -4 "$TT/segsum.txt"; ls -la "$TT"
    else
        fail "tools on a PyTorch trace"; for f in "$TT"/*.txt; do echo "== $f"; tail -n 5 "$f"; done
    fi
fi

fi

if part torch; then
# PyTorch's CUDA graphs and memory API under the shim, as without it.
out=$(LD_PRELOAD="$LIB" timeout 300 python3 "$WORK/graphs.py" 2>&1)
echo "$out" | grep -E '^(graphs|cachealloc:)'
if [ "$(echo "$out" | grep -c 'ok=True')" = 3 ]; then pass "graphs.py 3/3"; else fail "graphs.py"; echo "$out" | tail -5; fi
out=$(LD_PRELOAD="$LIB" timeout 300 python3 "$WORK/torch_memory_api.py" 2>&1)
echo "$out" | grep -E '^(api|cachealloc:)' | tail -14
if grep -q '^api result=PASS' <<< "$out"; then pass "torch_memory_api.py"; else fail "torch_memory_api.py"; fi

# PyTorch's features that live in its native allocator (issue 22), natively and under the shim:
# each script's checks must all pass under the shim where they all pass natively.
both mem_pools.py mem_pools
both ipc_torch.py ipc
both ipc_torch.py ipc CACHEALLOC_CONF=expandable_segments:False
both memory_history.py memory_api
# The allocator's state in a snapshot, from the trace and, with trace:off, from the pools.
both snapshot_state.py snapshot_state
both snapshot_state.py snapshot_state CACHEALLOC_CONF=trace:off
both torch_settings.py torch_settings
both profiler_memory.py profiler_memory
# PyTorch's GPU trace hears allocations and frees; CUDA Sanitizer follows memory through it.
both gpu_trace.py gpu_trace
# PyTorch's trace trackers (NCCL's registration hooks) hear every segment made and given back;
# with NCCL registering every segment, PyTorch's memory is in fixed segments under the shim.
both trace_trackers.py trackers
BOTH_ENV=TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 both trace_trackers.py trackers
BOTH_ENV=ALLOC=plain both change_allocator.py allocator
BOTH_ENV=ALLOC=managed both change_allocator.py allocator
both cuda_ipc_handles.py cuda_ipc
both cuda_ipc_handles.py cuda_ipc $FIXED
# Tensors in expandable segments (mapped memory, shared through POSIX file descriptors): natively
# with PyTorch's expandable segments, under the shim with its own; each run first checks that its
# tensor lies in mapped memory.
native=$(LABEL=native EXPANDABLE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python3 scripts/gpu/ipc_torch.py 2>&1 | grep -E "^ipc .*passed=")
shim=$(LABEL=shim EXPANDABLE=1 CACHEALLOC_CONF=expandable_segments:True LD_PRELOAD="$LIB" timeout 300 python3 scripts/gpu/ipc_torch.py 2>&1 | grep -E "^ipc |^cachealloc:")
echo "native: $native"; echo "$shim" | grep -v "ok=True"
n=$(sed -n 's/.*passed=\([0-9]*\/[0-9]*\).*/\1/p' <<< "$native")
s=$(sed -n 's/.*passed=\([0-9]*\/[0-9]*\).*/\1/p' <<< "$shim" | tail -1)
if [ -n "$s" ] && [ "$n" = "$s" ] && [ "${s%/*}" = "${s#*/}" ]; then pass "ipc_torch.py expandable segments $s"; else fail "ipc_torch.py expandable segments native=$n shim=$s"; fi
fi

if part multi; then
# Two GPUs (each check skips itself on one): the C programs across devices, peer access to fixed
# and mapped memory (and the race mode), PyTorch on two devices; a consumer process on GPU 1 of
# tensors from GPU 0 (the default, fixed and expandable segments); a graph captured on GPU 1
# while GPU 0 trains; a MemPool on both.
run multi_gpu "$FIXED" --
run multi_gpu X=1 --
run multi_gpu "$EXP" --
run peer_access "$EXP" --
run peer_access "$EXP" -- pool
run peer_access "$EXP" -- race
run peer_access "$FIXED" -- pool-fixed
run_py peer_access.py expandable_segments:True
run_py peer_access.py expandable_segments:False
run_py multi_gpu_torch.py ""
run_py multi_gpu_torch.py expandable_segments:False
run_py multi_gpu_torch.py expandable_segments:True
BOTH_ENV=CONSUMER_DEVICE=1 both ipc_torch.py ipc
BOTH_ENV=CONSUMER_DEVICE=1 both ipc_torch.py ipc CACHEALLOC_CONF=expandable_segments:False
BOTH_ENV=CONSUMER_DEVICE=1 NATIVE_ENV=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True both ipc_torch.py ipc CACHEALLOC_CONF=expandable_segments:True
both multi_gpu_features.py multi_gpu_features
both multi_gpu_features.py multi_gpu_features CACHEALLOC_CONF=expandable_segments:False
# NCCL's registration of PyTorch's memory: a MemPool over ncclMemAlloc registered with the
# process group, and every segment registered.
both nccl_registration.py nccl
BOTH_ENV=MODE=all both nccl_registration.py nccl
both symmetric_memory.py symm
fi

if part categories; then
# Memory by category (issue 23): cachealloc's categories against the program's own count.
out=$(scripts/gpu/categories.sh "$(dirname "$LIB")" 2>&1)
echo "$out" | grep -Ev '^(PASS|FAIL) '
for m in llama cnn; do
    if grep -q "^PASS categories $m" <<< "$out"; then pass "categories $m"; else fail "categories $m"; fi
done
fi

if part compile; then
out=$(ROUNDS=2 CALLS=10 LD_PRELOAD="$LIB" timeout 400 python3 scripts/gpu/compile_reduce_overhead.py 2>&1 | grep '^workload=')
echo "$out"
if grep -q "ok=True" <<< "$out"; then pass "torch.compile reduce-overhead on a transformers GPT-2"; else fail "compile_reduce_overhead.py"; fi
# CUDA graph trees on cachealloc's allocator for PyTorch: branches, checkpoints, training.
# A transformers model trained with torch.compile and a compiled-autograd backward: the losses
# and parameters under the shim equal native's (the category hooks run under Dynamo's frame
# callback there).
native=$(timeout 400 python3 scripts/gpu/compiled_model.py 2>&1 | grep '^compiled_model')
shim=$(LD_PRELOAD="$LIB" timeout 400 python3 scripts/gpu/compiled_model.py 2>&1 | grep '^compiled_model')
echo "$native"; echo "$shim"
if python3 scripts/gpu/compiled_model.py --compare "$native" "$shim"; then pass "compiled_model.py: the shim's losses equal native's"; else fail "compiled_model.py"; fi
out=$(LABEL=shim LD_PRELOAD="$LIB" timeout 300 python3 scripts/gpu/graph_trees.py 2>&1)
echo "$out" | grep -E '^graph_trees '
if grep -qE "^graph_trees label=shim passed=([0-9]+)/\1$" <<< "$out"; then pass "graph_trees.py"; else fail "graph_trees.py"; echo "$out" | tail -5; fi

fi

if part training; then
# Training: losses with and without the shim agree, with fixed and with expandable segments.
for w in mlp_train gpt2_train multistream infer_varbatch; do
    script="$WORK/$w.py"; [ -f "$script" ] || script="scripts/gpu/$w.py"
    native=$(python3 "$script" 2>&1 | grep '^workload=')
    a=$(echo "$native" | sed -n 's/.*loss=\([0-9.e+-]*\).*/\1/p')
    echo "native: $native"
    for conf in "" expandable_segments:False; do
        shim=$(CACHEALLOC_CONF="$conf" LD_PRELOAD="$LIB" python3 "$script" 2>&1 | grep -E '^(workload=|cachealloc:)')
        echo "shim $conf: $shim"
        b=$(echo "$shim" | sed -n 's/.*loss=\([0-9.e+-]*\).*/\1/p')
        if [ -n "$a" ] && [ -n "$b" ] && python3 -c "import sys; sys.exit(0 if abs($a - $b) <= 1e-6 else 1)"; then
            pass "$w $conf loss $a == $b"
        else
            fail "$w $conf loss native=$a shim=$b"
        fi
    done
done
fi
[ "$FAILED" = 0 ] && echo "ALL PASSED" || echo "SOME FAILED"
exit "$FAILED"
