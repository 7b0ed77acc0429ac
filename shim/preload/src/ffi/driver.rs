//! The wrapped driver functions (`cuMemAlloc_v2` …), exported and handed out by the
//! entry-point doors ([`super::entry_points`]; see [`crate::symbols`]).
//!
//! An allocation function exists once per door (the exported symbol, the copy handed out by
//! `dlsym`, the copy handed out by the resolvers), so that the exit summary can say which door
//! each allocation came through; the copies differ only in that. Every other wrapped function
//! is the exported one whichever door it was found through.

use std::ffi::{c_int, c_uint, c_void};

use super::{guarded, put};
use crate::cuda::driver::{self as codes, CuResult, DevicePtr, Handle, SUCCESS};
use crate::hooks::driver::{self as hooks, StreamArg};
use crate::process::PooledBlock;
use crate::real::driver::call_driver;
use crate::symbols::Door;

mod ipc;
pub use ipc::*;

// ----- allocation, one copy per door -------------------------------------------------------

/// Write an allocation's result: the pointer (0 on failure).
///
/// # Safety
/// `dptr` must be valid for a write.
unsafe fn put_allocation(dptr: *mut DevicePtr, result: Result<u64, CuResult>) -> CuResult {
    let (address, code) = match result {
        Ok(a) => (a, SUCCESS),
        Err(code) => (0, code),
    };
    // SAFETY: forwarded contract.
    unsafe { put(dptr, address) };
    code
}

/// `cuMemAlloc_v2` through `door`. Never inlined: the three doors' copies are thunks to this one
/// body, so that they cost the same.
///
/// # Safety
/// `dptr` must be valid for a write (CUDA's contract).
#[inline(never)]
unsafe fn mem_alloc(door: Door, dptr: *mut DevicePtr, size: usize) -> CuResult {
    if dptr.is_null() {
        return codes::ERROR_INVALID_VALUE;
    }
    let real = || {
        let mut p: DevicePtr = 0;
        // Valid out-pointer.
        match call_driver!(cuMemAlloc_v2(&mut p, size)) {
            SUCCESS => Ok(p),
            code => Err(code),
        }
    };
    let result = guarded(
        "cuMemAlloc_v2",
        || hooks::mem_alloc(door, size as u64, None, real),
        real,
    );
    // SAFETY: checked non-null; valid for a write per CUDA's contract.
    unsafe { put_allocation(dptr, result) }
}

/// `cuMemAllocAsync` (or `_ptsz`) through `door` (never inlined, as [`mem_alloc`]).
///
/// # Safety
/// `dptr` must be valid for a write (CUDA's contract).
#[inline(never)]
unsafe fn mem_alloc_async(
    door: Door,
    dptr: *mut DevicePtr,
    size: usize,
    stream: Handle,
    per_thread_default: bool,
) -> CuResult {
    if dptr.is_null() {
        return codes::ERROR_INVALID_VALUE;
    }
    let handle = stream as usize;
    let real = || {
        let mut p: DevicePtr = 0;
        let stream = handle as Handle;
        // Valid out-pointer; the stream is the application's, validated by the driver.
        let code = if per_thread_default {
            call_driver!(cuMemAllocAsync_ptsz(&mut p, size, stream))
        } else {
            call_driver!(cuMemAllocAsync(&mut p, size, stream))
        };
        if code == SUCCESS { Ok(p) } else { Err(code) }
    };
    let arg = StreamArg {
        handle,
        per_thread_default,
    };
    let result = guarded(
        "cuMemAllocAsync",
        || hooks::mem_alloc(door, size as u64, Some(arg), real),
        real,
    );
    // SAFETY: checked non-null; valid for a write per CUDA's contract.
    unsafe { put_allocation(dptr, result) }
}

