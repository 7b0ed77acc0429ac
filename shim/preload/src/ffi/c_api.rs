//! The C API: `cachealloc_*` functions for ctypes and applications (the library must be
//! preloaded; `dlsym` them): version, stats as JSON, empty the cache, annotations, the Python
//! integration's backward-pass markers, and PyTorch's `CUDAPluggableAllocator` pair.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

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
unsafe fn write_text(text: &str, buf: *mut c_char, len: usize) -> usize {
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
