#!/usr/bin/env bash
# Benchmarks on a real GPU (run on the GPU machine from the repository root):
#   scripts/gpu/bench.sh LIBDIR WORKLOADS [REPEATS]
# 1. Interposed cudaMalloc+cudaFree pair latency under the shim (trace off and on; flat out and
#    paced), against raw cudaMalloc/cudaFree and warm cudaMallocAsync pairs, in the same run.
# 2. mlp_train.py and gpt2_train.py: step time and peak reserved memory, PyTorch's native caching
#    allocator against the shim without and with its trace, alternating, REPEATS times each;
#    medians and ratios.
set -uo pipefail
LIB="$(realpath "$1")/libcachealloc.so"
WORK="$(realpath "$2")"
REPEATS=${3:-3}
BIN=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
nvcc -cudart shared -O2 -o "$BIN/bench_pair" scripts/gpu/bench_pair.c
echo "== pair latency"
"$BIN/bench_pair" sync 2000 | sed 's/^/raw /'
"$BIN/bench_pair" async 200000 | sed 's/^/raw /'
CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$LIB" "$BIN/bench_pair" sync 200000 | sed 's/^/shim /'
CACHEALLOC_CONF=log:quiet,trace_dir:/tmp/cachealloc-bench-trace LD_PRELOAD="$LIB" "$BIN/bench_pair" sync 200000 | sed 's/^/shim+trace /'
CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$LIB" "$BIN/bench_pair" sync 100000 paced | sed 's/^/shim /'
CACHEALLOC_CONF=log:quiet,trace_dir:/tmp/cachealloc-bench-trace LD_PRELOAD="$LIB" "$BIN/bench_pair" sync 100000 paced | sed 's/^/shim+trace /'
du -sh /tmp/cachealloc-bench-trace
echo "== training"
LOG=$(mktemp)
for r in $(seq "$REPEATS"); do
    for w in mlp_train gpt2_train; do
        LABEL=native python3 scripts/gpu/with_stats.py "$WORK/$w.py" 2>&1 | paste -sd' ' | tee -a "$LOG"
        LABEL=shim CACHEALLOC_CONF=log:quiet,trace:off LD_PRELOAD="$LIB" python3 scripts/gpu/with_stats.py "$WORK/$w.py" 2>&1 \
            | paste -sd' ' | tee -a "$LOG"
        LABEL=shim+trace CACHEALLOC_CONF=log:quiet,trace_dir:/tmp/cachealloc-bench-trace LD_PRELOAD="$LIB" \
            python3 scripts/gpu/with_stats.py "$WORK/$w.py" 2>&1 | paste -sd' ' | tee -a "$LOG"
    done
done
python3 - "$LOG" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(sys.argv[1])]
for w in ("mlp", "gpt2"):
    def med(label, key):
        vals = [float(r[key]) for r in rows if r.get("workload") == w and r.get("label") == label and key in r]
        return statistics.median(vals) if vals else float("nan")
    n, s, st = med("native", "step_ms"), med("shim", "step_ms"), med("shim+trace", "step_ms")
    rn, rs = med("native", "torch_max_reserved_MB"), med("shim", "cachealloc_peak_reserved_MB")
    un, us = med("native", "device_used_at_exit_MB"), med("shim", "device_used_at_exit_MB")
    print(f"summary workload={w} native_step_ms={n:.3f} shim_step_ms={s:.3f} step_ratio={s / n:.3f} "
          f"shim_trace_step_ms={st:.3f} trace_step_ratio={st / n:.3f} "
          f"native_reserved_MB={rn:.1f} shim_reserved_MB={rs:.1f} reserved_ratio={rs / rn:.3f} "
          f"native_device_used_MB={un:.1f} shim_device_used_MB={us:.1f} device_used_ratio={us / un:.3f}")
PY
