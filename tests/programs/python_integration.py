"""The shim's Python integration, run under LD_PRELOAD=libcachealloc.so (no torch needed): the
sitecustomize the integration shadows still runs; importing torch._inductor.config (a stand-in
package made here) turns CUDA graph trees off on the cudaMallocAsync route; and importing
torch.cuda.memory replaces torch._C's memory statistics, history and snapshot entry points on
that route (checked against an allocation made through the runtime, with fakecuda), and
torch.cuda.MemPool and use_mem_pool with the library's private pools (a pool of the program's
own allocator among them); Tensor.record_stream for the library's blocks. Importing torch.cuda
tries to build cachealloc's C++ allocator for PyTorch, which needs PyTorch's and CUDA's
headers (absent here): the backend stays, with one message, and graph trees go off.
Usage: python_integration.py EXPECTED_TREES   (True or False: False means the integration acts).
Prints "OK python_integration"."""
import os
import sys
import tempfile


def fail(why):
    print(f"FAIL: {why}")
    sys.exit(1)


if os.environ.get("USER_SITECUSTOMIZE_RAN") != "1":
    fail("the user's own sitecustomize did not run")
if "torch" in sys.modules:
    fail("the integration imported torch")

root = tempfile.mkdtemp()
package = os.path.join(root, "torch", "_inductor")
os.makedirs(package)
for d in (os.path.join(root, "torch"), package):
    open(os.path.join(d, "__init__.py"), "w").close()
# torch.Tensor's record_stream as PyTorch's backend takes it (noting what reached it).
with open(os.path.join(root, "torch", "__init__.py"), "w") as f:
    f.write(
        "class Tensor:\n"
        "    recorded_by_pytorch = []\n"
        "    def record_stream(self, stream):\n"
        "        Tensor.recorded_by_pytorch.append(stream)\n"
    )
with open(os.path.join(package, "config.py"), "w") as f:
    f.write("class triton:\n    cudagraph_trees = True\n    cudagraphs = False\n")
# torch._C's memory entry points as the cudaMallocAsync backend answers them, and the module
# that calls them.
with open(os.path.join(root, "torch", "_C.py"), "w") as f:
    f.write(
        "_GLIBCXX_USE_CXX11_ABI = True\n"
        "def _cuda_getAllocatorBackend():\n    return 'cudaMallocAsync'\n"
        "def _cuda_memoryStats(device):\n    return 'native'\n"
        "def _cuda_memorySnapshot(*args):\n    raise RuntimeError('native')\n"
        "def _cuda_record_memory_history(*args):\n    raise RuntimeError('native')\n"
        "def _cuda_resetAccumulatedMemoryStats(device):\n    return 'native'\n"
        "def _accelerator_getDeviceStats(device):\n    return 'native'\n"
        "def _cuda_getMemoryFraction(device):\n    return 216975863.59\n"
        "def _cuda_cudaCachingAllocator_enable(value):\n    return None\n"
        "def _cuda_setMemoryFraction(fraction, device):\n    return None\n"
        "settings_seen = []\n"
        "def _cuda_cudaCachingAllocator_set_allocator_settings(env):\n    settings_seen.append(env)\n"
        "_handles = [0]\n"
        "def _graph_pool_handle():\n    _handles[0] += 1\n    return (0, _handles[0])\n"
        "class _cuda_CUDAAllocator:\n    pass\n"
        "def _cuda_customAllocator(alloc, free):\n    return _cuda_CUDAAllocator()\n"
        "class _MemPool:\n    def __init__(self, *args):\n        raise RuntimeError('native')\n"
        "def _cuda_beginAllocateCurrentThreadToPool(device, pool):\n    raise RuntimeError('native')\n"
        "def _cuda_beginAllocateToPool(device, pool):\n    raise RuntimeError('native')\n"
        "def _cuda_endAllocateToPool(device, pool):\n    raise RuntimeError('native')\n"
        "def _cuda_releasePool(device, pool):\n    raise RuntimeError('native')\n"
        "allocators_installed = []\n"
        "def _cuda_changeCurrentAllocator(allocator):\n"
        "    if allocator == 'too late':\n"
        "        raise RuntimeError(\"Can't swap an already initialized allocator\")\n"
        "    allocators_installed.append(allocator)\n"
    )
