//! The driver's door: what each wrapped driver function does, in safe Rust. The wrappers in
//! [`crate::ffi::driver`] convert the C arguments and pass the real call as a closure, used for
//! everything that is not ours.
//!
//! Every hook first asks [`symbols::bypass_driver_hooks`]: a driver call the runtime makes while
//! the shim is calling into it belongs to a request the shim already handled, and goes straight
//! to the driver, as every driver call does with `driver_doors:off`. Allocations are pooled only in a device's primary context (the runtime's); the
//! current context decides the device ([`crate::gpu::contexts::current_context`]).

use cachealloc_core::NO_STREAM;

use crate::cuda::driver::{self as codes, CuResult};
use crate::cuda::{self, CudaError};
use crate::gpu::contexts::CurrentContext;
use crate::log;
use crate::process::{self, PooledBlock};
use crate::real::driver::call_driver;
use crate::symbols::{self, Door};

/// A stream argument of a driver call.
#[derive(Clone, Copy, Debug)]
pub struct StreamArg {
    /// The handle as given.
    pub handle: usize,
    /// Whether the call is a `_ptsz` variant, where NULL names the per-thread default stream.
    pub per_thread_default: bool,
}

impl StreamArg {
    /// The handle as the runtime would name the same stream (NULL in a `_ptsz` call is
    /// `cudaStreamPerThread`).
    fn runtime_handle(self) -> usize {
        if self.per_thread_default && self.handle == 0 {
            cuda::STREAM_PER_THREAD
        } else {
            self.handle
        }
    }
}

/// `cuMemAlloc_v2` (no stream) or `cuMemAllocAsync*`, which came through `door`.
pub fn mem_alloc(
    door: Door,
    size: u64,
    stream: Option<StreamArg>,
    real: impl FnOnce() -> Result<u64, CuResult>,
) -> Result<u64, CuResult> {
    if symbols::bypass_driver_hooks() {
        return real();
    }
    symbols::count(door);
    let Some(shim) = process::shim() else {
        return real();
    };
    if !shim.pooling() {
        return shim.passthrough_malloc(size, real);
    }
    if size == 0 {
        return real(); // the driver's own answer to a zero-byte request
    }
    let key = match stream.map(StreamArg::runtime_handle) {
        // On a capturing stream: the capture's private pool (Note [Capture pools]).
        Some(handle) if shim.is_capturing(handle) => {
            return match shim.capture_malloc(handle, size) {
                Some(result) => result.map_err(CudaError::to_driver),
                None => real(),
            };
        }
        Some(handle) => shim.stream_key(handle),
        None => NO_STREAM,
    };
    match shim.current_context() {
        CurrentContext::Primary(device) => shim
            .malloc_on(device, size, key)
            .map_err(CudaError::to_driver),
        CurrentContext::Other => {
            shim.note_unpooled_context();
            real()
        }
        CurrentContext::None => real(), // the driver says what is wrong
    }
}

/// `cuMemFree_v2` (no stream) or `cuMemFreeAsync*`: a pooled pointer returns to its pool;
/// anything else — allocated before us, in another context, by a graph, from the driver's own
/// pools — goes to the driver.
pub fn mem_free(
    address: u64,
    stream: Option<StreamArg>,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    if symbols::bypass_driver_hooks() || address == 0 {
        return real();
    }
    if let Some(shim) = process::shim() {
        let freed = match stream.map(StreamArg::runtime_handle) {
            Some(handle) if shim.is_capturing(handle) => shim.free_in_capture(address, handle),
            Some(handle) => shim.free(address, shim.stream_key(handle)),
            None => shim.free(address, NO_STREAM),
        };
        if let Some(code) = freed {
            return code.to_driver();
        }
        shim.passthrough_free(address);
    }
    real()
}

/// `cuMemGetInfo_v2`: our cached free bytes of the current context's device count as free.
pub fn mem_get_info(
    real: impl FnOnce() -> Result<(u64, u64), CuResult>,
) -> Result<(u64, u64), CuResult> {
    let (free, total) = real()?;
    if symbols::bypass_driver_hooks() {
        return Ok((free, total));
    }
    let cached = process::started_shim().map_or(0, |shim| match shim.current_context() {
        CurrentContext::Primary(device) => shim.cached_free_bytes_on(device),
        _ => 0,
    });
    Ok((free.saturating_add(cached).min(total), total))
}