/// Define an allocation function three times: the exported symbol and the copies handed out
/// through `dlsym` and through the resolvers.
macro_rules! through_each_door {
    ($exported:ident, $via_dlsym:ident, $via_entry_point:ident:
        fn($($arg:ident: $ty:ty),*) => $body:ident($($extra:expr),*)) => {
        #[doc = concat!("`", stringify!($exported), "`, called through the symbol we export.")]
        ///
        /// # Safety
        /// CUDA's contract for the function.
        #[cfg_attr(not(test), unsafe(no_mangle))]
        pub unsafe extern "C" fn $exported($($arg: $ty),*) -> CuResult {
            // SAFETY: forwarded contract.
            unsafe { $body(Door::DriverSymbol, $($arg,)* $($extra),*) }
        }

        #[doc = concat!("`", stringify!($exported), "`, as handed out by `dlsym`.")]
        ///
        /// # Safety
        /// CUDA's contract for the function.
        pub unsafe extern "C" fn $via_dlsym($($arg: $ty),*) -> CuResult {
            // SAFETY: forwarded contract.
            unsafe { $body(Door::Dlsym, $($arg,)* $($extra),*) }
        }

        #[doc = concat!("`", stringify!($exported), "`, as handed out by `cuGetProcAddress*`.")]
        ///
        /// # Safety
        /// CUDA's contract for the function.
        pub unsafe extern "C" fn $via_entry_point($($arg: $ty),*) -> CuResult {
            // SAFETY: forwarded contract.
            unsafe { $body(Door::EntryPoint, $($arg,)* $($extra),*) }
        }
    };
}

through_each_door!(cuMemAlloc_v2, cuMemAlloc_v2_via_dlsym, cuMemAlloc_v2_via_entry_point:
    fn(dptr: *mut DevicePtr, size: usize) => mem_alloc());
through_each_door!(cuMemAllocAsync, cuMemAllocAsync_via_dlsym, cuMemAllocAsync_via_entry_point:
    fn(dptr: *mut DevicePtr, size: usize, stream: Handle) => mem_alloc_async(false));
through_each_door!(cuMemAllocAsync_ptsz, cuMemAllocAsync_ptsz_via_dlsym,
    cuMemAllocAsync_ptsz_via_entry_point:
    fn(dptr: *mut DevicePtr, size: usize, stream: Handle) => mem_alloc_async(true));

// ----- frees -------------------------------------------------------------------------------

/// `cuMemFree_v2`: a pooled pointer returns to its pool; anything else goes to the driver.
///
/// # Safety
/// None beyond CUDA's: the pointer is only compared.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemFree_v2(dptr: DevicePtr) -> CuResult {
    // After an internal failure the pointer may be pooled: leaking it is safe, handing a
    // sub-block to the driver is not.
    guarded(
        "cuMemFree_v2",
        // The application's pointer, validated by the driver.
        || hooks::mem_free(dptr, None, || call_driver!(cuMemFree_v2(dptr))),
        || SUCCESS,
    )
}

/// `cuMemFreeAsync` and `_ptsz`.
fn mem_free_async(dptr: DevicePtr, stream: Handle, per_thread_default: bool) -> CuResult {
    let handle = stream as usize;
    let real = || {
        let stream = handle as Handle;
        // The application's pointer and stream, validated by the driver.
        if per_thread_default {
            call_driver!(cuMemFreeAsync_ptsz(dptr, stream))
        } else {
            call_driver!(cuMemFreeAsync(dptr, stream))
        }
    };
    let arg = StreamArg {
        handle,
        per_thread_default,
    };
    guarded(
        "cuMemFreeAsync",
        || hooks::mem_free(dptr, Some(arg), real),
        || SUCCESS,
    )
}

/// `cuMemFreeAsync`.
///
/// # Safety
/// None beyond CUDA's: the pointer is only compared.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: DevicePtr, stream: Handle) -> CuResult {
    mem_free_async(dptr, stream, false)
}

/// `cuMemFreeAsync_ptsz`.
///
/// # Safety
/// None beyond CUDA's: the pointer is only compared.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: DevicePtr, stream: Handle) -> CuResult {
    mem_free_async(dptr, stream, true)
}

