//! The C API's calls for sharing pooled blocks with other processes (PyTorch's CUDA tensors
//! sent through `torch.multiprocessing`; see Note [IPC of pooled memory] in the shim's
//! `process`): by a fixed segment's 64-byte IPC handle, or by a variable-length description
//! of a block of either kind of segment.

use std::ffi::{CStr, c_char};

use super::write_text;
use crate::cuda::{self, CudaError};
use crate::ffi::guarded;
use crate::process;

/// Share the pooled block at `ptr` with another process (PyTorch's `_share_cuda_`; see Note
/// [IPC of pooled memory] in the shim's `process`): writes its segment's
/// `cudaIpcMemHandle_t` into `handle` (64 bytes), the offset of `ptr` in that segment into
/// `offset`, and the reference counter the receiver releases — a file name into `counter`
/// (NUL-terminated, `counter_len` bytes at most) and a slot into `slot`. Returns 0, or
/// `cudaErrorInvalidValue` (with one message saying why) when `ptr` cannot be shared. A block
/// of an expandable segment is refused: [`cachealloc_ipc_share_desc`] shares it.
///
/// # Safety
/// `handle` valid for 64 bytes of writes, `offset` and `slot` for one `u64` each, `counter`
/// for `counter_len` bytes.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_ipc_share(
    ptr: u64,
    handle: *mut u8,
    offset: *mut u64,
    counter: *mut c_char,
    counter_len: usize,
    slot: *mut u64,
) -> CudaError {
    if handle.is_null() || offset.is_null() || counter.is_null() || slot.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    let shared = guarded(
        "cachealloc_ipc_share",
        || match process::shim() {
            Some(shim) => shim.ipc_share(ptr, false).map_err(|why| {
                crate::log::error!("sharing a CUDA allocation with another process: {why}");
                cuda::ERROR_INVALID_VALUE
            }),
            None => Err(cuda::ERROR_INITIALIZATION),
        },
        || Err(cuda::ERROR_INITIALIZATION),
    );
    match shared {
        Ok(share) => {
            let (bytes, at) = match share.what {
                process::Shared::Segment { handle, offset } => (handle, offset),
                process::Shared::Mapped(_) => return cuda::ERROR_INVALID_VALUE, // never shared
            };
            if share.counter.len() + 1 > counter_len {
                // Not handed over: no receiver will release it.
                if let Some(shim) = process::shim() {
                    shim.ipc_unshare(&share);
                }
                return cuda::ERROR_INVALID_VALUE;
            }
            // SAFETY: the caller's contract: each out-pointer is valid for what is written.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), handle, 64);
                offset.write(at);
                slot.write(share.slot);
                write_text(&share.counter, counter, counter_len);
            }
            cuda::SUCCESS
        }
        Err(code) => code,
    }
}

/// Share the pooled block at `ptr` with another process, whatever its segment's kind (see
/// Note [IPC of pooled memory] in the shim's `process`): writes the block's description (its
/// fixed segment's IPC handle and offset, or the memory mapped over it in an expandable
/// segment, exported as file descriptors this process keeps open until the counter is
/// released; the format is `process::ipc::description`'s) into `desc` (`desc_len` bytes at
/// most), and the reference counter the receiver releases — a file name into `counter`
/// (NUL-terminated; `counter_len` must be at least 64) and a slot into `slot`. Returns the
/// description's length. When that exceeds `desc_len` nothing is shared: call again with a
/// buffer that long. Returns 0 (with one message saying why) when `ptr` cannot be shared.
///
/// # Safety
/// `desc` valid for `desc_len` bytes of writes, `counter` for `counter_len` bytes, `slot`
/// for one `u64`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_ipc_share_desc(
    ptr: u64,
    desc: *mut u8,
    desc_len: usize,
    counter: *mut c_char,
    counter_len: usize,
    slot: *mut u64,
) -> usize {
    if desc.is_null() || counter.is_null() || slot.is_null() || counter_len < 64 {
        return 0;
    }
    let shared = guarded(
        "cachealloc_ipc_share_desc",
        || {
            let shim = process::shim()?;
            match shim.ipc_share(ptr, true) {
                Ok(share) => Some((shim, share)),
                Err(why) => {
                    crate::log::error!("sharing a CUDA allocation with another process: {why}");
                    None
                }
            }
        },
        || None,
    );
    let Some((shim, share)) = shared else {
        return 0;
    };
    let bytes = share.what.encode();
    if bytes.len() > desc_len {
        shim.ipc_unshare(&share);
        return bytes.len();
    }
    // SAFETY: the caller's contract: each out-pointer is valid for what is written (the
    // counter's name is under 64 bytes, `ipc_counters`).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), desc, bytes.len());
        slot.write(share.slot);
        write_text(&share.counter, counter, counter_len);
    }
    bytes.len()
}

