//! Reuse fences: CUDA events recorded on the application's streams.
//!
//! A fence for device *d* is one event recorded on *d*'s legacy default stream — which orders
//! after all earlier work of every blocking stream, per-thread default streams included — plus
//! one on each live non-blocking stream of *d*; while graphs are being captured the set changes
//! (see [`crate::streams`]). It has completed when all its events have. Events are recycled
//! through a per-device pool, since creating one costs microseconds. Every call runs with the
//! device's primary context current ([`Fences::on_own_context`]).

use std::ptr;
use std::sync::Mutex;

use cachealloc_core::DeviceError;
use cudarc::driver::sys;

use super::contexts::on_primary_context;
use super::{LoadedDriver, device_error};
use crate::streams::Stream;

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
    pub fn new(_driver: LoadedDriver, ordinal: i32) -> Self {
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
