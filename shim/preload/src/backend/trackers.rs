//! Segment trackers: functions the program attached to be told of the device memory the pools
//! take from the device and give back — PyTorch's `attachAllocatorTraceTracker`, served through
//! the C++ allocator for PyTorch (`cachealloc_attach_segment_tracker`).
//!
//! # Note [Segment trackers]
//!
//! PyTorch's allocator calls each attached tracker with every entry it records. Who attaches
//! one cares about segments: `ProcessGroupNCCL` registers each new segment with its NCCL
//! communicators and deregisters it before it is freed (`register_mem_pool`, as Megatron's NCCL
//! user buffers and symmetric memory use it; every segment of the default pool with
//! `TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1`), and torchcomms does the same for its
//! RDMA registration cache. NCCL checks both ends strictly: registering a segment twice, or
//! deregistering one it was never told of, is an error. So a tracker hears, from the device
//! layer ([`CudaDevice`](super::CudaDevice)), of exactly the memory the device gives and takes:
//!
//! * `SEGMENT_ALLOC` after a segment was allocated (from the driver, or from a `MemPool`'s own
//!   allocator such as NCCL's `ncclMemAlloc`), before any of it is handed out;
//! * `SEGMENT_FREE` when a segment leaves the pools — before the device frees it (a private
//!   pool's release waits until the pool is unused, and the segment has already left the
//!   pool's snapshot, which is what `deregister_mem_pool` walks);
//! * `SEGMENT_MAP` after memory was mapped into an expandable segment (a move maps memory at a
//!   second place), `SEGMENT_UNMAP` after a mapping was unmapped, as PyTorch's expandable
//!   segments record them (NCCL ignores both; PyTorch turns NCCL's registration of every
//!   segment off with expandable segments, and the shim then keeps PyTorch's memory in fixed
//!   segments: `settings`).
//!
//! Each with the device, the address and size, and the pool's id (0 for the device's own pool;
//! a `MemPool`'s or a graph pool's id as the Python integration packs PyTorch's pair).
//!
//! **Never under the allocator's lock.** PyTorch calls its trackers with its allocator's lock
//! held; the device layer calls ours outside the pools' lock (the core never holds it across a
//! device call). That matters more here than natively: a tracker's own library allocates
//! device memory — NCCL's `cudaMalloc`s reach the pools through the shim, where natively they
//! bypass PyTorch's allocator — and such an allocation would wait for the lock its own thread
//! holds.
//!
//! **Not told twice on one thread.** For the same reason, a tracker that allocates enough to
//! make a segment would be called again on its own thread, inside itself (NCCL's tracker holds
//! a non-recursive mutex). A segment made while a tracker runs on the thread is therefore not
//! told, and is remembered, so that its release is not told either: trackers never hear of it,
//! as natively they never hear of the libraries' own `cudaMalloc`s. A release of a segment
//! that *was* told, made while a tracker runs on the same thread (an out-of-memory ladder
//! inside a tracker), cannot be told without that deadlock: it is logged and not told.

use std::cell::Cell;
use std::collections::BTreeSet;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, RwLock};

use crate::log;

/// A tracker: `(action, device, address, size, pool)`, `action` one of the `SEGMENT_*` below.
pub type SegmentTracker = extern "C" fn(c_int, c_int, u64, u64, u64);

/// A segment was allocated.
pub const SEGMENT_ALLOC: c_int = 1;
/// A segment leaves the pools, to be freed.
pub const SEGMENT_FREE: c_int = 2;
/// Memory was mapped into an expandable segment.
pub const SEGMENT_MAP: c_int = 3;
/// Memory of an expandable segment was unmapped.
pub const SEGMENT_UNMAP: c_int = 4;

static TRACKERS: RwLock<Vec<SegmentTracker>> = RwLock::new(Vec::new());
/// Whether any tracker is attached: the one load a segment event costs without one.
static ATTACHED: AtomicBool = AtomicBool::new(false);
/// Segments and mappings made while a tracker ran on their thread: (device, address).
static UNTOLD: Mutex<BTreeSet<(c_int, u64)>> = Mutex::new(BTreeSet::new());

