"""cachealloc's Python integration for `torch.cuda.memory` (installed by `cachealloc_hooks`
when the program imports it): on the `cudaMallocAsync` route PyTorch's own statistics, history,
snapshots, MemPools, memory fraction and caching switch are not kept (its backend has none);
`adjust` replaces the entry points of `torch._C` that the memory API calls by ones served from
the preloaded library. The list, and why: the docstring of `cachealloc_hooks` and design.md,
"The Python integration"."""
import ctypes
import os
import sys

from cachealloc_common import c_functions, pool_key, replace, say, step_back, text, torch_backend, warn
from cachealloc_history import (
    History,
    NoTrace,
    get_metadata,
    record_history,
    record_history_legacy,
    set_metadata,
    snapshot_from_trace,
    with_library_facts,
    with_pytorch_frames,
)


def _memory_api():
    """The library's C API for the memory replacements, or None."""
    import ctypes

    try:
        lib = ctypes.CDLL(None)
        stats = lib.cachealloc_device_stats_json
        flush = lib.cachealloc_trace_flush
        reset = lib.cachealloc_reset_accumulated_stats
    except (OSError, AttributeError):
        return None
    stats.restype = flush.restype = ctypes.c_size_t
    stats.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    flush.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    reset.restype = None
    reset.argtypes = [ctypes.c_int]
    return stats, flush, reset


def nested_stats(flat):
    """PyTorch's nested statistics (`memoryStats`) from flat `a.b.c` keys."""
    out = {}
    for key, value in flat.items():
        parts = key.split(".")
        level = out
        for part in parts[:-1]:
            level = level.setdefault(part, {})
        level[parts[-1]] = value
    return out


def _mem_pool_api():
    """The library's C API for MemPools, as a namespace of ctypes functions, or None."""
    import ctypes

    api = c_functions(
        retain="cachealloc_mem_pool_retain",
        release="cachealloc_mem_pool_release",
        use_count="cachealloc_mem_pool_use_count",
        begin="cachealloc_mem_pool_begin_thread",
        end="cachealloc_mem_pool_end_thread",
        snapshot="cachealloc_mem_pool_snapshot_json",
    )
    if api is None:
        return None
    api.retain.restype = ctypes.c_int
    api.retain.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
    for fn in (api.release, api.use_count, api.begin):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_uint64]
    api.end.restype = None
    api.end.argtypes = [ctypes.c_int, ctypes.c_uint64]
    api.snapshot.restype = ctypes.c_size_t
    api.snapshot.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]
    return api


#: The ctypes callbacks of the out-of-memory observers (kept alive for the library).
_OOM_CALLBACKS = []


def _oom_observers(native):
    """Replace `_cuda_attach_out_of_memory_observer` with the library's observers."""
    import ctypes

    try:
        attach = ctypes.CDLL(None).cachealloc_attach_oom_observer
    except (OSError, AttributeError):
        return
    callback_type = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)
    attach.restype = ctypes.c_int
    attach.argtypes = [callback_type]

    def attach_out_of_memory_observer(observer):
        def call(device, requested, limit, free):
            observer(device, requested, limit, free)

        callback = callback_type(call)
        _OOM_CALLBACKS.append(callback)
        attach(callback)

    replace(native, "_cuda_attach_out_of_memory_observer", attach_out_of_memory_observer)


#: id() of each `_cuda_CUDAAllocator` made by `CUDAPluggableAllocator` -> (allocator, its
#: alloc and free function addresses): what a `MemPool(allocator)` takes its segments from.
_FOREIGN_ALLOCATORS = {}


#: PyTorch's own `MemPool` classes, Python's and `torch._C`'s, before they were replaced.
_PYTORCHS_MEM_POOL = {}