// ----- memory queries ----------------------------------------------------------------------

/// `cuMemGetInfo_v2`, counting our cached free bytes as free.
///
/// # Safety
/// `free` and `total` must each be null or valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    let real = || {
        let (mut f, mut t) = (0usize, 0usize);
        // Valid out-pointers.
        match call_driver!(cuMemGetInfo_v2(&mut f, &mut t)) {
            SUCCESS => Ok((f as u64, t as u64)),
            code => Err(code),
        }
    };
    match guarded("cuMemGetInfo_v2", || hooks::mem_get_info(real), real) {
        Ok((f, t)) => {
            // SAFETY: null or valid for a write, per the caller's contract.
            unsafe {
                put(free, f as usize);
                put(total, t as usize);
            }
            SUCCESS
        }
        Err(code) => code,
    }
}

/// Our answer about `address`, if it lies in our memory.
fn our_block(what: &str, address: DevicePtr) -> Option<Result<PooledBlock, CuResult>> {
    guarded(
        what,
        || Ok::<_, CuResult>(hooks::pooled_block(address)),
        || Ok(None),
    )
    .unwrap_or(None)
}

/// `cuMemGetAddressRange_v2`: for a pooled pointer, the allocation the program got (its
/// block), not the segment behind it.
///
/// # Safety
/// `base` and `size` must each be null or valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    base: *mut DevicePtr,
    size: *mut usize,
    dptr: DevicePtr,
) -> CuResult {
    match our_block("cuMemGetAddressRange_v2", dptr) {
        Some(Ok(block)) => {
            // SAFETY: null or valid for a write, per the caller's contract.
            unsafe {
                put(base, block.base);
                put(size, block.size as usize);
            }
            SUCCESS
        }
        Some(Err(code)) => code,
        // The application's arguments, passed on.
        None => call_driver!(cuMemGetAddressRange_v2(base, size, dptr)),
    }
}

/// Whether we answer `attribute` for a pooled pointer: its range (start and size) and its
/// buffer id are its block's; every other attribute is the driver's.
fn answered_by_block(attribute: c_int) -> bool {
    matches!(
        attribute,
        codes::POINTER_ATTRIBUTE_RANGE_START_ADDR
            | codes::POINTER_ATTRIBUTE_RANGE_SIZE
            | codes::POINTER_ATTRIBUTE_BUFFER_ID
    )
}

/// Write a pooled block's answer to one of the attributes of [`answered_by_block`].
///
/// # Safety
/// `data` must be valid for a write of the attribute's type.
unsafe fn write_block_attribute(data: *mut c_void, attribute: c_int, block: PooledBlock) {
    match attribute {
        codes::POINTER_ATTRIBUTE_RANGE_START_ADDR => {
            // SAFETY: a CUdeviceptr, per the caller's contract.
            unsafe { data.cast::<DevicePtr>().write(block.base) }
        }
        codes::POINTER_ATTRIBUTE_RANGE_SIZE => {
            // SAFETY: a size_t, per the caller's contract.
            unsafe { data.cast::<usize>().write(block.size as usize) }
        }
        _ => {
            // SAFETY: the buffer id is an unsigned long long, per the caller's contract.
            unsafe { data.cast::<u64>().write(block.buffer_id) }
        }
    }
}

/// `cuPointerGetAttribute`: a pooled pointer's range (start and size) and buffer id are its
/// block's; every other attribute is the driver's.
///
/// # Safety
/// `data` must be valid for a write of the attribute's type.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: c_int,
    ptr: DevicePtr,
) -> CuResult {
    if answered_by_block(attribute)
        && !data.is_null()
        && let Some(block) = our_block("cuPointerGetAttribute", ptr)
    {
        return match block {
            Ok(block) => {
                // SAFETY: non-null and valid for the attribute's type (CUDA's contract).
                unsafe { write_block_attribute(data, attribute, block) };
                SUCCESS
            }
            Err(code) => code,
        };
    }
    // The application's arguments, passed on.
    call_driver!(cuPointerGetAttribute(data, attribute, ptr))
}

