//! Pool checkpoints: a pool put back to a checkpoint has the checkpoint's layout again, frees
//! what it allocated since and re-allocates what the checkpoint had, with stats and events
//! that agree; a checkpoint that cannot be restored changes nothing. See Note [Pool
//! checkpoints] in `pools::checkpoint`.

use cachealloc_core::{AllocatorConfig, Checkpoint, RestoreError, ReusePolicy};

use crate::common::{Checked, MIB, fixed};

const S: u64 = 0x5000;

/// A graph pool: fixed segments, frees in the stream's order.
fn graph_pool() -> Checked {
    Checked::new(1 << 34, fixed())
}

fn restore(c: &Checked, checkpoint: &Checkpoint) -> cachealloc_core::Restored {
    let restored = c.alloc.restore(checkpoint).expect("restorable");
    c.check();
    restored
}

fn addresses(list: impl Iterator<Item = u64>) -> Vec<u64> {
    let mut v: Vec<u64> = list.collect();
    v.sort_unstable();
    v
}

#[test]
fn restore_frees_what_came_after_and_reallocates_what_the_checkpoint_held() {
    let c = graph_pool();
    let a = c.malloc_on(MIB, S);
    let b = c.malloc_on(2 * MIB, S);
    let small = c.malloc_on(512, S);
    c.free_on(b.address, S);
    let checkpoint = c.alloc.checkpoint().expect("settled");
    let stats_at_checkpoint = c.stats();

    // Replays make tensors live that the books do not know; the program frees a, allocates d.
    c.free_on(a.address, S);
    let d = c.malloc_on(3 * MIB, S);
    let e = c.malloc_on(4096, S);

    let restored = restore(&c, &checkpoint);
    assert_eq!(
        addresses(restored.freed.iter().map(|f| f.address)),
        addresses([small.address, d.address, e.address].into_iter()),
        "every block allocated now is freed"
    );
    assert_eq!(
        addresses(restored.allocated.iter().map(|a| a.address)),
        addresses([a.address, small.address].into_iter()),
        "the checkpoint's allocated blocks come back"
    );
    for allocation in &restored.allocated {
        assert_eq!(allocation.stream, S);
    }
    assert_eq!(
        c.alloc.checkpoint().as_ref(),
        Some(&checkpoint),
        "same layout again"
    );
    let stats = c.stats();
    assert_eq!(
        stats.allocated_bytes.all.current,
        stats_at_checkpoint.allocated_bytes.all.current
    );
    assert_eq!(
        stats.reserved_bytes.all.current,
        stats_at_checkpoint.reserved_bytes.all.current
    );
    // The pool serves new requests around the restored blocks.
    let next = c.malloc_on(MIB, S);
    assert_ne!(next.address, a.address);
}

#[test]
fn segments_gained_after_the_checkpoint_stay_free() {
    let c = graph_pool();
    let a = c.malloc_on(MIB, S);
    let checkpoint = c.alloc.checkpoint().unwrap();
    let big = c.malloc_on(64 * MIB, S);
    let segments_before = c.stats().segment.all.current;
    let restored = restore(&c, &checkpoint);
    assert_eq!(restored.freed.len(), 2);
    assert_eq!(restored.allocated.len(), 1);
    assert_eq!(restored.allocated[0].address, a.address);
    assert_eq!(
        c.stats().segment.all.current,
        segments_before,
        "no segment is released"
    );
    let info = c.alloc.lookup(big.address).unwrap();
    assert_eq!(info.state, cachealloc_core::BlockState::Free);
    assert_eq!(
        info.block_size, info.segment_size,
        "the new segment is one free block"
    );
}

#[test]
fn every_restore_gives_the_checkpoints_layout_again() {
    let c = graph_pool();
    let blocks: Vec<_> = (1..=6).map(|i| c.malloc_on(i * 300 * 1024, S)).collect();
    c.free_on(blocks[1].address, S);
    c.free_on(blocks[4].address, S);
    let checkpoint = c.alloc.checkpoint().unwrap();
    for round in 0..3 {
        c.malloc_on(700 * 1024 + round * 4096, S);
        c.free_on(blocks[0].address, S);
        restore(&c, &checkpoint);
        let now = c.alloc.checkpoint().unwrap();
        for segment in &now.segments {
            match checkpoint
                .segments
                .iter()
                .find(|s| s.address == segment.address)
            {
                Some(then) => assert_eq!(segment, then, "round {round}"),
                None => assert!(
                    segment.blocks.len() == 1 && !segment.blocks[0].allocated,
                    "a segment gained since is one free block"
                ),
            }
        }
    }
}

#[test]
fn a_lost_segment_refuses_the_restore_and_changes_nothing() {
    let c = graph_pool();
    let a = c.malloc_on(64 * MIB, S);
    c.free_on(a.address, S);
    let checkpoint = c.alloc.checkpoint().unwrap();
    let kept = c.malloc_on(MIB, S);
    c.empty_cache(); // releases the free 64 MiB segment
    let before = c.alloc.snapshot();
    assert_eq!(
        c.alloc.restore(&checkpoint),
        Err(RestoreError::SegmentGone(a.segment_address))
    );
    assert_eq!(c.alloc.snapshot(), before);
    c.check();
    c.free_on(kept.address, S);
}

#[test]
fn a_checkpoint_that_does_not_tile_its_segment_is_refused() {
    let c = graph_pool();
    let a = c.malloc_on(MIB, S);
    let mut checkpoint = c.alloc.checkpoint().unwrap();
    checkpoint.segments[0].blocks[0].size += 512;
    let before = c.alloc.snapshot();
    assert_eq!(
        c.alloc.restore(&checkpoint),
        Err(RestoreError::BadLayout(a.segment_address))
    );
    assert_eq!(c.alloc.snapshot(), before);
}

#[test]
fn fenced_frees_cannot_be_restored() {
    let c = Checked::new(
        1 << 34,
        AllocatorConfig {
            reuse: ReusePolicy::Fenced,
            ..fixed()
        },
    );
    let a = c.malloc(MIB);
    let checkpoint = c.alloc.checkpoint().unwrap();
    let before = c.alloc.snapshot();
    assert_eq!(
        c.alloc.restore(&checkpoint),
        Err(RestoreError::NotSettled(a.address))
    );
    assert_eq!(c.alloc.snapshot(), before);
    c.free(a.address);
    assert!(
        c.alloc.checkpoint().is_none(),
        "a pending free has no place in a checkpoint"
    );
}
