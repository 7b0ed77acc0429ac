"""cachealloc's Python integration: what the preloaded library cannot do from C.

Activated with no change to the user's program: the preloaded `libcachealloc.so` puts the
directory of this module first on `PYTHONPATH` of a Python process, and `sitecustomize.py`
beside it runs any `sitecustomize` it shadows, then calls `install()`. It never imports torch
itself and never touches the allocation path; it only acts when the program imports a module
it has to adjust:

* `torch._inductor.config` — `torch.compile(mode="reduce-overhead")` records CUDA graphs through
  "CUDA graph trees", which need PyTorch's native allocator (its private pools and
  `checkPoolLiveAllocations`); on the `cudaMallocAsync` backend that routes tensors to
  cachealloc, graph trees fail. Inductor's older CUDA graph path works on that backend, so graph
  trees are turned off (`triton.cudagraph_trees = False`); `log:debug` says so.
* `torch.cuda.graphs` — a CUDA graph's memory comes from a private pool of the library's, one
  per capture unless graphs share one (`torch.cuda.graph(pool=…)`, `graph_pool_handle()`,
  `make_graphed_callables`). `CUDAGraph.capture_begin` is wrapped to tell the library which
  pool the capture uses (`cachealloc_use_capture_pool`); a capture given no pool gets a handle
  of its own from `graph_pool_handle()` first, so that a later `pool=graph.pool()` names it.
* `torch.cuda.memory` — on the `cudaMallocAsync` route PyTorch's own statistics, history and
  snapshots are not kept (its backend has none); the entry points of `torch._C` that the memory
  API calls are replaced by ones served from the library: `_cuda_memoryStats` (every key of
  `memory_stats()`, from `cachealloc_device_stats_json`), `_cuda_resetAccumulatedMemoryStats`,
  `_cuda_attach_out_of_memory_observer` (the library calls the observer before an allocation
  fails for lack of memory: `cachealloc_attach_oom_observer`),
  `_cuda_cudaCachingAllocator_enable` (`caching_allocator_enable`: while caching is off, the
  library passes new allocations to CUDA, uncounted: `cachealloc_caching_enable`),
  `_cuda_setMemoryFraction` (the fraction then limits every pool of the device together, as
  natively: `cachealloc_set_memory_fraction`),
  `_cuda_record_memory_history`, `_cuda_memorySnapshot` (segments, blocks, frames and
  `device_traces` read from the trace the recorder keeps anyway, by the `cachealloc snapshot`
  command beside the library), and `torch.accelerator`'s `_accelerator_getDeviceStats` and
  `_accelerator_resetAccumulatedStats`; `_cuda_getMemoryFraction` answers 1.0, not the
  backend's "unlimited" over the device's memory, while no fraction is set. So `memory_stats`,
  `memory_summary`, `_record_memory_history`, `_snapshot`, `memory_snapshot` and
  `_dump_snapshot` work unchanged, and a snapshot has history even when the program never asked
  for it.
* `torch.cuda.memory`, again — `torch.cuda.MemPool` and `use_mem_pool` need PyTorch's native
  allocator (its `_MemPool` refuses the `cudaMallocAsync` backend). `MemPool` is replaced by a
  class of the same interface whose pool is one of the library's private pools
  (`cachealloc_mem_pool_retain`/`_release`/`_use_count`/`_snapshot_json`; a
  `CUDAPluggableAllocator` given to it provides the pool's segments), and `use_mem_pool`'s
  entry points `_cuda_beginAllocateCurrentThreadToPool`, `_cuda_endAllocateToPool` and
  `_cuda_releasePool` route the calling thread's allocations to it
  (`cachealloc_mem_pool_begin_thread`/`_end_thread`). `memory_snapshot(pool.id)` and
  `pool.snapshot()` read the pool's segments from the library.
* `torch.storage` — sending a CUDA tensor to another process (`torch.multiprocessing`) needs
  PyTorch's native allocator (its backend refuses `shareIpcHandle`). `UntypedStorage`'s
  `_share_cuda_`, `_new_shared_cuda` and `_release_ipc_counter_cuda` are replaced by ones served
  by the library (`cachealloc_ipc_share`/`_open`/`_close`/`_release`): the block's segment's
  IPC handle and offset, and a reference counter in shared memory that keeps the block from
  being reused until the receiving process lets go of it, as PyTorch does. Both processes run
  under the shim (children of `torch.multiprocessing` inherit `LD_PRELOAD`).
* `torch.autograd` — the backward pass runs on the autograd engine's threads, which have no
  Python frames; `backward()` and `grad()` are wrapped to tell the library which Python stack
  they were called from (`cachealloc_backward_begin`/`_end`), so that their allocations are
  attributed to it. One call into the library per `backward()`, none per allocation.
* `torch.nn.modules.module`, `torch.optim.optimizer` (and `backward()`, above) — for memory by
  category and module, global module and optimizer hooks tell the trace each thread's module,
  the step's phase and what blocks hold (`cachealloc_categories`; `categories:off` turns them
  off).

`CACHEALLOC_CONF=python:off` switches the integration off (the library then leaves
`PYTHONPATH` alone).
"""
import importlib.abc
import importlib.util
import os
import sys

