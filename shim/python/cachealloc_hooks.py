"""cachealloc's Python integration: what the preloaded library cannot do from C.

Activated with no change to the user's program: the preloaded `libcachealloc.so` puts the
directory of this module first on `PYTHONPATH` of a Python process, and `sitecustomize.py`
beside it runs any `sitecustomize` it shadows, then calls `install()`. It never imports torch
itself and never touches the allocation path; it only acts when the program imports a module
it has to adjust:

* `torch.cuda` — before CUDA is first used, cachealloc's C++ allocator for PyTorch is built
  against PyTorch's headers (once per PyTorch build, cached), loaded and installed in the place
  of the `cudaMallocAsync` backend (`cachealloc_torch_allocator`): it serves what the backend
  served, on the library's pools, plus the checkpoints of graph pools that CUDA graph trees
  need (Note [Graph trees under the shim]). `torch_allocator:off` keeps the backend.
* `torch._inductor.config` — `torch.compile(mode="reduce-overhead")` records CUDA graphs through
  "CUDA graph trees", which need an allocator that checkpoints graph pools and owns the
  deleters of their tensors. Without cachealloc's allocator installed (no compiler or CUDA
  headers, `torch_allocator:off`), graph trees would fail on the `cudaMallocAsync` backend;
  Inductor's older CUDA graph path works there, so graph trees are then turned off
  (`triton.cudagraph_trees = False`); `log:debug` says so.
* `torch.cuda.graphs` — a CUDA graph's memory comes from a private pool of the library's, one
  per capture unless graphs share one (`torch.cuda.graph(pool=…)`, `graph_pool_handle()`,
  `make_graphed_callables`). `CUDAGraph.capture_begin` is wrapped to tell the library which
  pool the capture uses (`cachealloc_use_capture_pool`); a capture given no pool gets a handle
  of its own from `graph_pool_handle()` first, so that a later `pool=graph.pool()` names it.
* `torch.cuda.memory` (`cachealloc_memory`) — on the `cudaMallocAsync` route PyTorch's own
  statistics, history and snapshots are not kept (its backend has none); the entry points of
  `torch._C` that the memory API calls are replaced by ones served from the library: `_cuda_memoryStats` (every key of
  `memory_stats()`, from `cachealloc_device_stats_json`), `_cuda_resetAccumulatedMemoryStats`,
  `_cuda_attach_out_of_memory_observer` (the library calls the observer before an allocation
  fails for lack of memory: `cachealloc_attach_oom_observer`),
  `_cuda_cudaCachingAllocator_enable` (`caching_allocator_enable`: while caching is off, the
  library passes new allocations to CUDA, uncounted: `cachealloc_caching_enable`),
  `_cuda_setMemoryFraction` (the fraction then limits every pool of the device together, as
  natively: `cachealloc_set_memory_fraction`),
  `_cuda_record_memory_history` (its settings over time: `cachealloc_memory_history`),
  `_cuda_setMemoryMetadata`/`_cuda_getMemoryMetadata` (the metadata over time, with the
  trace's time from `cachealloc_trace_time`),
  `_cuda_memorySnapshot` (segments, blocks, frames and `device_traces` read from the trace the
  recorder keeps anyway, by a `cachealloc snapshot --serve` process of the command beside the
  library, which walks only what is new at each snapshot after the first; showing what
  the history settings keep; no `device_traces` with `include_traces=False`), the Python
  `memory_snapshot` (it returns the segments alone, so it asks for no traces), and
  `torch.accelerator`'s `_accelerator_getDeviceStats` and `_accelerator_resetAccumulatedStats`; `_cuda_getMemoryFraction` answers the library's fraction
  (`cachealloc_memory_fraction`: set at run time or by `per_process_memory_fraction`), 1.0
  while none is set, not the backend's "unlimited" over the device's memory. So `memory_stats`,
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
  (`cachealloc_mem_pool_begin_thread`/`_end_thread`); so does `_cuda_beginAllocateToPool`,
  which natively routes every thread's (no PyTorch code calls it). `memory_snapshot(pool.id)` and
  `pool.snapshot()` read the pool's segments from the library. Once the C++ allocator for
  PyTorch is installed, PyTorch's own `MemPool` comes back (its pools are then the library's
  through that allocator, and it is what PyTorch's C++ functions take: NCCL's
  `register_mem_pool`), over any allocator object (`cachealloc_memory.use_pytorchs_mem_pools`).
* `torch.Tensor.record_stream` — PyTorch's backend would make a side stream wait for the
  recorded streams when the tensor is freed, which a CUDA graph capture cannot allow (the
  process aborts). For memory of the library's pools it is given to the library instead
  (`cachealloc_record_stream`), which keeps the freed block from reuse until the work queued on
  those streams has run, as PyTorch's native allocator does (Note [Recorded streams]); other
  memory stays with PyTorch's `record_stream`.
* `torch.profiler` — with `profile_memory=True` the profiler hears of allocations and frees
  from PyTorch's native allocator only (its backend reports none: no memory in the profile, the
  memory timeline or `_profile_to_snapshot`). Nothing of PyTorch's is replaced: the library is
  given c10's `memoryProfilingEnabled`, `reportMemoryUsageToProfiler` and
  `reportOutOfMemoryToProfiler` from `libc10.so` (`cachealloc_torch_profiler`) and reports as
  the native allocator does.
* `torch.storage` — sending a CUDA tensor to another process (`torch.multiprocessing`) needs
  PyTorch's native allocator (its backend refuses `shareIpcHandle`). `UntypedStorage`'s
  `_share_cuda_`, `_new_shared_cuda` and `_release_ipc_counter_cuda` are replaced by ones served
  by the library (`cachealloc_ipc_share_desc`, `_open`/`_close` or `_open_desc`/`_close_desc`,
  `_release`): the block's segment's IPC handle and offset, or for a block of an expandable
  segment a description of the memory mapped over it (its file descriptors, which the receiver
  takes from the sender), and a reference counter in shared memory that keeps the block from
  being reused until the receiving process lets go of it, as PyTorch does. As PyTorch does too,
  the sender records an IPC event on its current stream instead of waiting for it, the
  receiver's stream waits on that event, and the sender keeps the event until the receiver has
  let go (`cachealloc_ipc_sent_released`). Both processes run under the shim (children of
  `torch.multiprocessing` inherit `LD_PRELOAD`).
* `torch.autograd` — the backward pass runs on the autograd engine's threads, which have no
  Python frames; `backward()` and `grad()` are wrapped to tell the library which Python stack
  they were called from (`cachealloc_backward_begin`/`_end`), so that their allocations are
  attributed to it. One call into the library per `backward()`, none per allocation.
* `torch.nn.modules.module`, `torch.optim.optimizer` (and `backward()`, above) — for memory by
  category and module, global module and optimizer hooks tell the trace each thread's module,
  the step's phase and what blocks hold (`cachealloc_categories`; `categories:off` turns them
  off).
* `torch._C._cuda_changeCurrentAllocator` — a program that installs its own allocator
  (`change_current_allocator`, before CUDA's first use) gets every function and class above
  back as PyTorch's, since PyTorch's tensors then come from that allocator
  (`cachealloc_common.step_back`; the replacements go through `cachealloc_common.replace`).

`CACHEALLOC_CONF=python:off` switches the integration off (the library then leaves
`PYTHONPATH` alone).
"""
import importlib.abc
import importlib.util
import sys

