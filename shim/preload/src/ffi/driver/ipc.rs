//! The driver's IPC entry points (`cuIpcGetMemHandle`, `cuIpcOpenMemHandle_v2`,
//! `cuIpcCloseMemHandle`): a pooled block the driver cannot name is shared through a handle of
//! the shim's, which a receiving process under the shim opens (Note [CUDA's IPC handles for
//! pooled blocks] in `process::ipc::handles`); every other handle is the driver's.

use std::ffi::{c_uint, c_void};

use super::guarded;
use crate::cuda::IpcMemHandle;
use crate::cuda::driver::{self as codes, CuResult, DevicePtr, SUCCESS};
use crate::hooks::driver as hooks;
use crate::real::driver::call_driver;

/// `cuIpcGetMemHandle`: for a pooled block the driver cannot name, a handle of the shim's (Note
/// [CUDA's IPC handles for pooled blocks]); else the driver's.
///
/// # Safety
/// `handle` must be valid for a write of a `CUipcMemHandle`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuIpcGetMemHandle(handle: *mut c_void, dptr: DevicePtr) -> CuResult {
    if handle.is_null() {
        return codes::ERROR_INVALID_VALUE;
    }
    match guarded(
        "cuIpcGetMemHandle",
        || hooks::ipc_get_mem_handle(dptr),
        || None,
    ) {
        Some(Ok(ours)) => {
            // SAFETY: non-null and valid for a write of the 64-byte handle (CUDA's contract).
            unsafe { handle.cast::<[u8; 64]>().write_unaligned(ours) };
            SUCCESS
        }
        Some(Err(code)) => code,
        // The application's arguments, passed on.
        None => call_driver!(cuIpcGetMemHandle(handle, dptr)),
    }
}

/// `cuIpcOpenMemHandle_v2` (what the runtime's `cudaIpcOpenMemHandle` calls): a handle of the
/// shim's is opened by it (Note [CUDA's IPC handles for pooled blocks]); any other by the driver.
///
/// # Safety
/// `pdptr` must be valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    pdptr: *mut DevicePtr,
    handle: IpcMemHandle,
    flags: c_uint,
) -> CuResult {
    if !pdptr.is_null() {
        let bytes = handle.reserved;
        match guarded(
            "cuIpcOpenMemHandle",
            || hooks::ipc_open_mem_handle(&bytes),
            || None,
        ) {
            Some(Ok(address)) => {
                // SAFETY: checked non-null; valid for a write per CUDA's contract.
                unsafe { pdptr.write(address) };
                return SUCCESS;
            }
            Some(Err(code)) => return code,
            None => {}
        }
    }
    // The application's arguments, passed on.
    call_driver!(cuIpcOpenMemHandle_v2(pdptr, handle, flags))
}

/// `cuIpcCloseMemHandle`: a block opened through a handle of the shim's is unmapped by it; any
/// other address goes to the driver.
///
/// # Safety
/// None beyond the driver's own contract.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuIpcCloseMemHandle(dptr: DevicePtr) -> CuResult {
    guarded(
        "cuIpcCloseMemHandle",
        || hooks::ipc_close_mem_handle(dptr),
        || None,
    )
    // The application's argument, passed on.
    .unwrap_or_else(|| call_driver!(cuIpcCloseMemHandle(dptr)))
}