#: Modules to adjust after they load: name -> function of the loaded module.
ADJUSTMENTS = {}


def _adjusts(name):
    def register(fn):
        ADJUSTMENTS[name] = fn
        return fn

    return register


def _conf():
    return os.environ.get("CACHEALLOC_CONF", "").replace(" ", "")


def _say(message):
    """A message on stderr, shown with `log:debug` (the adjustment is documented, and would
    otherwise be printed by every PyTorch program)."""
    if "log:debug" in _conf():
        print(f"cachealloc: {message}", file=sys.stderr)


def _warn(message):
    """A message on stderr unless `log:quiet`: something did not work."""
    if "log:quiet" not in _conf():
        print(f"cachealloc: {message}", file=sys.stderr)


def _torch_backend():
    """The allocator backend PyTorch was configured with."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = os.environ.get(var)
        if conf is not None:
            for item in conf.split(","):
                key, _, value = item.partition(":")
                if key.strip() == "backend":
                    return value.strip()
            return "native"
    return "native"


@_adjusts("torch._inductor.config")
def _inductor_config(config):
    if _torch_backend() != "cudaMallocAsync" or not config.triton.cudagraph_trees:
        return
    config.triton.cudagraph_trees = False
    _say(
        "torch.compile's CUDA graph trees need PyTorch's native allocator; with cachealloc "
        "(PyTorch's cudaMallocAsync backend) Inductor records CUDA graphs without trees "
        "(torch._inductor.config.triton.cudagraph_trees = False)"
    )


def _library():
    """The preloaded library's C API, or None."""
    import ctypes

    try:
        lib = ctypes.CDLL(None)
        begin, end = lib.cachealloc_backward_begin, lib.cachealloc_backward_end
    except (OSError, AttributeError):
        return None
    begin.restype = ctypes.c_uint
    begin.argtypes = []
    end.restype = None
    end.argtypes = [ctypes.c_uint]
    return begin, end


def _attributed(fn, begin, end, gradients):
    """`fn`, telling the library that the calling thread's stack owns what is allocated on
    frameless threads while it runs, and (with the category hooks on) that it is the backward
    phase; after it, with `gradients`, the parameters' gradients are tagged."""
    import functools

    import cachealloc_categories as categories

    @functools.wraps(fn)
    def backward_with_stack(*args, **kwargs):
        token = begin()
        phase = categories.backward_begin()
        try:
            return fn(*args, **kwargs)
        finally:
            categories.backward_end(phase, gradients)
            end(token)

    backward_with_stack._cachealloc_wrapped = True
    return backward_with_stack


def _capture_pool_api():
    """The library's `cachealloc_use_capture_pool`, or None."""
    import ctypes

    try:
        use = ctypes.CDLL(None).cachealloc_use_capture_pool
    except (OSError, AttributeError):
        return None
    use.restype = None
    use.argtypes = [ctypes.c_uint64]
    return use


