"""The allocator's state in `torch.cuda.memory_snapshot()` — what PyTorch's CUDA graph tree
tests and memory tools read of it, history aside — natively and under the shim (check.sh runs
it under the shim with the trace and with `trace:off`, where the snapshot comes from the pools
instead of the trace). Checks: a live tensor's block is allocated and a freed one's inactive;
the segments tile their blocks, and add up to memory_reserved(); a MemPool's and a CUDA
graph's segments carry their pool's id; after empty_cache() no ordinary segment is left
without a live block; `_dump_snapshot`'s pickle is read by torch.cuda._memory_viz.

Prints one line per check, `snapshot_state label=L check=NAME ok=True|False detail=...`, and a
last `snapshot_state label=L passed=N/M`.
"""
import os
import pickle
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402

checks = Checks("snapshot_state")
check = checks.check
warnings.simplefilter("ignore")
MIB = 1 << 20


def blocks():
    return [b for s in torch.cuda.memory_snapshot() for b in s["blocks"]]


def state_of(address):
    return [b["state"] for b in blocks() if b["address"] == address]


def segment_of(address):
    for s in torch.cuda.memory_snapshot():
        if s["address"] <= address < s["address"] + s["total_size"]:
            return s
    return None


live = torch.ones(3 * MIB, device="cuda")
freed = torch.ones(5 * MIB, device="cuda")
freed_address = freed.data_ptr()
del freed
torch.cuda.synchronize()

check("live_block", lambda: (state_of(live.data_ptr()) == ["active_allocated"], state_of(live.data_ptr())))
check("freed_block", lambda: (state_of(freed_address) == ["inactive"], state_of(freed_address)))


def tiling():
    bad = []
    for s in torch.cuda.memory_snapshot():
        ends = [b["address"] + b["size"] for b in s["blocks"]]
        starts = [b["address"] for b in s["blocks"]]
        allocated = sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated")
        if starts != [s["address"]] + ends[:-1] or ends[-1] != s["address"] + s["total_size"] \
                or allocated != s["allocated_size"]:
            bad.append(hex(s["address"]))
    return not bad, f"segments not tiled: {bad}"


check("segments_tile_their_blocks", tiling)


def adds_up():
    total = sum(s["total_size"] for s in torch.cuda.memory_snapshot())
    return total == torch.cuda.memory_reserved(), f"segments {total} reserved {torch.cuda.memory_reserved()}"


check("segments_add_up_to_reserved", adds_up)


def mem_pool():
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.ones(MIB, device="cuda")
    s = segment_of(x.data_ptr())
    ok = s is not None and tuple(s["segment_pool_id"]) == tuple(pool.id)
    return ok, f"pool {pool.id} segment {s and s['segment_pool_id']}"


check("mem_pool_segment", mem_pool)


def graph_pool():
    static = torch.ones(MIB, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        (static * 2).sum()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static * 2
    graph.replay()
    s = segment_of(out.data_ptr())
    ok = s is not None and tuple(s["segment_pool_id"]) == tuple(graph.pool())
    return ok, f"graph pool {graph.pool()} segment {s and s['segment_pool_id']}"


check("graph_pool_segment", graph_pool)


def emptied():
    torch.cuda.empty_cache()
    idle = [
        hex(s["address"])
        for s in torch.cuda.memory_snapshot()
        if tuple(s["segment_pool_id"]) == (0, 0) and s["active_size"] == 0
    ]
    return not idle, f"ordinary segments without a live block after empty_cache: {idle}"


check("empty_cache", emptied)


def viewer():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            snapshot = pickle.load(f)
        from torch.cuda._memory_viz import segsum

        text = segsum(snapshot)
    return text.startswith("Summary of segments"), text.splitlines()[0] if text else "empty"


check("dump_and_viewer", viewer)
checks.summary()