def use_pytorchs_mem_pools(library):
    """Give the program PyTorch's own `MemPool` again, now that the C++ allocator for PyTorch
    (`library`) is installed: its pools are the library's all the same (the allocator's
    `createOrIncrefPool` makes them, `releasePool` lets them go), and a `MemPool` is then what
    PyTorch's C++ functions take — `ProcessGroupNCCL.register_mem_pool` for NCCL's registered
    buffers — over any allocator object, the process group's `mem_allocator` among them (Note
    [MemPools over PyTorch's allocator objects] in `cachealloc_torch_library.h`). Only the
    flags take another way: PyTorch would set them through allocator methods the library has no
    use for, so they go to the allocator just before the pool is made."""
    python_class, native_class = _PYTORCHS_MEM_POOL.get("python"), _PYTORCHS_MEM_POOL.get("native")
    if python_class is None or native_class is None:
        return
    set_flags = library.cachealloc_torch_next_pool_flags
    set_flags.restype = None
    set_flags.argtypes = [ctypes.c_uint]

    class MemPool(python_class):
        def __init__(self, allocator=None, use_on_oom=False, no_split=False):
            set_flags((1 if use_on_oom else 0) | (2 if no_split else 0))
            try:
                super().__init__(allocator)
            finally:
                set_flags(0)

    MemPool.__doc__ = python_class.__doc__
    MemPool.__module__ = python_class.__module__
    MemPool.__qualname__ = python_class.__qualname__
    replace(sys.modules["torch._C"], "_MemPool", native_class)
    replace(sys.modules["torch.cuda.memory"], "MemPool", MemPool)
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None and hasattr(cuda, "MemPool"):
        replace(cuda, "MemPool", MemPool)


def _mem_pool_class(api, torch_c, original):
    """`torch.cuda.MemPool` served by the library's private pools (Note [PyTorch MemPools]),
    while the C++ allocator for PyTorch is not installed (`use_pytorchs_mem_pools`)."""

    class MemPool:
        def __init__(self, allocator=None, use_on_oom=False, no_split=False):
            import torch

            self._allocator = allocator
            self._device = torch.cuda.current_device()
            flags = (1 if use_on_oom else 0) | (2 if no_split else 0)
            known = _FOREIGN_ALLOCATORS.get(id(allocator)) if allocator is not None else None
            if allocator is not None and (known is None or known[0] is not allocator):
                raise RuntimeError(
                    "cachealloc: MemPool(allocator) over this allocator (not a "
                    "CUDAPluggableAllocator's) needs cachealloc's allocator for PyTorch "
                    "(torch_allocator:on, a C++ compiler and CUDA's headers)"
                )
            # PyTorch's own counter, shared with graph_pool_handle(): ids never collide.
            self._id = tuple(torch_c._graph_pool_handle())
            alloc_fn, free_fn = (known[1], known[2]) if known is not None else (None, None)
            if api.retain(self._device, pool_key(self._id), flags, alloc_fn, free_fn) < 0:
                raise RuntimeError("cachealloc: MemPool needs the library's pools (pool:on)")

        @property
        def id(self):
            return self._id

        @property
        def allocator(self):
            return self._allocator

        def use_count(self):
            return api.use_count(self._device, pool_key(self._id))

        def snapshot(self, include_traces=True):
            import torch

            return torch.cuda.memory_snapshot(self._id, include_traces=include_traces)

        def __del__(self):
            try:
                api.release(self._device, pool_key(self._id))
            except Exception:  # interpreter shutdown: the library frees at exit anyway
                pass

    MemPool.__doc__ = getattr(original, "__doc__", None)
    MemPool.__module__ = getattr(original, "__module__", "torch.cuda.memory")
    return MemPool


def _pool_snapshot(api, pool_id):
    """PyTorch's snapshot of one pool: its segments now, on every device it was used on (a
    pool made on one device serves `use_mem_pool(pool, device=…)` on others), read from the
    library."""
    import json

    import torch

    segments = []
    for device in range(torch.cuda.device_count()):
        segments += json.loads(text(api.snapshot, device, pool_key(pool_id)))
    for segment in segments:
        segment["segment_pool_id"] = tuple(segment["segment_pool_id"])
    return {"segments": segments, "device_traces": []}


def _snapshot_from_pools(why):
    """PyTorch's snapshot of every device's pools now, read from the library, for when there
    is no trace to build it from (`why`): segments and blocks, no history and no stacks."""
    import ctypes
    import json

    import torch

    api = c_functions(snapshot="cachealloc_snapshot_json")
    if api is None:
        raise RuntimeError(f"cachealloc: no snapshot: {why}")
    api.snapshot.restype = ctypes.c_size_t
    api.snapshot.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    if not History.said_no_trace:
        History.said_no_trace = True
        say(f"memory snapshots show the pools now, without history or stacks: {why}")
    devices = range(torch.cuda.device_count())
    segments = [s for d in devices for s in json.loads(text(api.snapshot, d) or "[]")]
    for segment in segments:
        segment["segment_pool_id"] = tuple(segment["segment_pool_id"])
    return {"segments": segments, "device_traces": [[] for _ in devices]}


