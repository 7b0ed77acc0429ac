//! Size classes, pool choice, split and merge at their edges, through the whole allocator.

use cachealloc_core::sizes::{LARGE_BUFFER, Roundup};
use cachealloc_core::{AllocatorConfig, BlockState, FreeError, NO_STREAM, PoolKind};

use crate::common::{Checked, MIB, fixed};

fn default() -> Checked {
    Checked::new(1 << 34, fixed())
}

#[test]
fn zero_byte_request_gets_a_min_block() {
    let c = default();
    let a = c.malloc(0);
    assert_eq!((a.size, a.requested, a.pool), (512, 0, PoolKind::Small));
    assert_eq!(c.stats().requested_bytes.all.current, 0);
    assert_eq!(
        c.stats().reserved_bytes.small_pool.current,
        (2 * MIB) as i64
    );
}

#[test]
fn exactly_one_mib_is_small_and_two_share_a_segment() {
    let c = default();
    let a = c.malloc(MIB);
    let b = c.malloc(MIB);
    assert_eq!(a.pool, PoolKind::Small);
    assert_eq!(a.segment_address, b.segment_address);
    assert_eq!(b.address, a.address + MIB);
    assert_eq!(c.stats().num_device_alloc, 1);
    let d = c.malloc(MIB + 1);
    assert_eq!(d.pool, PoolKind::Large);
    assert_eq!(d.size, MIB + 512);
}

#[test]
fn large_requests_below_10_mib_share_a_20_mib_segment() {
    let c = default();
    let a = c.malloc(6 * MIB);
    let b = c.malloc(6 * MIB);
    let d = c.malloc(6 * MIB);
    assert_eq!(a.segment_address, d.segment_address);
    assert_eq!(
        (b.address, d.address),
        (a.address + 6 * MIB, a.address + 12 * MIB)
    );
    // 2 MiB remain: more than 1 MiB, so that rest was split off and is free.
    let snap = c.alloc.snapshot();
    assert_eq!(snap.len(), 1);
    assert_eq!(snap[0].total_size, LARGE_BUFFER);
    assert_eq!(
        snap[0].blocks.last().map(|b| (b.size, b.state)),
        Some((2 * MIB, BlockState::Free))
    );
    assert_eq!(
        c.stats().inactive_split_bytes.large_pool.current,
        (2 * MIB) as i64
    );
}

#[test]
fn a_rest_of_exactly_one_mib_is_not_split_off() {
    let c = default();
    let a = c.malloc(19 * MIB);
    // 19 MiB ≥ 10 MiB gets its own segment, rounded to 2 MiB: 20 MiB. The 1 MiB rest is not
    // more than 1 MiB, so the block is the whole segment.
    assert_eq!(a.size, 20 * MIB);
    assert_eq!(a.requested, 19 * MIB);
    let b = c.malloc(9 * MIB);
    let snap = c.alloc.snapshot();
    let seg = snap
        .iter()
        .find(|s| s.address == b.segment_address)
        .unwrap();
    assert_eq!(
        seg.blocks.len(),
        2,
        "20 MiB - 9 MiB = 11 MiB rest is split off"
    );
}

#[test]
fn ten_mib_gets_its_own_segment() {
    let c = default();
    let a = c.malloc(10 * MIB);
    let snap = c.alloc.snapshot();
    assert_eq!((snap[0].total_size, a.size), (10 * MIB, 10 * MIB));
    let b = c.malloc(10 * MIB + 512);
    let seg = c
        .alloc
        .snapshot()
        .into_iter()
        .find(|s| s.address == b.segment_address)
        .unwrap();
    assert_eq!(seg.total_size, 12 * MIB);
    assert_eq!(
        seg.blocks.len(),
        2,
        "the 2 MiB - 512 B rest is more than 1 MiB and split off"
    );
}

#[test]
fn max_split_size_blocks_are_never_split() {
    let config = AllocatorConfig {
        max_split_size: 32 * MIB,
        ..fixed()
    };
    let c = Checked::new(1 << 34, config);
    let big = c.malloc(32 * MIB); // exactly max_split: oversize
    assert_eq!(c.stats().oversize_allocations.current, 1);
    assert_eq!(c.stats().oversize_segments.current, 1);
    c.free(big.address);
    // A smaller request never takes the oversize block.
    let small = c.malloc(31 * MIB);
    assert_ne!(small.segment_address, big.segment_address);
    // An oversize request within +20 MiB takes it whole, unsplit.
    let again = c.malloc(32 * MIB);
    assert_eq!((again.address, again.size), (big.address, 32 * MIB));
    c.free(again.address);
    // A bigger request needs a new segment.
    let bigger = c.malloc(40 * MIB);
    assert_ne!(bigger.address, big.address);
    // A 32 MiB block serves requests down to max_split but not one more than 20 MiB smaller.
    let cfg = AllocatorConfig {
        max_split_size: 24 * MIB,
        ..fixed()
    };
    let c = Checked::new(1 << 34, cfg);
    let huge = c.malloc(50 * MIB);
    c.free(huge.address);
    let near = c.malloc(30 * MIB + 512);
    assert_eq!(
        near.address, huge.address,
        "50 MiB < 30.0005 + 20 MiB: served"
    );
    c.free(near.address);
    let far = c.malloc(30 * MIB);
    assert_ne!(
        far.address, huge.address,
        "50 MiB is not below 30 + 20 MiB: refused"
    );
}

