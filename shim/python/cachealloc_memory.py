"""cachealloc's Python integration for `torch.cuda.memory` (installed by `cachealloc_hooks`
when the program imports it): on the `cudaMallocAsync` route PyTorch's own statistics, history,
snapshots, MemPools, memory fraction and caching switch are not kept (its backend has none);
`adjust` replaces the entry points of `torch._C` that the memory API calls by ones served from
the preloaded library. The list, and why: the docstring of `cachealloc_hooks` and design.md,
"The Python integration"."""
import os
import sys

from cachealloc_common import c_functions, pool_key, say, text, torch_backend, warn


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


def _cachealloc_binary():
    """The `cachealloc` command beside the preloaded library."""
    for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if os.path.basename(entry).startswith("libcachealloc"):
            candidate = os.path.join(os.path.dirname(os.path.abspath(entry)), "cachealloc")
            if os.access(candidate, os.X_OK):
                return candidate
    return None


class _History:
    """What `_record_memory_history` asked, over time: each change with the trace's time at the
    call, which `cachealloc snapshot --history` applies (what each setting keeps, as PyTorch's
    native allocator keeps it: docs in the tool's `snapshot::history`). Before the first call
    nothing shows, as natively; a program that never calls it gets the recorder's whole
    history."""

    changes = []
    max_entries = 100_000
    # Changes passed to the tool at most (the last ones; a program that toggles its history
    # every step need not make the command line grow without end).
    keep = 4096
    # PyTorch's own `_cuda_record_memory_history` (the compiled regions: Note [Compile regions]).
    native = None


_ENABLED = (None, "state", "all")
_CONTEXT = (None, "state", "alloc", "all")
_STACKS = ("python", "all")


#: The actions `skip_actions` may name (the entries' `action` in `device_traces`).
_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
            "segment_map", "segment_unmap", "snapshot", "oom", "user_defined")


def _record_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize, *rest, **kw):
    # PyTorch passes (clear_history, compile_context, global_record_annotations, skip_actions)
    # after max_entries.
    skip = list(rest[3] if len(rest) > 3 else kw.get("skip_actions") or [])
    for action in skip:
        if action not in _ACTIONS:
            raise RuntimeError(
                f"Invalid action {action!r} in skip_actions; expected some of: {', '.join(_ACTIONS)}"
            )
    # The values PyTorch accepts.
    for value, valid, what in (
        (enabled, _ENABLED, "enabled"),
        (context, _CONTEXT, "context"),
        (stacks, _STACKS, "stacks"),
    ):
        if value not in valid:
            choices = ", ".join(repr(v) for v in valid)
            raise RuntimeError(f"Invalid option {what}={value!r}; expected one of: {choices}")
    api = c_functions(history="cachealloc_memory_history")
    if api is None:
        return
    import ctypes

    api.history.restype = ctypes.c_uint64
    api.history.argtypes = [ctypes.c_int, ctypes.c_int]
    # Free stacks are captured only while the program keeps them (events with context="all"),
    # C++ frames while it asks for them (stacks="all", PyTorch's default, which costs natively
    # too).
    t = api.history(
        1 if enabled == "all" and context == "all" else 0,
        1 if enabled is not None and context is not None and stacks == "all" else 0,
    )
    compile_context = rest[1] if len(rest) > 1 else kw.get("compile_context", False)
    import cachealloc_torch_allocator

    cachealloc_torch_allocator.tell_compile_regions(
        _History.native, enabled, compile_context, (enabled, context, stacks, max_entries, *rest), kw
    )
    if enabled is None:
        context = None
    _History.changes.append((t, enabled or "none", context or "none", stacks, "+".join(skip)))
    del _History.changes[: -_History.keep]
    if enabled is not None and isinstance(max_entries, int) and max_entries > 0:
        _History.max_entries = max_entries


class _Metadata:
    """What `_set_memory_metadata` set, over time: each text with the trace's time at the call,
    which `cachealloc snapshot --metadata` puts on the events recorded from then on (as
    `user_metadata`, as PyTorch's native allocator does)."""

    changes = []
    current = ""
    keep = 4096


