//! The table of primary contexts, and running on a device's own context.
//!
//! Driver calls need a current context, and the right one. Every call made for a device's pool
//! runs with that device's primary context current ([`on_primary_context`]): made current if
//! the thread has none (its `cudaMalloc` never reached the runtime), swapped in and back if the
//! thread is on another device (a block freed there). Which context an application's
//! driver-level allocation belongs to is [`current_context`]: only primary contexts are pooled.
//! Each primary context we use is retained once for the life of the process, as the runtime's
//! own reference is, and remembered in a table indexed by device (`PRIMARY`); a reset device
//! is forgotten ([`forget_primary_context`]).

use std::ptr;

use cachealloc_core::DeviceError;
use cudarc::driver::sys;

use super::device_facts::device_count;
use super::{LoadedDriver, device_error};

/// Most devices whose primary contexts we remember.
const MAX_PRIMARY: usize = 64;

/// Each device's primary context once we hold a reference to it (0: not yet).
static PRIMARY: [std::sync::atomic::AtomicUsize; MAX_PRIMARY] =
    [const { std::sync::atomic::AtomicUsize::new(0) }; MAX_PRIMARY];

/// The context current on the calling thread, as the pools see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CurrentContext {
    /// No context is current.
    None,
    /// The primary context of this device — the runtime's, and the one the pools serve.
    Primary(i32),
    /// A context made with `cuCtxCreate` (or a green context): its allocations are not pooled.
    Other,
}

/// Which context is current on the calling thread. The primary context of the current
/// context's device is retained (and remembered) only when it is already active, so asking
/// never creates a context.
pub fn current_context(_driver: LoadedDriver) -> CurrentContext {
    let mut current: sys::CUcontext = ptr::null_mut();
    // SAFETY: valid out-pointer.
    if unsafe { sys::cuCtxGetCurrent(&mut current) } != sys::CUresult::CUDA_SUCCESS
        || current.is_null()
    {
        return CurrentContext::None;
    }
    let current = current as usize;
    if let Some(d) = PRIMARY
        .iter()
        .position(|p| p.load(std::sync::atomic::Ordering::Acquire) == current)
    {
        return CurrentContext::Primary(d as i32);
    }
    let mut device: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; a context is current.
    if unsafe { sys::cuCtxGetDevice(&mut device) } != sys::CUresult::CUDA_SUCCESS {
        return CurrentContext::Other;
    }
    match primary_context(device) {
        Some(primary) if primary == current => CurrentContext::Primary(device),
        _ => CurrentContext::Other,
    }
}

/// The primary context of `device` if it is active, retained once for the life of the process
/// (as the fences' own reference is).
fn primary_context(device: i32) -> Option<usize> {
    let slot = PRIMARY.get(usize::try_from(device).ok()?)?;
    let known = slot.load(std::sync::atomic::Ordering::Acquire);
    if known != 0 {
        return Some(known);
    }
    let (mut flags, mut active) = (0u32, 0i32);
    // SAFETY: valid out-pointers; the device ordinal came from the driver.
    let r = unsafe { sys::cuDevicePrimaryCtxGetState(device, &mut flags, &mut active) };
    if r != sys::CUresult::CUDA_SUCCESS || active == 0 {
        return None;
    }
    let mut context: sys::CUcontext = ptr::null_mut();
    // SAFETY: valid out-pointer and device; the context is active, so retaining creates nothing.
    if unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, device) } != sys::CUresult::CUDA_SUCCESS
    {
        return None;
    }
    Some(remember(slot, context, device))
}

/// Remember `device`'s primary `context`, just retained, in its `slot`; if another thread
/// remembered it first, give our extra reference back. Returns the context remembered.
fn remember(
    slot: &std::sync::atomic::AtomicUsize,
    context: sys::CUcontext,
    device: sys::CUdevice,
) -> usize {
    match slot.compare_exchange(
        0,
        context as usize,
        std::sync::atomic::Ordering::AcqRel,
        std::sync::atomic::Ordering::Acquire,
    ) {
        Ok(_) => context as usize,
        Err(other) => {
            // SAFETY: releases the reference the caller retained just before.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) };
            other
        }
    }
}