os.makedirs(os.path.join(root, "torch", "cuda"))
with open(os.path.join(root, "torch", "cuda", "__init__.py"), "w") as f:
    f.write(
        "def current_device():\n    return 0\n"
        "def device_count():\n    return 1\n"
        "def memory_snapshot(*args, **kwargs):\n"
        "    from torch.cuda.memory import memory_snapshot\n"
        "    return memory_snapshot(*args, **kwargs)\n"
    )
# What torch/cuda/memory.py does with those entry points (PyTorch 2.11's MemPool, use_mem_pool
# and memory_snapshot, in short).
with open(os.path.join(root, "torch", "cuda", "memory.py"), "w") as f:
    f.write(
        "import contextlib\nimport torch._C\n"
        "from torch._C import _MemPool, _cuda_beginAllocateCurrentThreadToPool, "
        "_cuda_endAllocateToPool, _cuda_releasePool\n"
        "class MemPool(_MemPool):\n"
        "    def __init__(self, allocator=None, use_on_oom=False, no_split=False):\n"
        "        super().__init__(allocator, True, use_on_oom, no_split)\n"
        "@contextlib.contextmanager\n"
        "def use_mem_pool(pool, device=None):\n"
        "    _cuda_beginAllocateCurrentThreadToPool(0, pool.id)\n"
        "    try:\n        yield\n"
        "    finally:\n"
        "        _cuda_endAllocateToPool(0, pool.id)\n        _cuda_releasePool(0, pool.id)\n"
        "def memory_snapshot(mempool_id=None, include_traces=True):\n"
        "    which = (0, 0) if mempool_id is None else mempool_id\n"
        "    return torch._C._cuda_memorySnapshot((which[0], which[1], include_traces))['segments']\n"
    )
with open(os.path.join(root, "torch", "cuda", "graphs.py"), "w") as f:
    f.write(
        "handles = []\n"
        "def graph_pool_handle():\n    handles.append((0, len(handles) + 1))\n    return handles[-1]\n"
        "class CUDAGraph:\n"
        "    def capture_begin(self, pool=None, capture_error_mode='global'):\n"
        "        self.pool_used = (pool, capture_error_mode)\n"
    )
# libc10.so's profiler functions, as a stand-in that records what reaches them.
programs = os.environ.get("CACHEALLOC_TEST_PROGRAMS")
if programs:
    import shutil

    os.makedirs(os.path.join(root, "torch", "lib"))
    shutil.copy(os.path.join(programs, "libc10_profiler.so"), os.path.join(root, "torch", "lib", "libc10.so"))
sys.path.insert(0, root)

import torch._inductor.config as config  # noqa: E402

expected = sys.argv[1] == "True"
if config.triton.cudagraph_trees is not expected:
    fail(f"cudagraph_trees is {config.triton.cudagraph_trees}, expected {expected}")
import ctypes  # noqa: E402

import torch._C  # noqa: E402
import torch.cuda.memory  # noqa: E402

import torch.cuda.graphs as graphs  # noqa: E402

graph = graphs.CUDAGraph()
graph.capture_begin(capture_error_mode="thread_local")
# As natively, a pool of its own numbered (n, 0), apart from graph_pool_handle()'s (0, n).
named = (None, "thread_local") if expected else ((1, 0), "thread_local")
if graph.pool_used != named:
    fail(f"a capture without a pool began with {graph.pool_used}, expected {named}")
graph.capture_begin((0, 7))
if graph.pool_used != ((0, 7), "global"):
    fail(f"a capture given a pool began with {graph.pool_used}")

from python_history import check_history_settings, check_pool_snapshot  # noqa: E402
from python_mem_pools import (  # noqa: E402
    check_all_threads_entry_point,
    check_own_allocator_pool,
    check_program_allocator_steps_back,
    check_pytorchs_mem_pool_comes_back,
)