from cachealloc_common import c_functions, conf, pool_key, replace, say, torch_backend, warn

#: Modules to adjust after they load: name -> function of the loaded module.
ADJUSTMENTS = {}


def _adjusts(name):
    def register(fn):
        ADJUSTMENTS[name] = fn
        return fn

    return register


@_adjusts("torch.cuda")
def _torch_cuda(cuda):
    if torch_backend() != "cudaMallocAsync":
        return
    import cachealloc_torch_allocator

    cachealloc_torch_allocator.install()


@_adjusts("torch._inductor.config")
def _inductor_config(config):
    import cachealloc_torch_allocator

    if torch_backend() != "cudaMallocAsync" or not config.triton.cudagraph_trees:
        return
    if cachealloc_torch_allocator.installed():
        return
    config.triton.cudagraph_trees = False
    say(
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


@_adjusts("torch.cuda.graphs")
def _graphs(graphs):
    if torch_backend() != "cudaMallocAsync":
        return
    use = _capture_pool_api()
    graph_class = getattr(graphs, "CUDAGraph", None)
    if use is None or graph_class is None:
        return
    begin = graph_class.capture_begin
    if getattr(begin, "_cachealloc_wrapped", False):
        return
    import functools
    import itertools

    # A capture without a pool gets one of its own, numbered as PyTorch numbers it: (n, 0) from
    # a counter of such pools (its `graph_pool_handle(false)`), where pools a program asks for
    # (`graph_pool_handle()`, MemPools) are (0, n).
    anonymous = itertools.count(1)

    @functools.wraps(begin)
    def capture_begin(self, pool=None, *args, **kwargs):
        if pool is None:
            pool = (next(anonymous), 0)
        use(pool_key(pool))
        return begin(self, pool, *args, **kwargs)

    capture_begin._cachealloc_wrapped = True
    replace(graph_class, "capture_begin", capture_begin)


@_adjusts("torch.cuda.memory")
def _memory(memory):
    import cachealloc_memory

    cachealloc_memory.adjust(memory)


def _ipc_api():
    """The library's C API for IPC, as a namespace of ctypes functions, or None."""
    import ctypes

    api = c_functions(
        share_desc="cachealloc_ipc_share_desc",
        open="cachealloc_ipc_open",
        close="cachealloc_ipc_close",
        open_desc="cachealloc_ipc_open_desc",
        close_desc="cachealloc_ipc_close_desc",
        release="cachealloc_ipc_release",
        sent_released="cachealloc_ipc_sent_released",
    )
    if api is None:
        return None
    api.sent_released.restype = ctypes.c_int
    api.sent_released.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
    api.share_desc.restype = ctypes.c_size_t
    api.share_desc.argtypes = [
        ctypes.c_uint64,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_uint64),
    ]
    api.open.restype = ctypes.c_uint64
    api.open.argtypes = [ctypes.c_char_p]
    api.close.restype = ctypes.c_int
    api.close.argtypes = [ctypes.c_char_p]
    api.open_desc.restype = ctypes.c_uint64
    api.open_desc.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    api.close_desc.restype = ctypes.c_int
    api.close_desc.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    api.release.restype = ctypes.c_int
    api.release.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
    return api