/// For `cuMemGetAddressRange_v2` and `cuPointerGetAttribute(s)`: the live allocation
/// containing `address` if it is ours, an error for an address in our segments that is not live
/// (a freed block), `None` to ask the driver.
pub fn pooled_block(address: u64) -> Option<Result<PooledBlock, CuResult>> {
    if symbols::bypass_driver_hooks() {
        return None;
    }
    let shim = process::started_shim()?;
    shim.pooled_block(address)
        .map(|r| r.map_err(|()| codes::ERROR_INVALID_VALUE))
}

/// `cuIpcGetMemHandle`: for a pooled block the driver cannot name, a handle of ours (Note
/// [CUDA's IPC handles for pooled blocks]), or why not; `None`: the driver's to give.
pub fn ipc_get_mem_handle(address: u64) -> Option<Result<[u8; 64], CuResult>> {
    if symbols::bypass_driver_hooks() {
        return None;
    }
    match process::shim()?.ipc_handle(address) {
        Ok(ours) => ours.map(Ok),
        Err(why) => {
            log::error!(
                "{}",
                why.replace("cudaIpcGetMemHandle", "cuIpcGetMemHandle")
            );
            Some(Err(codes::ERROR_INVALID_VALUE))
        }
    }
}

/// `cuIpcOpenMemHandle`: a handle of ours opened by the shim (`None`: the driver's to open).
pub fn ipc_open_mem_handle(handle: &[u8; 64]) -> Option<Result<u64, CuResult>> {
    if symbols::bypass_driver_hooks() {
        return None;
    }
    crate::process::handle_open(handle).map(|r| r.map_err(|_| codes::ERROR_INVALID_VALUE))
}

/// `cuIpcCloseMemHandle`: a block opened through a handle of ours unmapped (`None`: the
/// driver's to close).
pub fn ipc_close_mem_handle(address: u64) -> Option<CuResult> {
    if symbols::bypass_driver_hooks() {
        return None;
    }
    crate::process::handle_close(address).map(|code| {
        if code == cuda::SUCCESS {
            codes::SUCCESS
        } else {
            codes::ERROR_INVALID_VALUE
        }
    })
}

/// `cuStreamCreate*`: a stream of a primary context becomes visible to the fences.
pub fn stream_create(
    flags: u32,
    real: impl FnOnce() -> Result<usize, CuResult>,
) -> Result<usize, CuResult> {
    let stream = real()?;
    if !symbols::bypass_driver_hooks()
        && let Some(shim) = process::shim()
        && let CurrentContext::Primary(device) = shim.current_context()
    {
        shim.stream_created_on(device, stream, flags);
    }
    Ok(stream)
}

/// `cuStreamDestroy_v2`.
pub fn stream_destroy(stream: usize, real: impl FnOnce(usize) -> CuResult) -> CuResult {
    if symbols::bypass_driver_hooks() {
        return real(stream);
    }
    super::runtime::stream_destroy_with(
        stream,
        // Handle from the application, validated by the driver.
        |s| call_driver!(cuStreamSynchronize(s as codes::Handle)),
        real,
    )
}

/// `cuStreamBeginCapture_v2*`.
pub fn stream_begin_capture(stream: StreamArg, real: impl FnOnce() -> CuResult) -> CuResult {
    if symbols::bypass_driver_hooks() {
        return real();
    }
    super::runtime::stream_begin_capture(stream.runtime_handle(), real)
}

/// `cuStreamEndCapture*`: `made` reads the graph the real call wrote.
pub fn stream_end_capture(
    stream: StreamArg,
    real: impl FnOnce() -> CuResult,
    made: impl FnOnce() -> usize,
) -> CuResult {
    if symbols::bypass_driver_hooks() {
        return real();
    }
    let code = real();
    let graph = (code == codes::SUCCESS).then(made);
    super::runtime::capture_ended(stream.runtime_handle(), graph);
    code
}

/// `cuCtxEnablePeerAccess(peer_context)`: the current context's device may now use the memory
/// of `peer_context`'s device, the memory mapped for expandable segments too.
pub fn ctx_enable_peer_access(peer_context: usize, real: impl FnOnce() -> CuResult) -> CuResult {
    let code = real();
    if code == codes::SUCCESS
        && !symbols::bypass_driver_hooks()
        && let Some(shim) = process::shim()
    {
        shim.peer_context_enabled(peer_context);
    }
    code
}

/// `cuDevicePrimaryCtxReset_v2`: the device's memory is gone; forget its pools.
pub fn primary_context_reset(device: i32, real: impl FnOnce() -> CuResult) -> CuResult {
    let code = real();
    if code == codes::SUCCESS
        && !symbols::bypass_driver_hooks()
        && let Some(shim) = process::started_shim()
    {
        shim.device_reset_of(device);
    }
    code
}
