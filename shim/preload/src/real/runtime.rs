//! The real CUDA runtime functions behind our hooks, found at first use (for the driver's, see
//! [`super::driver`]).
//!
//! The runtime is loaded long after our constructor, so nothing is resolved at load time. Each
//! function is looked up once with `dlsym(RTLD_NEXT)`; where that finds nothing (PyTorch loads
//! CUDA libraries with `RTLD_LOCAL`, out of the global scope), we ask the already-loaded runtime
//! directly: `dlopen(soname, RTLD_NOLOAD)` + `dlsym(handle)`.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use crate::cuda::{CudaError, CudaStream, IpcMemHandle, MemPool};

/// Sonames of the runtime we look for when `RTLD_NEXT` finds nothing, newest first.
const RUNTIME_SONAMES: [&CStr; 3] = [c"libcudart.so.13", c"libcudart.so.12", c"libcudart.so"];

/// Look a runtime function up; `None` when no loaded library defines it.
fn resolve(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: `name` is NUL-terminated; RTLD_NEXT asks for the next definition after this
    // library, which is never our own hook.
    let next = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
    if !next.is_null() {
        return Some(next);
    }
    for soname in RUNTIME_SONAMES {
        // SAFETY: NUL-terminated name; RTLD_NOLOAD never loads anything, it only returns a handle
        // to a library that is already loaded (or NULL).
        let handle = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if handle.is_null() {
            continue;
        }
        // SAFETY: `handle` is a live handle from dlopen and `name` is NUL-terminated.
        let symbol = unsafe { libc::dlsym(handle, name.as_ptr()) };
        // SAFETY: balances the dlopen above; with RTLD_NOLOAD the library stays loaded by its
        // other references.
        unsafe { libc::dlclose(handle) };
        if !symbol.is_null() {
            return Some(symbol);
        }
    }
    None
}

/// Declare an accessor per real function: it resolves once and returns the function pointer,
/// or `None` when the runtime does not define it.
macro_rules! real_functions {
    ($($name:ident: fn($($arg:ty),*) -> $ret:ty;)*) => {
        $(
            #[allow(non_snake_case)]
            #[doc = concat!("The real `", stringify!($name), "`.")]
            pub fn $name() -> Option<unsafe extern "C" fn($($arg),*) -> $ret> {
                static SLOT: OnceLock<Option<usize>> = OnceLock::new();
                let address = (*SLOT.get_or_init(|| {
                    let name = concat!(stringify!($name), "\0");
                    let name = CStr::from_bytes_with_nul(name.as_bytes()).expect("NUL-terminated");
                    resolve(name).map(|p| p as usize)
                }))?;
                // SAFETY: the symbol of this name in the CUDA runtime has exactly this C
                // signature (CUDA's published ABI), and a resolved address is never null.
                Some(unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($arg),*) -> $ret>(address) })
            }
        )*
    };
}

