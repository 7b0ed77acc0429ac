//! The driver through cudarc: reuse fences on real streams (CUDA events), contexts, devices.
//!
//! Reuse fences are CUDA events through the driver API (`cudarc::driver::sys`,
//! which dlopens libcuda itself and never binds to the runtime names we export).
//!
//! A fence for device *d* is one event recorded on *d*'s legacy default stream — which orders
//! after all earlier work of every blocking stream, per-thread default streams included — plus
//! one on each live non-blocking stream of *d*; while graphs are being captured the set changes
//! (see [`crate::streams`]). It has completed when all its events have. Events are recycled
//! through a per-device pool, since creating one costs microseconds.
//!
//! While any stream captures a graph, another thread's capture in `cudaStreamCaptureModeGlobal`
//! forbids "potentially unsafe" calls (event queries, `cudaMalloc`) on every thread, and one
//! such call makes the capture fail. Our own calls then run in the relaxed capture mode
//! ([`relaxed`]), as PyTorch's allocator does around its own.
//!
//! Driver calls need a current context, and the right one. Every call made for a device's pool
//! runs with that device's primary context current ([`Fences::on_own_context`]): made current
//! if the thread has none (its `cudaMalloc` never reached the runtime), swapped in and back if
//! the thread is on another device (a block freed there). Which context an application's
//! driver-level allocation belongs to is [`current_context`]: only primary contexts are pooled.
//!
//! cudarc resolves each driver symbol at first call and panics when it is missing; [`Driver::load`]
//! checks every symbol we use up front, so a missing libcuda or symbol becomes one clear message
//! and passthrough instead of a panic later.

use std::ffi::c_void;
use std::ptr;
use std::sync::{Mutex, OnceLock};

use cachealloc_core::DeviceError;
use cudarc::driver::sys;

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
pub struct Driver(());

