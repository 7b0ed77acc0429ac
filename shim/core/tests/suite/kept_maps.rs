//! Pools that keep their maps (a private pool's expandable segments; Note [Kept maps] in
//! `pools::expandable`): maps in PyTorch's pages, nothing given back until `empty_cache`,
//! checkpoints of runs of mapped memory, and the address space freed once the pool is empty.

use cachealloc_core::{BlockState, Checkpoint, RestoreError};

use crate::common::{Checked, MIB};
use crate::expandable::{expandable, reserved};

const S: u64 = 0x5000;

/// A private pool's allocator with expandable segments over a device of `capacity` bytes.
fn kept(capacity: u64) -> Checked {
    let c = Checked::new(capacity, expandable());
    c.alloc.keep_maps();
    c
}

/// The (size, state) of every mapped block of the large pool, in address order: what
/// PyTorch's test reads from the snapshot.
fn large_mapped_blocks(c: &Checked) -> Vec<(u64, BlockState)> {
    (c.alloc.snapshot().iter())
        .filter(|s| s.pool == cachealloc_core::PoolKind::Large)
        .flat_map(|s| s.blocks.iter())
        .filter(|b| b.state != BlockState::Unmapped)
        .map(|b| (b.size, b.state))
        .collect()
}

fn restore(c: &Checked, checkpoint: &Checkpoint) -> cachealloc_core::Restored {
    let restored = c.alloc.restore(checkpoint).expect("restorable");
    c.check();
    restored
}

#[test]
fn maps_are_made_in_pytorchs_pages() {
    let c = kept(1 << 34);
    let a = c.malloc_on(2 * MIB, S);
    assert_eq!(reserved(&c), 20 * MIB, "a large request maps a 20 MiB page");
    use BlockState::{Active, Free};
    assert_eq!(
        large_mapped_blocks(&c),
        [(2 * MIB, Active), (18 * MIB, Free)]
    );
    let b = c.malloc_on(10 * MIB, S);
    assert_eq!(
        b.address,
        a.address + a.size,
        "the page's rest serves the next"
    );
    assert_eq!(reserved(&c), 20 * MIB);
    c.malloc_on(4096, S);
    assert_eq!(reserved(&c), 22 * MIB, "a small request maps one granule");
}

#[test]
fn nothing_is_given_back_until_the_cache_is_emptied() {
    let c = kept(128 * MIB);
    let a = c.malloc_on(20 * MIB, S);
    let b = c.malloc_on(20 * MIB, S);
    c.free_on(a.address, S);
    // A new peak: an ordinary pool would recycle a's memory into the map.
    let d = c.malloc_on(40 * MIB, S);
    assert_eq!(reserved(&c), 80 * MIB, "a's memory stays mapped");
    assert_eq!(c.device().counters().unmaps, 0);
    // Out of memory: an ordinary pool would unmap a's 20 MiB and try again.
    assert!(c.try_malloc_on(60 * MIB, S).is_err());
    assert_eq!(
        c.device().counters().unmaps,
        0,
        "no unmap on the way to OOM"
    );
    assert_eq!(reserved(&c), 80 * MIB);
    assert_eq!(
        c.alloc.lookup(a.address).map(|i| i.state),
        Some(BlockState::Free),
        "a's memory is still there for a replay to write"
    );
    // Once the pool is given up: empty_cache unmaps, and the address space goes too.
    c.free_on(b.address, S);
    c.free_on(d.address, S);
    c.empty_cache();
    assert_eq!(reserved(&c), 0);
    assert_eq!(c.device().mapped_bytes(), 0);
    assert_eq!(c.alloc.snapshot().len(), 1, "the range is still reserved");
    assert_eq!(c.alloc.free_empty_ranges(), 0, "the device freed the range");
    assert!(c.alloc.snapshot().is_empty(), "no range is left");
    c.check();
}