/// `cuPointerGetAttributes`: the driver's answers, with a live pooled pointer's range and buffer
/// id replaced by its block's.
///
/// # Safety
/// `attributes` and `data` must be valid for `count` elements, each `data[i]` null or valid for
/// a write of `attributes[i]`'s type.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuPointerGetAttributes(
    count: c_uint,
    attributes: *mut c_int,
    data: *mut *mut c_void,
    ptr: DevicePtr,
) -> CuResult {
    // The application's arguments, passed on.
    let code = call_driver!(cuPointerGetAttributes(count, attributes, data, ptr));
    if code != SUCCESS || attributes.is_null() || data.is_null() {
        return code;
    }
    // Most callers (the runtime's `cudaPointerGetAttributes`: the memory type, the device, the
    // pointers) ask nothing a block answers, and finding the block of an interior pointer
    // walks its segment's blocks: an expandable range has hundreds.
    // SAFETY: `attributes` holds `count` elements (CUDA's contract).
    let asked = unsafe { std::slice::from_raw_parts(attributes, count as usize) };
    if !asked.iter().any(|&attribute| answered_by_block(attribute)) {
        return code;
    }
    if let Some(Ok(block)) = our_block("cuPointerGetAttributes", ptr) {
        for i in 0..count as usize {
            // SAFETY: both arrays hold `count` elements (CUDA's contract).
            let (attribute, slot) = unsafe { (attributes.add(i).read(), data.add(i).read()) };
            if answered_by_block(attribute) && !slot.is_null() {
                // SAFETY: `slot` is valid for the attribute's type (CUDA's contract).
                unsafe { write_block_attribute(slot, attribute, block) };
            }
        }
    }
    code
}

// ----- streams, captures, contexts ---------------------------------------------------------

/// Shared body of the stream-creation wrappers.
///
/// # Safety
/// `stream` must be valid for a write.
unsafe fn create_stream(stream: *mut Handle, flags: c_uint, priority: Option<c_int>) -> CuResult {
    if stream.is_null() {
        return codes::ERROR_INVALID_VALUE;
    }
    let real = || {
        let mut s: Handle = std::ptr::null_mut();
        // Valid out-pointer; flags and priority are the application's.
        let code = match priority {
            Some(p) => call_driver!(cuStreamCreateWithPriority(&mut s, flags, p)),
            None => call_driver!(cuStreamCreate(&mut s, flags)),
        };
        if code == SUCCESS {
            Ok(s as usize)
        } else {
            Err(code)
        }
    };
    match guarded("cuStreamCreate", || hooks::stream_create(flags, real), real) {
        Ok(s) => {
            // SAFETY: checked non-null; valid for a write per CUDA's contract.
            unsafe { stream.write(s as Handle) };
            SUCCESS
        }
        Err(code) => code,
    }
}

/// `cuStreamCreate`, noting the stream for fences.
///
/// # Safety
/// `stream` must be valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut Handle, flags: c_uint) -> CuResult {
    // SAFETY: forwarded contract.
    unsafe { create_stream(stream, flags, None) }
}

/// `cuStreamCreateWithPriority`, noting the stream for fences.
///
/// # Safety
/// `stream` must be valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    stream: *mut Handle,
    flags: c_uint,
    priority: c_int,
) -> CuResult {
    // SAFETY: forwarded contract.
    unsafe { create_stream(stream, flags, Some(priority)) }
}

/// `cuStreamDestroy_v2`.
///
/// # Safety
/// None beyond CUDA's: the handle is passed on.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: Handle) -> CuResult {
    let handle = stream as usize;
    // The application's handle, passed on.
    let real = |s: usize| call_driver!(cuStreamDestroy_v2(s as Handle));
    guarded(
        "cuStreamDestroy_v2",
        || hooks::stream_destroy(handle, real),
        || real(handle),
    )
}

