//! The C API: `cachealloc_*` functions for ctypes and applications (the library must be
//! preloaded; `dlsym` them): version, stats as JSON, empty the cache, annotations, the Python
//! integration's backward-pass markers and private pools (graph captures, `MemPool`s), and
//! PyTorch's `CUDAPluggableAllocator` pair; `ipc`: pooled blocks shared with other
//! processes; `pool_checkpoints`: graph pools' checkpoints for PyTorch's CUDA graph trees;
//! `program_context`: module scopes, phases and what blocks hold, for memory by
//! category; `torch_settings`: PyTorch's memory settings at run time and the segments' facts
//! its snapshots need; `torch_profiler`: PyTorch's profiler's functions, to report memory to.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

mod ipc;
mod pool_checkpoints;
mod program_context;
mod torch_profiler;
mod torch_settings;
pub use ipc::*;
pub use pool_checkpoints::*;
pub use program_context::*;
pub use torch_profiler::*;
pub use torch_settings::*;

use super::guarded;
use crate::cuda::{self, CudaError, CudaStream};
use crate::hooks::runtime as hooks;
use crate::process;

/// The library's version, a static NUL-terminated string.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// Write the stats of every pooled device as JSON (PyTorch's `memory_stats()` key names) into
/// `buf`, NUL-terminated, truncated to `len` bytes. Returns the length the whole text needs,
/// NUL included: call again with a bigger buffer if it exceeds `len`.
///
/// # Safety
/// `buf` must be null or valid for `len` bytes of writes.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_stats_json(buf: *mut c_char, len: usize) -> usize {
    let text = guarded(
        "cachealloc_stats_json",
        crate::report::stats_json,
        String::new,
    );
    // SAFETY: the caller's contract.
    unsafe { write_text(&text, buf, len) }
}

/// Write `device`'s stats as one flat JSON object of PyTorch's `memory_stats()` keys (its
/// capture pools counted; zeros before its first allocation) into `buf`, as
/// [`cachealloc_stats_json`] does. What the Python integration answers `memory_stats()` with.
///
/// # Safety
/// `buf` must be null or valid for `len` bytes of writes.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_device_stats_json(
    device: c_int,
    buf: *mut c_char,
    len: usize,
) -> usize {
    let text = guarded(
        "cachealloc_device_stats_json",
        || crate::report::device_stats_json(device),
        String::new,
    );
    // SAFETY: the caller's contract.
    unsafe { write_text(&text, buf, len) }
}

/// Write every record traced so far to the trace files (waiting up to five seconds), and the
/// trace directory's path into `buf`, as [`cachealloc_stats_json`] writes its text. Returns 0
/// when there is no trace (`trace:off`, or it could not be written). What the Python
/// integration's `torch.cuda.memory._snapshot()` reads the state and history from.
///
/// # Safety
/// `buf` must be null or valid for `len` bytes of writes.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_trace_flush(buf: *mut c_char, len: usize) -> usize {
    let dir = guarded(
        "cachealloc_trace_flush",
        || {
            process::shim()
                .and_then(|s| s.flush_trace(std::time::Duration::from_secs(5)))
                .map(|d| d.to_string_lossy().into_owned())
                .unwrap_or_default()
        },
        String::new,
    );
    if dir.is_empty() {
        return 0;
    }
    // SAFETY: the caller's contract.
    unsafe { write_text(&dir, buf, len) }
}

/// Zero `device`'s accumulated stats (`torch.cuda.reset_accumulated_memory_stats`).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_reset_accumulated_stats(device: c_int) {
    guarded(
        "cachealloc_reset_accumulated_stats",
        || {
            if let Some(shim) = process::shim() {
                shim.reset_accumulated_stats(device);
            }
        },
        || (),
    );
}

