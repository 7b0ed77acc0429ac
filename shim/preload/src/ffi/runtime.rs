//! The interposed CUDA runtime functions (`cudaMalloc`, `cudaFreeAsync`, `cudaStreamCreate` …),
//! exported in place of a shared runtime's: each converts its C arguments and calls
//! [`crate::hooks::runtime`] inside `guarded`.

use std::ffi::{c_int, c_uint, c_void};

use super::{guarded, put};
use crate::cuda::{self, CudaError, CudaStream, IpcMemHandle};
use crate::hooks::runtime as hooks;

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
        || crate::real::runtime::malloc(size as u64),
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

/// `cudaMallocAsync`, served from the pool of the stream (passed through while the stream
/// captures a graph).
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
        || crate::real::runtime::malloc_async(size as u64, stream),
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
        crate::real::runtime::mem_get_info,
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
        crate::real::runtime::device_reset,
    )
}

/// `cudaDeviceEnablePeerAccess`: enables, then shares the peer's mapped memory with the current
/// device.
///
/// # Safety
/// None beyond CUDA's.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaDeviceEnablePeerAccess(
    peer_device: c_int,
    flags: c_uint,
) -> CudaError {
    guarded(
        "cudaDeviceEnablePeerAccess",
        || hooks::device_enable_peer_access(peer_device, flags),
        || crate::real::runtime::device_enable_peer_access(peer_device, flags),
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
        || crate::real::runtime::stream_create(flags, priority),
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
        || crate::real::runtime::stream_destroy(handle),
    )
}

/// `cudaStreamBeginCapture`, noting the capture.
///
/// # Safety
/// None beyond CUDA's: the handle is passed on.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaStreamBeginCapture(stream: CudaStream, mode: c_int) -> CudaError {
    let handle = stream as usize;
    guarded(
        "cudaStreamBeginCapture",
        || {
            hooks::stream_begin_capture(handle, || {
                crate::real::runtime::stream_begin_capture(handle, mode)
            })
        },
        || crate::real::runtime::stream_begin_capture(handle, mode),
    )
}

/// `cudaStreamEndCapture`, noting the end of the capture.
///
/// # Safety
/// `graph` must be null or valid for a write of a pointer.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaStreamEndCapture(
    stream: CudaStream,
    graph: *mut *mut c_void,
) -> CudaError {
    if graph.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    let handle = stream as usize;
    let result = guarded(
        "cudaStreamEndCapture",
        || hooks::stream_end_capture(handle, || crate::real::runtime::stream_end_capture(handle)),
        || crate::real::runtime::stream_end_capture(handle),
    );
    // SAFETY: checked non-null; valid for a write per CUDA's contract.
    unsafe { put_allocation(graph, result.map(|g| g as u64)) }
}

/// An instantiation of `graph` by `instantiate` (the real call): the executable graph holds the
/// graph's capture pool too.
///
/// # Safety
/// `exec` must be null or valid for a write of a pointer.
unsafe fn instantiate(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    instantiate: impl FnOnce() -> Result<usize, CudaError>,
) -> CudaError {
    if exec.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    let result = instantiate();
    if let Ok(made) = result {
        guarded(
            "cudaGraphInstantiate",
            || hooks::graph_instantiated(graph as usize, made),
            || (),
        );
    }
    // SAFETY: non-null, and valid for a write per the caller's contract.
    unsafe { put_allocation(exec, result.map(|e| e as u64)) }
}

/// `cudaGraphInstantiate` (CUDA 12's, with flags), noting the graph's capture pool.
///
/// # Safety
/// `exec` must be valid for a write of a pointer (CUDA's contract).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaGraphInstantiate(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    flags: u64,
) -> CudaError {
    let real = || crate::real::runtime::graph_instantiate(graph as usize, flags, false);
    // SAFETY: null or valid for a write, per CUDA's contract.
    unsafe { instantiate(exec, graph, real) }
}

/// `cudaGraphInstantiateWithFlags`, noting the graph's capture pool.
///
/// # Safety
/// `exec` must be valid for a write of a pointer (CUDA's contract).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaGraphInstantiateWithFlags(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    flags: u64,
) -> CudaError {
    let real = || crate::real::runtime::graph_instantiate(graph as usize, flags, true);
    // SAFETY: null or valid for a write, per CUDA's contract.
    unsafe { instantiate(exec, graph, real) }
}

/// `cudaGraphInstantiateWithParams`, noting the graph's capture pool.
///
/// # Safety
/// `exec` must be valid for a write of a pointer, `params` CUDA's
/// `cudaGraphInstantiateParams*` (CUDA's contract).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaGraphInstantiateWithParams(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    params: *mut c_void,
) -> CudaError {
    // SAFETY: the application's parameters, passed on.
    let real =
        || unsafe { crate::real::runtime::graph_instantiate_with_params(graph as usize, params) };
    // SAFETY: checked non-null; valid for a write per CUDA's contract.
    unsafe { instantiate(exec, graph, real) }
}

