//! The real CUDA driver functions behind the driver-level hooks, looked up in libcuda itself.
//!
//! Every lookup here goes through the real `dlsym` ([`crate::doors::real_dlsym`]) on our own
//! handle of `libcuda.so.1`, so it can never return one of our own wrappers. Functions resolve
//! once, at first use; a function the driver lacks is `None` and its hook answers
//! `CUDA_ERROR_NOT_FOUND`.
//!
//! `libcuda` is never loaded by a lookup made for the doors ([`loaded_handle`]): a pointer can
//! only be libcuda's if libcuda is loaded. It is loaded (if it is not yet) only by a hook that is
//! about to call the driver — which means the application already reached it.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys;

/// `CUresult`.
pub type CuResult = c_int;
/// `CUdeviceptr`.
pub type DevicePtr = u64;
/// `CUstream`, `CUcontext`, `CUgraph`: opaque handles.
pub type Handle = *mut c_void;

/// `CUDA_SUCCESS`.
pub const SUCCESS: CuResult = 0;
/// `CUDA_ERROR_INVALID_VALUE`.
pub const ERROR_INVALID_VALUE: CuResult = 1;
/// `CUDA_ERROR_NOT_INITIALIZED`.
pub const ERROR_NOT_INITIALIZED: CuResult = 3;
/// `CUDA_ERROR_DEINITIALIZED`: the driver is shutting down (late frees at process exit).
pub const ERROR_DEINITIALIZED: CuResult = 4;
/// `CUDA_ERROR_NOT_FOUND`: what a hook answers when the real function does not exist.
pub const ERROR_NOT_FOUND: CuResult = 500;
/// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`.
pub const ERROR_PEER_ACCESS_ALREADY_ENABLED: CuResult = 704;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const ERROR_OUT_OF_MEMORY: CuResult = 2;

/// `CU_POINTER_ATTRIBUTE_BUFFER_ID` (an `unsigned long long`, unique per allocation).
pub const POINTER_ATTRIBUTE_BUFFER_ID: c_int = 7;
/// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` (a `CUdeviceptr`).
pub const POINTER_ATTRIBUTE_RANGE_START_ADDR: c_int = 11;
/// `CU_POINTER_ATTRIBUTE_RANGE_SIZE` (a `size_t`).
pub const POINTER_ATTRIBUTE_RANGE_SIZE: c_int = 12;

const SONAME: &CStr = c"libcuda.so.1";