def _set_metadata(metadata):
    import ctypes

    api = c_functions(now="cachealloc_trace_time")
    if api is None:
        return
    api.now.restype = ctypes.c_uint64
    api.now.argtypes = []
    _Metadata.current = str(metadata)
    _Metadata.changes.append((api.now(), _Metadata.current))
    del _Metadata.changes[: -_Metadata.keep]


def _get_metadata():
    return _Metadata.current


def _record_history_legacy(enabled, record_context=True, trace_alloc_max_entries=1,
                           trace_alloc_record_context=False, record_context_cpp=False, *rest, **kw):
    """`_record_memory_history(True, …)`, PyTorch's older form, in the newer one's terms."""
    if not enabled:
        return _record_history(None, None, "python")
    context = "alloc" if trace_alloc_record_context else ("state" if record_context else None)
    return _record_history(
        "all" if trace_alloc_max_entries > 1 else "state",
        context,
        "all" if record_context_cpp else "python",
        max(trace_alloc_max_entries, 1),
    )


def _snapshot_from_trace(flush):
    import pickle
    import subprocess
    import tempfile

    trace = text(flush)
    if not trace:
        raise RuntimeError(
            "cachealloc: no trace to take a snapshot from (CACHEALLOC_CONF has trace:off, "
            "or the trace could not be written)"
        )
    tool = _cachealloc_binary()
    if tool is None:
        raise RuntimeError(
            "cachealloc: the `cachealloc` command was not found beside the preloaded library"
        )
    events = min(_History.max_entries, 10_000_000)
    history = ",".join(":".join(str(part) for part in change) for change in _History.changes)
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "snapshot.pickle")
        texts = []
        import json
        import cachealloc_torch_allocator

        for flag, changes in (
            ("--metadata", _Metadata.changes),
            ("--compile-context", cachealloc_torch_allocator.compile_regions()),
        ):
            if changes:
                path = os.path.join(scratch, flag.strip("-") + ".json")
                with open(path, "w") as f:
                    json.dump(changes, f)
                texts += [flag, path]
        done = subprocess.run(
            [tool, "snapshot", trace, "--events", str(events), "-o", out]
            + (["--history", history] if history else [])
            + texts,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"cachealloc snapshot failed: {done.stderr.strip()}")
        with open(out, "rb") as f:
            snapshot = pickle.load(f)
    return snapshot


def _with_library_facts(snapshot):
    """`snapshot` with what the library knows of each segment and the trace does not say: its
    pool (`segment_pool_id`: a graph pool's or a MemPool's id) and whether it is expandable (the
    program may switch expandable segments at run time)."""
    import ctypes
    import json

    api = c_functions(segments="cachealloc_segments_json")
    if api is None:
        return snapshot
    api.segments.restype = ctypes.c_size_t
    api.segments.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    spans = {}
    for device in {s.get("device", 0) for s in snapshot.get("segments", [])}:
        spans[device] = json.loads(text(api.segments, int(device)) or "[]")
    for segment in snapshot.get("segments", []):
        address = segment.get("address", 0)
        for start, size, first, second, expandable in spans.get(segment.get("device", 0), []):
            if start <= address < start + size:
                segment["segment_pool_id"] = (first, second)
                segment["is_expandable"] = bool(expandable)
                break
    return snapshot


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

    native._cuda_attach_out_of_memory_observer = attach_out_of_memory_observer


#: id() of each `_cuda_CUDAAllocator` made by `CUDAPluggableAllocator` -> (allocator, its
#: alloc and free function addresses): what a `MemPool(allocator)` takes its segments from.
_FOREIGN_ALLOCATORS = {}


