//! Every symbol `libcachealloc.so` exports: the interposed CUDA runtime functions and the C API.
//!
//! Each function converts its C arguments, calls safe code in [`crate::hooks`] inside
//! `guarded` (no panic crosses the ABI: a panic degrades the shim to passthrough with one
//! message), and writes the results through the caller's out-pointers.
//!
//! Exports are `#[cfg_attr(not(test), unsafe(no_mangle))]`, so the crate's own unit-test binary
//! does not interpose itself.

// The exported names are CUDA's.
#![allow(non_snake_case)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::cuda::{self, CudaError, CudaStream, IpcMemHandle};
use crate::{hooks, process};

/// What a hook returns when even its fallback panicked.
trait OnPanic {
    fn on_panic() -> Self;
}

impl OnPanic for CudaError {
    fn on_panic() -> Self {
        cuda::ERROR_INITIALIZATION
    }
}

impl<T> OnPanic for Result<T, CudaError> {
    fn on_panic() -> Self {
        Err(cuda::ERROR_INITIALIZATION)
    }
}

impl OnPanic for String {
    fn on_panic() -> Self {
        String::new()
    }
}

/// Run `body`; if it panics, degrade to passthrough (once, with a message) and return
/// `fallback()` — itself guarded, so that no panic ever crosses the ABI.
fn guarded<T: OnPanic>(what: &str, body: impl FnOnce() -> T, fallback: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(_) => {
            process::degrade(what);
            catch_unwind(AssertUnwindSafe(fallback)).unwrap_or_else(|_| T::on_panic())
        }
    }
}

/// Write `value` to `out` if the pointer is not null.
///
/// # Safety
/// `out` must be null or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: non-null and valid for a write, per the caller's contract.
        unsafe { out.write(value) };
    }
}

/// Write an allocation result: the pointer on success, NULL on failure (as the runtime does).
///
/// # Safety
/// `dev_ptr` must be valid for a write.
unsafe fn put_allocation(dev_ptr: *mut *mut c_void, result: Result<u64, CudaError>) -> CudaError {
    let (ptr, code) = match result {
        Ok(address) => (address as *mut c_void, cuda::SUCCESS),
        Err(code) => (std::ptr::null_mut(), code),
    };
    // SAFETY: forwarded from the caller.
    unsafe { put(dev_ptr, ptr) };
    code
}

/// `cudaMalloc`, served from the current device's pool.
///
/// # Safety
/// `dev_ptr` must be valid for a write of a pointer (CUDA's contract).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: usize) -> CudaError {
    if dev_ptr.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    let result = guarded(
        "cudaMalloc",
        || hooks::malloc(size as u64),
        || crate::real::malloc(size as u64),
    );
    // SAFETY: checked non-null; valid for a write per CUDA's contract.
    unsafe { put_allocation(dev_ptr, result) }
}

/// `cudaFree`: a pooled pointer returns to its pool; anything else goes to the runtime.
///
/// # Safety
/// None beyond CUDA's: the pointer is only compared, never dereferenced.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaFree(dev_ptr: *mut c_void) -> CudaError {
    // After an internal failure the pointer may be pooled: leaking it is safe, handing a
    // sub-block to the real cudaFree is not.
    guarded("cudaFree", || hooks::free(dev_ptr as u64), || cuda::SUCCESS)
}

/// `cudaMallocAsync`: passed through.
///
/// # Safety
/// `dev_ptr` must be valid for a write of a pointer.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaMallocAsync(
    dev_ptr: *mut *mut c_void,
    size: usize,
    stream: CudaStream,
) -> CudaError {
    if dev_ptr.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    let stream = stream as usize;
    let result = guarded(
        "cudaMallocAsync",
        || hooks::malloc_async(size as u64, stream),
        || crate::real::malloc_async(size as u64, stream),
    );
    // SAFETY: checked non-null; valid for a write per CUDA's contract.
    unsafe { put_allocation(dev_ptr, result) }
}

/// `cudaFreeAsync`: a pooled pointer returns to its pool; anything else goes to the runtime.
///
/// # Safety
/// None beyond CUDA's: the pointer is only compared.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaFreeAsync(dev_ptr: *mut c_void, stream: CudaStream) -> CudaError {
    let stream = stream as usize;
    guarded(
        "cudaFreeAsync",
        || hooks::free_async(dev_ptr as u64, stream),
        || cuda::SUCCESS,
    )
}

