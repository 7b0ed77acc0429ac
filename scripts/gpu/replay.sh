#!/usr/bin/env bash
# Record a workload's allocations under the shim, then replay them through the three backends of
# `cachealloc replay` (raw cudaMalloc, cudaMallocAsync's pool, the shim), on a GPU machine
# without cargo:
#   scripts/gpu/replay.sh BINDIR WORKLOAD [ROUNDS] [-- REPLAY_OPTIONS...]
# BINDIR holds the prebuilt `cachealloc` and `libcachealloc.so` (target/release/ of a
# `cargo build --release -p cachealloc -p cachealloc-tools`). WORKLOAD is a Python script (run
# with python3) or an executable. ROUNDS (default 3): each backend replays that many times, the
# backends alternating, each replay in a fresh process; the table shows each backend's medians
# (`--json` after `--` gives every round). Other replay options go after `--` (--touch,
# --verify, --conf K:V). The trace is kept in a temporary directory, printed first; a workload of
# several processes (DDP) leaves one trace per rank, and the first (rank 0) is replayed.
set -euo pipefail
BIN="$(realpath "$1")"
WORKLOAD="$2"
shift 2
ROUNDS=3
if [ $# -gt 0 ] && [ "$1" != "--" ]; then ROUNDS="$1"; shift; fi
if [ $# -gt 0 ] && [ "$1" = "--" ]; then shift; fi
CACHEALLOC="$BIN/cachealloc"
LIB="$BIN/libcachealloc.so"
for f in "$CACHEALLOC" "$LIB"; do
    [ -e "$f" ] || { echo "replay.sh: $f is missing" >&2; exit 1; }
done
TRACES=$(mktemp -d /tmp/cachealloc-replay-XXXXXX)
echo "trace under $TRACES"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
case "$WORKLOAD" in
    *.py) RUN=(python3 "$WORKLOAD") ;;
    *) RUN=("$WORKLOAD") ;;
esac
# Record: the shim pools and traces (a large rotation budget, so no request is rotated away).
CACHEALLOC_CONF="log:quiet,trace_dir:$TRACES,trace_file_mb:512,trace_files:64" \
    LD_PRELOAD="$LIB" "${RUN[@]}"
TRACE=$(find "$TRACES" -mindepth 1 -maxdepth 1 -type d | sort | head -n 1)
[ -n "$TRACE" ] || { echo "replay.sh: the workload left no trace" >&2; exit 1; }
"$CACHEALLOC" summary "$TRACE" | head -n 20
# Replay: `--repeat` alternates the backends round by round and prints one table of medians.
CACHEALLOC_LIB="$LIB" "$CACHEALLOC" replay "$TRACE" --backend raw,async,cachealloc \
    --repeat "$ROUNDS" "$@"