/// Our handle of libcuda if it is loaded (never loads it).
pub fn loaded_handle() -> Option<usize> {
    static HANDLE: OnceLock<usize> = OnceLock::new();
    if let Some(&h) = HANDLE.get() {
        return Some(h);
    }
    // SAFETY: NUL-terminated name; RTLD_NOLOAD only returns a handle to a library that is
    // already loaded (or NULL), running no code. The reference it takes is kept for the life of
    // the process.
    let h = unsafe { libc::dlopen(SONAME.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    if h.is_null() {
        return None;
    }
    Some(*HANDLE.get_or_init(|| h as usize))
}

/// Our handle of libcuda, loading it if needed.
fn handle() -> Option<usize> {
    if let Some(h) = loaded_handle() {
        return Some(h);
    }
    // SAFETY: NUL-terminated name. Loading libcuda runs its initializers, as the first driver
    // call of the application (which brought us here) would have.
    let h = unsafe { libc::dlopen(SONAME.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if h.is_null() {
        return None;
    }
    loaded_handle()
}

/// The address of libcuda's own `name`, loading libcuda if needed.
pub fn lookup(name: &CStr) -> Option<usize> {
    let h = handle()?;
    // SAFETY: a live handle of ours from dlopen and a NUL-terminated name.
    let p = unsafe { crate::doors::real_dlsym(h as *mut c_void, name.as_ptr()) }?;
    Some(p as usize)
}

/// The address of libcuda's own `name` if libcuda is loaded (never loads it).
pub fn lookup_loaded(name: &CStr) -> Option<usize> {
    let h = loaded_handle()?;
    // SAFETY: a live handle of ours from dlopen and a NUL-terminated name.
    let p = unsafe { crate::doors::real_dlsym(h as *mut c_void, name.as_ptr()) }?;
    Some(p as usize)
}

/// Declare an accessor per real driver function: it resolves once and returns the function
/// pointer, or `None` when libcuda lacks it.
macro_rules! real_driver_functions {
    ($($name:ident: fn($($arg:ty),*);)*) => {
        $(
            #[allow(non_snake_case)]
            #[doc = concat!("libcuda's own `", stringify!($name), "`.")]
            pub fn $name() -> Option<unsafe extern "C" fn($($arg),*) -> CuResult> {
                static SLOT: OnceLock<Option<usize>> = OnceLock::new();
                let address = (*SLOT.get_or_init(|| {
                    let name = concat!(stringify!($name), "\0");
                    lookup(CStr::from_bytes_with_nul(name.as_bytes()).expect("NUL-terminated"))
                }))?;
                // SAFETY: libcuda's symbol of this name has exactly this C signature (the
                // driver's published ABI, cuda.h), and a resolved address is never null.
                Some(unsafe {
                    std::mem::transmute::<usize, unsafe extern "C" fn($($arg),*) -> CuResult>(address)
                })
            }
        )*
    };
}

real_driver_functions! {
    cuMemAlloc_v2: fn(*mut DevicePtr, usize);
    cuMemFree_v2: fn(DevicePtr);
    cuMemAllocAsync: fn(*mut DevicePtr, usize, Handle);
    cuMemAllocAsync_ptsz: fn(*mut DevicePtr, usize, Handle);
    cuMemFreeAsync: fn(DevicePtr, Handle);
    cuMemFreeAsync_ptsz: fn(DevicePtr, Handle);
    cuMemGetInfo_v2: fn(*mut usize, *mut usize);
    cuMemGetAddressRange_v2: fn(*mut DevicePtr, *mut usize, DevicePtr);
    cuPointerGetAttribute: fn(*mut c_void, c_int, DevicePtr);
    cuPointerGetAttributes: fn(c_uint, *mut c_int, *mut *mut c_void, DevicePtr);
    cuIpcGetMemHandle: fn(*mut c_void, DevicePtr);
    cuStreamCreate: fn(*mut Handle, c_uint);
    cuStreamCreateWithPriority: fn(*mut Handle, c_uint, c_int);
    cuStreamDestroy_v2: fn(Handle);
    cuStreamBeginCapture_v2: fn(Handle, c_int);
    cuStreamBeginCapture_v2_ptsz: fn(Handle, c_int);
    cuStreamEndCapture: fn(Handle, *mut Handle);
    cuStreamEndCapture_ptsz: fn(Handle, *mut Handle);
    cuStreamSynchronize: fn(Handle);
    cuDevicePrimaryCtxReset_v2: fn(c_int);
    cuCtxSynchronize: fn();
    cuCtxEnablePeerAccess: fn(Handle, c_uint);
    cuGetProcAddress: fn(*const c_char, *mut *mut c_void, c_int, u64);
    cuGetProcAddress_v2: fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int);
    cuGetProcAddress_v2_ptsz: fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int);
    cuDeviceGetAttribute: fn(*mut c_int, c_int, c_int);
    cuMemGetAllocationGranularity: fn(*mut usize, *const sys::CUmemAllocationProp, c_uint);
    cuMemAddressReserve: fn(*mut DevicePtr, usize, usize, DevicePtr, u64);
    cuMemAddressFree: fn(DevicePtr, usize);
    cuMemCreate: fn(*mut sys::CUmemGenericAllocationHandle, usize, *const sys::CUmemAllocationProp, u64);
    cuMemRelease: fn(sys::CUmemGenericAllocationHandle);
    cuMemMap: fn(DevicePtr, usize, usize, sys::CUmemGenericAllocationHandle, u64);
    cuMemRetainAllocationHandle: fn(*mut sys::CUmemGenericAllocationHandle, *mut c_void);
    cuMemUnmap: fn(DevicePtr, usize);
    cuMemSetAccess: fn(DevicePtr, usize, *const sys::CUmemAccessDesc, usize);
}

/// Call a real driver function, or answer `CUDA_ERROR_NOT_FOUND` when libcuda lacks it.
macro_rules! call_driver {
    ($name:ident($($arg:expr),*)) => {
        match crate::real_driver::$name() {
            // SAFETY: the caller passes arguments that satisfy the driver function's contract
            // (each call site says why).
            Some(f) => unsafe { f($($arg),*) },
            None => crate::real_driver::ERROR_NOT_FOUND,
        }
    };
}
pub(crate) use call_driver;