def check_profiler(torch, glob):
    """torch.profiler's memory events: while the profiler records memory (the stand-in's
    switch), an allocation and its free are reported with the block's size, the device's
    totals and the device, and an allocation out of memory with its request; nothing while it
    does not."""
    c10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))

    def reports():
        out = []
        for i in range(c10.profiler_count()):
            kind, device_type, device_index = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
            address, allocated, reserved = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
            size = ctypes.c_int64()
            c10.profiler_report(
                i, ctypes.byref(kind), ctypes.byref(address), ctypes.byref(size), ctypes.byref(allocated),
                ctypes.byref(reserved), ctypes.byref(device_type), ctypes.byref(device_index),
            )
            out.append((kind.value, address.value, size.value, allocated.value, reserved.value,
                        device_type.value, device_index.value))
        c10.profiler_clear()
        return out

    # PyTorch's allocations are stream-ordered under the shim; a library's own cudaMalloc is
    # not PyTorch's and is not reported.
    glob.cudaMallocAsync.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p]
    glob.cudaFreeAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    p = ctypes.c_void_p()
    c10.profiler_clear()
    glob.cudaMallocAsync(ctypes.byref(p), 1 << 20, None)
    glob.cudaFreeAsync(p, None)
    if reports():
        fail("allocations were reported while the profiler did not record memory")
    c10.profiler_enable(1)
    library = ctypes.c_void_p()
    if glob.cudaMalloc(ctypes.byref(library), 1 << 20) != 0:
        fail("cudaMalloc failed")
    glob.cudaFree(library)
    if glob.cudaMallocAsync(ctypes.byref(p), (1 << 20) + 100, None) != 0:
        fail("cudaMallocAsync failed")
    glob.cudaFreeAsync(p, None)
    huge = ctypes.c_void_p()
    glob.cudaMallocAsync(ctypes.byref(huge), 1 << 44, None)
    c10.profiler_enable(0)
    got = reports()
    if len(got) != 3:
        fail(f"the profiler was told {got}, expected an allocation, its free and an OOM")
    (k1, a1, s1, al1, r1, t1, i1), (k2, a2, s2, al2, r2, t2, i2), (k3, _, s3, _, _, _, _) = got
    if (k1, k2, k3) != (1, 1, 2) or a1 != p.value or a2 != p.value:
        fail(f"the profiler's reports are {got} for the block at {p.value:#x}")
    if s1 != (1 << 20) + 512 or s2 != -s1 or s3 != 1 << 44:
        fail(f"the profiler was told sizes {s1}, {s2}, {s3}: the block's size, its negation, the request")
    if not (al1 >= s1 and r1 >= al1 and al2 == al1 - s1 and r2 == r1) or (t1, i1, t2, i2) != (1, 0, 1, 0):
        fail(f"the profiler's totals or device are wrong: {got}")


def check_segments_walk(glob, live):
    """`cachealloc_segments_walk`, what the C++ allocator for PyTorch builds its `snapshot()`
    from: every segment of the device's pools with its pool's id, its blocks tiling it from
    its address, and each block of `live` ({address: (pool id, requested size)}) allocated in
    its pool's segment with its requested size."""
    FIELDS = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64))
    segments = []

    @FIELDS
    def segment(_, f):
        segments.append({"fields": [f[i] for i in range(8)], "blocks": []})

    @FIELDS
    def block(_, f):
        segments[-1]["blocks"].append([f[i] for i in range(4)])

    walk = glob.cachealloc_segments_walk
    walk.restype = ctypes.c_int
    walk.argtypes = [ctypes.c_int, FIELDS, FIELDS, ctypes.c_void_p]
    if walk(0, segment, block, None) != len(segments) or not segments:
        fail(f"cachealloc_segments_walk told {len(segments)} segments")
    found = {}
    for seg in segments:
        address, total, first, second = seg["fields"][:4]
        at = address
        for b_address, size, requested, state in seg["blocks"]:
            if b_address != at or state > 3:
                fail(f"a block at {b_address} (state {state}) where the segment's next starts at {at}")
            at += size
            if b_address in live and state == 0:
                found[b_address] = ((first, second), requested)
        if at != address + total:
            fail(f"the blocks of a {total}-byte segment end at {at - address}")
    if found != live:
        fail(f"cachealloc_segments_walk found the live blocks {found}, expected {live}")