/// Shared body of the capture-begin wrappers.
fn begin_capture(stream: Handle, mode: c_int, per_thread_default: bool) -> CuResult {
    let handle = stream as usize;
    let real = || {
        // The application's arguments, passed on.
        if per_thread_default {
            call_driver!(cuStreamBeginCapture_v2_ptsz(handle as Handle, mode))
        } else {
            call_driver!(cuStreamBeginCapture_v2(handle as Handle, mode))
        }
    };
    let arg = StreamArg {
        handle,
        per_thread_default,
    };
    guarded(
        "cuStreamBeginCapture",
        || hooks::stream_begin_capture(arg, real),
        real,
    )
}

/// `cuStreamBeginCapture_v2`, noting the capture.
///
/// # Safety
/// None beyond CUDA's: the handle is passed on.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(stream: Handle, mode: c_int) -> CuResult {
    begin_capture(stream, mode, false)
}

/// `cuStreamBeginCapture_v2_ptsz`, noting the capture.
///
/// # Safety
/// None beyond CUDA's: the handle is passed on.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuStreamBeginCapture_v2_ptsz(stream: Handle, mode: c_int) -> CuResult {
    begin_capture(stream, mode, true)
}

/// Shared body of the capture-end wrappers.
///
/// # Safety
/// `graph` must be valid for a write.
unsafe fn end_capture(stream: Handle, graph: *mut Handle, per_thread_default: bool) -> CuResult {
    let (handle, graph_out) = (stream as usize, graph as usize);
    let real = || {
        let (stream, graph) = (handle as Handle, graph_out as *mut Handle);
        // The application's arguments, passed on.
        if per_thread_default {
            call_driver!(cuStreamEndCapture_ptsz(stream, graph))
        } else {
            call_driver!(cuStreamEndCapture(stream, graph))
        }
    };
    let arg = StreamArg {
        handle,
        per_thread_default,
    };
    // The graph the capture made, once the real call wrote it (0: none).
    let made = move || {
        let graph = graph_out as *const Handle;
        // SAFETY: the application's out-pointer, valid for the real call that just wrote it
        // (the caller's contract); read only after a successful call.
        unsafe { graph.read() as usize }
    };
    guarded(
        "cuStreamEndCapture",
        || hooks::stream_end_capture(arg, real, made),
        real,
    )
}

/// `cuStreamEndCapture`, noting the end of the capture.
///
/// # Safety
/// `graph` must be valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuStreamEndCapture(stream: Handle, graph: *mut Handle) -> CuResult {
    // SAFETY: forwarded contract.
    unsafe { end_capture(stream, graph, false) }
}

/// `cuStreamEndCapture_ptsz`, noting the end of the capture.
///
/// # Safety
/// `graph` must be valid for a write.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuStreamEndCapture_ptsz(stream: Handle, graph: *mut Handle) -> CuResult {
    // SAFETY: forwarded contract.
    unsafe { end_capture(stream, graph, true) }
}

/// `cuCtxEnablePeerAccess` (a static runtime's `cudaDeviceEnablePeerAccess`): shares the peer
/// device's mapped memory with the current one.
///
/// # Safety
/// None beyond CUDA's.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer_context: Handle, flags: c_uint) -> CuResult {
    let context = peer_context as usize;
    // The application's arguments, passed on.
    let real = || call_driver!(cuCtxEnablePeerAccess(context as Handle, flags));
    guarded(
        "cuCtxEnablePeerAccess",
        || hooks::ctx_enable_peer_access(context, real),
        real,
    )
}

/// `cuDevicePrimaryCtxReset_v2` (a static runtime's `cudaDeviceReset`): forgets the device's
/// pools.
///
/// # Safety
/// None beyond CUDA's.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(device: c_int) -> CuResult {
    // The application's device, passed on.
    let real = || call_driver!(cuDevicePrimaryCtxReset_v2(device));
    guarded(
        "cuDevicePrimaryCtxReset_v2",
        || hooks::primary_context_reset(device, real),
        real,
    )
}