#[test]
fn free_merges_neighbours_in_any_order() {
    let c = default();
    let a = c.malloc(4096);
    let b = c.malloc(4096);
    let d = c.malloc(4096);
    let keep = c.malloc(4096);
    c.free(a.address);
    c.free(d.address);
    assert_eq!(
        c.stats().inactive_split.small_pool.current,
        3,
        "a, d and the segment's tail"
    );
    c.free(b.address);
    let snap = c.alloc.snapshot();
    assert_eq!(snap[0].blocks.len(), 3, "a+b+d merged; keep; the tail");
    assert_eq!(snap[0].blocks[0].size, 3 * 4096);
    c.free(keep.address);
    let snap = c.alloc.snapshot();
    assert_eq!(
        snap[0].blocks.len(),
        1,
        "everything merged back into one block"
    );
    assert_eq!(
        c.stats().inactive_split.all.current,
        0,
        "an unsplit free segment is not inactive_split"
    );
}

#[test]
fn blocks_never_merge_across_segments() {
    let c = default();
    // Two 2 MiB small segments; the simulated device places them back to back.
    let a = c.malloc(MIB);
    let b = c.malloc(MIB);
    let d = c.malloc(MIB);
    assert_ne!(a.segment_address, d.segment_address);
    assert_eq!(
        d.segment_address,
        a.segment_address + 2 * MIB,
        "adjacent segments"
    );
    c.free(b.address);
    c.free(d.address);
    let snap = c.alloc.snapshot();
    assert_eq!(snap.len(), 2);
    assert_eq!(snap[1].blocks.len(), 1);
    assert!(
        snap.iter()
            .all(|s| s.blocks.iter().map(|b| b.size).sum::<u64>() == s.total_size)
    );
}

#[test]
fn best_fit_prefers_smallest_then_lowest_address() {
    let c = default();
    let blocks: Vec<_> = (0..6).map(|_| c.malloc(8192)).collect();
    let _guard = c.malloc(512);
    // Free 0 and 4 (8 KiB each) and 2 (merged with nothing): three 8 KiB holes.
    for i in [4, 0, 2] {
        c.free(blocks[i].address);
    }
    let got = c.malloc(8000);
    assert_eq!(
        got.address, blocks[0].address,
        "lowest address among equal sizes"
    );
    let got = c.malloc(6000);
    assert_eq!(got.address, blocks[2].address);
}

#[test]
fn roundup_divisions_make_near_sizes_share_blocks() {
    let config = AllocatorConfig {
        roundup: Roundup::Uniform(4),
        ..fixed()
    };
    let c = Checked::new(1 << 34, config);
    let a = c.malloc(5 * MIB + 3);
    assert_eq!(a.size, 6 * MIB);
    c.free(a.address);
    let b = c.malloc(5 * MIB + 700_000);
    assert_eq!((b.address, b.size), (a.address, 6 * MIB));
}

#[test]
fn bad_frees_change_nothing() {
    let c = default();
    let a = c.malloc(4096);
    let before = c.stats();
    assert_eq!(c.alloc.free(0x1234), Err(FreeError::NotOurs(0x1234)));
    match c.alloc.free(a.address + 512) {
        Err(FreeError::InteriorPointer {
            block, offset: 512, ..
        }) => assert_eq!(block, a.address),
        other => panic!("expected an interior pointer error, got {other:?}"),
    }
    c.free(a.address);
    match c.alloc.free(a.address) {
        Err(FreeError::DoubleFree {
            address,
            state: BlockState::Free,
            ..
        }) => assert_eq!(address, a.address),
        other => panic!("expected a double free, got {other:?}"),
    }
    c.check();
    assert_eq!(before.reserved_bytes, c.stats().reserved_bytes);
    // A pointer past the end of a segment is not ours either.
    let seg_end = a.segment_address + 2 * MIB;
    assert_eq!(c.alloc.free(seg_end), Err(FreeError::NotOurs(seg_end)));
}

#[test]
fn lookup_finds_the_block_and_segment() {
    let c = default();
    let _a = c.malloc(4096);
    let b = c.malloc(4096);
    let info = c.alloc.lookup(b.address + 100).unwrap();
    assert_eq!(
        (info.block_address, info.block_size, info.state),
        (b.address, 4096, BlockState::Active)
    );
    assert_eq!(
        (info.segment_address, info.segment_size),
        (b.segment_address, 2 * MIB)
    );
    assert!(c.alloc.lookup(1).is_none());
}