real_functions! {
    cudaMalloc: fn(*mut *mut c_void, usize) -> CudaError;
    cudaFree: fn(*mut c_void) -> CudaError;
    cudaMallocAsync: fn(*mut *mut c_void, usize, CudaStream) -> CudaError;
    cudaFreeAsync: fn(*mut c_void, CudaStream) -> CudaError;
    cudaMemGetInfo: fn(*mut usize, *mut usize) -> CudaError;
    cudaGetDevice: fn(*mut c_int) -> CudaError;
    cudaSetDevice: fn(c_int) -> CudaError;
    cudaGetDeviceCount: fn(*mut c_int) -> CudaError;
    cudaGetLastError: fn() -> CudaError;
    cudaDeviceReset: fn() -> CudaError;
    cudaDeviceEnablePeerAccess: fn(c_int, c_uint) -> CudaError;
    cudaStreamCreate: fn(*mut CudaStream) -> CudaError;
    cudaStreamCreateWithFlags: fn(*mut CudaStream, c_uint) -> CudaError;
    cudaStreamCreateWithPriority: fn(*mut CudaStream, c_uint, c_int) -> CudaError;
    cudaStreamDestroy: fn(CudaStream) -> CudaError;
    cudaIpcGetMemHandle: fn(*mut IpcMemHandle, *mut c_void) -> CudaError;
    cudaIpcOpenMemHandle: fn(*mut *mut c_void, IpcMemHandle, c_uint) -> CudaError;
    cudaIpcCloseMemHandle: fn(*mut c_void) -> CudaError;
    cudaDeviceSynchronize: fn() -> CudaError;
    cudaStreamSynchronize: fn(CudaStream) -> CudaError;
    cudaStreamBeginCapture: fn(CudaStream, c_int) -> CudaError;
    cudaStreamEndCapture: fn(CudaStream, *mut *mut c_void) -> CudaError;
    cudaGraphInstantiate: fn(*mut *mut c_void, *mut c_void, u64) -> CudaError;
    cudaGraphInstantiateWithFlags: fn(*mut *mut c_void, *mut c_void, u64) -> CudaError;
    cudaGraphInstantiateWithParams: fn(*mut *mut c_void, *mut c_void, *mut c_void) -> CudaError;
    cudaGraphExecDestroy: fn(*mut c_void) -> CudaError;
    cudaGraphDestroy: fn(*mut c_void) -> CudaError;
    cudaDeviceGetDefaultMemPool: fn(*mut MemPool, c_int) -> CudaError;
    cudaMemPoolGetAttribute: fn(MemPool, c_int, *mut c_void) -> CudaError;
    cudaMemPoolSetAttribute: fn(MemPool, c_int, *mut c_void) -> CudaError;
    cudaMemPoolTrimTo: fn(MemPool, usize) -> CudaError;
    cudaMemPoolSetAccess: fn(MemPool, *const crate::cuda::MemAccessDesc, usize) -> CudaError;
    cudaGetDriverEntryPoint: fn(*const c_char, *mut *mut c_void, u64, *mut c_int) -> CudaError;
    cudaGetDriverEntryPointByVersion: fn(*const c_char, *mut *mut c_void, c_uint, u64, *mut c_int) -> CudaError;
}

/// Call a real function, or fail with `cudaErrorInitializationError` when it does not exist.
/// The runtime's own driver calls during it go straight to the driver
/// ([`crate::symbols::through_runtime`]): the shim already handled the request.
macro_rules! call_real {
    ($name:ident($($arg:expr),*)) => {
        match $name() {
            // SAFETY: the caller passes arguments that satisfy the CUDA function's contract
            // (each wrapper below documents why).
            Some(f) => crate::symbols::through_runtime(|| unsafe { f($($arg),*) }),
            None => crate::cuda::ERROR_INITIALIZATION,
        }
    };
}

/// The calling thread's current device, through the real runtime.
pub fn current_device() -> Result<i32, CudaError> {
    let mut device: c_int = 0;
    // Valid out-pointer for the duration of the call.
    let code = call_real!(cudaGetDevice(&mut device));
    if code == crate::cuda::SUCCESS {
        Ok(device)
    } else {
        Err(code)
    }
}

/// The real `cudaMalloc`.
pub fn malloc(size: u64) -> Result<u64, CudaError> {
    let mut ptr: *mut c_void = std::ptr::null_mut();
    // Valid out-pointer for the duration of the call.
    let code = call_real!(cudaMalloc(&mut ptr, size as usize));
    if code == crate::cuda::SUCCESS {
        Ok(ptr as u64)
    } else {
        Err(code)
    }
}

/// The real `cudaFree`. `address` comes from the application, which answers for it; the real
/// runtime validates it.
pub fn free(address: u64) -> CudaError {
    call_real!(cudaFree(address as *mut c_void))
}

/// The real `cudaMallocAsync`.
pub fn malloc_async(size: u64, stream: usize) -> Result<u64, CudaError> {
    let mut ptr: *mut c_void = std::ptr::null_mut();
    // Valid out-pointer; the stream handle is the application's, validated by the runtime.
    let code = call_real!(cudaMallocAsync(
        &mut ptr,
        size as usize,
        stream as CudaStream
    ));
    if code == crate::cuda::SUCCESS {
        Ok(ptr as u64)
    } else {
        Err(code)
    }
}

/// The real `cudaFreeAsync` (arguments from the application, validated by the runtime).
pub fn free_async(address: u64, stream: usize) -> CudaError {
    call_real!(cudaFreeAsync(address as *mut c_void, stream as CudaStream))
}