impl Driver {
    /// Load and check the driver once; the error says what is missing.
    pub fn load() -> Result<Driver, String> {
        static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();
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
                Ok(Driver(()))
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

fn device_error(result: sys::CUresult, what: &str) -> DeviceError {
    DeviceError::Other {
        code: result as i32,
        message: format!("{what}: {result:?}"),
    }
}

/// Number of devices the driver sees (0 when it cannot say).
pub fn device_count(_driver: Driver) -> usize {
    let mut n = 0;
    // SAFETY: valid out-pointer; the driver is loaded and initialized (a `Driver` exists).
    if unsafe { sys::cuDeviceGetCount(&mut n) } == sys::CUresult::CUDA_SUCCESS {
        usize::try_from(n).unwrap_or(0)
    } else {
        0
    }
}

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
pub fn current_context(_driver: Driver) -> CurrentContext {
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
    match slot.compare_exchange(
        0,
        context as usize,
        std::sync::atomic::Ordering::AcqRel,
        std::sync::atomic::Ordering::Acquire,
    ) {
        Ok(_) => Some(context as usize),
        Err(other) => {
            // Another thread remembered it first: give our extra reference back.
            // SAFETY: releases the reference retained just above.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) };
            Some(other)
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
            code: crate::cuda::ERROR_INVALID_VALUE,
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
    match slot.compare_exchange(
        0,
        context as usize,
        std::sync::atomic::Ordering::AcqRel,
        std::sync::atomic::Ordering::Acquire,
    ) {
        Ok(_) => Ok(context as usize),
        Err(other) => {
            // SAFETY: gives back the extra reference retained just above.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) };
            Ok(other)
        }
    }
}

/// The device of the context current on the calling thread, whatever the context.
pub fn current_context_device(_driver: Driver) -> Option<i32> {
    let mut device: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; with no context current the driver returns an error.
    (unsafe { sys::cuCtxGetDevice(&mut device) } == sys::CUresult::CUDA_SUCCESS).then_some(device)
}

/// The device whose (active) primary context `context` is, or `None` for any other context.
pub fn device_of_primary_context(driver: Driver, context: usize) -> Option<i32> {
    (0..device_count(driver) as i32).find(|&d| primary_context(d) == Some(context))
}

/// Forget `device`'s primary context (it was reset; its handle may change).
pub fn forget_primary_context(device: i32) {
    if let Some(slot) = usize::try_from(device).ok().and_then(|d| PRIMARY.get(d)) {
        slot.store(0, std::sync::atomic::Ordering::Release);
    }
}

/// Run `f` with the calling thread in the relaxed stream-capture mode (`f` then may make calls
/// that another thread's global capture would forbid), restoring the thread's mode after. With
/// a driver that lacks the function, `f` just runs.
pub fn relaxed<T>(f: impl FnOnce() -> T) -> T {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    let present = *PRESENT.get_or_init(|| {
        // SAFETY: only dlopens libcuda (by cudarc's list of names); no code of it runs.
        if !unsafe { sys::is_culib_present() } {
            return false;
        }
        // SAFETY: the library is present (checked above); looking a symbol up runs no code.
        let lib = unsafe { sys::culib() };
        // SAFETY: as above; the pointer is not used.
        unsafe { lib.get::<*const c_void>(b"cuThreadExchangeStreamCaptureMode") }.is_ok()
    });
    if !present {
        return f();
    }
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: valid in/out pointer; the function is present (checked above).
    let swapped = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    let result = f();
    if swapped == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: as above; puts the thread's own mode back.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
    result
}

/// Name and total memory of device `ordinal`, when the driver offers the functions (they are
/// optional: only the trace header uses them).
pub fn device_info(_driver: Driver, ordinal: i32) -> Option<(String, u64)> {
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

/// Whether a stream call failed because the stream is gone: another thread destroyed it between
/// our listing the live streams and recording on it (regression: a load test saw
/// `cuEventRecord` fail with `CUDA_ERROR_INVALID_HANDLE` and the allocation fail with it). Its
/// work is finished — the shim's `cudaStreamDestroy` waits for it in pool mode — so it needs no
/// event.
fn destroyed(result: sys::CUresult) -> bool {
    matches!(
        result,
        sys::CUresult::CUDA_ERROR_INVALID_HANDLE | sys::CUresult::CUDA_ERROR_INVALID_CONTEXT
    )
}

/// A CUDA event handle that may move between threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event(sys::CUevent);

// SAFETY: CUDA event handles are process-wide; the driver allows using them from any thread.
unsafe impl Send for Event {}

/// A stream handle (runtime `cudaStream_t` and driver `CUstream` are the same handle).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Stream(pub usize);

/// The events of one fence.
#[derive(Clone, Debug, Default)]
pub struct Fence {
    events: Vec<Event>,
}

/// Fence recording for one device.
#[derive(Debug)]
pub struct Fences {
    ordinal: i32,
    spare: Mutex<Vec<Event>>,
}

impl Fences {
    /// Fences for device `ordinal`.
    pub fn new(_driver: Driver, ordinal: i32) -> Self {
        Fences {
            ordinal,
            spare: Mutex::new(Vec::new()),
        }
    }

    /// Run `f` with this device's primary context current on the calling thread: made current
    /// if no context is (and left current, as the runtime would), swapped in and back out if
    /// another context is (a block of this device freed while another device is current).
    pub fn on_own_context<T>(&self, f: impl FnOnce() -> T) -> Result<T, DeviceError> {
        on_primary_context(self.ordinal, f)
    }

    fn take_event(&self) -> Result<Event, DeviceError> {
        if let Some(e) = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(e);
        }
        let mut event: sys::CUevent = ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: valid out-pointer; this device's context is current (on_own_context).
        let r = unsafe { sys::cuEventCreate(&mut event, flags) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(device_error(r, "cuEventCreate"));
        }
        Ok(Event(event))
    }

    /// Record a fence: one event on each of `streams` (see
    /// [`crate::streams::StreamRegistry::with_fence_targets`]) that has unfinished work. A stream
    /// that is idle now has finished all work enqueued before the fence: it needs no event. (The
    /// legacy stream always gets one: its event also orders after the blocking streams' work,
    /// which its own idleness says nothing about.)
    pub fn record(&self, streams: &[Stream]) -> Result<Fence, DeviceError> {
        self.on_own_context(|| self.record_here(streams))?
    }

    fn record_here(&self, streams: &[Stream]) -> Result<Fence, DeviceError> {
        let mut fence = Fence {
            events: Vec::with_capacity(streams.len()),
        };
        for &stream in streams {
            let legacy = stream.0 == crate::cuda::STREAM_LEGACY;
            if !legacy {
                // SAFETY: a stream handle of the application's, of this device (or one destroyed
                // since: the driver then answers with an error, no harm done).
                let state = unsafe { sys::cuStreamQuery(stream.0 as sys::CUstream) };
                if state == sys::CUresult::CUDA_SUCCESS || destroyed(state) {
                    continue;
                }
            }
            let event = match self.take_event() {
                Ok(e) => e,
                Err(e) => {
                    self.release(fence);
                    return Err(e);
                }
            };
            // SAFETY: a live event and a stream handle of this device (or CU_STREAM_LEGACY).
            let r = unsafe { sys::cuEventRecord(event.0, stream.0 as sys::CUstream) };
            if !legacy && destroyed(r) {
                self.spare_event(event);
                continue;
            }
            fence.events.push(event);
            if r != sys::CUresult::CUDA_SUCCESS {
                self.release(fence);
                return Err(device_error(r, "cuEventRecord"));
            }
        }
        Ok(fence)
    }

    fn spare_event(&self, event: Event) {
        self.spare
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(event);
    }

    /// Whether every event of the fence has completed. An error other than "not ready" (a
    /// broken context) counts as completed: no work of ours can still be running then.
    pub fn completed(&self, fence: &Fence) -> bool {
        fence.events.iter().all(|e| {
            // SAFETY: a live event of ours.
            let r = unsafe { sys::cuEventQuery(e.0) };
            r != sys::CUresult::CUDA_ERROR_NOT_READY
        })
    }

    /// Block until the fence completes.
    pub fn wait(&self, fence: &Fence) -> Result<(), DeviceError> {
        for e in &fence.events {
            // SAFETY: a live event of ours.
            let r = unsafe { sys::cuEventSynchronize(e.0) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(device_error(r, "cuEventSynchronize"));
            }
        }
        Ok(())
    }

    /// Make `stream`'s later work wait on the device for every event of the fence
    /// (`cuStreamWaitEvent`): nothing waits on the host.
    pub fn make_wait(&self, stream: Stream, fence: &Fence) -> Result<(), DeviceError> {
        self.on_own_context(|| self.make_wait_here(stream, fence))?
    }

    fn make_wait_here(&self, stream: Stream, fence: &Fence) -> Result<(), DeviceError> {
        for e in &fence.events {
            // SAFETY: a live event of ours and a stream handle of the application's (the one
            // its allocation was made for); 0 is the only valid flag value.
            let r = unsafe { sys::cuStreamWaitEvent(stream.0 as sys::CUstream, e.0, 0) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(device_error(r, "cuStreamWaitEvent"));
            }
        }
        Ok(())
    }

    /// Give a fence's events back to the pool.
    pub fn release(&self, fence: Fence) {
        self.spare
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(fence.events);
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
    _driver: Driver,
    accessor: i32,
    owner: i32,
) -> Result<(), DeviceError> {
    let owner_context = own_primary_context(owner)?;
    let code = on_primary_context(accessor, || {
        // The owner's live primary context (retained for the process); no flags.
        crate::real_driver::call_driver!(cuCtxEnablePeerAccess(
            owner_context as crate::real_driver::Handle,
            0
        ))
    })?;
    match code {
        crate::real_driver::SUCCESS | crate::real_driver::ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(())
        }
        other => Err(DeviceError::Other {
            code: other,
            message: format!("cuCtxEnablePeerAccess returned CUDA error {other}"),
        }),
    }
}
