//! What each interposed call does, in safe Rust: pool or pass through. [`crate::ffi`] converts
//! the C arguments and calls these; [`crate::process`] holds the state.

use crate::cuda::{self, CudaError};
use crate::log;
use crate::process;
use crate::real;

/// `cudaMalloc`.
pub fn malloc(size: u64) -> Result<u64, CudaError> {
    match process::shim() {
        Some(shim) if shim.pooling() => shim.malloc(size),
        Some(shim) => shim.passthrough_malloc(size),
        None => real::malloc(size),
    }
}

/// `cudaFree`. `cudaFree(NULL)` — the usual way to initialize a context — goes to the runtime.
pub fn free(address: u64) -> CudaError {
    if address != 0
        && let Some(shim) = process::shim()
    {
        if let Some(code) = shim.free(address) {
            return code;
        }
        shim.passthrough_free(address);
    }
    match real::free(address) {
        // The runtime is unloading (a free from a static destructor at exit): the memory goes
        // with the process anyway.
        cuda::ERROR_CUDART_UNLOADING => cuda::SUCCESS,
        code => code,
    }
}

/// `cudaMallocAsync`: passed through (stream-ordered pools are the runtime's own).
pub fn malloc_async(size: u64, stream: usize) -> Result<u64, CudaError> {
    real::malloc_async(size, stream)
}

/// `cudaFreeAsync`: a pooled pointer is freed into its pool (its reuse then waits for a fence,
/// which orders after the stream's earlier work); anything else goes to the runtime.
pub fn free_async(address: u64, stream: usize) -> CudaError {
    if address != 0
        && let Some(shim) = process::shim()
    {
        if let Some(code) = shim.free(address) {
            return code;
        }
        shim.passthrough_free(address);
    }
    real::free_async(address, stream)
}

/// `cudaMemGetInfo`: our cached free bytes count as free (the application's next `cudaMalloc`
/// gets them), unless `report_cached_as_free:false`.
pub fn mem_get_info() -> Result<(u64, u64), CudaError> {
    let (free, total) = real::mem_get_info()?;
    let cached = process::shim().map_or(0, |s| s.cached_free_bytes());
    Ok((free.saturating_add(cached).min(total), total))
}

/// `cudaDeviceReset`: the context and all its memory are gone; forget the device's pools
/// without freeing anything.
pub fn device_reset() -> CudaError {
    let code = real::device_reset();
    if code == cuda::SUCCESS
        && let Some(shim) = process::shim()
    {
        shim.device_reset();
    }
    code
}

/// `cudaStreamCreate*`.
pub fn stream_create(flags: u32, priority: Option<i32>) -> Result<usize, CudaError> {
    let stream = real::stream_create(flags, priority)?;
    if let Some(shim) = process::shim() {
        shim.stream_created(stream, flags);
    }
    Ok(stream)
}

/// `cudaStreamDestroy`.
pub fn stream_destroy(stream: usize) -> CudaError {
    if let Some(shim) = process::shim() {
        shim.stream_destroyed(stream);
    }
    real::stream_destroy(stream)
}

/// `cudaIpcGetMemHandle`: allowed for a pooled pointer only where the handle maps exactly it
/// (the pointer is its segment's base); refused, with an explanation, inside a segment.
pub fn ipc_get_mem_handle(address: u64) -> Result<[u8; 64], CudaError> {
    if let Some(shim) = process::shim()
        && let Err(why) = shim.ipc_check(address)
    {
        log::error!("{why}");
        return Err(cuda::ERROR_INVALID_VALUE);
    }
    real::ipc_get_mem_handle(address)
}

/// `cachealloc_empty_cache`.
pub fn empty_cache() -> CudaError {
    match process::shim() {
        Some(shim) => shim.empty_cache().err().unwrap_or(cuda::SUCCESS),
        None => cuda::SUCCESS,
    }
}

/// `cachealloc_torch_malloc`: `cudaMalloc` on the named device.
pub fn torch_malloc(size: u64, device: i32) -> Result<u64, CudaError> {
    match process::shim() {
        Some(shim) if shim.pooling() => shim.on_device(device, || shim.malloc(size))?,
        _ => real::malloc(size),
    }
}

/// `cachealloc_torch_free`.
pub fn torch_free(address: u64) -> CudaError {
    free(address)
}