/// The real `cudaMemGetInfo`: `(free, total)`.
pub fn mem_get_info() -> Result<(u64, u64), CudaError> {
    let (mut free, mut total) = (0usize, 0usize);
    // Valid out-pointers.
    let code = call_real!(cudaMemGetInfo(&mut free, &mut total));
    if code == crate::cuda::SUCCESS {
        Ok((free as u64, total as u64))
    } else {
        Err(code)
    }
}

/// The real `cudaSetDevice` (an ordinal of the application's, validated by the runtime).
pub fn set_device(device: i32) -> CudaError {
    call_real!(cudaSetDevice(device))
}

/// The real `cudaDeviceReset`.
pub fn device_reset() -> CudaError {
    call_real!(cudaDeviceReset())
}

/// The real `cudaDeviceEnablePeerAccess`.
pub fn device_enable_peer_access(peer: i32, flags: u32) -> CudaError {
    // The application's arguments, passed on.
    call_real!(cudaDeviceEnablePeerAccess(peer, flags))
}

/// The real `cudaStreamCreateWithPriority` (and its simpler forms): the new stream's handle.
pub fn stream_create(flags: u32, priority: Option<i32>) -> Result<usize, CudaError> {
    let mut stream: CudaStream = std::ptr::null_mut();
    // Valid out-pointer; flags and priority are the application's, validated by the runtime.
    let code = match priority {
        Some(p) => call_real!(cudaStreamCreateWithPriority(&mut stream, flags, p)),
        None if flags == 0 => call_real!(cudaStreamCreate(&mut stream)),
        None => call_real!(cudaStreamCreateWithFlags(&mut stream, flags)),
    };
    if code == crate::cuda::SUCCESS {
        Ok(stream as usize)
    } else {
        Err(code)
    }
}

/// The real `cudaStreamDestroy` (handle from the application, validated by the runtime).
pub fn stream_destroy(stream: usize) -> CudaError {
    call_real!(cudaStreamDestroy(stream as CudaStream))
}

/// The real `cudaIpcGetMemHandle`: the handle's bytes.
pub fn ipc_get_mem_handle(address: u64) -> Result<[u8; 64], CudaError> {
    let mut handle = IpcMemHandle { reserved: [0; 64] };
    // Valid out-pointer; the address is validated by the runtime.
    let code = call_real!(cudaIpcGetMemHandle(&mut handle, address as *mut c_void));
    if code == crate::cuda::SUCCESS {
        Ok(handle.reserved)
    } else {
        Err(code)
    }
}

/// The real `cudaIpcOpenMemHandle` on the current device (with lazy peer access, as PyTorch
/// opens them): the segment's address here.
pub fn ipc_open_mem_handle(handle: [u8; 64]) -> Result<u64, CudaError> {
    let mut address: *mut c_void = std::ptr::null_mut();
    const LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
    // Valid out-pointer; the handle is validated by the runtime.
    let code = call_real!(cudaIpcOpenMemHandle(
        &mut address,
        IpcMemHandle { reserved: handle },
        LAZY_ENABLE_PEER_ACCESS
    ));
    if code == crate::cuda::SUCCESS {
        Ok(address as u64)
    } else {
        Err(code)
    }
}

/// The real `cudaIpcCloseMemHandle` of an address `ipc_open_mem_handle` returned.
pub fn ipc_close_mem_handle(address: u64) -> CudaError {
    call_real!(cudaIpcCloseMemHandle(address as *mut c_void))
}

/// The real `cudaDeviceSynchronize` (the current device).
pub fn device_synchronize() -> CudaError {
    call_real!(cudaDeviceSynchronize())
}

/// Number of visible devices, through the real runtime (0 when it cannot say).
pub fn device_count() -> usize {
    let mut n: c_int = 0;
    // Valid out-pointer.
    let code = call_real!(cudaGetDeviceCount(&mut n));
    if code == crate::cuda::SUCCESS {
        usize::try_from(n).unwrap_or(0)
    } else {
        0
    }
}