def pool_key(pool):
    """The library's id for PyTorch's pool handle (a pair of integers, never (0, 0))."""
    first, second = pool
    return ((int(first) & 0xFFFFFFFF) << 32) | (int(second) & 0xFFFFFFFF)


@_adjusts("torch.cuda.graphs")
def _graphs(graphs):
    if _torch_backend() != "cudaMallocAsync":
        return
    use = _capture_pool_api()
    graph_class = getattr(graphs, "CUDAGraph", None)
    if use is None or graph_class is None:
        return
    begin = graph_class.capture_begin
    if getattr(begin, "_cachealloc_wrapped", False):
        return
    import functools

    @functools.wraps(begin)
    def capture_begin(self, pool=None, *args, **kwargs):
        if pool is None:
            pool = graphs.graph_pool_handle()
        use(pool_key(pool))
        return begin(self, pool, *args, **kwargs)

    capture_begin._cachealloc_wrapped = True
    graph_class.capture_begin = capture_begin


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


def _text(fn, *args):
    """The text a `cachealloc_*` function writes into a buffer ("" when it writes none)."""
    import ctypes

    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        need = fn(*args, buf, size)
        if need <= size:
            return buf.value.decode() if need else ""
        size = need


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
    """What `_record_memory_history` asked for: the recorder keeps the history anyway; a
    snapshot shows its last `max_entries` events, none after an explicit `enabled=None`."""

    enabled = True
    max_entries = 100_000


def _record_history(enabled="all", context="all", stacks="all", max_entries=None, *rest, **kw):
    _History.enabled = enabled is not None and enabled is not False
    if isinstance(max_entries, int) and max_entries > 0:
        _History.max_entries = max_entries


def _snapshot_from_trace(flush):
    import pickle
    import subprocess
    import tempfile

    trace = _text(flush)
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
    events = min(_History.max_entries, 10_000_000) if _History.enabled else 0
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "snapshot.pickle")
        done = subprocess.run(
            [tool, "snapshot", trace, "--events", str(events), "-o", out],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"cachealloc snapshot failed: {done.stderr.strip()}")
        with open(out, "rb") as f:
            snapshot = pickle.load(f)
    if not _History.enabled:
        snapshot["device_traces"] = [[] for _ in snapshot.get("device_traces", [])]
    return snapshot


def _with_pool_ids(snapshot):
    """`snapshot` with each private pool's segment named by its pool (`segment_pool_id`), which
    the library knows and the trace does not."""
    import ctypes
    import json

    api = _c_functions(segments="cachealloc_private_segments_json")
    if api is None:
        return snapshot
    api.segments.restype = ctypes.c_size_t
    api.segments.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    pools = {}
    for device in {s.get("device", 0) for s in snapshot.get("segments", [])}:
        for address, first, second in json.loads(_text(api.segments, int(device)) or "[]"):
            pools[(device, address)] = (first, second)
    for segment in snapshot.get("segments", []):
        pool = pools.get((segment.get("device", 0), segment.get("address")))
        if pool is not None:
            segment["segment_pool_id"] = pool
    return snapshot


def _c_functions(**names):
    """The preloaded library's functions `names` (short name -> `cachealloc_…` symbol) as a
    namespace of ctypes functions, or None when the library is not there."""
    import ctypes
    import types

    try:
        lib = ctypes.CDLL(None)
        return types.SimpleNamespace(**{short: getattr(lib, symbol) for short, symbol in names.items()})
    except (OSError, AttributeError):
        return None