thread_local! {
    /// Whether a tracker runs on this thread now.
    static TELLING: Cell<bool> = const { Cell::new(false) };
}

/// Attach `tracker`: from now on it hears of every segment event, in any thread.
pub fn attach(tracker: SegmentTracker) {
    TRACKERS
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .push(tracker);
    ATTACHED.store(true, Ordering::Release);
}

/// Tell the trackers of `action` on `[address, address + size)` of `device`'s pool `pool`
/// (see the Note for when each is told).
pub fn tell(action: c_int, device: c_int, address: u64, size: u64, pool: u64) {
    if !ATTACHED.load(Ordering::Acquire) {
        return;
    }
    let made = matches!(action, SEGMENT_ALLOC | SEGMENT_MAP);
    // A thread that is exiting has no flag left: tell nothing rather than risk a nested call.
    let Ok(nested) = TELLING.try_with(|t| t.replace(true)) else {
        return;
    };
    let mut untold = UNTOLD.lock().unwrap_or_else(|p| p.into_inner());
    let skip = if made {
        if nested {
            untold.insert((device, address));
        }
        nested
    } else {
        let was_untold = untold.remove(&(device, address));
        if nested && !was_untold {
            log::error!(
                "device {device}: memory at {address:#x} was given back while a segment tracker \
                 ran on the same thread; the trackers are not told of it"
            );
        }
        nested || was_untold
    };
    drop(untold);
    if !skip {
        let trackers = TRACKERS.read().unwrap_or_else(|p| p.into_inner()).clone();
        for tracker in trackers {
            tracker(action, device, address, size, pool);
        }
    }
    if !nested {
        let _ = TELLING.try_with(|t| t.set(false));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a tracker was told: (action, device, address, size, pool).
    type Told = (c_int, c_int, u64, u64, u64);
    static HEARD: Mutex<Vec<Told>> = Mutex::new(Vec::new());

    /// Records what it hears; on the allocation at 0x1000 it reports a nested allocation and
    /// release at 0x9000, as a tracker whose own library allocates would cause.
    extern "C" fn recording(action: c_int, device: c_int, address: u64, size: u64, pool: u64) {
        HEARD
            .lock()
            .unwrap()
            .push((action, device, address, size, pool));
        if action == SEGMENT_ALLOC && address == 0x1000 {
            tell(SEGMENT_ALLOC, device, 0x9000, 64, 0);
        }
    }

    #[test]
    fn trackers_hear_segments_once_and_never_inside_themselves() {
        tell(SEGMENT_ALLOC, 0, 0x500, 8, 0); // none attached: nobody hears
        attach(recording);
        tell(SEGMENT_ALLOC, 1, 0x1000, 4096, 7);
        tell(SEGMENT_MAP, 1, 0x2000, 2048, 0);
        tell(SEGMENT_FREE, 1, 0x9000, 64, 0); // made inside the tracker: not told
        tell(SEGMENT_FREE, 1, 0x1000, 4096, 7);
        tell(SEGMENT_UNMAP, 1, 0x2000, 2048, 0);
        let heard = HEARD.lock().unwrap().clone();
        assert_eq!(
            heard,
            vec![
                (SEGMENT_ALLOC, 1, 0x1000, 4096, 7),
                (SEGMENT_MAP, 1, 0x2000, 2048, 0),
                (SEGMENT_FREE, 1, 0x1000, 4096, 7),
                (SEGMENT_UNMAP, 1, 0x2000, 2048, 0),
            ]
        );
        assert!(
            UNTOLD.lock().unwrap().is_empty(),
            "the untold release is forgotten"
        );
        assert!(
            !TELLING.with(Cell::get),
            "the thread is told again afterwards"
        );
    }
}