/// The primary context of `ordinal`, retained (and so created if need be) once for the life of
/// the process, like the runtime's own reference.
fn own_primary_context(ordinal: i32) -> Result<usize, DeviceError> {
    let slot = usize::try_from(ordinal)
        .ok()
        .and_then(|d| PRIMARY.get(d))
        .ok_or_else(|| DeviceError::Other {
            code: crate::cuda::driver::ERROR_INVALID_VALUE.0,
            message: format!("device {ordinal} is beyond the shim's {MAX_PRIMARY}"),
        })?;
    let known = slot.load(std::sync::atomic::Ordering::Acquire);
    if known != 0 {
        return Ok(known);
    }
    let mut device: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; the ordinal came from the runtime or the driver.
    let r = unsafe { sys::cuDeviceGet(&mut device, ordinal) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(device_error(r, "cuDeviceGet"));
    }
    let mut context: sys::CUcontext = ptr::null_mut();
    // SAFETY: valid out-pointer and device.
    let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, device) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(device_error(r, "cuDevicePrimaryCtxRetain"));
    }
    Ok(remember(slot, context, device))
}

/// The device of the context current on the calling thread, whatever the context.
pub fn current_context_device(_driver: LoadedDriver) -> Option<i32> {
    let mut device: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; with no context current the driver returns an error.
    (unsafe { sys::cuCtxGetDevice(&mut device) } == sys::CUresult::CUDA_SUCCESS).then_some(device)
}

/// The device whose (active) primary context `context` is, or `None` for any other context.
pub fn device_of_primary_context(driver: LoadedDriver, context: usize) -> Option<i32> {
    (0..device_count(driver) as i32).find(|&d| primary_context(d) == Some(context))
}

/// Forget `device`'s primary context (it was reset; its handle may change).
pub fn forget_primary_context(device: i32) {
    if let Some(slot) = usize::try_from(device).ok().and_then(|d| PRIMARY.get(d)) {
        slot.store(0, std::sync::atomic::Ordering::Release);
    }
}

/// Run `f` with `ordinal`'s primary context current on the calling thread: made current if no
/// context is (and left current, as the runtime would), swapped in and back out if another
/// context is.
pub fn on_primary_context<T>(ordinal: i32, f: impl FnOnce() -> T) -> Result<T, DeviceError> {
    let own = own_primary_context(ordinal)?;

    let mut current: sys::CUcontext = ptr::null_mut();
    // SAFETY: `current` is a valid out-pointer.
    let r = unsafe { sys::cuCtxGetCurrent(&mut current) };
    if r == sys::CUresult::CUDA_SUCCESS && current as usize == own {
        return Ok(f());
    }
    // SAFETY: `own` is this device's live primary context, retained for the process.
    let r = unsafe { sys::cuCtxSetCurrent(own as sys::CUcontext) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(device_error(r, "cuCtxSetCurrent"));
    }
    let result = f();
    if !current.is_null() {
        // SAFETY: puts back the context that was current (still alive: the thread holds it).
        unsafe { sys::cuCtxSetCurrent(current) };
    }
    Ok(result)
}

/// Let `accessor`'s primary context use the memory of `owner`'s (`cuCtxEnablePeerAccess`, as
/// `cudaDeviceEnablePeerAccess` does): `cudaMalloc`'s memory is reachable from a peer only
/// this way. Access already enabled is success.
pub fn enable_context_peer_access(
    _driver: LoadedDriver,
    accessor: i32,
    owner: i32,
) -> Result<(), DeviceError> {
    let owner_context = own_primary_context(owner)?;
    let code = on_primary_context(accessor, || {
        // The owner's live primary context (retained for the process); no flags.
        crate::real::driver::call_driver!(cuCtxEnablePeerAccess(
            owner_context as crate::cuda::driver::Handle,
            0
        ))
    })?;
    match code {
        crate::cuda::driver::SUCCESS | crate::cuda::driver::ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(())
        }
        other => Err(DeviceError::Other {
            code: other.0,
            message: format!("cuCtxEnablePeerAccess returned {other}"),
        }),
    }
}
