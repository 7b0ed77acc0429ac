//! The C ABI: every symbol `libcachealloc.so` exports, and the only module the ABI touches.
//!
//! | module | exports |
//! |---|---|
//! | [`runtime`] | the interposed CUDA runtime functions (`cudaMalloc` …) |
//! | [`driver`] | the wrapped driver functions (`cuMemAlloc_v2` …) |
//! | [`entry_points`] | `dlsym`, `cuGetProcAddress*`, `cudaGetDriverEntryPoint*`, and the table of wrapped driver functions |
//! | [`c_api`] | the `cachealloc_*` C API |
//! | [`static_tls`] | thread-locals the allocation path reads without the loader (the TLS ABI) |
//!
//! and here: `guarded` and the out-pointer writes every export uses, the library's
//! constructor, its fork handler and its exit callback.
//!
//! Each function converts its C arguments, calls safe code in [`crate::hooks`] inside
//! `guarded` (no panic crosses the ABI: a panic degrades the shim to passthrough with one
//! message), and writes the results through the caller's out-pointers.
//!
//! Exports are `#[cfg_attr(not(test), unsafe(no_mangle))]`, so the crate's own unit-test binary
//! does not interpose itself.

// The exported names are CUDA's.
#![allow(non_snake_case)]

pub mod c_api;
pub mod driver;
pub mod entry_points;
pub mod runtime;
pub mod static_tls;

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::cuda::driver::CuResult;
use crate::cuda::{self, CudaError};
use crate::process;

/// What a hook returns when even its fallback panicked.
pub(crate) trait OnPanic {
    fn on_panic() -> Self;
}

impl OnPanic for CudaError {
    fn on_panic() -> Self {
        cuda::ERROR_INITIALIZATION
    }
}

impl<T> OnPanic for Result<T, CudaError> {
    fn on_panic() -> Self {
        Err(cuda::ERROR_INITIALIZATION)
    }
}

impl OnPanic for CuResult {
    fn on_panic() -> Self {
        cuda::driver::ERROR_NOT_INITIALIZED
    }
}

impl<T> OnPanic for Result<T, CuResult> {
    fn on_panic() -> Self {
        Err(cuda::driver::ERROR_NOT_INITIALIZED)
    }
}

impl<T> OnPanic for Option<T> {
    fn on_panic() -> Self {
        None
    }
}

/// A time, a count or an address: 0.
impl OnPanic for u64 {
    fn on_panic() -> Self {
        0
    }
}

/// A fraction: -1.0, which no fraction is.
impl OnPanic for f64 {
    fn on_panic() -> Self {
        -1.0
    }
}

impl OnPanic for () {
    fn on_panic() -> Self {}
}

impl OnPanic for std::ffi::c_int {
    fn on_panic() -> Self {
        -1
    }
}

impl OnPanic for String {
    fn on_panic() -> Self {
        String::new()
    }
}

/// Run `body`; if it panics, degrade to passthrough (once, with a message) and return
/// `fallback()` — itself guarded, so that no panic ever crosses the ABI.
pub(crate) fn guarded<T: OnPanic>(
    what: &str,
    body: impl FnOnce() -> T,
    fallback: impl FnOnce() -> T,
) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(_) => {
            process::degrade(what);
            catch_unwind(AssertUnwindSafe(fallback)).unwrap_or_else(|_| T::on_panic())
        }
    }
}

/// Write `value` to `out` if the pointer is not null.
///
/// # Safety
/// `out` must be null or valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: non-null and valid for a write, per the caller's contract.
        unsafe { out.write(value) };
    }
}

// ----- the process's life: load, fork, first use, exit ----------------------------------------

/// Constructor: read the settings, find libc's `dlsym`, register the fork handler and what runs
/// at the shim's first CUDA use. Nothing CUDA.
#[ctor::ctor(unsafe)]
fn on_load() {
    // No panic may escape a constructor.
    let _ = std::panic::catch_unwind(|| {
        crate::settings::on_load();
        crate::symbols::libc_dlsym::prepare();
        extern "C" fn child() {
            process::after_fork_in_child();
        }
        // SAFETY: registers a plain `extern "C" fn()` that only stores to an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(child)) };
        process::at_start(register_exit_summary);
    });
}

/// Register the exit summary. Called at the shim's first CUDA use: an `atexit` registered in the
/// constructor would run after the destructors of libraries loaded later, CUDA's among them.
fn register_exit_summary() {
    extern "C" fn at_exit() {
        // No panic may cross this C callback.
        let _ = catch_unwind(crate::report::exit_summary);
        let _ = catch_unwind(crate::ipc_counters::remove_files);
        let _ = catch_unwind(crate::process::remove_handle_files);
    }
    // SAFETY: registers a plain `extern "C" fn()` that never unwinds.
    unsafe { libc::atexit(at_exit) };
}
