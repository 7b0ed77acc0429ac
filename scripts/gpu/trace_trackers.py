"""PyTorch's allocator trace trackers, natively and under the shim (same command): a tracker
attached as `ProcessGroupNCCL` attaches its registration hooks (`attachAllocatorTraceTracker`,
through a small C++ library built here against the PyTorch in use, `trace_trackers.cpp`) must
hear of every segment PyTorch's tensors get and give back, with the pool's id, and never of a
release it was not told the making of (NCCL refuses to deregister what it never registered).

Checks, each printed as `trackers label=L check=NAME ok=True|False detail=...`:
* a new tensor's segment is told (SEGMENT_ALLOC, or SEGMENT_MAP with expandable segments), and
  its release after `empty_cache` (SEGMENT_FREE / SEGMENT_UNMAP);
* a `MemPool`'s segment is told with the pool's id, and its release when the pool goes;
* every segment release told was told made before, and no segment is told made twice without
  a release between.
Then `trackers label=L passed=N/M actions=...`. LABEL names the run.
"""
import ctypes
import os
import subprocess
import sys
import tempfile
import warnings

import torch

warnings.simplefilter("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "shim", "python"))
import cachealloc_torch_allocator  # noqa: E402  (the integration's build helpers)
import cachealloc_torch_build  # noqa: E402

label = os.environ.get("LABEL", "-")
ALLOC, FREE, MAP, UNMAP = "SEGMENT_ALLOC", "SEGMENT_FREE", "SEGMENT_MAP", "SEGMENT_UNMAP"
results = []


def check(name, ok, detail=""):
    results.append(ok)
    print(f"trackers label={label} check={name} ok={ok} detail={detail}", flush=True)


def build():
    torch_dir = os.path.dirname(torch.__file__)
    flags = cachealloc_torch_build.torch_flags(torch_dir, torch._C._GLIBCXX_USE_CXX11_ABI)
    flags += ["-I", cachealloc_torch_allocator._cuda_include()]
    libraries = cachealloc_torch_build.torch_libraries(torch_dir, ["c10", "c10_cuda"])
    out = os.path.join(tempfile.mkdtemp(prefix="trackers-"), "libtrace_trackers.so")
    compiler = cachealloc_torch_build.compiler()
    cmd = [compiler, *flags, os.path.join(HERE, "trace_trackers.cpp"), "-o", out, *libraries]
    subprocess.run(cmd, check=True, env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    lib = ctypes.CDLL(out)
    lib.tracker_entries.restype = ctypes.c_int64
    lib.tracker_entries.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    return lib


def entries(lib):
    n = lib.tracker_entries(None, 0)
    buf = (ctypes.c_int64 * n)()
    lib.tracker_entries(buf, n)
    out = []
    for i in range(0, n, 6):
        action = ACTIONS.get(buf[i], str(buf[i]))
        out.append((action, buf[i + 1], buf[i + 2] & (2**64 - 1), buf[i + 3], (buf[i + 4], buf[i + 5])))
    return out


# c10::CachingDeviceAllocator::TraceEntry::Action, in its order.
ACTIONS = dict(enumerate(["ALLOC", "FREE_REQUESTED", "FREE_COMPLETED", "SEGMENT_ALLOC", "SEGMENT_FREE",
                          "SEGMENT_MAP", "SEGMENT_UNMAP", "SNAPSHOT", "OOM", "USER_DEFINED"]))


def covering(events, actions, ptr, pool=None):
    return [e for e in events if e[0] in actions and e[2] <= ptr < e[2] + e[3]
            and (pool is None or e[4] == pool)]


def main():
    lib = build()
    torch.zeros(1, device="cuda")
    lib.tracker_attach()
    start = len(entries(lib))
    # What NCCL registers when it starts: the segments of a snapshot (fixed ones).
    before = {(s["device"], s["address"]) for s in torch.cuda.memory_snapshot() if not s.get("is_expandable")}

    x = torch.empty(300 << 20, dtype=torch.uint8, device="cuda")
    ptr = x.data_ptr()
    made = covering(entries(lib)[start:], (ALLOC, MAP), ptr)
    check("tensor_segment_told", len(made) >= 1, f"{[(e[0], hex(e[2]), e[3]) for e in made]}")
    if os.environ.get("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK") == "1":
        # NCCL registers every segment: PyTorch's memory must be in fixed segments.
        check("fixed_segments_for_nccl", bool(made) and all(e[0] == ALLOC for e in made), f"{made[:1]}")
    del x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    gone = covering(entries(lib)[start:], (FREE, UNMAP), ptr)
    check("tensor_release_told", len(gone) >= 1, f"{[(e[0], hex(e[2]), e[3]) for e in gone]}")

    pool = torch.cuda.MemPool()
    pool_id = tuple(pool.id)
    with torch.cuda.use_mem_pool(pool):
        y = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    ptr = y.data_ptr()
    made = covering(entries(lib), (ALLOC, MAP), ptr, pool_id)
    check("mem_pool_segment_told", len(made) >= 1, f"pool={pool_id} {[(e[0], hex(e[2]), e[4]) for e in made]}")
    del y, pool
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    gone = covering(entries(lib), (FREE, UNMAP), ptr, pool_id)
    check("mem_pool_release_told", len(gone) >= 1, f"{[(e[0], hex(e[2]), e[4]) for e in gone]}")

    # As NCCL keeps segments: a release of what was never told made, or a second making, is an
    # error. (Mapped memory may be unmapped in other pieces than it was mapped in.)
    told, bad = set(before), []
    for action, device, address, size, _ in entries(lib)[start:]:
        key = (device, address)
        if action == ALLOC:
            if key in told:
                bad.append((action, hex(address)))
            told.add(key)
        elif action == FREE:
            if key not in told:
                bad.append((action, hex(address)))
            told.discard(key)
    check("releases_match_makings", not bad, f"{bad[:5]}")
    counts = {}
    for e in entries(lib)[start:]:
        counts[e[0]] = counts.get(e[0], 0) + 1
    print(f"trackers label={label} passed={sum(results)}/{len(results)} actions={counts}", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
