#!/usr/bin/env bash
# Memory by category (issue 23) on a GPU, run from the repository root:
#   scripts/gpu/categories.sh LIBDIR [STEPS]
# LIBDIR holds libcachealloc.so and the cachealloc binary. For the Llama and the CNN of
# models.py: trains STEPS (6) steps under the shim writing the program's own count of its
# parameters, optimizer state, gradients and saved tensors at annotated instants
# (categories.py truth), then compares cachealloc's categories there
# (`memory-timeline --at-annotations`) and its UNKNOWN share at the peak (`summary`) with it
# (categories_check.py), and, for the Llama, that its first backward names each decoder layer
# (scripts/lib/backward_layers.sh). Prints PASS/FAIL per model; exits non-zero if any failed.
set -uo pipefail
source scripts/lib/backward_layers.sh
LIBDIR="$(realpath "$1")"
STEPS=${2:-6}
FAILED=0
for m in llama cnn; do
    dir=$(mktemp -d)
    CACHEALLOC_CONF="trace_dir:$dir,log:quiet" LD_PRELOAD="$LIBDIR/libcachealloc.so" \
        timeout 300 python3 scripts/gpu/categories.py "$m" truth "$STEPS" "$dir/truth.json" 2>&1 | tail -1
    trace=$(ls -d "$dir"/*/ | head -1)
    "$LIBDIR/cachealloc" memory-timeline "$trace" --at-annotations -o "$dir/at.json" >/dev/null &&
        "$LIBDIR/cachealloc" summary "$trace" >"$dir/summary.txt" 2>&1
    out=$(python3 scripts/gpu/categories_check.py "$dir/truth.json" "$dir/at.json" "$dir/summary.txt")
    echo "$out" | tail -2
    grep -q "^PASS" <<< "$out" || FAILED=1
    if [ "$m" = llama ]; then
        # The backward is named layer by layer (its 8 decoder layers, on autograd's thread).
        layers=$(backward_layers "$LIBDIR/cachealloc" "$trace" | grep -c '\.model\.layers\.')
        if [ "$layers" = 8 ]; then echo "PASS llama: the first backward names its 8 layers"
        else echo "FAIL llama: the first backward names $layers of its 8 layers"; FAILED=1; fi
    fi
    [ -n "${OUT:-}" ] && cp "$dir/truth.json" "$OUT/truth-$m.json" && cp "$dir/at.json" "$OUT/at-$m.json" &&
        cp "$dir/summary.txt" "$OUT/summary-$m.txt"
done
exit $FAILED
