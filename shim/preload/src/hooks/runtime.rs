//! The runtime's hooks: what each interposed runtime function does, in safe Rust — pool or pass
//! through. [`crate::ffi::runtime`] converts the C arguments and calls these; the driver's hooks
//! are [`super::driver`] (see [`crate::symbols`] for the doors).

use crate::cuda::{self, CudaError, ResultCode};
use crate::log;
use crate::process;
use crate::real::runtime as real;
use crate::symbols::{self, Door};
use cachealloc_core::NO_STREAM;

/// `cudaMalloc`.
pub fn malloc(size: u64) -> Result<u64, CudaError> {
    symbols::count(Door::Runtime);
    match process::shim() {
        Some(shim) if shim.pooling() => shim.malloc(size, NO_STREAM),
        Some(shim) => shim.passthrough_malloc(size, || real::malloc(size)),
        None => real::malloc(size),
    }
}

/// `cudaFree`. `cudaFree(NULL)` — the usual way to initialize a context — goes to the runtime.
pub fn free(address: u64) -> CudaError {
    if address != 0
        && let Some(shim) = process::shim()
    {
        if let Some(code) = shim.free(address, NO_STREAM) {
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

/// `cudaMallocAsync`: served from the pool of `stream` (see Note [Stream-ordered reuse] in
/// `cachealloc-core`); on a stream that is capturing a CUDA graph, from the capture's private
/// pool (Note [Capture pools] in the shim's `process`).
pub fn malloc_async(size: u64, stream: usize) -> Result<u64, CudaError> {
    symbols::count(Door::Runtime);
    match process::shim() {
        Some(shim) if shim.pooling() => {
            if shim.is_capturing(stream) {
                match shim.capture_malloc(stream, size) {
                    Some(result) => result,
                    None => real::malloc_async(size, stream),
                }
            } else {
                shim.malloc(size, shim.stream_key(stream))
            }
        }
        _ => real::malloc_async(size, stream),
    }
}

/// `cudaFreeAsync`: a pooled pointer returns to its pool, reusable at once on its own stream
/// when freed there, else behind a fence (a free captured into a graph counts as a synchronous
/// free); anything else — graph memory, the runtime's own pools — goes to the runtime.
pub fn free_async(address: u64, stream: usize) -> CudaError {
    if let Some(code) = pooled_free_async(address, stream) {
        return code;
    }
    if address != 0
        && let Some(shim) = process::shim()
    {
        shim.passthrough_free(address);
    }
    real::free_async(address, stream)
}

/// The pools' part of `cudaFreeAsync`: `None` when `address` is not a block of the pools (the
/// caller frees it through CUDA). `cachealloc_free_async`, for the C++ allocator for PyTorch,
/// which then needs no device guard for the library's blocks.
pub fn pooled_free_async(address: u64, stream: usize) -> Option<CudaError> {
    if address == 0 {
        return None;
    }
    let shim = process::shim()?;
    if shim.is_capturing(stream) {
        shim.free_in_capture(address, stream)
    } else {
        shim.free(address, shim.stream_key(stream))
    }
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

/// `cudaDeviceEnablePeerAccess(peer)`: the current device may now use `peer`'s memory, the
/// memory mapped for expandable segments too.
pub fn device_enable_peer_access(peer: i32, flags: u32) -> CudaError {
    let code = real::device_enable_peer_access(peer, flags);
    if code == cuda::SUCCESS
        && let Some(shim) = process::shim()
    {
        shim.peer_access_enabled(peer);
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

/// `cudaStreamDestroy`. In pool mode the stream is synchronized first: its free blocks stay in
/// the pool under its handle, which a stream created later may get again, and that stream's
/// work must not overlap this one's.
pub fn stream_destroy(stream: usize) -> CudaError {
    stream_destroy_with(stream, real::stream_synchronize, real::stream_destroy)
}

/// `cudaStreamDestroy` or `cuStreamDestroy_v2`, with the matching real functions.
pub fn stream_destroy_with<C: ResultCode>(
    stream: usize,
    synchronize: impl FnOnce(usize) -> C,
    destroy: impl FnOnce(usize) -> C,
) -> C {
    if let Some(shim) = process::shim() {
        if shim.pooling() {
            let _ = synchronize(stream);
        }
        shim.stream_destroyed(stream);
    }
    destroy(stream)
}

/// `cudaStreamBeginCapture` (or `cuStreamBeginCapture*`, with its real function): noted, after a
/// barrier fence, so that allocations on the capturing stream go to the graph and our fences
/// leave the stream alone.
pub fn stream_begin_capture<C: ResultCode>(stream: usize, real: impl FnOnce() -> C) -> C {
    let shim = process::shim();
    if let Some(shim) = shim {
        shim.capture_beginning(stream);
    }
    let code = real();
    if let Some(shim) = shim {
        if code.is_success() {
            shim.capture_started(stream);
        } else {
            shim.capture_ended(stream, None);
        }
    }
    code
}

/// `cudaStreamEndCapture`: the capture is over, whether it succeeded (making a graph) or not.
pub fn stream_end_capture(
    stream: usize,
    real: impl FnOnce() -> Result<usize, CudaError>,
) -> Result<usize, CudaError> {
    let result = real();
    capture_ended(stream, result.ok());
    result
}

/// The capture on `stream` ended, through either API, making `graph` if it succeeded.
pub fn capture_ended(stream: usize, graph: Option<usize>) {
    if let Some(shim) = process::shim() {
        shim.capture_ended(stream, graph);
    }
}

/// `cudaGraphInstantiate*`, after the runtime made `exec` from `graph`: the executable graph
/// holds the graph's capture pool too.
pub fn graph_instantiated(graph: usize, exec: usize) {
    if let Some(shim) = process::started_shim() {
        shim.graph_instantiated(graph, exec);
    }
}

/// `cudaGraphDestroy` or `cudaGraphExecDestroy` of `handle` (called before the real call):
/// it no longer holds its capture pool.
pub fn graph_destroyed(handle: usize) {
    if let Some(shim) = process::started_shim() {
        shim.graph_destroyed(handle);
    }
}

/// `cudaDeviceGetDefaultMemPool`: noted, since PyTorch reads its memory statistics from this
/// pool's attributes.
pub fn device_get_default_mem_pool(device: i32) -> Result<usize, CudaError> {
    let pool = real::default_mem_pool(device)?;
    if let Some(shim) = process::shim() {
        shim.note_default_pool(pool, device);
    }
    Ok(pool)
}

/// `cudaMemPoolGetAttribute` on a device's default pool: the memory in use and reserved, and
/// their peaks, are our pools' stream-ordered memory (what PyTorch's `memory_allocated()`,
/// `memory_reserved()` and their maxima read). `None`: ask the runtime.
pub fn mem_pool_get_attribute(pool: usize, attribute: i32) -> Option<u64> {
    let shim = process::shim()?;
    let stats = shim.pytorch_device_stats(shim.default_pool_device(pool)?)?;
    let value = match attribute {
        cuda::MEMPOOL_ATTR_RESERVED_MEM_CURRENT => stats.reserved_bytes.all.current,
        cuda::MEMPOOL_ATTR_RESERVED_MEM_HIGH => stats.reserved_bytes.all.peak,
        cuda::MEMPOOL_ATTR_USED_MEM_CURRENT => stats.allocated_bytes.all.current,
        cuda::MEMPOOL_ATTR_USED_MEM_HIGH => stats.allocated_bytes.all.peak,
        _ => return None,
    };
    Some(value.max(0) as u64)
}

/// `cudaMemPoolSetAttribute`, after the runtime accepted it: resetting a default pool's peak
/// (`reset_peak_memory_stats`) resets our peaks.
pub fn mem_pool_attribute_set(pool: usize, attribute: i32) {
    if matches!(
        attribute,
        cuda::MEMPOOL_ATTR_RESERVED_MEM_HIGH | cuda::MEMPOOL_ATTR_USED_MEM_HIGH
    ) && let Some(shim) = process::shim()
        && let Some(device) = shim.default_pool_device(pool)
    {
        shim.reset_peak_stats(device);
    }
}

/// `cudaMemPoolSetAccess`: on a default pool (PyTorch's `enablePeerAccess` on its
/// `cudaMallocAsync` route), each device given access may use our pool's memory of that device
/// too, as it may the driver's pool's.
pub fn mem_pool_set_access(
    pool: usize,
    descs: &[cuda::MemAccessDesc],
    real: impl FnOnce() -> CudaError,
) -> CudaError {
    let code = real();
    if code == cuda::SUCCESS
        && let Some(shim) = process::shim()
    {
        for desc in descs {
            if desc.location_type == cuda::MEM_LOCATION_TYPE_DEVICE
                && desc.flags != cuda::MEM_ACCESS_NONE
            {
                shim.default_pool_access_granted(pool, desc.location_id);
            }
        }
    }
    code
}

/// `cudaMemPoolTrimTo`: on a default pool (PyTorch's `empty_cache`), our cached free segments
/// of that device are released too; then the runtime trims its own.
pub fn mem_pool_trim_to(pool: usize, min_bytes_to_keep: usize) -> CudaError {
    if let Some(shim) = process::shim()
        && let Some(device) = shim.default_pool_device(pool)
        && let Err(code) = shim.empty_device_cache(device)
    {
        return code;
    }
    real::mem_pool_trim_to(pool, min_bytes_to_keep)
}

/// `cudaIpcGetMemHandle`: the driver's handle where it maps the pooled block from its base (a
/// fixed segment's first block) or the memory is not pooled; else a handle of the shim's (Note
/// [CUDA's IPC handles for pooled blocks]); refused, with a message, for a freed block.
pub fn ipc_get_mem_handle(address: u64) -> Result<[u8; 64], CudaError> {
    if let Some(shim) = process::shim() {
        match shim.ipc_handle(address) {
            Ok(Some(ours)) => return Ok(ours),
            Ok(None) => {}
            Err(why) => {
                log::error!("{why}");
                return Err(cuda::ERROR_INVALID_VALUE);
            }
        }
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

/// `cachealloc_torch_malloc`: an allocation for `stream` on the named device.
pub fn torch_malloc(size: u64, device: i32, stream: usize) -> Result<u64, CudaError> {
    symbols::count(Door::Runtime);
    match process::shim() {
        Some(shim) if shim.pooling() => {
            shim.on_device(device, || shim.malloc(size, shim.stream_key(stream)))?
        }
        _ => real::malloc(size),
    }
}

/// `cachealloc_torch_free`: a free ordered on `stream` (PyTorch frees a block on the stream it
/// was allocated for, after `record_stream` users).
pub fn torch_free(address: u64, stream: usize) -> CudaError {
    if address != 0
        && let Some(shim) = process::shim()
        && let Some(code) = shim.free(address, shim.stream_key(stream))
    {
        return code;
    }
    free(address)
}