def _mem_pools(memory, native):
    """Replace MemPool and use_mem_pool's entry points (see the module's docs)."""
    api = _mem_pool_api()
    if api is None:
        return None
    native_custom = getattr(native, "_cuda_customAllocator", None)
    if native_custom is not None and not getattr(native_custom, "_cachealloc_wrapped", False):

        def custom_allocator(alloc_fn, free_fn):
            allocator = native_custom(alloc_fn, free_fn)
            _FOREIGN_ALLOCATORS[id(allocator)] = (allocator, alloc_fn, free_fn)
            return allocator

        custom_allocator._cachealloc_wrapped = True
        replace(native, "_cuda_customAllocator", custom_allocator)

    def begin_allocate_to_pool(device, pool_id):
        code = api.begin(int(device), pool_key(pool_id))
        if code != 0:
            raise RuntimeError(f"cachealloc: cannot allocate to MemPool {tuple(pool_id)} (error {code})")

    def end_allocate_to_pool(device, pool_id):
        api.end(int(device), pool_key(pool_id))

    def release_pool(device, pool_id):
        api.release(int(device), pool_key(pool_id))

    for module in (native, memory):
        replace(module, "_cuda_beginAllocateCurrentThreadToPool", begin_allocate_to_pool)
        # PyTorch's all-threads variant (no caller in PyTorch 2.11) routes the calling thread
        # only: the library routes by thread. Its reference goes back through `_cuda_releasePool`
        # as PyTorch's does, not to the graph pool references of the C++ allocator.
        if hasattr(module, "_cuda_beginAllocateToPool"):
            replace(module, "_cuda_beginAllocateToPool", begin_allocate_to_pool)
        replace(module, "_cuda_endAllocateToPool", end_allocate_to_pool)
        replace(module, "_cuda_releasePool", release_pool)
    _PYTORCHS_MEM_POOL.update(python=getattr(memory, "MemPool", None), native=getattr(native, "_MemPool", None))
    pool_class = _mem_pool_class(api, native, getattr(memory, "MemPool", None))
    replace(memory, "MemPool", pool_class)
    replace(native, "_MemPool", pool_class)
    if "torch.cuda" in sys.modules and hasattr(sys.modules["torch.cuda"], "MemPool"):
        replace(sys.modules["torch.cuda"], "MemPool", pool_class)
    import cachealloc_torch_allocator

    if cachealloc_torch_allocator.installed():  # installed before this module was adjusted
        use_pytorchs_mem_pools(cachealloc_torch_allocator._library)
    return api


def _record_stream(tensor_class):
    """Give `Tensor.record_stream` to the library (Note [Recorded streams] in the library's
    `process::recorded_streams`): PyTorch's backend would make a side stream wait for the
    recorded streams at the free, which a CUDA graph capture cannot allow (the process
    aborts). Tensors whose memory is not the library's, and streams that are not CUDA streams,
    stay with PyTorch."""
    api = c_functions(record="cachealloc_record_stream")
    original = getattr(tensor_class, "record_stream", None)
    if api is None or original is None or getattr(original, "_cachealloc_wrapped", False):
        return
    import ctypes

    api.record.restype = ctypes.c_int
    api.record.argtypes = [ctypes.c_uint64, ctypes.c_size_t]

    def record_stream(self, stream):
        handle = getattr(stream, "cuda_stream", None)
        if handle is not None and self.is_cuda and not self.is_sparse:
            try:
                address = self.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):
                address = 0
            if address and api.record(address, handle) == 0:
                return None
        return original(self, stream)

    record_stream._cachealloc_wrapped = True
    record_stream.__doc__ = original.__doc__
    replace(tensor_class, "record_stream", record_stream)


def _settings_setter(original, apply):
    """`original` (a `torch._C` setter of allocator settings), then the library's."""

    def set_allocator_settings(env, *args, **kwargs):
        result = original(env, *args, **kwargs)
        if apply(str(env).encode()) != 0:
            warn(f"the allocator settings {env!r} were not applied to cachealloc's pools (the message above says why)")
        return result

    return set_allocator_settings


