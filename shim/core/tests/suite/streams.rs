//! Stream-ordered reuse: a block belongs to its stream; freed on that stream it is reusable at
//! once there (no fence, no wait), and never serves another stream; freed elsewhere or
//! synchronously it waits for a fence. See Note [Stream-ordered reuse] in `pools`.

use cachealloc_core::{AllocatorConfig, BlockState, NO_STREAM, ReusePolicy};

use crate::common::{Checked, MIB, fixed};

const A: u64 = 0xa000;
const B: u64 = 0xb000;

/// An allocator with `policy` whose fences complete only when the test says so, after the
/// application created its first stream (so `auto` fences synchronous frees).
fn with_streams(policy: ReusePolicy) -> Checked {
    let c = Checked::manual(
        1 << 34,
        AllocatorConfig {
            reuse: policy,
            ..fixed()
        },
    );
    c.alloc.start_fencing().unwrap();
    c
}

#[test]
fn freed_on_its_stream_is_reused_there_at_once() {
    let c = with_streams(ReusePolicy::Auto);
    let a = c.malloc_on(4096, A);
    assert_eq!(a.stream, A);
    let f = c.free_on(a.address, A);
    assert!(!f.pending, "no fence is needed in the stream's own order");
    assert_eq!(c.alloc.lookup(a.address).unwrap().state, BlockState::Free);
    let again = c.malloc_on(4096, A);
    assert_eq!(again.address, a.address);
    let counters = c.device().counters();
    assert_eq!((counters.fences, counters.waits), (0, 0));
    assert_eq!(c.stats().num_device_alloc, 1);
}

#[test]
fn a_streams_blocks_never_serve_another_stream() {
    let c = with_streams(ReusePolicy::Auto);
    let a = c.malloc_on(4 * MIB, A);
    c.free_on(a.address, A);
    let b = c.malloc_on(4 * MIB, B);
    assert_ne!(b.address, a.address);
    assert_eq!(b.stream, B);
    let seg_a = c.alloc.lookup(a.address).unwrap().segment_address;
    let seg_b = c.alloc.lookup(b.address).unwrap().segment_address;
    assert_ne!(seg_a, seg_b, "B got a segment of its own");
    let sync = c.malloc(4 * MIB);
    let seg_sync = c.alloc.lookup(sync.address).unwrap().segment_address;
    assert!(seg_sync != seg_a && seg_sync != seg_b);
    assert_eq!(c.stats().num_device_alloc, 3);
    let streams: Vec<u64> = c.alloc.snapshot().iter().map(|s| s.stream).collect();
    assert!(streams.contains(&A) && streams.contains(&B) && streams.contains(&NO_STREAM));
}

#[test]
fn freed_on_another_stream_is_adopted_behind_a_device_side_wait() {
    let c = with_streams(ReusePolicy::Auto);
    let a = c.malloc_on(4096, A);
    c.malloc_on(MIB - 4096, A); // fill the segment: a new request cannot go elsewhere in it
    c.malloc_on(MIB, A);
    let f = c.free_on(a.address, B);
    assert!(f.pending, "A's next work is not ordered after B's free");
    assert_eq!(c.device().counters().fences, 0, "batched until needed");
    // Nothing else fits in A's lists: A is made to wait for B's free on the device, and the
    // block is reused at once — no host wait, no new segment.
    let reused = c.malloc_on(4096, A);
    assert_eq!(reused.address, a.address);
    let counters = c.device().counters();
    assert_eq!(
        (counters.fences, counters.stream_waits, counters.waits),
        (1, 1, 0)
    );
    assert_eq!(c.stats().num_device_alloc, 1);
}

#[test]
fn a_cross_stream_free_completes_on_its_own_fence() {
    let c = with_streams(ReusePolicy::Auto);
    let a = c.malloc_on(4096, A);
    c.free_on(a.address, B);
    c.alloc.flush_fences().unwrap();
    assert_eq!(
        c.alloc.lookup(a.address).unwrap().state,
        BlockState::PendingFree
    );
    c.device().complete_fences();
    c.alloc.flush_fences().unwrap();
    assert_eq!(c.alloc.lookup(a.address).unwrap().state, BlockState::Free);
    assert_eq!(c.device().counters().stream_waits, 0);
}