# The kind of a description `cachealloc_ipc_share_desc` writes (its first byte): a fixed
# segment's block (80 bytes: kind, 7 zero bytes, the offset in the segment, the segment's
# 64-byte IPC handle), or an expandable segment's (never 64 bytes long).
_FIXED_SEGMENT = 1


# At most this many IPC events alive for shares, as PyTorch's `CUDA_IPC_MAXIMUM_EVENTS_TO_USE`:
# CUDA limits recorded interprocess events (unofficially, ~22 000 measured by PyTorch), so past
# it a share synchronizes its stream instead, as PyTorch's does.
_MAX_SENT_EVENTS = 1000


class _SentEvents:
    """The IPC events that shares' receivers wait on, each kept until its receiver has let go
    of the block (its counter released), as PyTorch keeps its `CudaIPCSentData`'s: a receiver
    may open the event long after the share (a queue's backlog), and an event its creator
    destroyed cannot be opened."""

    def __init__(self, api):
        import collections

        self._api = api
        self._kept = collections.deque()  # (counter file's name, slot, event)

    def room(self):
        """Whether a share may have an event: let go of released ones first, looking at a
        few at each share, the one looked at longest ago first. Never all of them: a producer
        may hold thousands of shares (a model's parameters), and a look is a call into the
        library (looking at all 1 000 at every share once they were kept cost ~1 ms a share
        on the H200)."""
        kept = self._kept
        for _ in range(min(len(kept), 4)):
            name, number, _ = kept[0]
            # 1: released; -1: not this process's counter (a forked child's copy): let go.
            if self._api.sent_released(name, number) != 0:
                kept.popleft()
            else:
                kept.rotate(-1)
        return len(kept) < _MAX_SENT_EVENTS

    def keep(self, counter, slot, event):
        self._kept.append((counter, slot, event))


class _ReceivedBlock:
    """Device memory received from another process, as `__cuda_array_interface__`: the
    tensor made from it holds this object, whose end waits for the device's current stream,
    then closes the mapping (`close()`) and releases the sender's counter."""

    def __init__(self, api, close, device, address, size, counter, slot):
        self._api, self._close, self._device = api, close, device
        self._counter, self._slot = counter, slot
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 2,
        }

    def __del__(self):
        try:
            # Work queued on the memory may not have run yet (`t.clone()`, then `del t`): once
            # the counter is released the sender may hand the block to new work, so the
            # receiver first waits for its current stream, as PyTorch's own deleter does.
            import torch

            torch.cuda.current_stream(self._device).synchronize()
        except Exception:  # interpreter shutdown: nothing runs on the device any more
            pass
        try:
            self._close()
            if self._counter:
                self._api.release(self._counter, self._slot)
        except Exception:  # interpreter shutdown: the sender's files go with it
            pass