/// The real `cudaStreamSynchronize` (handle from the application, validated by the runtime).
pub fn stream_synchronize(stream: usize) -> CudaError {
    call_real!(cudaStreamSynchronize(stream as CudaStream))
}

/// The real `cudaStreamBeginCapture` (arguments from the application, validated by the
/// runtime).
pub fn stream_begin_capture(stream: usize, mode: i32) -> CudaError {
    call_real!(cudaStreamBeginCapture(stream as CudaStream, mode))
}

/// The real `cudaStreamEndCapture`: the captured graph's handle.
pub fn stream_end_capture(stream: usize) -> Result<usize, CudaError> {
    let mut graph: *mut c_void = std::ptr::null_mut();
    // Valid out-pointer; the stream handle is validated by the runtime.
    let code = call_real!(cudaStreamEndCapture(stream as CudaStream, &mut graph));
    if code == crate::cuda::SUCCESS {
        Ok(graph as usize)
    } else {
        Err(code)
    }
}

/// The real `cudaGraphInstantiate` (CUDA 12's, with flags) or `cudaGraphInstantiateWithFlags`
/// (`with_flags`): the executable graph's handle.
pub fn graph_instantiate(graph: usize, flags: u64, with_flags: bool) -> Result<usize, CudaError> {
    let mut exec: *mut c_void = std::ptr::null_mut();
    let graph = graph as *mut c_void;
    // Valid out-pointer; the graph handle and flags are validated by the runtime.
    let code = if with_flags {
        call_real!(cudaGraphInstantiateWithFlags(&mut exec, graph, flags))
    } else {
        call_real!(cudaGraphInstantiate(&mut exec, graph, flags))
    };
    if code == crate::cuda::SUCCESS {
        Ok(exec as usize)
    } else {
        Err(code)
    }
}

/// The real `cudaGraphInstantiateWithParams`.
///
/// # Safety
/// `params` is the application's `cudaGraphInstantiateParams*`, passed on (the runtime checks
/// it).
pub unsafe fn graph_instantiate_with_params(
    graph: usize,
    params: *mut c_void,
) -> Result<usize, CudaError> {
    let mut exec: *mut c_void = std::ptr::null_mut();
    // Valid out-pointer; the graph handle and the caller's parameters go to the runtime.
    let code = call_real!(cudaGraphInstantiateWithParams(
        &mut exec,
        graph as *mut c_void,
        params
    ));
    if code == crate::cuda::SUCCESS {
        Ok(exec as usize)
    } else {
        Err(code)
    }
}

/// The real `cudaGraphExecDestroy`.
pub fn graph_exec_destroy(exec: usize) -> CudaError {
    // The application's handle, validated by the runtime.
    call_real!(cudaGraphExecDestroy(exec as *mut c_void))
}

/// The real `cudaGraphDestroy`.
pub fn graph_destroy(graph: usize) -> CudaError {
    // The application's handle, validated by the runtime.
    call_real!(cudaGraphDestroy(graph as *mut c_void))
}

/// The real `cudaDeviceGetDefaultMemPool`: the pool's handle.
pub fn default_mem_pool(device: i32) -> Result<usize, CudaError> {
    let mut pool: MemPool = std::ptr::null_mut();
    // Valid out-pointer; the device ordinal is validated by the runtime.
    let code = call_real!(cudaDeviceGetDefaultMemPool(&mut pool, device));
    if code == crate::cuda::SUCCESS {
        Ok(pool as usize)
    } else {
        Err(code)
    }
}

/// The real `cudaMemPoolSetAccess`.
///
/// # Safety
/// `descs` is null or valid for reads of `count` descriptors.
pub unsafe fn mem_pool_set_access(
    pool: usize,
    descs: *const crate::cuda::MemAccessDesc,
    count: usize,
) -> CudaError {
    // The application's pool and descriptors, passed on.
    call_real!(cudaMemPoolSetAccess(pool as MemPool, descs, count))
}

/// The real `cudaMemPoolTrimTo` (arguments from the application, validated by the runtime).
pub fn mem_pool_trim_to(pool: usize, min_bytes_to_keep: usize) -> CudaError {
    call_real!(cudaMemPoolTrimTo(pool as MemPool, min_bytes_to_keep))
}