def check_history(torch, glob, ptr):
    """The history from the trace: it begins at the program's first call, as natively; then
    what its settings keep (python_history.py)."""
    import cachealloc_history

    server = cachealloc_history.Server
    if server.process is not None:  # a snapshot taken before: start afresh
        server.process.kill()
        server.process.wait()
        server.process = None
    torch._C._cuda_record_memory_history("all", "all", "all", 1000)
    # The program's history call starts the snapshot server, which follows the trace from then
    # on: its first snapshot finds the walk done.
    if server.process is None or server.process.poll() is not None:
        fail("_record_memory_history did not start a snapshot server")
    after = ctypes.c_void_p()
    if glob.cudaMalloc(ctypes.byref(after), 8192) != 0:
        fail("cudaMalloc after the history began failed")
    snapshot = torch._C._cuda_memorySnapshot(None)
    blocks = [b for seg in snapshot["segments"] for b in seg["blocks"]]
    mine = [b for b in blocks if b["address"] == ptr.value]
    if len(mine) != 1 or mine[0]["state"] != "active_allocated" or mine[0]["size"] < 3 << 20:
        fail(f"the snapshot does not hold the allocation at {ptr.value:#x}: {blocks}")
    if mine[0]["frames"]:
        fail("a block allocated before the program's history began shows a stack")
    # As natively, the history begins at the program's first call.
    allocs = [e["addr"] for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc"]
    if after.value not in allocs or ptr.value in allocs:
        fail(f"the history should hold the allocation after its start, not the one before: {allocs}")
    # Without traces (memory_snapshot's segments, include_traces=False) the same segments, and
    # no device traces built.
    light = torch._C._cuda_memorySnapshot((0, 0, False))
    if any(light["device_traces"]) or light["segments"] != snapshot["segments"]:
        fail(f"include_traces=False: {light['device_traces']}, segments equal: "
             f"{light['segments'] == snapshot['segments']}")
    if torch.cuda.memory_snapshot() != snapshot["segments"]:
        fail("torch.cuda.memory_snapshot() is not the snapshot's segments")
    # The snapshots came from the program's snapshot server, which walks only what is new; the
    # command, walking the whole trace, writes the same.
    if not server.enabled or server.process is None or server.process.poll() is not None:
        fail("the snapshots did not come from a snapshot server")
    glob.cudaFree(after)
    after = ctypes.c_void_p()
    if glob.cudaMalloc(ctypes.byref(after), 8192) != 0:
        fail("cudaMalloc after the history began failed")
    served = torch._C._cuda_memorySnapshot(None)
    server.enabled = False
    walked = torch._C._cuda_memorySnapshot(None)
    server.enabled = True
    if served != walked or not served["device_traces"][0]:
        fail(f"the server's snapshot differs from the command's: {served} {walked}")
    torch._C._cuda_record_memory_history(None, None, "all", 1000)
    if any(torch._C._cuda_memorySnapshot(None)["device_traces"]):
        fail("history was shown after _record_memory_history(None)")
    check_history_settings(torch, glob)


def check_record_stream(torch, glob):
    """Tensor.record_stream is the library's for its blocks: a block freed while work on a
    recorded stream may still use it is not reused until that work is done; PyTorch's backend
    never sees the stream. Another address stays PyTorch's."""
    import threading
    import types

    class Storage:
        def __init__(self, address):
            self.address = address

        def data_ptr(self):
            return self.address

    class CudaTensor(torch.Tensor):
        is_cuda = True
        is_sparse = False

        def __init__(self, address):
            self.address = address

        def untyped_storage(self):
            return Storage(self.address)

    glob.cudaMallocAsync.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p]
    glob.cudaFreeAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    glob.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    glob.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]

    def stream():
        s = ctypes.c_void_p()
        if glob.cudaStreamCreate(ctypes.byref(s)) != 0:
            fail("cudaStreamCreate failed")
        return s

    def malloc_on(s):
        p = ctypes.c_void_p()
        if glob.cudaMallocAsync(ctypes.byref(p), 1 << 20, s) != 0:
            fail("cudaMallocAsync failed")
        return p

    own, user = stream(), stream()
    gate = threading.Event()
    hold = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: gate.wait(30))
    if glob.cudaLaunchHostFunc(user, hold, None) != 0:
        fail("cudaLaunchHostFunc failed")
    block = malloc_on(own)
    CudaTensor(block.value).record_stream(types.SimpleNamespace(cuda_stream=user.value))
    if torch.Tensor.recorded_by_pytorch:
        fail("record_stream of the library's block reached PyTorch's backend")
    def bytes_now(key):
        return torch._C._cuda_memoryStats(0)[key]["all"]["current"]

    allocated, active = bytes_now("allocated_bytes"), bytes_now("active_bytes")
    glob.cudaFreeAsync(block, own)
    # As natively: freed by the program, so no longer allocated, but active until the recorded
    # work is done.
    if (bytes_now("allocated_bytes"), bytes_now("active_bytes")) != (allocated - (1 << 20), active):
        fail(f"a block freed while its recorded stream works: allocated {allocated} -> "
             f"{bytes_now('allocated_bytes')}, active {active} -> {bytes_now('active_bytes')}")
    # The snapshot shows it as PyTorch's does: freed, waiting for the streams' work.
    states = [b["state"] for seg in torch._C._cuda_memorySnapshot(None)["segments"]
              for b in seg["blocks"] if b["address"] == block.value]
    if states != ["active_pending_free"]:
        fail(f"the snapshot shows the block freed while its recorded stream works as {states}")
    while_busy = malloc_on(own)
    gate.set()
    glob.cudaStreamSynchronize(user)
    after = malloc_on(own)
    if while_busy.value == block.value:
        fail("a block was reused while work on its recorded stream could still use it")
    if after.value != block.value:
        fail("a block was not reused once the work on its recorded stream was done")
    if bytes_now("active_bytes") != active + (1 << 20):
        fail(f"active bytes {bytes_now('active_bytes')} once the recorded work was done, not {active + (1 << 20)}")
    glob.cudaFreeAsync(while_busy, own)
    glob.cudaFreeAsync(after, own)
    foreign = types.SimpleNamespace(cuda_stream=user.value)
    CudaTensor(0x1000).record_stream(foreign)
    if torch.Tensor.recorded_by_pytorch != [foreign]:
        fail("record_stream of memory that is not the library's did not reach PyTorch's backend")


