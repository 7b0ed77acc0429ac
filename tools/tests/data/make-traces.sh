#!/usr/bin/env bash
# Regenerate the checked-in traces the golden tests read (then regenerate the goldens:
# UPDATE_GOLDEN=1 cargo test -p cachealloc-tools --test golden). Run from the repository root.
# Each trace is a small run of a test program under libcachealloc.so over fakecuda:
#   python: tests/programs/python_stacks.py (Python stacks, GIL released and held, a thread)
#   oom:    tests/programs/oom.c on a 64 MiB device (an OOM, cache release and retry, native stacks)
#   race:   tests/programs/race.c nonblocking (streams, fenced frees, fence completions)
set -euo pipefail
cd "$(dirname "$0")/../../.."
cargo build -p cachealloc
source scripts/lib/fakecuda.sh
FAKE="$PWD/target/golden-fakecuda"
build_fakecuda "$FAKE" oom race
LIB="$PWD/target/debug/libcachealloc.so"
OUT="$PWD/tools/tests/data"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
record() { # name conf command...
    local name=$1 conf=$2
    shift 2
    rm -rf "${OUT:?}/$name"
    (cd "$WORK" && LD_LIBRARY_PATH="$FAKE" CACHEALLOC_CONF="trace_dir:$WORK/$name,log:quiet,$conf" \
        LD_PRELOAD="$LIB" "$@" >/dev/null)
    mkdir -p "$OUT/$name"
    # One process directory per trace, renamed to a stable name.
    mv "$WORK/$name"/*/ "$OUT/$name/run"
}
record python "stacks:python" python3 "$PWD/tests/programs/python_stacks.py" "$WORK/expected.json"
FAKECUDA_CAPACITY_MB=64 record oom "stacks:native,stack_depth:8" "$FAKE/oom"
record race "stacks:native,stack_depth:8" "$FAKE/race" nonblocking
ls -la "$OUT"/*/run
