//! Checkpoints of graph pools, for the Python integration's C++ allocator that serves
//! PyTorch's CUDA graph trees (`getCheckpointState`, `setCheckpointPoolState`,
//! `checkPoolLiveAllocations`): see `process::private_pools::checkpoints`.

use std::ffi::{c_int, c_void};

use super::guarded;
use crate::cuda::{self, CudaError};
use crate::process::{self, PoolCheckpoint};

/// Told of a block that a restore freed: `(context, address)`.
pub type FreedBlock = extern "C" fn(*mut c_void, u64);
/// Told of a block that a restore allocated again: `(context, address, size, stream)`, the
/// stream being the one the block belongs to (`cudaStreamLegacy` for the legacy default
/// stream).
pub type AllocatedBlock = extern "C" fn(*mut c_void, u64, u64, u64);

/// A checkpoint of the private pool `id` of `device`: its layout now, for
/// [`cachealloc_pool_restore`]. Null when there is no such pool or one of its blocks waits for
/// a fence. Released by [`cachealloc_pool_checkpoint_drop`].
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_pool_checkpoint(device: c_int, id: u64) -> *mut c_void {
    let checkpoint = guarded(
        "cachealloc_pool_checkpoint",
        || process::shim()?.pool_checkpoint((id, device)),
        || None,
    );
    checkpoint.map_or(std::ptr::null_mut(), |c| Box::into_raw(Box::new(c)).cast())
}

/// Release a checkpoint of [`cachealloc_pool_checkpoint`].
///
/// # Safety
/// `checkpoint` is null or a checkpoint of [`cachealloc_pool_checkpoint`], not released
/// before; it is not used after.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_pool_checkpoint_drop(checkpoint: *mut c_void) {
    if !checkpoint.is_null() {
        // SAFETY: the caller's contract: it came from Box::into_raw and is released once.
        drop(unsafe { Box::from_raw(checkpoint.cast::<PoolCheckpoint>()) });
    }
}

/// Put the checkpoint's pool back to it: every block the pool has allocated is freed (each
/// told to `freed`), then the blocks the checkpoint had allocated are allocated again (each
/// told to `allocated`); segments gained since stay, free. Returns 0, or
/// `cudaErrorInvalidValue` with nothing changed when the pool is gone or lost a segment of
/// the checkpoint.
///
/// # Safety
/// `checkpoint` is a live checkpoint of [`cachealloc_pool_checkpoint`]; the callbacks may be
/// called with `context` (from this thread, before this returns) and must not call back into
/// the library's pools.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_pool_restore(
    checkpoint: *const c_void,
    freed: FreedBlock,
    allocated: AllocatedBlock,
    context: *mut c_void,
) -> CudaError {
    if checkpoint.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's contract: a live checkpoint.
    let checkpoint = unsafe { &*checkpoint.cast::<PoolCheckpoint>() };
    let restored = guarded(
        "cachealloc_pool_restore",
        || match process::shim() {
            Some(shim) => shim.pool_restore(checkpoint),
            None => Err(cuda::ERROR_INITIALIZATION),
        },
        || Err(cuda::ERROR_INITIALIZATION),
    );
    match restored {
        Ok(restored) => {
            for f in &restored.freed {
                freed(context, f.address);
            }
            for a in &restored.allocated {
                allocated(context, a.address, a.size, a.stream);
            }
            cuda::SUCCESS
        }
        Err(code) => code,
    }
}

/// Tell `live` the address of each block the private pool `id` of `device` has allocated.
/// Returns how many, or -1 for no such pool.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_pool_live_blocks(
    device: c_int,
    id: u64,
    live: FreedBlock,
    context: *mut c_void,
) -> c_int {
    let blocks = guarded(
        "cachealloc_pool_live_blocks",
        || process::shim()?.pool_live_blocks((id, device)),
        || None,
    );
    match blocks {
        Some(blocks) => {
            for &address in &blocks {
                live(context, address);
            }
            blocks.len() as c_int
        }
        None => -1,
    }
}