#[test]
fn stats_follow_pytorch_meanings() {
    let c = default();
    let a = c.malloc(1000);
    let b = c.malloc(3 * MIB);
    let s = c.stats();
    assert_eq!(s.allocated_bytes.all.current, (1024 + 3 * MIB) as i64);
    assert_eq!(s.requested_bytes.all.current, (1000 + 3 * MIB) as i64);
    assert_eq!(s.reserved_bytes.all.current, (2 * MIB + 20 * MIB) as i64);
    assert_eq!(s.allocation.small_pool.current, 1);
    assert_eq!(s.segment.large_pool.current, 1);
    c.free(a.address);
    c.free(b.address);
    let s = c.stats();
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(s.allocated_bytes.all.peak, (1024 + 3 * MIB) as i64);
    assert_eq!(s.allocated_bytes.all.freed, (1024 + 3 * MIB) as i64);
    c.alloc.reset_peak_stats();
    assert_eq!(c.stats().allocated_bytes.all.peak, 0);
    c.alloc.reset_accumulated_stats();
    assert_eq!(c.stats().allocated_bytes.all.allocated, 0);
    assert_eq!(c.stats().num_device_alloc, 0);
    assert_eq!(
        c.stats().reserved_bytes.all.current,
        (22 * MIB) as i64,
        "currents survive resets"
    );
}

#[test]
fn empty_cache_releases_only_free_segments() {
    let c = default();
    let a = c.malloc(4096);
    let b = c.malloc(12 * MIB);
    let d = c.malloc(30 * MIB);
    c.free(b.address);
    c.free(d.address);
    c.empty_cache();
    let s = c.stats();
    assert_eq!(s.reserved_bytes.all.current, (2 * MIB) as i64);
    assert_eq!(s.num_device_free, 2);
    assert_eq!(c.device().live_segments(), 1);
    c.free(a.address);
    c.empty_cache();
    assert_eq!(c.device().used(), 0);
}

#[test]
fn device_reset_forgets_without_releasing() {
    let c = default();
    let a = c.malloc(4096);
    let _b = c.malloc(12 * MIB);
    c.free(a.address);
    c.alloc.forget_all();
    c.check();
    let s = c.stats();
    assert_eq!(s.reserved_bytes.all.current, 0);
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(s.num_device_alloc, 2, "accumulated counters survive");
    assert_eq!(
        c.device().counters().frees,
        0,
        "nothing was released on the device"
    );
    assert!(c.alloc.snapshot().is_empty());
}

#[test]
fn a_replayed_growth_gets_a_new_segment_at_the_planned_address() {
    use cachealloc_core::Allocator;
    use cachealloc_core::sim::SimDevice;
    let device = SimDevice::new(1 << 34);
    let planned = 0x5000_0000_0000;
    device.plan_addresses([(20 * MIB, 0x1000_0000_0000), (20 * MIB, planned)]);
    let a = Allocator::new(device, fixed());
    // The first small segment does not match the plan's size: fresh address, plan kept.
    let small = a.malloc(4096, 0).unwrap();
    assert_ne!(small.segment_address, 0x1000_0000_0000);
    // A cached block fits, yet the replay asks for a new segment: it gets one, planned.
    let first = a.malloc(3 * MIB, 0).unwrap();
    assert_eq!(first.segment_address, 0x1000_0000_0000);
    a.free(first.address).unwrap();
    let before = a.stats().num_device_alloc;
    let grown = a.malloc_from_new_segment(3 * MIB, NO_STREAM, 0).unwrap();
    assert_eq!(a.stats().num_device_alloc, before + 1);
    assert_ne!(grown.segment_address, first.segment_address);
    assert_eq!(grown.segment_address, planned);
    a.check_invariants().unwrap();
}

/// PyTorch's `_set_allocator_settings` at run time: the rounding and the split limit in force
/// apply to the next requests; blocks already handed out keep their sizes.
#[test]
fn settings_changed_at_run_time_apply_to_later_requests() {
    let c = default();
    let size = 84 * MIB;
    let before = c.malloc(size);
    assert_eq!(before.size, size, "no rounding by default");
    c.alloc.set_policy(&AllocatorConfig {
        roundup: Roundup::Uniform(4),
        ..fixed()
    });
    let after = c.malloc(size);
    assert_eq!(
        after.size,
        96 * MIB,
        "64..128 MiB in four steps: 84 MiB rounds to 96"
    );
    c.alloc.set_policy(&AllocatorConfig {
        max_split_size: 40 * MIB,
        ..fixed()
    });
    assert_eq!(c.stats().max_split_size, 40 * MIB);
    let plain = c.malloc(size);
    assert_eq!(plain.size, size, "the rounding went back to none");
    for a in [before, after, plain] {
        c.free(a.address);
    }
}
