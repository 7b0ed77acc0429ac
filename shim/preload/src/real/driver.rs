//! The real CUDA driver functions behind the driver-level hooks, looked up in libcuda itself.
//!
//! Every lookup here goes through the real `dlsym` on our own handle of `libcuda.so.1`
//! ([`crate::symbols::libcuda`]), so it can never return one of our own wrappers. Functions
//! resolve once, at first use; a function the driver lacks is `None` and its hook answers
//! `CUDA_ERROR_NOT_FOUND`.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::cuda::driver::{CuResult, DevicePtr, Handle};

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
                    crate::symbols::libcuda::lookup(
                        CStr::from_bytes_with_nul(name.as_bytes()).expect("NUL-terminated"),
                    )
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
    cuIpcOpenMemHandle_v2: fn(*mut DevicePtr, crate::cuda::IpcMemHandle, c_uint);
    cuIpcCloseMemHandle: fn(DevicePtr);
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
    cuMemExportToShareableHandle: fn(*mut c_void, sys::CUmemGenericAllocationHandle, c_uint, u64);
    cuMemImportFromShareableHandle: fn(*mut sys::CUmemGenericAllocationHandle, *mut c_void, c_uint);
}

/// Call a real driver function, or answer `CUDA_ERROR_NOT_FOUND` when libcuda lacks it.
macro_rules! call_driver {
    ($name:ident($($arg:expr),*)) => {
        match crate::real::driver::$name() {
            // SAFETY: the caller passes arguments that satisfy the driver function's contract
            // (each call site says why).
            Some(f) => unsafe { f($($arg),*) },
            None => crate::cuda::driver::ERROR_NOT_FOUND,
        }
    };
}
pub(crate) use call_driver;
