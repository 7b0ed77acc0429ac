"""MemPools of PyTorch's other entry points under the shim, part of python_integration.py
(which calls these with its stand-in torch and the runtime's library): the all-threads
`_cuda_beginAllocateToPool`, and a `MemPool` of the program's own allocator."""
import ctypes
import sys


def fail(why):
    print(f"FAIL: {why}")
    sys.exit(1)


def check_all_threads_entry_point(torch, glob, pool, blocks_of):
    """`_cuda_beginAllocateToPool`: a reference that `_cuda_releasePool` takes back, and the
    calling thread's allocations to the pool."""
    also = ctypes.c_void_p()
    torch._C._cuda_beginAllocateToPool(0, pool.id)
    if pool.use_count() != 2 or glob.cudaMallocAsync(ctypes.byref(also), 4096, None) != 0:
        fail(f"_cuda_beginAllocateToPool: use count {pool.use_count()}")
    torch._C._cuda_endAllocateToPool(0, pool.id)
    torch._C._cuda_releasePool(0, pool.id)
    if pool.use_count() != 1 or also.value not in blocks_of(pool.snapshot()):
        fail(f"after _cuda_beginAllocateToPool: use count {pool.use_count()}, block not the pool's")
    glob.cudaFreeAsync(also, None)


def check_own_allocator_pool(torch, glob, memory, blocks_of):
    """A pool of the program's own allocator: segments from its functions, whose own
    cudaMalloc/cudaFree reach CUDA."""
    calls = []
    ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)

    @ALLOC
    def own_alloc(size, device, stream):
        p = ctypes.c_void_p()
        calls.append(("alloc", size))
        return p.value if glob.cudaMalloc(ctypes.byref(p), size) == 0 else None

    @FREE
    def own_free(ptr, size, device, stream):
        calls.append(("free", size))
        glob.cudaFree.argtypes = [ctypes.c_void_p]
        glob.cudaFree(ptr)

    addr = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
    allocator = torch._C._cuda_customAllocator(addr(own_alloc), addr(own_free))
    own = memory.MemPool(allocator)
    if own.allocator is not allocator:
        fail("MemPool.allocator is not the allocator it was given")
    mine = ctypes.c_void_p()
    with memory.use_mem_pool(own):
        glob.cudaMallocAsync(ctypes.byref(mine), 4096, None)
    if [c[0] for c in calls] != ["alloc"] or blocks_of(own.snapshot()) != {mine.value}:
        fail(f"the pool's segment did not come from its allocator: {calls}, {own.snapshot()}")
    del own
    if len(calls) != 1:
        fail("a MemPool's segment with a live block was freed when the pool was deleted")
    glob.cudaFree.argtypes = [ctypes.c_void_p]
    glob.cudaFree(mine)
    if [c[0] for c in calls] != ["alloc", "free"]:
        fail(f"the last block's segment did not go back through the allocator: {calls}")


def check_pytorchs_mem_pool_comes_back():
    """Once the C++ allocator for PyTorch is installed, `torch.cuda.MemPool` is PyTorch's own
    class again (what `register_mem_pool` takes), subclassed only to hand its flags to the
    allocator just before PyTorch's constructor runs, and never to PyTorch's own flag setters
    (`cachealloc_memory.use_pytorchs_mem_pools`); stand-ins for both classes and the allocator's
    library, the integration's state put back afterwards."""
    import types

    import cachealloc_memory

    events = []

    class NativePool:  # torch._C._MemPool
        def __init__(self, allocator, is_user_created, use_on_oom, no_split):
            events.append(("native", allocator, is_user_created, use_on_oom, no_split))

    class PyTorchsPool(NativePool):  # torch.cuda.memory.MemPool
        def __init__(self, allocator=None, use_on_oom=False, no_split=False):
            super().__init__(allocator, True, use_on_oom, no_split)

    def next_pool_flags(flags):
        events.append(("flags", flags))

    saved = dict(cachealloc_memory._PYTORCHS_MEM_POOL)
    memory, c = sys.modules["torch.cuda.memory"], sys.modules["torch._C"]
    before = (memory.MemPool, c._MemPool)
    try:
        cachealloc_memory._PYTORCHS_MEM_POOL.update(python=PyTorchsPool, native=NativePool)
        library = types.SimpleNamespace(cachealloc_torch_next_pool_flags=next_pool_flags)
        cachealloc_memory.use_pytorchs_mem_pools(library)
        pool_class = memory.MemPool
        if not issubclass(pool_class, PyTorchsPool) or c._MemPool is not NativePool:
            fail(f"PyTorch's MemPool did not come back: {pool_class.__mro__}, {c._MemPool}")
        pool_class("allocator", use_on_oom=True, no_split=True)
        want = [("flags", 3), ("native", "allocator", True, False, False), ("flags", 0)]
        if events != want:
            fail(f"a MemPool's flags did not reach the allocator before PyTorch's constructor: {events}")
    finally:
        cachealloc_memory._PYTORCHS_MEM_POOL.clear()
        cachealloc_memory._PYTORCHS_MEM_POOL.update(saved)
        memory.MemPool, c._MemPool = before


