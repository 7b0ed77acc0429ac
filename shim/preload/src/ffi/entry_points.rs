//! The doors into the driver's entry points: `dlsym`, `cuGetProcAddress*` and the runtime's
//! `cudaGetDriverEntryPoint*`, each of which hands out our wrappers ([`super::driver`]) in place
//! of the driver functions we wrap — see [`crate::symbols`] — and the table of those functions
//! ([`INTERPOSED`]).

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::LazyLock;

use super::driver::*;
use crate::cuda::CudaError;
use crate::cuda::driver::{CuResult, SUCCESS};
use crate::real::driver::call_driver;
use crate::symbols::{self, Interposed, libc_dlsym};

// ----- dlsym -------------------------------------------------------------------------------

/// `dlsym`. For `RTLD_DEFAULT` and `RTLD_NEXT`, whose answers depend on who calls, a tail jump
/// to libc's `dlsym` (it then sees the original caller); for an explicit handle,
/// `dlsym_on_handle` with the caller's return address.
///
/// # Safety
/// `dlsym`'s contract.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "test rdi, rdi",
        "jz 2f",
        "cmp rdi, -1",
        "je 2f",
        // An explicit handle: third argument, the return address into the caller.
        "mov rdx, [rsp]",
        "jmp {on_handle}",
        "2:",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz 3f",
        "jmp rax",
        // libc's dlsym not found yet (a lookup before our constructor ran): the slow path.
        "3:",
        "mov rdx, [rsp]",
        "jmp {on_handle}",
        on_handle = sym dlsym_on_handle,
        real = sym libc_dlsym::REAL_DLSYM,
    )
}

/// The Rust side of [`dlsym`]: never unwinds into the caller.
///
/// # Safety
/// `dlsym`'s contract.
unsafe extern "C" fn dlsym_on_handle(
    handle: *mut c_void,
    symbol: *const c_char,
    caller: usize,
) -> *mut c_void {
    // SAFETY: the application's arguments to `dlsym`, passed on.
    let lookup = || unsafe { symbols::dlsym_lookup(handle, symbol, caller, &INTERPOSED) };
    catch_unwind(AssertUnwindSafe(lookup)).unwrap_or_else(|_| {
        // SAFETY: as above.
        unsafe { symbols::real_dlsym(handle, symbol) }.unwrap_or(std::ptr::null_mut())
    })
}

// ----- the entry-point resolvers -----------------------------------------------------------

/// Replace a successful lookup's function by our wrapper where it is one, never unwinding.
///
/// # Safety
/// `pfn` must be null or valid for reads and writes of a pointer.
unsafe fn substitute_found(pfn: *mut *mut c_void) {
    // SAFETY: forwarded contract.
    let _ = catch_unwind(AssertUnwindSafe(|| unsafe {
        symbols::substitute_found(pfn, &INTERPOSED)
    }));
}

/// `cuGetProcAddress_v2`: the real lookup, then our wrapper where it found one we wrap.
///
/// # Safety
/// CUDA's contract: `symbol` a NUL-terminated string, `pfn` valid for a write, `status` null
/// or valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CuResult {
    let code = call_driver!(cuGetProcAddress_v2(symbol, pfn, version, flags, status));
    // SAFETY: the caller's pointers, which the real call accepted.
    unsafe { after_lookup(code, pfn, status) }
}

/// After a `cuGetProcAddress_v2*` lookup: substitute the function found if the lookup
/// succeeded, and return its code.
///
/// # Safety
/// `pfn` must be null or valid for reads and writes of a pointer, `status` null or valid for a
/// read.
unsafe fn after_lookup(code: CuResult, pfn: *mut *mut c_void, status: *mut c_int) -> CuResult {
    // SAFETY: `status` is null or valid for a read (the caller's contract).
    if code == SUCCESS && (status.is_null() || unsafe { status.read() } == 0) {
        // SAFETY: the caller's contract.
        unsafe { substitute_found(pfn) };
    }
    code
}

/// `cuGetProcAddress_v2_ptsz`, as [`cuGetProcAddress_v2`].
///
/// # Safety
/// As [`cuGetProcAddress_v2`].
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGetProcAddress_v2_ptsz(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CuResult {
    let code = call_driver!(cuGetProcAddress_v2_ptsz(
        symbol, pfn, version, flags, status
    ));
    // SAFETY: the caller's pointers, which the real call accepted.
    unsafe { after_lookup(code, pfn, status) }
}

/// `cuGetProcAddress` (CUDA 11's, without a status).
///
/// # Safety
/// CUDA's contract: `symbol` a NUL-terminated string, `pfn` valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CuResult {
    let code = call_driver!(cuGetProcAddress(symbol, pfn, version, flags));
    if code == SUCCESS {
        // SAFETY: `pfn` was valid for the real call.
        unsafe { substitute_found(pfn) };
    }
    code
}

