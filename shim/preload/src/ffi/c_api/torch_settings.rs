//! The C API's calls for PyTorch's memory settings at run time, made by the Python
//! integration (see [`crate::process`]'s `torch_settings`): the memory fraction, the allocator
//! settings, caching on or off, `record_stream`; and the segments with their pools, kinds and blocks, for
//! PyTorch's snapshots.

use std::ffi::{c_char, c_int, c_void};

use cachealloc_core::{BlockState, PoolKind};

use super::write_text;
use crate::cuda::{self, CudaError};
use crate::ffi::guarded;
use crate::process;

/// Limit the memory that `device`'s pools hold in all (the ordinary pool and every private
/// pool) to `fraction` of the device's memory, as PyTorch's `set_per_process_memory_fraction`
/// does; 1.0 lifts the limit. Returns 0, or `cudaErrorInvalidValue` for a fraction outside
/// [0, 1] or a device without a pool.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_set_memory_fraction(device: c_int, fraction: f64) -> CudaError {
    guarded(
        "cachealloc_set_memory_fraction",
        || match process::shim().filter(|s| s.healthy()) {
            Some(shim) => match shim.set_memory_fraction(device, fraction) {
                Ok(()) => cuda::SUCCESS,
                Err(code) => code,
            },
            None => cuda::ERROR_INITIALIZATION,
        },
        || cuda::ERROR_INITIALIZATION,
    )
}

/// The fraction of `device`'s memory that its pools may hold (PyTorch's
/// `get_per_process_memory_fraction`): see `Shim::memory_fraction`. Returns -1.0 where the
/// library has no pools (passthrough).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_memory_fraction(device: c_int) -> f64 {
    guarded(
        "cachealloc_memory_fraction",
        || match process::shim().filter(|s| s.healthy()) {
            Some(shim) => shim.memory_fraction(device),
            None => -1.0,
        },
        || -1.0,
    )
}

/// PyTorch's allocator settings changed at run time (`torch.cuda.memory._set_allocator_settings`;
/// `settings` a NUL-terminated `PYTORCH_CUDA_ALLOC_CONF`-style string): see
/// `Shim::set_allocator_settings`. Returns 0, or `cudaErrorInvalidValue` with one message
/// naming the key and its valid values.
///
/// # Safety
/// `settings` must be null or a NUL-terminated string.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_set_allocator_settings(settings: *const c_char) -> CudaError {
    if settings.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    // SAFETY: a NUL-terminated string, per the contract.
    let text = unsafe { std::ffi::CStr::from_ptr(settings) }.to_string_lossy();
    guarded(
        "cachealloc_set_allocator_settings",
        || match process::shim().filter(|s| s.healthy()) {
            Some(shim) => match shim.set_allocator_settings(&text) {
                Ok(()) => cuda::SUCCESS,
                Err(why) => {
                    crate::log::error!("_set_allocator_settings: {why}");
                    cuda::ERROR_INVALID_VALUE
                }
            },
            None => cuda::ERROR_INITIALIZATION,
        },
        || cuda::ERROR_INITIALIZATION,
    )
}

/// Turn caching on (`on` non-zero) or off, as PyTorch's `caching_allocator_enable` does: while
/// it is off, new allocations go to CUDA, uncounted. Returns whether it was on before.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_caching_enable(on: c_int) -> c_int {
    guarded(
        "cachealloc_caching_enable",
        || {
            process::shim().map_or(1, |s| {
                let was = s.caching();
                s.set_caching(on != 0);
                was as c_int
            })
        },
        || 1,
    )
}

/// Write the segments of `device`'s pools (the ordinary pool, graph pools and `MemPool`s) —
/// JSON `[[address, size, first, second, expandable], ...]`: each segment's span, its pool's
/// id as PyTorch's pair ((0, 0): the ordinary pool) and whether it is expandable — into `buf`,
/// as [`cachealloc_stats_json`](super::cachealloc_stats_json) writes its text. What the Python integration sets each
/// snapshot segment's `segment_pool_id` and `is_expandable` from.
///
/// # Safety
/// `buf` must be null or valid for `len` bytes of writes.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_segments_json(
    device: c_int,
    buf: *mut c_char,
    len: usize,
) -> usize {
    let text = guarded(
        "cachealloc_segments_json",
        || process::shim().map_or_else(|| "[]".to_string(), |s| s.segments_json(device)),
        || "[]".to_string(),
    );
    // SAFETY: the caller's contract.
    unsafe { write_text(&text, buf, len) }
}

/// `tensor.record_stream(stream)` for the block at `address` (the base of the tensor's
/// storage): work queued on `stream` uses it, and its free waits for that work (Note [Recorded
/// streams] in `process::recorded_streams`). Returns 0 if recorded, 1 if `address` is not a
/// live block of ours (the Python integration then leaves the call to PyTorch).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_record_stream(address: u64, stream: usize) -> c_int {
    guarded(
        "cachealloc_record_stream",
        || match process::shim().filter(|s| s.healthy()) {
            Some(shim) if shim.record_stream(address, shim.stream_key(stream)) => 0,
            _ => 1,
        },
        || 1,
    )
}

/// Told of a segment by [`cachealloc_segments_walk`]: `(context, fields)`, the fields being
/// `[address, total_size, pool_first, pool_second, expandable, large, stream, requested]`
/// (`large`: 1 for the large pool's segments; `stream`: the library's key of the stream it
/// serves; `requested`: the requested bytes of its active blocks).
pub type SegmentFn = extern "C" fn(*mut c_void, *const u64);
/// Told of each block of the segment last told, in address order from the segment's start:
/// `(context, fields)`, the fields being `[address, size, requested, state]`, `state` 0 for
/// allocated, 1 for freed and waiting for the device (active), 2 for free, 3 for address
/// space of an expandable segment with no memory behind it.
pub type BlockFn = extern "C" fn(*mut c_void, *const u64);

/// Tell `segment` of each segment of `device`'s pools (the ordinary pool, graph pools and
/// `MemPool`s), each followed by its blocks through `block`: the layout PyTorch's
/// `snapshot()` describes, for the C++ allocator the Python integration installs. Returns the
/// number of segments told (0 without pools).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_segments_walk(
    device: c_int,
    segment: SegmentFn,
    block: BlockFn,
    context: *mut c_void,
) -> c_int {
    let segments = guarded(
        "cachealloc_segments_walk",
        || process::shim().map(|s| s.segment_snapshots(device)),
        || None,
    )
    .unwrap_or_default();
    for (pool, s) in &segments {
        let fields = [
            s.address,
            s.total_size,
            pool >> 32,
            pool & 0xFFFF_FFFF,
            s.expandable as u64,
            (s.pool == PoolKind::Large) as u64,
            s.stream,
            s.requested_size,
        ];
        segment(context, fields.as_ptr());
        for b in &s.blocks {
            let state = match b.state {
                BlockState::Active => 0,
                BlockState::PendingFree => 1,
                BlockState::Free => 2,
                BlockState::Unmapped => 3,
            };
            block(
                context,
                [b.address, b.size, b.requested_size, state].as_ptr(),
            );
        }
    }
    segments.len() as c_int
}
