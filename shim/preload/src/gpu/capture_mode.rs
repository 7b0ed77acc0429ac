//! Our calls in the relaxed stream-capture mode.
//!
//! While any stream captures a graph, another thread's capture in `cudaStreamCaptureModeGlobal`
//! forbids "potentially unsafe" calls (event queries, `cudaMalloc`) on every thread, and one
//! such call makes the capture fail. Our own calls then run in the relaxed capture mode
//! ([`relaxed`]), as PyTorch's allocator does around its own.

use std::ffi::c_void;
use std::sync::OnceLock;

use cudarc::driver::sys;

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