def _mem_pool_class(api, torch_c, original):
    """`torch.cuda.MemPool` served by the library's private pools (Note [PyTorch MemPools])."""

    class MemPool:
        def __init__(self, allocator=None, use_on_oom=False, no_split=False):
            import torch

            self._allocator = allocator
            # PyTorch's own counter, shared with graph_pool_handle(): ids never collide.
            self._id = tuple(torch_c._graph_pool_handle())
            self._device = torch.cuda.current_device()
            alloc_fn = free_fn = None
            if allocator is not None:
                known = _FOREIGN_ALLOCATORS.get(id(allocator))
                if known is None or known[0] is not allocator:
                    raise RuntimeError(
                        "cachealloc: MemPool(allocator) takes the allocator() of a "
                        "torch.cuda.memory.CUDAPluggableAllocator"
                    )
                alloc_fn, free_fn = known[1], known[2]
            flags = (1 if use_on_oom else 0) | (2 if no_split else 0)
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
        native._cuda_customAllocator = custom_allocator

    def begin_allocate_to_pool(device, pool_id):
        code = api.begin(int(device), pool_key(pool_id))
        if code != 0:
            raise RuntimeError(f"cachealloc: cannot allocate to MemPool {tuple(pool_id)} (error {code})")

    def end_allocate_to_pool(device, pool_id):
        api.end(int(device), pool_key(pool_id))

    def release_pool(device, pool_id):
        api.release(int(device), pool_key(pool_id))

    for module in (native, memory):
        module._cuda_beginAllocateCurrentThreadToPool = begin_allocate_to_pool
        module._cuda_endAllocateToPool = end_allocate_to_pool
        module._cuda_releasePool = release_pool
    pool_class = _mem_pool_class(api, native, getattr(memory, "MemPool", None))
    memory.MemPool = pool_class
    native._MemPool = pool_class
    if "torch.cuda" in sys.modules and hasattr(sys.modules["torch.cuda"], "MemPool"):
        sys.modules["torch.cuda"].MemPool = pool_class
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
    tensor_class.record_stream = record_stream


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
        # whole allocator.
        if pools is not None and isinstance(which, tuple) and len(which) >= 2 and tuple(which[:2]) != (0, 0):
            return _pool_snapshot(pools, which[:2])
        return _with_library_facts(_snapshot_from_trace(flush))

    def history_enabled():
        # What the program asked for (the recorder keeps the history anyway).
        return bool(_History.changes) and _History.changes[-1][1] != "none"

    native._cuda_memoryStats = memory_stats
    native._cuda_resetAccumulatedMemoryStats = reset_accumulated
    native._cuda_isHistoryEnabled = history_enabled
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

        native._cuda_getMemoryFraction = memory_fraction
    # torch.accelerator's memory functions read the same statistics through these.
    if hasattr(native, "_accelerator_getDeviceStats"):
        native._accelerator_getDeviceStats = memory_stats
    if hasattr(native, "_accelerator_resetAccumulatedStats"):
        native._accelerator_resetAccumulatedStats = reset_accumulated
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

        native._cuda_setMemoryFraction = set_memory_fraction
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
                setattr(native, name, _settings_setter(original, settings.apply))
    caching = c_functions(enable="cachealloc_caching_enable")
    if caching is not None and hasattr(native, "_cuda_cudaCachingAllocator_enable"):
        import ctypes

        caching.enable.restype = ctypes.c_int
        caching.enable.argtypes = [ctypes.c_int]
        native._cuda_cudaCachingAllocator_enable = lambda value: caching.enable(1 if value else 0) and None
    if native._cuda_record_memory_history is not _record_history:
        _History.native = native._cuda_record_memory_history
    native._cuda_record_memory_history = _record_history
    if hasattr(native, "_cuda_record_memory_history_legacy"):
        native._cuda_record_memory_history_legacy = _record_history_legacy
    native._cuda_memorySnapshot = memory_snapshot
    native._cuda_setMemoryMetadata = _set_metadata
    native._cuda_getMemoryMetadata = _get_metadata
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "Tensor"):
        _record_stream(torch.Tensor)
    if torch is not None:
        _profiler_reports(torch)
    say("torch.cuda's memory statistics, history and snapshots are served by cachealloc")