/// Write `text` into `buf`, NUL-terminated and truncated to `len` bytes; returns the length the
/// whole text needs, NUL included.
///
/// # Safety
/// `buf` must be null or valid for `len` bytes of writes.
pub(super) unsafe fn write_text(text: &str, buf: *mut c_char, len: usize) -> usize {
    if !buf.is_null() && len > 0 {
        let n = text.len().min(len - 1);
        // SAFETY: `buf` is valid for `len` bytes and `n + 1 <= len`; source and destination
        // cannot overlap (the text is our own allocation).
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            buf.add(n).write(0);
        }
    }
    text.len() + 1
}

/// Release every cached free segment of every device (waiting for pending fences first).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_empty_cache() -> CudaError {
    guarded("cachealloc_empty_cache", hooks::empty_cache, || {
        cuda::ERROR_INITIALIZATION
    })
}

/// Mark a point of the run (an epoch, a phase) with a name: written with the memory state of
/// every device. Returns 0, or `cudaErrorInvalidValue` for a null or non-UTF-8 name.
///
/// # Safety
/// `name` must be null or a valid NUL-terminated string.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_annotate(name: *const c_char) -> CudaError {
    if name.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    let Ok(name) = unsafe { CStr::from_ptr(name) }.to_str() else {
        return cuda::ERROR_INVALID_VALUE;
    };
    let name = name.to_owned();
    guarded(
        "cachealloc_annotate",
        || {
            crate::report::annotate(&name);
            cuda::SUCCESS
        },
        || cuda::SUCCESS,
    )
}

/// The calling Python thread enters `backward()`: allocations on threads without frames of their
/// own (PyTorch's autograd threads) get its stack until [`cachealloc_backward_end`]. Returns a
/// token for `cachealloc_backward_end`. Called by the Python integration.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_backward_begin() -> c_uint {
    guarded(
        "cachealloc_backward_begin",
        || Ok::<_, CudaError>(process::shim().map_or(0, |s| s.backward_begin())),
        || Ok(0),
    )
    .unwrap_or(0)
}

/// The calling thread's next CUDA graph capture allocates from the capture pool `id`, shared by
/// every capture given the same id; 0 for a pool of its own (see Note [Capture pools] in the
/// shim's `process`). Called by the Python integration for `torch.cuda.graph(pool=…)`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_use_capture_pool(id: u64) {
    guarded(
        "cachealloc_use_capture_pool",
        || {
            if let Some(shim) = process::shim() {
                shim.use_capture_pool(id);
            }
        },
        || (),
    );
}

/// One more of the program's graphs holds the graph pool `id` of `device` (PyTorch's
/// `CUDAGraph::capture_begin`, told by the C++ allocator for PyTorch's `beginAllocateToPool`):
/// from now on the program's references, not its graph objects, say when the pool's graphs let
/// go (Note [The program's graph references] in the shim's `process`). Returns the program's
/// references to it.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_graph_pool_retain(device: c_int, id: u64) -> c_int {
    guarded(
        "cachealloc_graph_pool_retain",
        || process::shim().map_or(0, |s| s.graph_pool_retain((id, device)) as c_int),
        || 0,
    )
}

/// One of the program's graphs let go of the graph pool `id` of `device` (PyTorch's
/// `CUDAGraph::reset`, through `releasePool`). Returns the program's references left; at zero,
/// with no capture or executable graph using it, the pool's memory goes.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_graph_pool_release(device: c_int, id: u64) -> c_int {
    guarded(
        "cachealloc_graph_pool_release",
        || process::shim().map_or(0, |s| s.graph_pool_release((id, device)) as c_int),
        || 0,
    )
}

/// `MemPool(use_on_oom=True)`: see [`cachealloc_mem_pool_retain`].
pub const MEM_POOL_USE_ON_OOM: c_uint = 1;
/// `MemPool(no_split=True)`: see [`cachealloc_mem_pool_retain`].
pub const MEM_POOL_NO_SPLIT: c_uint = 2;