/// Regression: a block freed on B waited in B's open batch; B's thread destroyed B; another
/// thread's allocation then closed the batch by recording a fence on B — a dangling handle (a
/// segmentation fault in `cuStreamQuery` on an H100). The batch is closed before the destroy.
#[test]
fn a_stream_being_destroyed_gets_its_fence_before_it_goes() {
    let c = with_streams(ReusePolicy::Auto);
    let a = c.malloc_on(4096, A);
    c.malloc_on(MIB - 4096, A); // fill the segment: A's next request needs the freed block
    c.malloc_on(MIB, A);
    c.free_on(a.address, B);
    assert_eq!(c.device().counters().fences, 0, "batched until needed");
    c.alloc.stream_destroying(B).unwrap();
    assert_eq!(
        c.device().counters().fences,
        1,
        "B's fence, recorded while B exists"
    );
    c.device().destroy_stream(B);
    let reused = c.malloc_on(4096, A); // SimDevice panics if this records on B
    assert_eq!(reused.address, a.address);
    assert_eq!(c.device().counters().stream_waits, 1);
}

#[test]
fn blocks_freed_on_another_stream_never_serve_that_stream() {
    let c = with_streams(ReusePolicy::Auto);
    let a = c.malloc_on(4096, A);
    c.free_on(a.address, B);
    let b = c.malloc_on(4096, B);
    assert_ne!(b.address, a.address, "the block is A's, whoever freed it");
    assert_eq!(c.device().counters().stream_waits, 0);
}

#[test]
fn a_synchronous_free_of_a_stream_block_is_fenced() {
    let c = with_streams(ReusePolicy::Auto);
    let a = c.malloc_on(4096, A);
    assert!(c.free(a.address).pending);
    assert_eq!(
        c.alloc.lookup(a.address).unwrap().state,
        BlockState::PendingFree
    );
}

#[test]
fn reuse_fenced_fences_even_frees_on_the_blocks_stream() {
    let c = with_streams(ReusePolicy::Fenced);
    let a = c.malloc_on(4096, A);
    assert!(c.free_on(a.address, A).pending);
}

#[test]
fn reuse_immediate_never_fences() {
    let c = with_streams(ReusePolicy::Immediate);
    let a = c.malloc_on(4096, A);
    assert!(!c.free_on(a.address, B).pending);
    assert!(!c.free(c.malloc_on(4096, A).address).pending);
}

#[test]
fn the_first_stream_gates_only_blocks_without_a_stream() {
    let c = Checked::manual(1 << 34, fixed());
    let sync = c.malloc(4096);
    let on_a = c.malloc_on(4096, A);
    c.free(sync.address);
    c.free_on(on_a.address, A);
    c.alloc.start_fencing().unwrap(); // the gate fence, not completed
    assert_eq!(
        c.malloc_on(4096, A).address,
        on_a.address,
        "A's free block was freed in A's order: still safe for A"
    );
    assert_eq!(c.device().counters().waits, 0);
    assert_eq!(c.malloc(4096).address, sync.address);
    assert_eq!(
        c.device().counters().waits,
        1,
        "the unordered block was reused only after waiting for the gate"
    );
}

#[test]
fn empty_cache_releases_every_streams_segments() {
    let c = with_streams(ReusePolicy::Auto);
    for stream in [A, B, NO_STREAM] {
        let x = c.malloc_on(30 * MIB, stream);
        c.free_on(x.address, stream);
    }
    c.empty_cache();
    assert_eq!(c.stats().reserved_bytes.all.current, 0);
    assert_eq!(c.device().used(), 0);
}