#: c10's profiler functions by their C++ names: `memoryProfilingEnabled()`,
#: `reportMemoryUsageToProfiler(void*, int64_t, size_t, size_t, Device)` and
#: `reportOutOfMemoryToProfiler(int64_t, size_t, size_t, Device)`.
_PROFILER_SYMBOLS = (
    "_ZN3c1022memoryProfilingEnabledEv",
    "_ZN3c1027reportMemoryUsageToProfilerEPvlmmNS_6DeviceE",
    "_ZN3c1027reportOutOfMemoryToProfilerElmmNS_6DeviceE",
)


def _profiler_reports(torch):
    """Hand the library c10's profiler functions, so that `torch.profiler` with
    `profile_memory=True` sees the pools' allocations and frees as the native allocator reports
    them (PyTorch's `cudaMallocAsync` backend reports none)."""
    import ctypes

    give = c_functions(give="cachealloc_torch_profiler")
    path = os.path.join(os.path.dirname(getattr(torch, "__file__", "") or ""), "lib", "libc10.so")
    if give is None or not os.path.exists(path):
        return
    try:
        c10 = ctypes.CDLL(path)
        addresses = [ctypes.cast(getattr(c10, name), ctypes.c_void_p).value for name in _PROFILER_SYMBOLS]
    except (OSError, AttributeError):
        say(f"{path} has not the profiler's memory functions: torch.profiler sees no CUDA memory")
        return
    give.give.restype = ctypes.c_int
    give.give.argtypes = [ctypes.c_size_t] * 3
    give.give(*addresses)


