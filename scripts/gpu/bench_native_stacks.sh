#!/usr/bin/env bash
# Native stacks in PyTorch (run on the GPU machine from the repository root):
#   scripts/gpu/bench_native_stacks.sh LIBDIR WORKLOADS [REPEATS]
# mlp_train.py and gpt2_train.py step time: PyTorch native caching (the anchor) against the shim
# with stacks:all (native frames through libtorch, then Python's), alternating, REPEATS times;
# medians and ratios. Then the deepest recorded stack of a gpt2 run, to show what is captured.
set -uo pipefail
LIBDIR="$(realpath "$1")"
WORK="$(realpath "$2")"
REPEATS=${3:-3}
LIB="$LIBDIR/libcachealloc.so"
TRACE=$(mktemp -d)
LOG=$(mktemp)
for r in $(seq "$REPEATS"); do
    for w in mlp_train gpt2_train; do
        LABEL=native python3 "$WORK/$w.py" 2>&1 | grep workload= | tee -a "$LOG"
        LABEL=shim-all CACHEALLOC_CONF="log:quiet,stacks:all,trace_dir:$TRACE/a$r$w" LD_PRELOAD="$LIB" \
            python3 "$WORK/$w.py" 2>&1 | grep workload= | tee -a "$LOG"
    done
done
python3 - "$LOG" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(sys.argv[1])]
for w in ("mlp", "gpt2"):
    def med(label):
        vals = [float(r["step_ms"]) for r in rows if r.get("workload") == w and r.get("label") == label]
        return statistics.median(vals) if vals else float("nan")
    n, a = med("native"), med("shim-all")
    print(f"summary workload={w} native_step_ms={n:.3f} shim_all_step_ms={a:.3f} ratio={a / n:.3f}")
PY
"$LIBDIR/cachealloc" peak "$TRACE/a1gpt2_train" --top 1 | head -60
