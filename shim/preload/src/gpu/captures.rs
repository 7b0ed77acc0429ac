//! Which capture a stream takes part in, asked of the driver.
//!
//! A capture begins on one stream, which the shim sees (`cudaStreamBeginCapture`); other
//! streams join it without a call the shim sees, by waiting on an event recorded on a capturing
//! stream (`s2.wait_stream(s1)` in PyTorch). Work enqueued on a joined stream is captured too,
//! so the shim asks the driver whenever a stream it does not know as capturing allocates, frees
//! or would take a fence event while a capture is under way (see Note [Capture pools] in the
//! shim's `process::private_pools::captures`).

use std::ffi::c_void;
use std::ptr;
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::streams::Stream;

/// `cuStreamGetCaptureInfo_v3` and `_v2` share their first three parameters (the stream, the
/// status and the capture's id); the rest are optional outputs we pass as null.
type CaptureInfoV3 = unsafe extern "C" fn(
    sys::CUstream,
    *mut sys::CUstreamCaptureStatus,
    *mut u64,
    *mut c_void,
    *mut c_void,
    *mut c_void,
    *mut c_void,
) -> sys::CUresult;
type CaptureInfoV2 = unsafe extern "C" fn(
    sys::CUstream,
    *mut sys::CUstreamCaptureStatus,
    *mut u64,
    *mut c_void,
    *mut c_void,
    *mut c_void,
) -> sys::CUresult;

#[derive(Clone, Copy)]
enum CaptureInfo {
    V3(CaptureInfoV3),
    V2(CaptureInfoV2),
}

/// The driver's capture-info function: `_v3` (CUDA 12.3 and later), else `_v2` (11.3 and
/// later); `None` with a driver that has neither (it has no capture to join either).
fn capture_info() -> Option<CaptureInfo> {
    static FUNCTION: OnceLock<Option<CaptureInfo>> = OnceLock::new();
    *FUNCTION.get_or_init(|| {
        // SAFETY: only dlopens libcuda (by cudarc's list of names); no code of it runs.
        if !unsafe { sys::is_culib_present() } {
            return None;
        }
        // SAFETY: the library is present (checked above).
        let lib = unsafe { sys::culib() };
        // SAFETY: looking a symbol up runs no code; the types are the driver's declarations of
        // these versioned functions (cuda.h).
        if let Ok(f) = unsafe { lib.get::<CaptureInfoV3>(b"cuStreamGetCaptureInfo_v3") } {
            return Some(CaptureInfo::V3(*f));
        }
        // SAFETY: as above.
        let v2 = unsafe { lib.get::<CaptureInfoV2>(b"cuStreamGetCaptureInfo_v2") };
        v2.ok().map(|f| CaptureInfo::V2(*f))
    })
}

/// Where a stream stands with graph captures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaptureState {
    /// Not capturing (or the driver could not say: a destroyed stream, say).
    None,
    /// Capturing into the capture with this id (the driver's, unique in the process).
    Active(u64),
    /// Its capture failed and waits for `cudaStreamEndCapture`: work on it is refused.
    Invalidated,
}

/// Where `stream` stands with graph captures. Legal on a capturing stream and in every capture
/// mode (unlike a stream query).
pub fn capture_state(stream: Stream) -> CaptureState {
    let Some(function) = capture_info() else {
        return CaptureState::None;
    };
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id = 0u64;
    let handle = stream.0 as sys::CUstream;
    let null = ptr::null_mut();
    // SAFETY: valid out-pointers for the status and the id, null for the optional outputs; the
    // stream handle is the application's (a stale one gets an error code back).
    let result = unsafe {
        match function {
            CaptureInfo::V3(f) => f(handle, &mut status, &mut id, null, null, null, null),
            CaptureInfo::V2(f) => f(handle, &mut status, &mut id, null, null, null),
        }
    };
    if result != sys::CUresult::CUDA_SUCCESS {
        return CaptureState::None;
    }
    match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureState::Active(id),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
            CaptureState::Invalidated
        }
        _ => CaptureState::None,
    }
}

/// Whether `stream` takes part in a capture (under way or invalidated): no event may be recorded
/// on it, nor may it be queried, for a fence.
pub fn is_capturing(stream: Stream) -> bool {
    capture_state(stream) != CaptureState::None
}