/// In the receiving process: map the block described by `desc` (`len` bytes, from
/// [`cachealloc_ipc_share_desc`]) for the current device, its segment or range once for all
/// the blocks received through it. Returns the block's address (not its segment's), or 0 (with
/// one message saying why).
///
/// # Safety
/// `desc` valid for `len` bytes of reads.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_ipc_open_desc(desc: *const u8, len: usize) -> u64 {
    // SAFETY: the caller's contract.
    let Some(shared) = (unsafe { read_description(desc, len) }) else {
        return 0;
    };
    guarded(
        "cachealloc_ipc_open_desc",
        || {
            process::ipc_open_shared(&shared).unwrap_or_else(|why| {
                crate::log::error!("mapping a CUDA allocation of another process: {why}");
                0
            })
        },
        || 0,
    )
}

/// In the receiving process: a block received through `desc` (`len` bytes) is let go; its
/// segment or range is unmapped with the last of them.
///
/// # Safety
/// `desc` valid for `len` bytes of reads.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_ipc_close_desc(desc: *const u8, len: usize) -> CudaError {
    // SAFETY: the caller's contract.
    let Some(shared) = (unsafe { read_description(desc, len) }) else {
        return cuda::ERROR_INVALID_VALUE;
    };
    guarded(
        "cachealloc_ipc_close_desc",
        || process::ipc_close_shared(&shared),
        || cuda::ERROR_INITIALIZATION,
    )
}

/// Decode a description of `len` bytes at `desc` (saying why not).
///
/// # Safety
/// `desc` null or valid for `len` bytes of reads.
unsafe fn read_description(desc: *const u8, len: usize) -> Option<process::Shared> {
    if desc.is_null() || len == 0 {
        return None;
    }
    // SAFETY: the caller's contract.
    let bytes = unsafe { std::slice::from_raw_parts(desc, len) };
    process::Shared::decode(bytes)
        .inspect_err(|why| crate::log::error!("{why}"))
        .ok()
}

/// In the receiving process: map the segment named by `handle` (64 bytes) on the current
/// device, once per handle (PyTorch's `_new_shared_cuda`). Returns its address, or 0.
///
/// # Safety
/// `handle` valid for 64 bytes of reads.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_ipc_open(handle: *const u8) -> u64 {
    if handle.is_null() {
        return 0;
    }
    let mut bytes = [0u8; 64];
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(handle, bytes.as_mut_ptr(), 64) };
    guarded(
        "cachealloc_ipc_open",
        || process::ipc_open(bytes),
        || Err(cuda::ERROR_INITIALIZATION),
    )
    .unwrap_or(0)
}

/// In the receiving process: a block received through `handle` is let go; the segment is
/// unmapped with the last of them.
///
/// # Safety
/// `handle` valid for 64 bytes of reads.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_ipc_close(handle: *const u8) -> CudaError {
    if handle.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    let mut bytes = [0u8; 64];
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(handle, bytes.as_mut_ptr(), 64) };
    guarded(
        "cachealloc_ipc_close",
        || process::ipc_close(bytes),
        || cuda::ERROR_INITIALIZATION,
    )
}

/// In the receiving process: release the sender's reference counter (`counter`, a file name
/// from [`cachealloc_ipc_share`] or [`cachealloc_ipc_share_desc`], and `slot`), so that it may
/// reuse the block. Call it once the work queued on the block has finished: the sender may
/// hand the block to new work at once.
///
/// # Safety
/// `counter` must be null or a valid NUL-terminated string.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_ipc_release(counter: *const c_char, slot: u64) -> CudaError {
    if counter.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    let Ok(name) = unsafe { CStr::from_ptr(counter) }.to_str() else {
        return cuda::ERROR_INVALID_VALUE;
    };
    let name = name.to_owned();
    guarded(
        "cachealloc_ipc_release",
        || match process::ipc_release(&name, slot) {
            Ok(()) => cuda::SUCCESS,
            Err(why) => {
                crate::log::error!("{why}");
                cuda::ERROR_INVALID_VALUE
            }
        },
        || cuda::ERROR_INITIALIZATION,
    )
}

/// In the sharing process: whether the receiver has let go of slot `slot` of this process's
/// counter `counter` (from [`cachealloc_ipc_share_desc`]): 1 released, 0 still held, -1 when
/// `counter` is not one of this process's counters. What the Python integration keeps alive
/// for a share (the event the receiver waits on) may go once it is released.
///
/// # Safety
/// `counter` must be null or a valid NUL-terminated string.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_ipc_sent_released(counter: *const c_char, slot: u64) -> i32 {
    if counter.is_null() {
        return -1;
    }
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    let Ok(name) = unsafe { CStr::from_ptr(counter) }.to_str() else {
        return -1;
    };
    let name = name.to_owned();
    guarded(
        "cachealloc_ipc_sent_released",
        || match process::ipc_sent_released(&name, slot) {
            Some(released) => i32::from(released),
            None => -1,
        },
        || -1,
    )
}