#[test]
fn out_of_memory_releases_other_streams_cache_before_failing() {
    let c = Checked::manual(64 * MIB, fixed());
    c.alloc.start_fencing().unwrap();
    let x = c.malloc_on(40 * MIB, A);
    c.free_on(x.address, A);
    // B cannot use A's cached segment, but the ladder empties the cache and grows for B.
    let y = c.malloc_on(40 * MIB, B);
    assert_eq!(y.stream, B);
    assert_eq!(c.stats().num_device_free, 1);
}

/// PyTorch's view of the statistics counts stream-ordered memory only: what the synchronous
/// API allocates (libraries' own `cudaMalloc`s, which PyTorch never sees) is left out of every
/// array, while the whole allocator's statistics count both. Note [PyTorch's view of the
/// statistics] in `stats`.
#[test]
fn pytorchs_view_counts_stream_ordered_memory_only() {
    for (name, config) in crate::common::presets() {
        let c = Checked::new(1 << 34, config);
        let library = c.malloc(64 * MIB);
        let tensor = c.malloc_on(3 * MIB, A);
        let whole = c.stats();
        let view = whole.stream_ordered_view();
        assert_eq!(
            view.allocated_bytes.all.current as u64, tensor.size,
            "{name}: allocated"
        );
        assert_eq!(
            whole.allocated_bytes.all.current as u64,
            tensor.size + library.size,
            "{name}: the whole allocator's allocated"
        );
        assert_eq!(view.allocation.all.current, 1, "{name}: allocations");
        assert_eq!(
            view.requested_bytes.all.allocated as u64,
            3 * MIB,
            "{name}: requested"
        );
        let reserved = view.reserved_bytes.all.current as u64;
        assert!(
            reserved >= tensor.size && reserved < tensor.size + library.size,
            "{name}: reserved {reserved} should hold the tensor's segment, not the library's"
        );
        assert_eq!(
            view.reserved_bytes.large_pool.current, view.reserved_bytes.all.current,
            "{name}: pools within the view"
        );
        c.free(library.address);
        c.free_on(tensor.address, A);
        c.empty_cache();
        let view = c.stats().stream_ordered_view();
        assert_eq!(
            (
                view.allocated_bytes.all.current,
                view.reserved_bytes.all.current
            ),
            (0, 0),
            "{name}: all given back"
        );
        assert_eq!(
            view.allocated_bytes.all.freed as u64, tensor.size,
            "{name}: freed"
        );
        assert_eq!(
            view.allocated_bytes.all.peak as u64, tensor.size,
            "{name}: the view's own peak"
        );
    }
}

/// Note [Held frees]: a block freed while other streams' work may use it (`record_stream`) is
/// no longer allocated but still active, is never reused while held, and once released goes
/// where its free would have sent it (here: its own stream's list, at once).
#[test]
fn a_held_free_is_not_allocated_and_not_reused_until_released() {
    let c = with_streams(ReusePolicy::Auto);
    let a = c.malloc_on(4 * MIB, A);
    let f = c.alloc.free_held(a.address, A).unwrap();
    c.check();
    assert!(f.pending);
    let s = c.stats();
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(s.active_bytes.all.current, a.size as i64);
    assert_eq!(
        c.stats().stream_ordered_view().allocated_bytes.all.current,
        0
    );
    assert_eq!(
        c.alloc.lookup(a.address).unwrap().state,
        BlockState::PendingFree
    );
    let other = c.malloc_on(4 * MIB, A);
    assert_ne!(other.address, a.address, "a held block was reused");
    c.alloc.flush_fences().unwrap();
    c.device().complete_fences();
    c.empty_cache();
    assert_eq!(
        c.alloc.lookup(a.address).unwrap().state,
        BlockState::PendingFree
    );
    assert!(c.alloc.release_held(a.address));
    c.check();
    assert!(!c.alloc.release_held(a.address));
    assert_eq!(c.alloc.lookup(a.address).unwrap().state, BlockState::Free);
    assert_eq!(c.stats().active_bytes.all.current, other.size as i64);
    assert_eq!(c.malloc_on(4 * MIB, A).address, a.address);
}