def _mem_pool_api():
    """The library's C API for MemPools, as a namespace of ctypes functions, or None."""
    import ctypes

    api = _c_functions(
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


#: PyTorch's pool id -> the device of a MemPool made under the library (for snapshots).
_POOL_DEVICES = {}
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
            _POOL_DEVICES[self._id] = self._device

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
    """PyTorch's snapshot of one pool: its segments now, read from the library."""
    import json

    device = _POOL_DEVICES.get(tuple(pool_id), 0)
    segments = json.loads(_text(api.snapshot, device, pool_key(pool_id)))
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


@_adjusts("torch.cuda.memory")
def _memory(memory):
    if _torch_backend() != "cudaMallocAsync":
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
        return nested_stats(json.loads(_text(stats, int(device))))

    def reset_accumulated(device):
        reset(int(device))

    def memory_snapshot(which=None, *args, **kwargs):
        # memory_snapshot(mempool_id) passes (first, second, include_traces); (0, 0) is the
        # whole allocator.
        if pools is not None and isinstance(which, tuple) and len(which) >= 2 and tuple(which[:2]) != (0, 0):
            return _pool_snapshot(pools, which[:2])
        return _with_pool_ids(_snapshot_from_trace(flush))

    native._cuda_memoryStats = memory_stats
    native._cuda_resetAccumulatedMemoryStats = reset_accumulated
    # The backend answers the memory fraction as its limit over the device's memory, and its
    # limit is "unlimited" (2**64 - 1) until one is set: a "fraction" of millions, which
    # set_per_process_memory_fraction then refuses to take back. Unset is 1.0, as natively.
    get_fraction = getattr(native, "_cuda_getMemoryFraction", None)
    if get_fraction is not None:
        native._cuda_getMemoryFraction = lambda device: min(get_fraction(device), 1.0)
    # torch.accelerator's memory functions read the same statistics through these.
    if hasattr(native, "_accelerator_getDeviceStats"):
        native._accelerator_getDeviceStats = memory_stats
    if hasattr(native, "_accelerator_resetAccumulatedStats"):
        native._accelerator_resetAccumulatedStats = reset_accumulated
    # The fraction limits all of a device's pools together, private pools too, as natively;
    # PyTorch's backend counts only its own allocations.
    set_fraction = getattr(native, "_cuda_setMemoryFraction", None)
    limits = _c_functions(set="cachealloc_set_memory_fraction")
    if set_fraction is not None and limits is not None:
        import ctypes

        limits.set.restype = ctypes.c_int
        limits.set.argtypes = [ctypes.c_int, ctypes.c_double]

        def set_memory_fraction(fraction, device):
            set_fraction(fraction, device)
            limits.set(int(device), float(fraction))

        native._cuda_setMemoryFraction = set_memory_fraction
    caching = _c_functions(enable="cachealloc_caching_enable")
    if caching is not None and hasattr(native, "_cuda_cudaCachingAllocator_enable"):
        import ctypes

        caching.enable.restype = ctypes.c_int
        caching.enable.argtypes = [ctypes.c_int]
        native._cuda_cudaCachingAllocator_enable = lambda value: caching.enable(1 if value else 0) and None
    native._cuda_record_memory_history = _record_history
    native._cuda_memorySnapshot = memory_snapshot
    _say("torch.cuda's memory statistics, history and snapshots are served by cachealloc")


def _ipc_api():
    """The library's C API for IPC, as a namespace of ctypes functions, or None."""
    import ctypes

    api = _c_functions(
        share="cachealloc_ipc_share",
        open="cachealloc_ipc_open",
        close="cachealloc_ipc_close",
        release="cachealloc_ipc_release",
    )
    if api is None:
        return None
    api.share.restype = ctypes.c_int
    api.share.argtypes = [
        ctypes.c_uint64,
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_uint64),
    ]
    api.open.restype = ctypes.c_uint64
    api.open.argtypes = [ctypes.c_char_p]
    api.close.restype = ctypes.c_int
    api.close.argtypes = [ctypes.c_char_p]
    api.release.restype = ctypes.c_int
    api.release.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
    return api


class _ReceivedBlock:
    """Device memory received from another process, as `__cuda_array_interface__`: the
    tensor made from it holds this object, whose end closes the mapping and releases the
    sender's counter."""

    def __init__(self, api, handle, address, size, counter, slot):
        self._api, self._handle, self._counter, self._slot = api, handle, counter, slot
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 2,
        }

    def __del__(self):
        try:
            self._api.close(self._handle)
            if self._counter:
                self._api.release(self._counter, self._slot)
        except Exception:  # interpreter shutdown: the sender's files go with it
            pass


