//! Reuse fences on real streams: CUDA events through the driver API (`cudarc::driver::sys`,
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
//! Driver calls need a current context. A thread that reaches our hooks may not have one yet
//! (its `cudaMalloc` never reached the runtime), so before recording we make the device's primary
//! context — the one the runtime uses — current on the thread if no context is.
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
const REQUIRED_SYMBOLS: [&str; 11] = [
    "cuInit",
    "cuDeviceGet",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuDevicePrimaryCtxRetain",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuStreamWaitEvent",
    "cuStreamQuery",
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

    /// Make this device's primary context current on the calling thread if none is.
    fn ensure_context(&self) -> Result<(), DeviceError> {
        let mut current: sys::CUcontext = ptr::null_mut();
        // SAFETY: `current` is a valid out-pointer.
        let r = unsafe { sys::cuCtxGetCurrent(&mut current) };
        if r == sys::CUresult::CUDA_SUCCESS && !current.is_null() {
            return Ok(());
        }
        let mut device: sys::CUdevice = 0;
        // SAFETY: valid out-pointer; the ordinal came from the runtime.
        let r = unsafe { sys::cuDeviceGet(&mut device, self.ordinal) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(device_error(r, "cuDeviceGet"));
        }
        let mut context: sys::CUcontext = ptr::null_mut();
        // SAFETY: valid out-pointer and device. The reference taken here is kept for the life
        // of the process, like the runtime's own.
        let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, device) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(device_error(r, "cuDevicePrimaryCtxRetain"));
        }
        // SAFETY: `context` is the live primary context just retained.
        let r = unsafe { sys::cuCtxSetCurrent(context) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(device_error(r, "cuCtxSetCurrent"));
        }
        Ok(())
    }

    fn take_event(&self) -> Result<Event, DeviceError> {
        if let Some(e) = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(e);
        }
        let mut event: sys::CUevent = ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: valid out-pointer; a context is current (ensure_context ran before).
        let r = unsafe { sys::cuEventCreate(&mut event, flags) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(device_error(r, "cuEventCreate"));
        }
        Ok(Event(event))
    }

    /// Record a fence: one event on each of `streams` (see
    /// [`crate::streams::StreamRegistry::fence_targets`]) that has unfinished work. A stream
    /// that is idle now has finished all work enqueued before the fence: it needs no event. (The
    /// legacy stream always gets one: its event also orders after the blocking streams' work,
    /// which its own idleness says nothing about.)
    pub fn record(&self, streams: &[Stream]) -> Result<Fence, DeviceError> {
        self.ensure_context()?;
        let mut fence = Fence {
            events: Vec::with_capacity(streams.len()),
        };
        for &stream in streams {
            if stream.0 != crate::cuda::STREAM_LEGACY
                // SAFETY: a stream handle of the application's, of this device.
                && unsafe { sys::cuStreamQuery(stream.0 as sys::CUstream) }
                    == sys::CUresult::CUDA_SUCCESS
            {
                continue;
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
            fence.events.push(event);
            if r != sys::CUresult::CUDA_SUCCESS {
                self.release(fence);
                return Err(device_error(r, "cuEventRecord"));
            }
        }
        Ok(fence)
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
        self.ensure_context()?;
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
