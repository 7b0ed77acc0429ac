//! Reuse fences: a freed block is not handed out before a fence recorded after its free has
//! completed; waiting happens only when nothing else can serve; gating at the first stream.

use cachealloc_core::{AllocatorConfig, BlockState, ReusePolicy};

use crate::common::{Checked, MIB, fixed};

/// Fill the rest of the small segment that begins with a 4 KiB block (small-pool requests only).
fn fill_small_segment(c: &Checked) {
    c.malloc(MIB - 4096);
    c.malloc(MIB);
}

fn fenced() -> Checked {
    Checked::manual(
        1 << 34,
        AllocatorConfig {
            reuse: ReusePolicy::Fenced,
            ..fixed()
        },
    )
}

#[test]
fn freed_block_is_pending_and_still_active_in_stats() {
    let c = fenced();
    let a = c.malloc(4096);
    let f = c.free(a.address);
    assert!(f.pending);
    let s = c.stats();
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(
        s.active_bytes.all.current, 4096,
        "pending blocks stay active until their fence"
    );
    assert_eq!(
        c.alloc.lookup(a.address).unwrap().state,
        BlockState::PendingFree
    );
}

#[test]
fn no_reuse_before_the_fence_completes_when_other_memory_serves() {
    let c = fenced();
    let a = c.malloc(4096);
    c.free(a.address);
    // The same segment has free space after `a`: the request is served there, no waiting.
    let b = c.malloc(4096);
    assert_ne!(b.address, a.address);
    assert_eq!(c.device().counters().waits, 0);
    // The free of `a` was put behind a fence only when the cache missed: it did not miss yet.
    assert_eq!(c.device().counters().fences, 0);
}

#[test]
fn completed_fence_makes_the_block_reusable_without_waiting() {
    let c = fenced();
    let a = c.malloc(4096);
    fill_small_segment(&c);
    c.free(a.address);
    c.alloc.flush_fences().unwrap(); // closes the batch
    assert_eq!(c.device().counters().fences, 1);
    c.device().complete_fences(); // the GPU caught up
    let b = c.malloc(4096);
    assert_eq!(b.address, a.address);
    assert_eq!(c.device().counters().waits, 0);
    assert_eq!(c.stats().num_device_alloc, 1);
}

#[test]
fn ladder_waits_for_the_oldest_batch_before_growing() {
    let c = fenced();
    let a = c.malloc(4096);
    fill_small_segment(&c);
    c.free(a.address);
    let b = c.malloc(4096);
    assert_eq!(
        b.address, a.address,
        "waited for the fence instead of growing"
    );
    assert_eq!(c.device().counters().waits, 1);
    assert_eq!(c.stats().num_fence_waits, 1);
    assert_eq!(c.stats().num_device_alloc, 1);
}

#[test]
fn no_wait_when_pending_blocks_cannot_serve_the_request() {
    let c = fenced();
    let a = c.malloc(4096);
    c.free(a.address);
    let _big = c.malloc(50 * MIB);
    assert_eq!(
        c.device().counters().waits,
        0,
        "4 KiB pending cannot serve 50 MiB"
    );
}

#[test]
fn immediate_reuse_hands_the_block_back_at_once() {
    let c = Checked::manual(
        1 << 34,
        AllocatorConfig {
            reuse: ReusePolicy::Immediate,
            ..fixed()
        },
    );
    let a = c.malloc(4096);
    assert!(!c.free(a.address).pending);
    assert_eq!(c.malloc(4096).address, a.address);
    c.alloc.start_fencing().unwrap();
    let b = c.malloc(4096);
    assert!(
        !c.free(b.address).pending,
        "immediate policy never starts fencing"
    );
}

#[test]
fn auto_gates_cached_blocks_at_the_first_stream() {
    let c = Checked::manual(1 << 34, fixed());
    assert_eq!(c.alloc.config().reuse, ReusePolicy::Auto);
    let a = c.malloc(4096);
    fill_small_segment(&c);
    assert!(!c.free(a.address).pending, "no stream yet: immediate");
    c.alloc.start_fencing().unwrap(); // the app created its first stream
    c.check();
    assert_eq!(
        c.device().counters().fences,
        1,
        "one gate fence for all cached blocks"
    );
    // A new request must not take `a` before the gate completes: here the ladder waits for it.
    let b = c.malloc(4096);
    assert_eq!(b.address, a.address);
    assert_eq!(c.device().counters().waits, 1);
    // From now on frees are fenced.
    assert!(c.free(b.address).pending);
}