@_adjusts("torch.storage")
def _storage(storage):
    if _torch_backend() != "cudaMallocAsync":
        return
    api = _ipc_api()
    untyped = getattr(storage, "UntypedStorage", None)
    if api is None or untyped is None or getattr(untyped, "_cachealloc_ipc", False):
        return
    import ctypes

    def share_cuda(self, *args, **kwargs):
        import torch

        device = self.device.index
        if self.data_ptr() == 0 or self.nbytes() == 0:
            return (device, None, 0, 0, None, None, None, False)
        handle = ctypes.create_string_buffer(64)
        offset, slot = ctypes.c_uint64(), ctypes.c_uint64()
        counter = ctypes.create_string_buffer(128)
        with torch.cuda.device(device):
            # The receiver reads what this stream wrote (PyTorch records an event instead).
            torch.cuda.current_stream().synchronize()
            code = api.share(self.data_ptr(), handle, ctypes.byref(offset), counter, 128, ctypes.byref(slot))
        if code != 0:
            raise RuntimeError(
                f"cachealloc: this CUDA tensor cannot be shared with another process (error {code}; "
                "the library said why above)"
            )
        return (device, handle.raw, self.nbytes(), offset.value, counter.value, slot.value, None, False)

    def new_shared_cuda(cls, device, handle, size, offset, counter, slot, *rest, **kwargs):
        import torch

        with torch.cuda.device(device):
            base = api.open(handle)
            if base == 0:
                raise RuntimeError("cachealloc: could not map a CUDA tensor of another process")
        block = _ReceivedBlock(api, handle, base + offset, size, counter, slot)
        return torch.as_tensor(block, device=f"cuda:{device}").untyped_storage()

    def release_counter(cls, counter, slot, *rest, **kwargs):
        if counter:
            api.release(counter, slot)

    untyped._share_cuda_ = share_cuda
    untyped._new_shared_cuda = classmethod(new_shared_cuda)
    untyped._release_ipc_counter_cuda = classmethod(release_counter)
    untyped._cachealloc_ipc = True
    _say("CUDA tensors shared between processes go through cachealloc's IPC")


@_adjusts("torch.autograd")
def _autograd(autograd):
    api = _library()
    if api is None:
        return
    for name in ("backward", "grad"):
        fn = getattr(autograd, name, None)
        if fn is not None and not getattr(fn, "_cachealloc_wrapped", False):
            setattr(autograd, name, _attributed(fn, *api, gradients=name == "backward"))


@_adjusts("torch.nn.modules.module")
def _module_hooks(module):
    import cachealloc_categories as categories

    if categories.wanted(_conf()) and categories.install_module_hooks(module):
        _say("nn.Module calls tell the trace each thread's module and the forward phase")


@_adjusts("torch.optim.optimizer")
def _optimizer_hooks(optimizer):
    import cachealloc_categories as categories

    if categories.wanted(_conf()) and categories.install_optimizer_hooks(optimizer):
        _say("optimizer hooks tell the trace the optimizer's phase and state")


class _Wrapped(importlib.abc.Loader):
    """A loader that runs the module's own loader, then its adjustment."""

    def __init__(self, loader, adjust):
        self.loader = loader
        self.adjust = adjust

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            self.adjust(module)
        except Exception as e:  # never break the user's import
            _warn(f"could not adjust {module.__name__}: {e}")


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module in ADJUSTMENTS, asks the other finders, then wraps
    the loader they found."""

    def find_spec(self, name, path=None, target=None):
        adjust = ADJUSTMENTS.get(name)
        if adjust is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Wrapped(spec.loader, adjust)
                return spec
        return None


def install():
    """Adjust the modules of ADJUSTMENTS when they are imported (now, if already imported)."""
    if "python:off" in _conf():
        return
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    for name, adjust in ADJUSTMENTS.items():
        if name in sys.modules:
            adjust(sys.modules[name])