def adjust(memory):
    if torch_backend() != "cudaMallocAsync":
        return
    api = _memory_api()
    native = sys.modules.get("torch._C")
    if api is None or native is None:
        return
    stats, flush, reset = api
    pools = _mem_pools(memory, native)
    _oom_observers(native)
    import json

    def memory_stats(device):
        return nested_stats(json.loads(text(stats, int(device))))

    def reset_accumulated(device):
        reset(int(device))

    def memory_snapshot(which=None, *args, **kwargs):
        # memory_snapshot(mempool_id) passes (first, second, include_traces); (0, 0) is the
        # whole allocator. Without traces, `device_traces` is left empty, as natively
        # ("lightweight/fast snapshot"); blocks keep their frames.
        if pools is not None and isinstance(which, tuple) and len(which) >= 2 and tuple(which[:2]) != (0, 0):
            return _pool_snapshot(pools, which[:2])
        include_traces = not (isinstance(which, tuple) and len(which) >= 3 and not which[2])
        try:
            snapshot = snapshot_from_trace(flush, include_traces)
        except NoTrace as e:
            return _snapshot_from_pools(e)
        return with_pytorch_frames(with_library_facts(snapshot))

    def segments_snapshot(mempool_id=None, include_traces=True):
        # PyTorch's `memory_snapshot`: the snapshot's segments alone, so no device traces are
        # built for it (a snapshot's traces are what cost: graph trees call this at every
        # check of their pools).
        which = (0, 0) if mempool_id is None else tuple(mempool_id[:2])
        return memory_snapshot((*which, False))["segments"]

    def history_enabled():
        # What the program asked for (the recorder keeps the history anyway).
        return bool(History.changes) and History.changes[-1][1] != "none"

    replace(native, "_cuda_memoryStats", memory_stats)
    replace(native, "_cuda_resetAccumulatedMemoryStats", reset_accumulated)
    replace(native, "_cuda_isHistoryEnabled", history_enabled)
    # The backend answers the memory fraction as its limit over the device's memory, and its
    # limit is "unlimited" (2**64 - 1) until one is set: a "fraction" of millions, which
    # set_per_process_memory_fraction then refuses to take back. Unset is 1.0, as natively.
    # The library's own fraction comes first: it is the one in force for all of the device's
    # pools, set from `per_process_memory_fraction` (0.0 included) or at run time.
    get_fraction = getattr(native, "_cuda_getMemoryFraction", None)
    library_fraction = c_functions(get="cachealloc_memory_fraction")
    if get_fraction is not None:
        if library_fraction is not None:
            import ctypes

            library_fraction.get.restype = ctypes.c_double
            library_fraction.get.argtypes = [ctypes.c_int]

        def memory_fraction(device):
            if library_fraction is not None:
                fraction = library_fraction.get(int(device))
                if fraction >= 0.0:
                    return fraction
            return min(get_fraction(device), 1.0)

        replace(native, "_cuda_getMemoryFraction", memory_fraction)
    # torch.accelerator's memory functions read the same statistics through these.
    if hasattr(native, "_accelerator_getDeviceStats"):
        replace(native, "_accelerator_getDeviceStats", memory_stats)
    if hasattr(native, "_accelerator_resetAccumulatedStats"):
        replace(native, "_accelerator_resetAccumulatedStats", reset_accumulated)
    # The fraction limits all of a device's pools together, private pools too, as natively;
    # PyTorch's backend counts only its own allocations.
    set_fraction = getattr(native, "_cuda_setMemoryFraction", None)
    limits = c_functions(set="cachealloc_set_memory_fraction")
    if set_fraction is not None and limits is not None:
        import ctypes

        limits.set.restype = ctypes.c_int
        limits.set.argtypes = [ctypes.c_int, ctypes.c_double]

        def set_memory_fraction(fraction, device):
            set_fraction(fraction, device)
            limits.set(int(device), float(fraction))

        replace(native, "_cuda_setMemoryFraction", set_memory_fraction)
    # _set_allocator_settings: PyTorch's parser first (its checks and errors, its own keys),
    # then the library's pools.
    settings = c_functions(apply="cachealloc_set_allocator_settings")
    if settings is not None:
        import ctypes

        settings.apply.restype = ctypes.c_int
        settings.apply.argtypes = [ctypes.c_char_p]
        for name in ("_cuda_cudaCachingAllocator_set_allocator_settings", "_accelerator_setAllocatorSettings"):
            original = getattr(native, name, None)
            if original is not None:
                replace(native, name, _settings_setter(original, settings.apply))
    caching = c_functions(enable="cachealloc_caching_enable")
    if caching is not None and hasattr(native, "_cuda_cudaCachingAllocator_enable"):
        import ctypes

        caching.enable.restype = ctypes.c_int
        caching.enable.argtypes = [ctypes.c_int]
        replace(native, "_cuda_cudaCachingAllocator_enable", lambda value: caching.enable(1 if value else 0) and None)
    if native._cuda_record_memory_history is not record_history:
        History.native = native._cuda_record_memory_history
    replace(native, "_cuda_record_memory_history", record_history)
    if hasattr(native, "_cuda_record_memory_history_legacy"):
        replace(native, "_cuda_record_memory_history_legacy", record_history_legacy)
    if History.native_snapshot is None:
        History.native_snapshot = native._cuda_memorySnapshot
    replace(native, "_cuda_memorySnapshot", memory_snapshot)
    original_segments = getattr(memory, "memory_snapshot", None)
    if original_segments is not None:
        segments_snapshot.__doc__ = original_segments.__doc__
        replace(memory, "memory_snapshot", segments_snapshot)
        # (`torch.cuda` takes it by `from .memory import *` once this module is loaded; a
        # `torch.cuda` loaded already has the old one.)
        cuda = sys.modules.get("torch.cuda")
        if getattr(cuda, "memory_snapshot", None) is original_segments:
            replace(cuda, "memory_snapshot", segments_snapshot)
    replace(native, "_cuda_setMemoryMetadata", set_metadata)
    replace(native, "_cuda_getMemoryMetadata", get_metadata)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "Tensor"):
        _record_stream(torch.Tensor)
    if torch is not None:
        _profiler_reports(torch)
    change = getattr(native, "_cuda_changeCurrentAllocator", None)
    if change is not None:

        def change_current_allocator(allocator):
            change(allocator)  # PyTorch refuses once its allocator is in use: nothing changes then
            step_back()
            say("the program installed its own allocator: PyTorch's tensors come from it, and "
                "torch.cuda's memory functions are PyTorch's again (cachealloc still serves and "
                "records what it asks of CUDA)")

        replace(native, "_cuda_changeCurrentAllocator", change_current_allocator)
    say("torch.cuda's memory statistics, history and snapshots are served by cachealloc")
