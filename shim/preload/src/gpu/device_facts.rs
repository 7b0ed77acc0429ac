//! Facts about the devices: how many there are, their names and total memory (the trace
//! header's).

use std::ffi::c_void;

use cudarc::driver::sys;

use super::LoadedDriver;

/// Number of devices the driver sees (0 when it cannot say).
pub fn device_count(_driver: LoadedDriver) -> usize {
    let mut n = 0;
    // SAFETY: valid out-pointer; the driver is loaded and initialized (a `Driver` exists).
    if unsafe { sys::cuDeviceGetCount(&mut n) } == sys::CUresult::CUDA_SUCCESS {
        usize::try_from(n).unwrap_or(0)
    } else {
        0
    }
}

/// Name and total memory of device `ordinal`, when the driver offers the functions (they are
/// optional: only the trace header uses them).
pub fn device_info(_driver: LoadedDriver, ordinal: i32) -> Option<(String, u64)> {
    // SAFETY: the driver is loaded (a `Driver` exists); looking symbols up runs no code.
    let lib = unsafe { sys::culib() };
    for name in ["cuDeviceGetName", "cuDeviceTotalMem_v2"] {
        // SAFETY: as above.
        unsafe { lib.get::<*const c_void>(name.as_bytes()) }.ok()?;
    }
    let mut device: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; cuDeviceGet is present (checked at load).
    if unsafe { sys::cuDeviceGet(&mut device, ordinal) } != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    let mut name = [0 as std::ffi::c_char; 256];
    // SAFETY: the buffer is valid for its length; the function is present (checked above).
    if unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, device) }
        != sys::CUresult::CUDA_SUCCESS
    {
        return None;
    }
    // SAFETY: the driver wrote a NUL-terminated string into the zeroed buffer.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut total: usize = 0;
    // SAFETY: valid out-pointer; the function is present (checked above).
    if unsafe { sys::cuDeviceTotalMem_v2(&mut total, device) } != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    Some((name, total as u64))
}