/// Make the private pool `id` of `device` if it does not exist — with `flags`
/// ([`MEM_POOL_USE_ON_OOM`], [`MEM_POOL_NO_SPLIT`]) and, when both are non-null, segments from
/// `alloc` and `free` (a `CUDAPluggableAllocator`'s functions) — and add a reference to it
/// (PyTorch's `createOrIncrefPool`; see Note [PyTorch MemPools] in the shim's `process`). Returns the
/// pool's use count, or -1 when the library does not pool. Called by the Python integration's
/// `MemPool`.
///
/// # Safety
/// `alloc` and `free` are null, or functions with the signatures of PyTorch's pluggable
/// allocator (`void* alloc(ssize_t, int, cudaStream_t)`, `void free(void*, ssize_t, int,
/// cudaStream_t)`) that stay loaded while the pool has memory.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_mem_pool_retain(
    device: c_int,
    id: u64,
    flags: c_uint,
    alloc: *const c_void,
    free: *const c_void,
) -> c_int {
    let foreign = (!alloc.is_null() && !free.is_null()).then(|| {
        // SAFETY: non-null, and the caller's contract gives them these signatures.
        unsafe {
            crate::backend::ForeignAllocator::Pluggable {
                alloc: std::mem::transmute::<
                    *const c_void,
                    unsafe extern "C" fn(isize, c_int, *mut c_void) -> *mut c_void,
                >(alloc),
                free: std::mem::transmute::<
                    *const c_void,
                    unsafe extern "C" fn(*mut c_void, isize, c_int, *mut c_void),
                >(free),
            }
        }
    });
    mem_pool_retain(device, id, flags, foreign)
}

/// [`cachealloc_mem_pool_retain`] with the pool's segments from `alloc` and `free`, which take
/// `context` first: `void* alloc(void* context, ssize_t size, int device, cudaStream_t stream)`,
/// `void free(void* context, void* ptr, ssize_t size, int device, cudaStream_t stream)`. How the
/// C++ allocator for PyTorch gives a pool any of PyTorch's allocator objects (a `MemPool` over
/// the NCCL process group's `mem_allocator`).
///
/// # Safety
/// `alloc` and `free` have those signatures and, with `context`, stay valid for the rest of the
/// process.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_mem_pool_retain_with_context(
    device: c_int,
    id: u64,
    flags: c_uint,
    alloc: Option<unsafe extern "C" fn(*mut c_void, isize, c_int, *mut c_void) -> *mut c_void>,
    free: Option<unsafe extern "C" fn(*mut c_void, *mut c_void, isize, c_int, *mut c_void)>,
    context: *mut c_void,
) -> c_int {
    let (Some(alloc), Some(free)) = (alloc, free) else {
        return -1;
    };
    let foreign = crate::backend::ForeignAllocator::WithContext {
        alloc,
        free,
        context: context as usize,
    };
    mem_pool_retain(device, id, flags, Some(foreign))
}

fn mem_pool_retain(
    device: c_int,
    id: u64,
    flags: c_uint,
    foreign: Option<crate::backend::ForeignAllocator>,
) -> c_int {
    let settings = process::PoolSettings {
        use_on_oom: flags & MEM_POOL_USE_ON_OOM != 0,
        no_split: flags & MEM_POOL_NO_SPLIT != 0,
        foreign,
        for_graphs: false,
    };
    guarded(
        "cachealloc_mem_pool_retain",
        || match process::shim().filter(|s| s.pooling()) {
            Some(shim) => shim
                .mem_pool_retain((id, device), settings)
                .map_or(-1, |n| n as c_int),
            None => -1,
        },
        || -1,
    )
}

/// Take back a reference to the private pool `id` of `device` (PyTorch's `releasePool`).
/// Returns the use count left; at zero, with no graph using it, the pool's memory goes.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_mem_pool_release(device: c_int, id: u64) -> c_int {
    guarded(
        "cachealloc_mem_pool_release",
        || process::shim().map_or(0, |s| s.mem_pool_release((id, device)) as c_int),
        || 0,
    )
}

/// The use count (references) of the private pool `id` of `device`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_mem_pool_use_count(device: c_int, id: u64) -> c_int {
    guarded(
        "cachealloc_mem_pool_use_count",
        || process::shim().map_or(0, |s| s.mem_pool_use_count((id, device)) as c_int),
        || 0,
    )
}