/// `cudaGetDriverEntryPoint`: the runtime's lookup, then our wrapper where it found one. The
/// status argument is passed on and never read (CUDA 11's runtime has no such argument); a
/// function found is non-NULL.
///
/// # Safety
/// The runtime's contract.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaGetDriverEntryPoint(
    symbol: *const c_char,
    func_ptr: *mut *mut c_void,
    flags: u64,
    status: *mut c_int,
) -> CudaError {
    let Some(real) = crate::real::runtime::cudaGetDriverEntryPoint() else {
        return crate::cuda::ERROR_INITIALIZATION;
    };
    // SAFETY: the application's arguments, passed on unchanged.
    let code = unsafe { real(symbol, func_ptr, flags, status) };
    // SAFETY: `func_ptr` was valid for the real call.
    unsafe { after_runtime_lookup(code, func_ptr) }
}

/// `cudaGetDriverEntryPointByVersion`, as [`cudaGetDriverEntryPoint`].
///
/// # Safety
/// The runtime's contract.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaGetDriverEntryPointByVersion(
    symbol: *const c_char,
    func_ptr: *mut *mut c_void,
    version: c_uint,
    flags: u64,
    status: *mut c_int,
) -> CudaError {
    let Some(real) = crate::real::runtime::cudaGetDriverEntryPointByVersion() else {
        return crate::cuda::ERROR_INITIALIZATION;
    };
    // SAFETY: the application's arguments, passed on unchanged.
    let code = unsafe { real(symbol, func_ptr, version, flags, status) };
    // SAFETY: `func_ptr` was valid for the real call.
    unsafe { after_runtime_lookup(code, func_ptr) }
}

/// After a `cudaGetDriverEntryPoint*` lookup: substitute the function found if the lookup
/// succeeded, and return its code.
///
/// # Safety
/// `func_ptr` must be null or valid for reads and writes of a pointer.
unsafe fn after_runtime_lookup(code: CudaError, func_ptr: *mut *mut c_void) -> CudaError {
    if code == crate::cuda::SUCCESS {
        // SAFETY: the caller's contract.
        unsafe { substitute_found(func_ptr) };
    }
    code
}

// ----- the table of what we wrap -----------------------------------------------------------

/// Every driver function we wrap, with our wrapper per door ([`symbols::substitute`]).
pub static INTERPOSED: LazyLock<Vec<Interposed>> = LazyLock::new(interposed);

fn interposed() -> Vec<Interposed> {
    macro_rules! same {
        ($name:ident) => {
            Interposed {
                name: crate::cstr_of!($name),
                through_dlsym: $name as *const () as usize,
                through_entry_points: $name as *const () as usize,
            }
        };
    }
    macro_rules! per_door {
        ($name:ident, $via_dlsym:ident, $via_entry_point:ident) => {
            Interposed {
                name: crate::cstr_of!($name),
                through_dlsym: $via_dlsym as *const () as usize,
                through_entry_points: $via_entry_point as *const () as usize,
            }
        };
    }
    vec![
        per_door!(
            cuMemAlloc_v2,
            cuMemAlloc_v2_via_dlsym,
            cuMemAlloc_v2_via_entry_point
        ),
        per_door!(
            cuMemAllocAsync,
            cuMemAllocAsync_via_dlsym,
            cuMemAllocAsync_via_entry_point
        ),
        per_door!(
            cuMemAllocAsync_ptsz,
            cuMemAllocAsync_ptsz_via_dlsym,
            cuMemAllocAsync_ptsz_via_entry_point
        ),
        same!(cuMemFree_v2),
        same!(cuMemFreeAsync),
        same!(cuMemFreeAsync_ptsz),
        same!(cuMemGetInfo_v2),
        same!(cuMemGetAddressRange_v2),
        same!(cuPointerGetAttribute),
        same!(cuPointerGetAttributes),
        same!(cuIpcGetMemHandle),
        same!(cuIpcOpenMemHandle_v2),
        same!(cuIpcCloseMemHandle),
        same!(cuStreamCreate),
        same!(cuStreamCreateWithPriority),
        same!(cuStreamDestroy_v2),
        same!(cuStreamBeginCapture_v2),
        same!(cuStreamBeginCapture_v2_ptsz),
        same!(cuStreamEndCapture),
        same!(cuStreamEndCapture_ptsz),
        same!(cuDevicePrimaryCtxReset_v2),
        same!(cuCtxEnablePeerAccess),
        same!(cuGetProcAddress),
        same!(cuGetProcAddress_v2),
        same!(cuGetProcAddress_v2_ptsz),
    ]
}