/// PyTorch's `test_graph_memory_stats_and_use_result_after_destroy_graph` with expandable
/// segments: a graph's result outlives the graph; once the pool's cache is emptied it keeps
/// its whole 20 MiB page mapped, and every other page is given back.
#[test]
fn a_live_block_keeps_its_page_and_no_more() {
    let c = kept(1 << 34);
    // A chain of clones as a capture makes them: each result ~1 MiB, the previous freed.
    let size = MIB + 512;
    let mut b = c.malloc_on(size, S);
    for _ in 0..5 {
        let next = c.malloc_on(size, S);
        c.free_on(b.address, S);
        b = next;
    }
    // More than b's page has left: one more page, joined to the free end of b's.
    let big = c.malloc_on(30 * MIB, S);
    assert_eq!(reserved(&c), 40 * MIB);
    c.free_on(big.address, S);
    c.empty_cache();
    assert_eq!(reserved(&c), 20 * MIB, "b's page, whole, and nothing else");
    assert_eq!(c.device().mapped_bytes(), 20 * MIB);
    c.free_on(b.address, S);
    c.empty_cache();
    assert_eq!(reserved(&c), 0);
    c.check();
}

#[test]
fn the_address_space_of_a_range_with_memory_is_kept() {
    let c = kept(1 << 34);
    let a = c.malloc_on(2 * MIB, S);
    c.malloc_on(4096, S);
    c.free_on(a.address, S);
    c.empty_cache(); // the large range is empty, the small one holds a block
    assert_eq!(c.alloc.free_empty_ranges(), 0);
    let left = c.alloc.snapshot();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].pool, cachealloc_core::PoolKind::Small);
    c.check();
}

/// PyTorch's `test_expandable_segment_checkpoint_growth`, on the pools: a run that grew after
/// a checkpoint is put back to it with the grown memory free around the checkpoint's blocks.
#[test]
fn a_run_that_grew_is_put_back_to_its_checkpoint() {
    use BlockState::{Active, Free};
    let c = kept(1 << 34);
    let original = c.alloc.checkpoint().expect("settled");
    assert!(original.segments.is_empty());

    let a = c.malloc_on(2 * MIB, S);
    let small = c.alloc.checkpoint().expect("settled");
    assert_eq!(small.segments.len(), 1, "one run of mapped memory");
    assert_eq!(small.segments[0].size, 20 * MIB);
    c.free_on(a.address, S);
    restore(&c, &original);

    let b = c.malloc_on(32 * MIB, S);
    assert_eq!(b.address, a.address, "the free page joins the next map");
    assert_eq!(
        large_mapped_blocks(&c),
        [(32 * MIB, Active), (8 * MIB, Free)]
    );

    let freed = restore(&c, &original).freed;
    assert_eq!(
        freed.iter().map(|f| f.address).collect::<Vec<_>>(),
        [b.address]
    );
    let again = restore(&c, &small);
    assert_eq!(
        again
            .allocated
            .iter()
            .map(|x| (x.address, x.size))
            .collect::<Vec<_>>(),
        [(a.address, 2 * MIB)]
    );
    assert_eq!(
        large_mapped_blocks(&c),
        [(2 * MIB, Active), (38 * MIB, Free)],
        "the memory mapped since stays, free, merged"
    );
    assert_eq!(reserved(&c), 40 * MIB, "a private pool never shrinks");
}

#[test]
fn a_checkpoint_of_memory_since_unmapped_is_refused() {
    let c = kept(1 << 34);
    let a = c.malloc_on(2 * MIB, S);
    let checkpoint = c.alloc.checkpoint().expect("settled");
    c.free_on(a.address, S);
    c.empty_cache();
    let before = c.alloc.snapshot();
    assert_eq!(
        c.alloc.restore(&checkpoint),
        Err(RestoreError::SegmentGone(a.address))
    );
    assert_eq!(c.alloc.snapshot(), before, "nothing was changed");
}

#[test]
fn a_checkpoint_of_a_range_skips_its_unmapped_space() {
    let c = kept(1 << 34);
    let a = c.malloc_on(2 * MIB, S);
    let b = c.malloc_on(30 * MIB, S);
    let checkpoint = c.alloc.checkpoint().expect("settled");
    let run: Vec<_> = checkpoint.segments[0]
        .blocks
        .iter()
        .map(|x| (x.address, x.size, x.allocated))
        .collect();
    assert_eq!(
        run,
        [
            (a.address, 2 * MIB, true),
            (b.address, 30 * MIB, true),
            (b.address + 30 * MIB, 8 * MIB, false)
        ],
        "40 MiB mapped: the checkpoint's run stops where the mapped memory does"
    );
    assert_eq!(checkpoint.segments[0].size, 40 * MIB);
}