def check_program_allocator_steps_back(torch, glob, graphs):
    """A program that installs its own allocator (`change_current_allocator`, as RMM's and
    unified-memory recipes do) gets PyTorch's own functions and classes back, since PyTorch's
    tensors now come from that allocator: statistics, snapshots, history, fractions, settings,
    MemPool and its entry points, `record_stream`, graph captures answer as natively (the
    stand-in's). A swap PyTorch refuses (its allocator in use) changes nothing; the library
    still serves the allocator's CUDA calls, and the integration replaces nothing more."""
    import types

    import cachealloc_memory

    c, memory = torch._C, sys.modules["torch.cuda.memory"]
    try:
        c._cuda_changeCurrentAllocator("too late")
        fail("a swap PyTorch refuses did not raise")
    except RuntimeError:
        pass
    if not isinstance(c._cuda_memoryStats(0), dict):
        fail("a refused swap gave PyTorch's statistics back")
    # What `from .memory import *` in `torch.cuda` copies of the integration's.
    cuda = sys.modules["torch.cuda"]
    cuda.MemPool, cuda.memory_snapshot = memory.MemPool, memory.memory_snapshot
    mine = object()
    c._cuda_changeCurrentAllocator(mine)
    if c.allocators_installed != [mine]:
        fail(f"the program's allocator did not reach PyTorch: {c.allocators_installed}")
    native = {
        "memory_stats": c._cuda_memoryStats(0),
        "accelerator_stats": c._accelerator_getDeviceStats(0),
        "reset": c._cuda_resetAccumulatedMemoryStats(0),
        "fraction": c._cuda_getMemoryFraction(0),
    }
    want = {"memory_stats": "native", "accelerator_stats": "native", "reset": "native", "fraction": 216975863.59}
    if native != want:
        fail(f"after the program's own allocator: {native}")
    for name in ("_cuda_memorySnapshot", "_cuda_record_memory_history", "_cuda_beginAllocateCurrentThreadToPool",
                 "_cuda_beginAllocateToPool", "_cuda_endAllocateToPool", "_cuda_releasePool", "_MemPool"):
        try:
            getattr(c, name)(0, (0, 1))
            fail(f"torch._C.{name} is not PyTorch's after the program's own allocator")
        except RuntimeError as e:
            if str(e) != "native":
                fail(f"torch._C.{name} raised {e!r}, not PyTorch's")
        except TypeError:
            fail(f"torch._C.{name} is not PyTorch's after the program's own allocator")
    if memory.MemPool.__module__ != "torch.cuda.memory" or memory.MemPool.__bases__ != (c._MemPool,):
        fail(f"torch.cuda.memory.MemPool is {memory.MemPool.__mro__}, not PyTorch's")
    if memory.memory_snapshot.__module__ != "torch.cuda.memory":
        fail("torch.cuda.memory.memory_snapshot is not PyTorch's")
    if cuda.MemPool is not memory.MemPool or cuda.memory_snapshot is not memory.memory_snapshot:
        fail(f"torch.cuda's copies of the integration's MemPool or memory_snapshot stayed: {cuda.MemPool}")
    for name in ("_cuda_attach_out_of_memory_observer", "_cuda_setMemoryMetadata", "_cuda_changeCurrentAllocator"):
        if getattr(getattr(c, name, None), "__module__", "torch._C") != "torch._C":
            fail(f"torch._C.{name} is the integration's after the program's own allocator")
    if c._cuda_cudaCachingAllocator_set_allocator_settings.__module__ != "torch._C":
        fail("torch._C's allocator settings setter is the integration's")
    graph = graphs.CUDAGraph()
    graph.capture_begin()
    if graph.pool_used != (None, "global"):
        fail(f"a capture is still given a pool of the library's: {graph.pool_used}")
    p = ctypes.c_void_p()
    if glob.cudaMallocAsync(ctypes.byref(p), 4096, None) != 0:
        fail("the library stopped serving CUDA's calls")

    class Tensor(torch.Tensor):
        is_cuda, is_sparse = True, False

        def untyped_storage(self):
            return types.SimpleNamespace(data_ptr=lambda: p.value)

    stream = types.SimpleNamespace(cuda_stream=1)
    torch.Tensor.recorded_by_pytorch.clear()
    Tensor().record_stream(stream)
    if torch.Tensor.recorded_by_pytorch != [stream]:
        fail("record_stream of the library's block did not reach PyTorch's, as natively")
    glob.cudaFreeAsync(p, None)
    cachealloc_memory.adjust(memory)
    if c._cuda_memoryStats(0) != "native":
        fail("the integration replaced PyTorch's statistics again after the program's allocator")