@_adjusts("torch.storage")
def _storage(storage):
    if torch_backend() != "cudaMallocAsync":
        return
    api = _ipc_api()
    untyped = getattr(storage, "UntypedStorage", None)
    if api is None or untyped is None or getattr(untyped, "_cachealloc_ipc", False):
        return
    import ctypes
    import functools

    sent_events = _SentEvents(api)

    def share_cuda(self, *args, **kwargs):
        import torch

        device = self.device.index
        if self.data_ptr() == 0 or self.nbytes() == 0:
            return (device, None, 0, 0, None, None, None, False)
        counter = ctypes.create_string_buffer(128)
        slot = ctypes.c_uint64()
        size = 4096
        with torch.cuda.device(device):
            while True:
                desc = ctypes.create_string_buffer(size)
                need = api.share_desc(self.data_ptr(), desc, size, counter, 128, ctypes.byref(slot))
                if need <= size:
                    break
                size = need  # too small: nothing was shared; again with the length it needs
            if need == 0:
                raise RuntimeError(
                    "cachealloc: this CUDA tensor cannot be shared with another process (the "
                    "library said why above)"
                )
            # The receiver's stream waits on the device for what this stream queued so far
            # (an IPC event, as PyTorch sends one): the sender does not wait, unless the
            # events kept for its shares have reached CUDA's limit.
            event = event_handle = None
            if sent_events.room():
                event = torch.cuda.Event(interprocess=True)
                event.record(torch.cuda.current_stream())
                event_handle = event.ipc_handle()
                sent_events.keep(counter.value, slot.value, event)
            else:
                torch.cuda.current_stream().synchronize()
        sync = event is not None
        desc = desc.raw[:need]
        if desc[0] == _FIXED_SEGMENT:
            # The segment's IPC handle and the offset in it, as PyTorch sends them.
            offset = int.from_bytes(desc[8:16], "little")
            return (device, desc[16:80], self.nbytes(), offset, counter.value, slot.value,
                    event_handle, sync)
        # An expandable segment's block: the description names the sender's memory.
        return (device, desc, self.nbytes(), 0, counter.value, slot.value, event_handle, sync)

    def new_shared_cuda(cls, device, handle, size, offset, counter, slot, *rest, **kwargs):
        import torch

        event_handle, event_sync_required = (list(rest) + [None, False])[:2]
        with torch.cuda.device(device):
            if event_sync_required and event_handle:
                # What the sender queued before the share runs before this stream's work.
                event = torch.cuda.Event.from_ipc_handle(device, event_handle)
                torch.cuda.current_stream().wait_event(event)
            if len(handle) == 64:  # a fixed segment's IPC handle
                base = api.open(handle)
                address = base + offset
                close = functools.partial(api.close, handle)
            else:  # a description: the block's address
                base = address = api.open_desc(handle, len(handle))
                close = functools.partial(api.close_desc, handle, len(handle))
            if base == 0:
                raise RuntimeError("cachealloc: could not map a CUDA tensor of another process")
        block = _ReceivedBlock(api, close, device, address, size, counter, slot)
        return torch.as_tensor(block, device=f"cuda:{device}").untyped_storage()

    def release_counter(cls, counter, slot, *rest, **kwargs):
        if counter:
            api.release(counter, slot)

    untyped._share_cuda_ = share_cuda
    untyped._new_shared_cuda = classmethod(new_shared_cuda)
    untyped._release_ipc_counter_cuda = classmethod(release_counter)
    untyped._cachealloc_ipc = True
    say("CUDA tensors shared between processes go through cachealloc's IPC")


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

    if categories.wanted(conf()) and categories.install_module_hooks(module):
        say("nn.Module calls tell the trace each thread's module and the forward phase")


@_adjusts("torch.compiler")
def _compiler(compiler):
    import cachealloc_categories as categories

    categories.torch_compiler_imported()


@_adjusts("torch.optim.optimizer")
def _optimizer_hooks(optimizer):
    import cachealloc_categories as categories

    if categories.wanted(conf()) and categories.install_optimizer_hooks(optimizer):
        say("optimizer hooks tell the trace the optimizer's phase and state")


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
            warn(f"could not adjust {module.__name__}: {e}")


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


def watch_code_objects():
    """Let the library hear of code objects' deaths (Python 3.12+), so that its warm stack
    captures need not check each frame's code object (Note [Code objects' deaths]). Through
    `ctypes.PyDLL`, which keeps the GIL held during the call, as the interpreter requires."""
    if sys.version_info < (3, 12):
        return
    try:
        import ctypes

        if ctypes.PyDLL(None).cachealloc_python_watch_code() != 0:
            say("Python code objects' deaths not heard: stack keys keep their checks")
    except Exception as e:  # an older library, or no watcher place left
        say(f"Python code objects' deaths not heard ({e}): stack keys keep their checks")


def install():
    """Adjust the modules of ADJUSTMENTS when they are imported (now, if already imported)."""
    if "python:off" in conf():
        return
    watch_code_objects()
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    for name, adjust in ADJUSTMENTS.items():
        if name in sys.modules:
            adjust(sys.modules[name])