if expected:
    if torch._C._cuda_memoryStats(0) != "native":
        fail("the memory entry points were replaced where the integration must not act")
else:
    ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
    glob = ctypes.CDLL(None)
    glob.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    glob.cudaMallocAsync.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p]
    glob.cudaFreeAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

    # PyTorch's statistics count what PyTorch allocates (stream-ordered under the shim), not
    # what libraries allocate for themselves with cudaMalloc (cuBLAS's handles).
    def torch_malloc(size):
        p = ctypes.c_void_p()
        if glob.cudaMallocAsync(ctypes.byref(p), size, None) != 0:
            fail(f"cudaMallocAsync({size}) failed")
        return p

    def torch_free(p):
        if glob.cudaFreeAsync(p, None) != 0:
            fail("cudaFreeAsync failed")

    ptr = ctypes.c_void_p()
    if glob.cudaMalloc(ctypes.byref(ptr), 3 << 20) != 0:
        fail("cudaMalloc failed")
    if torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["allocated"] != 0:
        fail("a library's cudaMalloc was counted in PyTorch's statistics")
    tensor = torch_malloc(3 << 20)

    stats = torch._C._cuda_memoryStats(0)
    if not isinstance(stats, dict):
        fail(f"memory stats are {stats!r}")
    leaves = []

    def walk(prefix, d):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(prefix + k + ".", v)
            else:
                leaves.append(prefix + k)

    walk("", stats)
    if len(leaves) < 100:
        fail(f"memory_stats has {len(leaves)} keys: {leaves}")
    if stats["allocated_bytes"]["all"]["current"] != 3 << 20:
        fail(f"allocated_bytes.all.current is {stats['allocated_bytes']['all']['current']}")
    torch_free(tensor)
    if torch._C._cuda_getMemoryFraction(0) != 1.0:
        fail(f"an unset memory fraction reads {torch._C._cuda_getMemoryFraction(0)}")
    # set_per_process_memory_fraction limits the library's pools (fakecuda: 1 GiB).
    torch._C._cuda_setMemoryFraction(0.25, 0)
    if torch._C._cuda_getMemoryFraction(0) != 0.25:
        fail(f"the fraction set (0.25) reads back {torch._C._cuda_getMemoryFraction(0)}")
    # PyTorch's allocations are stream-ordered; a library's own cudaMalloc (cuBLAS's) is not
    # PyTorch's memory, which its fraction neither counts nor refuses.
    big = ctypes.c_void_p()
    if glob.cudaMallocAsync(ctypes.byref(big), 512 << 20, None) == 0:
        fail("512 MiB were allocated under a fraction of 0.25 of 1 GiB")
    if glob.cudaMalloc(ctypes.byref(big), 512 << 20) != 0:
        fail("PyTorch's fraction refused a library's own cudaMalloc")
    glob.cudaFree(big)
    torch._C._cuda_setMemoryFraction(1.0, 0)
    if torch._C._cuda_getMemoryFraction(0) != 1.0:
        fail(f"the fraction lifted (1.0) reads back {torch._C._cuda_getMemoryFraction(0)}")
    if glob.cudaMalloc(ctypes.byref(big), 512 << 20) != 0:
        fail("512 MiB could not be allocated once the fraction was lifted")
    glob.cudaFree(big)

    # _set_allocator_settings reaches PyTorch's parser, then the library's pools.
    def grows_by(size):
        start = torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"]
        block = torch_malloc(size)
        grown = torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"] - start
        torch_free(block)
        return grown

    torch._C._cuda_cudaCachingAllocator_set_allocator_settings("roundup_power2_divisions:4,max_split_size_mb:40")
    if torch._C.settings_seen != ["roundup_power2_divisions:4,max_split_size_mb:40"]:
        fail(f"PyTorch's own setter saw {torch._C.settings_seen}")
    if grows_by(84 << 20) != 96 << 20:
        fail(f"with roundup_power2_divisions:4, 84 MiB took {grows_by(84 << 20) >> 20} MiB")
    if torch._C._cuda_memoryStats(0)["max_split_size"] != 40 << 20:
        fail(f"max_split_size is {torch._C._cuda_memoryStats(0)['max_split_size']}")
    torch._C._cuda_cudaCachingAllocator_set_allocator_settings("")
    if grows_by(84 << 20) != 84 << 20:
        fail("an empty settings string did not reset the rounding, as PyTorch's does")

    # expandable_segments switched at run time: new memory is mapped, then fixed again.
    def expandable_of(address):
        for seg in torch._C._cuda_memorySnapshot(None)["segments"]:
            if seg["address"] <= address < seg["address"] + seg["total_size"]:
                return seg["is_expandable"]
        segs = [(hex(g["address"]), g["total_size"], g["is_expandable"]) for g in torch._C._cuda_memorySnapshot(None)["segments"]]
        fail(f"no segment holds {address:#x}: {segs}")

    default_pool = ctypes.c_void_p()
    if glob.cudaDeviceGetDefaultMemPool(ctypes.byref(default_pool), 0) != 0:
        fail("cudaDeviceGetDefaultMemPool failed")
    glob.cudaMemPoolTrimTo(default_pool, ctypes.c_size_t(0))  # empty_cache: no cached fixed block
    torch._C._cuda_cudaCachingAllocator_set_allocator_settings("expandable_segments:True")
    mapped = ctypes.c_void_p()
    if glob.cudaMalloc(ctypes.byref(mapped), 200 << 20) != 0 or not expandable_of(mapped.value):
        fail(f"after expandable_segments:True the block {mapped.value:#x} is not in an expandable segment")
    torch._C._cuda_cudaCachingAllocator_set_allocator_settings("expandable_segments:False")
    fixed = ctypes.c_void_p()
    if glob.cudaMalloc(ctypes.byref(fixed), 220 << 20) != 0 or expandable_of(fixed.value):
        fail("after expandable_segments:False a new block is in an expandable segment")
    glob.cudaFree(mapped)
    glob.cudaFree(fixed)

    # caching_allocator_enable(False): new allocations go to CUDA, uncounted, until it is on.
    def requested():
        return torch._C._cuda_memoryStats(0)["requested_bytes"]["all"]["allocated"]

    before = requested()
    torch._C._cuda_cudaCachingAllocator_enable(False)
    raw = torch_malloc(1 << 20)
    if requested() != before:
        fail(f"with caching off an allocation was counted: {requested() - before} bytes")
    torch._C._cuda_cudaCachingAllocator_enable(True)
    torch_free(raw)
    raw = torch_malloc(1 << 20)
    if requested() != before + (1 << 20):
        fail(f"with caching on again the allocation counted {requested() - before} bytes")
    torch_free(raw)
    stats = torch._C._cuda_memoryStats(0)
    if torch._C._accelerator_getDeviceStats(0) != stats:
        fail("torch.accelerator's statistics are not the library's")
    # The library's live cudaMalloc (ptr) is not PyTorch's: no allocation is current.
    if stats["allocation"]["large_pool"]["current"] != 0 or "num_alloc_retries" not in stats:
        fail(f"the allocations are not counted as PyTorch would: {stats}")
    torch._C._cuda_resetAccumulatedMemoryStats(0)
    if torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["allocated"] != 0:
        fail("reset_accumulated_memory_stats left the accumulated bytes")

    if "trace:off" in os.environ.get("CACHEALLOC_CONF", ""):
        check_pool_snapshot(torch, glob, ptr.value)
    else:
        check_history(torch, glob, ptr)
    # (Its streams turn fenced reuse on: after the checks that assume none.)
    check_record_stream(torch, glob)

    # Out-of-memory observers hear of an allocation that fails.
    heard = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *args: heard.append(args))
    huge = ctypes.c_void_p()
    if glob.cudaMalloc(ctypes.byref(huge), 1 << 44) == 0:
        fail("a 16 TiB allocation succeeded")
    if len(heard) != 1 or heard[0][0] != 0 or heard[0][1] != 1 << 44:
        fail(f"the out-of-memory observer heard {heard}")
    if programs:
        check_profiler(torch, glob)

    # MemPool and use_mem_pool.
    memory = torch.cuda.memory

    def blocks_of(segments):
        return {b["address"] for seg in segments for b in seg["blocks"] if b["state"] != "inactive"}

    pool = memory.MemPool()
    if pool.use_count() != 1 or pool.allocator is not None or pool.id[0] != 0:
        fail(f"a new MemPool: use count {pool.use_count()}, id {pool.id}")
    inside = ctypes.c_void_p()
    with memory.use_mem_pool(pool):
        if pool.use_count() != 2:
            fail(f"use_mem_pool's use count is {pool.use_count()}")
        # PyTorch's allocations are stream-ordered (a library's own cudaMalloc is not routed).
        if glob.cudaMallocAsync(ctypes.byref(inside), 1 << 20, None) != 0:
            fail("cudaMallocAsync in a MemPool failed")
    if pool.use_count() != 1:
        fail(f"after use_mem_pool the use count is {pool.use_count()}")
    in_pool = blocks_of(pool.snapshot())
    if in_pool != {inside.value}:
        fail(f"the pool's blocks are {in_pool}, expected {{{inside.value}}}")
    if any(seg["segment_pool_id"] != pool.id for seg in memory.memory_snapshot(pool.id)):
        fail("memory_snapshot(pool.id) shows segments of another pool")
    # The whole snapshot (from the trace) names each segment's pool too.
    ids = {
        b["address"]: tuple(seg["segment_pool_id"])
        for seg in torch._C._cuda_memorySnapshot(None)["segments"]
        for b in seg["blocks"]
    }
    if ids.get(inside.value) != tuple(pool.id) or ids.get(ptr.value) != (0, 0):
        fail(f"the snapshot's segment_pool_id: {ids.get(inside.value)} for the MemPool's block "
             f"(pool {pool.id}), {ids.get(ptr.value)} for an ordinary one")
    if memory.MemPool().id[1] <= pool.id[1]:
        fail("MemPool ids do not follow graph_pool_handle's counter")
    check_segments_walk(glob, {inside.value: (tuple(pool.id), 1 << 20), ptr.value: ((0, 0), 3 << 20)})

    check_all_threads_entry_point(torch, glob, pool, blocks_of)
    check_own_allocator_pool(torch, glob, memory, blocks_of)
    check_pytorchs_mem_pool_comes_back()
    # Last: it gives PyTorch its own functions back.
    check_program_allocator_steps_back(torch, glob, graphs)
print("OK python_integration")
