//! The shim's own calls to the GPU, through cudarc's driver bindings (`cudarc::driver::sys`,
//! which dlopen libcuda themselves and never bind to the names we export): everything the pools
//! need from the driver besides the segments' memory ([`crate::real::driver`]).
//!
//! | module | what |
//! |---|---|
//! | here | [`LoadedDriver`]: proof that libcuda is loaded, initialized and has every function we use |
//! | [`contexts`] | the table of primary contexts: which context is current, running on a device's own context, context peer access |
//! | [`fences`] | reuse fences: CUDA events recorded on the application's streams |
//! | [`capture_mode`] | our calls in the relaxed capture mode while graphs are being captured |
//! | [`captures`] | which capture a stream takes part in (streams join captures through events) |
//! | [`device_facts`] | how many devices, their names and memory |
//!
//! cudarc resolves each driver symbol at first call and panics when it is missing;
//! [`LoadedDriver::load`] checks every symbol we use up front, so a missing libcuda or symbol
//! becomes one clear message and passthrough instead of a panic later.

use std::ffi::c_void;
use std::sync::OnceLock;

use cachealloc_core::DeviceError;
use cudarc::driver::sys;

pub mod capture_mode;
pub mod captures;
pub mod contexts;
pub mod device_facts;
pub mod fences;

/// Every driver function the shim needs.
const REQUIRED_SYMBOLS: [&str; 17] = [
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxGetDevice",
    "cuCtxSynchronize",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxGetState",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuStreamWaitEvent",
    "cuStreamQuery",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
];

/// Proof that libcuda is loaded, initialized, and has every function we use.
#[derive(Clone, Copy, Debug)]
pub struct LoadedDriver(());

impl LoadedDriver {
    /// Load and check the driver once; the error says what is missing.
    pub fn load() -> Result<LoadedDriver, String> {
        static DRIVER: OnceLock<Result<LoadedDriver, String>> = OnceLock::new();
        DRIVER
            .get_or_init(|| {
                // SAFETY: only dlopens libcuda (by cudarc's list of names); no code of it runs.
                if !unsafe { sys::is_culib_present() } {
                    return Err("libcuda (the CUDA driver) could not be loaded".to_string());
                }
                // SAFETY: the library is present (checked above), so culib() returns it.
                let lib = unsafe { sys::culib() };
                for name in REQUIRED_SYMBOLS {
                    // SAFETY: looking a symbol up runs no code; the pointer is not used.
                    if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
                        return Err(format!("the CUDA driver lacks {name}"));
                    }
                }
                // SAFETY: cuInit is present (checked above); 0 is its only valid flag value.
                check(unsafe { sys::cuInit(0) }, "cuInit")?;
                Ok(LoadedDriver(()))
            })
            .clone()
    }
}

fn check(result: sys::CUresult, what: &str) -> Result<(), String> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {result:?}"))
    }
}

pub(crate) fn device_error(result: sys::CUresult, what: &str) -> DeviceError {
    DeviceError::Other {
        code: result as i32,
        message: format!("{what}: {result:?}"),
    }
}