/// The calling thread's allocations on `device` go to the private pool `id` until
/// [`cachealloc_mem_pool_end_thread`] (PyTorch's `beginAllocateCurrentThreadToPool`; adds a
/// reference, which [`cachealloc_mem_pool_release`] takes back). Returns 0, or
/// `cudaErrorInitializationError` when the library does not pool.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_mem_pool_begin_thread(device: c_int, id: u64) -> CudaError {
    guarded(
        "cachealloc_mem_pool_begin_thread",
        || match process::shim().filter(|s| s.pooling()) {
            Some(shim) => match shim.mem_pool_begin_thread((id, device)) {
                Ok(()) => cuda::SUCCESS,
                Err(code) => code,
            },
            None => cuda::ERROR_INITIALIZATION,
        },
        || cuda::ERROR_INITIALIZATION,
    )
}

/// The calling thread stops allocating to the private pool `id` of `device` (PyTorch's
/// `endAllocateToPool`).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_mem_pool_end_thread(device: c_int, id: u64) {
    guarded(
        "cachealloc_mem_pool_end_thread",
        || {
            if let Some(shim) = process::shim() {
                shim.mem_pool_end_thread((id, device));
            }
        },
        || (),
    );
}

/// Write the segments of every pool of `device` now (the ordinary pool, graph pools and
/// `MemPool`s) — a JSON list of PyTorch's snapshot `segments`, each with its blocks — into
/// `buf`, as [`cachealloc_stats_json`] writes its text. What `torch.cuda.memory_snapshot()`
/// returns under the shim when there is no trace to build it from (`trace:off`).
///
/// # Safety
/// `buf` must be null or valid for `len` bytes of writes.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_snapshot_json(
    device: c_int,
    buf: *mut c_char,
    len: usize,
) -> usize {
    let text = guarded(
        "cachealloc_snapshot_json",
        || process::shim().map_or_else(|| "[]".to_string(), |s| s.pool_segments_json(device, None)),
        || "[]".to_string(),
    );
    // SAFETY: the caller's contract.
    unsafe { write_text(&text, buf, len) }
}

/// Write the segments of the private pool `id` of `device` now — a JSON list of PyTorch's
/// snapshot `segments`, each with its blocks — into `buf`, as [`cachealloc_stats_json`]
/// writes its text. What `MemPool.snapshot()` returns under the shim.
///
/// # Safety
/// `buf` must be null or valid for `len` bytes of writes.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_mem_pool_snapshot_json(
    device: c_int,
    id: u64,
    buf: *mut c_char,
    len: usize,
) -> usize {
    let text = guarded(
        "cachealloc_mem_pool_snapshot_json",
        || {
            process::shim().map_or_else(
                || "[]".to_string(),
                |s| s.mem_pool_snapshot_json((id, device)),
            )
        },
        || "[]".to_string(),
    );
    // SAFETY: the caller's contract.
    unsafe { write_text(&text, buf, len) }
}

/// An out-of-memory observer: `(device, requested bytes, the device's limit, its free bytes)`.
pub type OomObserver = extern "C" fn(c_int, u64, u64, u64);

fn oom_observers() -> &'static std::sync::Mutex<Vec<OomObserver>> {
    static OBSERVERS: std::sync::OnceLock<std::sync::Mutex<Vec<OomObserver>>> =
        std::sync::OnceLock::new();
    OBSERVERS.get_or_init(Default::default)
}

/// Call every attached observer (what [`process::OOM_OBSERVERS`] holds once one is attached).
fn notify_oom_observers(device: i32, size: u64, limit: u64, free: u64) {
    let observers = oom_observers()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    for observer in observers {
        // No panic or unwinding crosses back: the observer is C (a ctypes callback catches
        // Python's exceptions itself).
        observer(device, size, limit, free);
    }
}