/// `cudaMemGetInfo`, counting our cached free bytes as free.
///
/// # Safety
/// `free` and `total` must each be null or valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaMemGetInfo(free: *mut usize, total: *mut usize) -> CudaError {
    let result = guarded(
        "cudaMemGetInfo",
        hooks::mem_get_info,
        crate::real::mem_get_info,
    );
    match result {
        Ok((f, t)) => {
            // SAFETY: null or valid for a write, per the caller's contract.
            unsafe {
                put(free, f as usize);
                put(total, t as usize);
            }
            cuda::SUCCESS
        }
        Err(code) => code,
    }
}

/// `cudaDeviceReset`: resets, then forgets the device's pools.
///
/// # Safety
/// None beyond CUDA's.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaDeviceReset() -> CudaError {
    guarded(
        "cudaDeviceReset",
        hooks::device_reset,
        crate::real::device_reset,
    )
}

/// Shared body of the stream-creation hooks.
///
/// # Safety
/// `stream` must be valid for a write.
unsafe fn create_stream(stream: *mut CudaStream, flags: u32, priority: Option<i32>) -> CudaError {
    if stream.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    let result = guarded(
        "cudaStreamCreate",
        || hooks::stream_create(flags, priority),
        || crate::real::stream_create(flags, priority),
    );
    // SAFETY: checked non-null; valid for a write per CUDA's contract.
    unsafe { put_allocation(stream.cast(), result.map(|s| s as u64)) }
}

/// `cudaStreamCreate`, noting the stream for fences.
///
/// # Safety
/// `stream` must be valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaStreamCreate(stream: *mut CudaStream) -> CudaError {
    // SAFETY: forwarded contract.
    unsafe { create_stream(stream, 0, None) }
}

/// `cudaStreamCreateWithFlags`, noting the stream for fences.
///
/// # Safety
/// `stream` must be valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaStreamCreateWithFlags(
    stream: *mut CudaStream,
    flags: c_uint,
) -> CudaError {
    // SAFETY: forwarded contract.
    unsafe { create_stream(stream, flags, None) }
}

/// `cudaStreamCreateWithPriority`, noting the stream for fences.
///
/// # Safety
/// `stream` must be valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaStreamCreateWithPriority(
    stream: *mut CudaStream,
    flags: c_uint,
    priority: c_int,
) -> CudaError {
    // SAFETY: forwarded contract.
    unsafe { create_stream(stream, flags, Some(priority)) }
}

/// `cudaStreamDestroy`.
///
/// # Safety
/// None beyond CUDA's.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaStreamDestroy(stream: CudaStream) -> CudaError {
    let handle = stream as usize;
    guarded(
        "cudaStreamDestroy",
        || hooks::stream_destroy(handle),
        || crate::real::stream_destroy(handle),
    )
}

/// `cudaIpcGetMemHandle`: refused (with a message) for pointers inside pooled segments.
///
/// # Safety
/// `handle` must be valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaIpcGetMemHandle(
    handle: *mut IpcMemHandle,
    dev_ptr: *mut c_void,
) -> CudaError {
    if handle.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    let address = dev_ptr as u64;
    match guarded(
        "cudaIpcGetMemHandle",
        || hooks::ipc_get_mem_handle(address),
        || Err(cuda::ERROR_INVALID_VALUE),
    ) {
        Ok(bytes) => {
            // SAFETY: checked non-null; valid for a write per CUDA's contract.
            unsafe { put(handle, IpcMemHandle { reserved: bytes }) };
            cuda::SUCCESS
        }
        Err(code) => code,
    }
}

// ----- the C API ---------------------------------------------------------------------------

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
pub extern "C" fn cachealloc_empty_cache() -> c_int {
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
pub unsafe extern "C" fn cachealloc_annotate(name: *const c_char) -> c_int {
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

/// PyTorch `CUDAPluggableAllocator` allocation entry point.
///
/// # Safety
/// None: plain values in, a device pointer (or NULL on failure) out.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_torch_malloc(
    size: isize,
    device: c_int,
    _stream: CudaStream,
) -> *mut c_void {
    let size = size.max(0) as u64;
    match guarded(
        "cachealloc_torch_malloc",
        || hooks::torch_malloc(size, device),
        || crate::real::malloc(size),
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
    _stream: CudaStream,
) {
    guarded(
        "cachealloc_torch_free",
        || hooks::torch_free(ptr as u64),
        || cuda::SUCCESS,
    );
}