#[test]
fn gate_completes_through_polling() {
    let c = Checked::manual(1 << 34, fixed());
    let a = c.malloc(4096);
    c.free(a.address);
    c.alloc.start_fencing().unwrap();
    c.device().complete_fences();
    let b = c.malloc(4096);
    assert_eq!(b.address, a.address);
    assert_eq!(c.device().counters().waits, 0);
}

#[test]
fn empty_cache_waits_for_pending_blocks_then_releases() {
    let c = fenced();
    let a = c.malloc(12 * MIB);
    c.free(a.address);
    c.empty_cache();
    assert_eq!(c.device().used(), 0);
    assert_eq!(c.stats().active_bytes.all.current, 0);
}

#[test]
fn batches_complete_in_order() {
    let c = fenced();
    let a = c.malloc(4096);
    let b = c.malloc(4096);
    c.malloc(MIB - 8192);
    c.malloc(MIB);
    c.free(a.address);
    c.alloc.flush_fences().unwrap();
    c.free(b.address);
    c.alloc.flush_fences().unwrap();
    assert_eq!(c.device().counters().fences, 2);
    c.device().complete_fences();
    let x = c.malloc(8192);
    assert_eq!(
        x.address, a.address,
        "both batches done: a and b merged into one 8 KiB block"
    );
}

#[test]
fn a_full_open_batch_is_closed_without_a_cache_miss() {
    use cachealloc_core::pools::FENCE_BATCH_BLOCKS;
    let c = fenced();
    let blocks: Vec<_> = (0..FENCE_BATCH_BLOCKS + 1).map(|_| c.malloc(512)).collect();
    for b in &blocks[..FENCE_BATCH_BLOCKS - 1] {
        c.free(b.address);
    }
    c.malloc(512); // a hit; the batch is not full yet
    assert_eq!(c.device().counters().fences, 0);
    c.free(blocks[FENCE_BATCH_BLOCKS - 1].address);
    c.malloc(512); // still a hit, but the batch is full now: it is closed
    assert_eq!(c.device().counters().fences, 1);
    c.device().complete_fences();
    let again = c.malloc(512);
    assert_eq!(
        again.address, blocks[0].address,
        "the closed batch came back without a miss"
    );
}

#[test]
fn completed_frees_are_reported_with_the_applications_address_and_size() {
    let c = fenced();
    let a = c.malloc(4096);
    let b = c.malloc(4096);
    c.free(a.address);
    c.free(b.address);
    let changes = c.alloc.flush_fences().unwrap();
    assert!(
        changes.completed_frees.is_empty(),
        "the fence has not completed"
    );
    c.device().complete_fences();
    let mut changes = cachealloc_core::SegmentChanges::default();
    c.alloc.malloc_traced(512, 0, &mut changes).unwrap();
    // a and b merged into one free block, but each free is reported as the app knew it.
    assert_eq!(
        changes.completed_frees,
        vec![(a.address, 4096), (b.address, 4096)]
    );
}

#[test]
fn a_barrier_fences_even_an_empty_batch_and_orders_later_frees_after_it() {
    let c = fenced();
    let a = c.malloc(4096);
    fill_small_segment(&c);
    c.alloc.fence_barrier().unwrap(); // nothing pending: an empty batch behind a fence
    assert_eq!(c.device().counters().fences, 1);
    c.free(a.address);
    c.alloc.fence_barrier().unwrap(); // closes the open batch: no extra fence
    assert_eq!(c.device().counters().fences, 2);
    c.device().complete_fences();
    assert_eq!(c.malloc(4096).address, a.address);
    assert_eq!(c.device().counters().waits, 0);
}

#[test]
fn no_barrier_without_fencing() {
    let c = Checked::manual(
        1 << 34,
        AllocatorConfig {
            reuse: ReusePolicy::Immediate,
            ..fixed()
        },
    );
    c.alloc.fence_barrier().unwrap();
    assert_eq!(c.device().counters().fences, 0);
}