/// `cudaGraphExecDestroy`: the executable graph no longer holds its capture pool (noted before
/// the real call, after which the handle may name a new graph).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cudaGraphExecDestroy(exec: *mut c_void) -> CudaError {
    let handle = exec as usize;
    guarded(
        "cudaGraphExecDestroy",
        || hooks::graph_destroyed(handle),
        || (),
    );
    crate::real::runtime::graph_exec_destroy(handle)
}

/// `cudaGraphDestroy`: the graph no longer holds its capture pool (noted before the real call).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cudaGraphDestroy(graph: *mut c_void) -> CudaError {
    let handle = graph as usize;
    guarded("cudaGraphDestroy", || hooks::graph_destroyed(handle), || ());
    crate::real::runtime::graph_destroy(handle)
}

/// `cudaDeviceGetDefaultMemPool`, noting which pool is the device's default.
///
/// # Safety
/// `pool` must be valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaDeviceGetDefaultMemPool(
    pool: *mut cuda::MemPool,
    device: c_int,
) -> CudaError {
    if pool.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    let result = guarded(
        "cudaDeviceGetDefaultMemPool",
        || hooks::device_get_default_mem_pool(device),
        || crate::real::runtime::default_mem_pool(device),
    );
    // SAFETY: checked non-null; valid for a write per CUDA's contract.
    unsafe { put_allocation(pool.cast(), result.map(|p| p as u64)) }
}

/// `cudaMemPoolGetAttribute`: a default pool's used and reserved memory (and peaks) are our
/// pool's; everything else is the runtime's.
///
/// # Safety
/// `value` must be valid for a write of the attribute's type (a `cuuint64_t` for the four
/// memory attributes).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaMemPoolGetAttribute(
    pool: cuda::MemPool,
    attribute: c_int,
    value: *mut c_void,
) -> CudaError {
    let handle = pool as usize;
    let ours = guarded(
        "cudaMemPoolGetAttribute",
        || Ok::<_, CudaError>(hooks::mem_pool_get_attribute(handle, attribute)),
        || Ok(None),
    );
    if let Ok(Some(v)) = ours
        && !value.is_null()
    {
        // SAFETY: non-null; the four memory attributes are `cuuint64_t` (CUDA's contract).
        unsafe { value.cast::<u64>().write(v) };
        return cuda::SUCCESS;
    }
    match crate::real::runtime::cudaMemPoolGetAttribute() {
        // SAFETY: the application's arguments, passed on unchanged.
        Some(real) => unsafe { real(pool, attribute, value) },
        None => cuda::ERROR_INITIALIZATION,
    }
}

/// `cudaMemPoolSetAttribute`: resetting a default pool's peaks resets ours too.
///
/// # Safety
/// `value` must be valid for a read of the attribute's type.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaMemPoolSetAttribute(
    pool: cuda::MemPool,
    attribute: c_int,
    value: *mut c_void,
) -> CudaError {
    let code = match crate::real::runtime::cudaMemPoolSetAttribute() {
        // SAFETY: the application's arguments, passed on unchanged.
        Some(real) => unsafe { real(pool, attribute, value) },
        None => return cuda::ERROR_INITIALIZATION,
    };
    if code == cuda::SUCCESS {
        let handle = pool as usize;
        guarded(
            "cudaMemPoolSetAttribute",
            || {
                hooks::mem_pool_attribute_set(handle, attribute);
                cuda::SUCCESS
            },
            || cuda::SUCCESS,
        );
    }
    code
}

/// `cudaMemPoolSetAccess`: on a default pool (PyTorch's peer access on its `cudaMallocAsync`
/// route), the devices given access may use our pool's memory too.
///
/// # Safety
/// `descs` must be valid for reads of `count` descriptors (CUDA's contract).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaMemPoolSetAccess(
    pool: cuda::MemPool,
    descs: *const cuda::MemAccessDesc,
    count: usize,
) -> CudaError {
    let handle = pool as usize;
    // SAFETY: the application's arguments, passed on as they are (CUDA's contract holds them).
    let real = || unsafe { crate::real::runtime::mem_pool_set_access(handle, descs, count) };
    if descs.is_null() || count == 0 {
        return real(); // the runtime's own answer to no descriptors
    }
    // SAFETY: CUDA's contract: `count` valid descriptors at `descs` (checked non-null).
    let list = unsafe { std::slice::from_raw_parts(descs, count) };
    guarded(
        "cudaMemPoolSetAccess",
        || hooks::mem_pool_set_access(handle, list, real),
        real,
    )
}

/// `cudaMemPoolTrimTo`: on a default pool (PyTorch's `empty_cache`), releases our cache too.
///
/// # Safety
/// None beyond CUDA's: the handle is passed on.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaMemPoolTrimTo(
    pool: cuda::MemPool,
    min_bytes_to_keep: usize,
) -> CudaError {
    let handle = pool as usize;
    guarded(
        "cudaMemPoolTrimTo",
        || hooks::mem_pool_trim_to(handle, min_bytes_to_keep),
        || crate::real::runtime::mem_pool_trim_to(handle, min_bytes_to_keep),
    )
}

/// `cudaIpcGetMemHandle`: a handle of the shim's for a pooled block the driver cannot name (Note
/// [CUDA's IPC handles for pooled blocks]); refused, with a message, for a freed block.
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