/// Call `observer` whenever an allocation fails for lack of memory, before the failure is
/// returned (PyTorch's `_cuda_attach_out_of_memory_observer`, served through the Python
/// integration): with the device, the request's bytes, the device's limit and its free bytes.
/// The observer must not allocate device memory through the pools of the failing device.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_attach_oom_observer(observer: Option<OomObserver>) -> CudaError {
    let Some(observer) = observer else {
        return cuda::ERROR_INVALID_VALUE;
    };
    guarded(
        "cachealloc_attach_oom_observer",
        || {
            oom_observers()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(observer);
            let _ = process::OOM_OBSERVERS.set(notify_oom_observers);
            cuda::SUCCESS
        },
        || cuda::ERROR_INITIALIZATION,
    )
}

/// Call `tracker` with every segment event of the pools from now on: `(action, device, address,
/// size, pool)`, `action` 1 (a segment allocated), 2 (a segment leaving the pools, before it is
/// freed), 3 (memory mapped into an expandable segment) or 4 (unmapped), `pool` 0 for the
/// device's own pool, else the private pool's id (PyTorch's `attachAllocatorTraceTracker`,
/// served through the C++ allocator for PyTorch; see Note [Segment trackers]). The tracker
/// runs outside the pools' lock and may allocate device memory; it must not unwind.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_attach_segment_tracker(
    tracker: Option<crate::backend::trackers::SegmentTracker>,
) -> CudaError {
    let Some(tracker) = tracker else {
        return cuda::ERROR_INVALID_VALUE;
    };
    guarded(
        "cachealloc_attach_segment_tracker",
        || {
            crate::backend::trackers::attach(tracker);
            cuda::SUCCESS
        },
        || cuda::ERROR_INITIALIZATION,
    )
}

/// The `backward()` announced by [`cachealloc_backward_begin`] returned.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_backward_end(token: c_uint) {
    guarded(
        "cachealloc_backward_end",
        || {
            if let Some(shim) = process::started_shim() {
                shim.backward_end(token);
            }
            cuda::SUCCESS
        },
        || cuda::SUCCESS,
    );
}

/// PyTorch `CUDAPluggableAllocator` allocation entry point.
///
/// # Safety
/// None: plain values in, a device pointer (or NULL on failure) out.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_torch_malloc(
    size: isize,
    device: c_int,
    stream: CudaStream,
) -> *mut c_void {
    let size = size.max(0) as u64;
    let stream = stream as usize;
    match guarded(
        "cachealloc_torch_malloc",
        || hooks::torch_malloc(size, device, stream),
        || crate::real::runtime::malloc(size),
    ) {
        Ok(address) => address as *mut c_void,
        Err(_) => std::ptr::null_mut(),
    }
}

/// PyTorch `CUDAPluggableAllocator` free entry point.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_torch_free(
    ptr: *mut c_void,
    _size: isize,
    _device: c_int,
    stream: CudaStream,
) {
    let stream = stream as usize;
    guarded(
        "cachealloc_torch_free",
        || hooks::torch_free(ptr as u64, stream),
        || cuda::SUCCESS,
    );
}

/// What `cachealloc_free_async` answers for memory that is not in the library's pools.
pub const NOT_POOLED: c_int = -1;

/// `cudaFreeAsync(ptr, stream)` for a block of the library's pools, as the interposed
/// `cudaFreeAsync` does it; [`NOT_POOLED`] (nothing done) for any other pointer. For the C++
/// allocator for PyTorch: its free needs the block's device current (a `CUDAGuard`, two calls
/// into the runtime and PyTorch's checks) only for memory CUDA frees, so it asks here first.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_free_async(ptr: *mut c_void, stream: CudaStream) -> c_int {
    let stream = stream as usize;
    // After an internal failure the pointer may be pooled: leaking it is safe, handing a
    // sub-block to CUDA is not.
    let freed = guarded(
        "cachealloc_free_async",
        || hooks::pooled_free_async(ptr as u64, stream),
        || Some(cuda::SUCCESS),
    );
    freed.map_or(NOT_POOLED, |code| code.0)
}
