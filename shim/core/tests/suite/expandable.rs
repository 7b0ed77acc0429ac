//! Expandable segments: growth by mapping only what a request still needs, free splitting and
//! merging, unmapping on `empty_cache` and in the out-of-memory ladder, ranges per stream, and
//! the fallback on a device without virtual memory. (The conformance suite runs its scenarios
//! over expandable presets too, and the property test over random sequences.)

use cachealloc_core::{
    AllocError, Allocator, AllocatorConfig, BlockState, Expandable, NO_STREAM, ReusePolicy,
    SimDevice,
};

use crate::common::{Checked, GRANULARITY, MIB, fixed};

pub(crate) fn expandable() -> AllocatorConfig {
    AllocatorConfig {
        expandable_segments: Expandable::On,
        ..fixed()
    }
}

pub(crate) fn reserved(c: &Checked) -> u64 {
    c.stats().reserved_bytes.all.current as u64
}

#[test]
fn growth_maps_only_the_granules_a_request_still_needs() {
    let c = Checked::new(1 << 30, expandable());
    let a = c.malloc(3 * MIB);
    assert_eq!(reserved(&c), 4 * MIB, "two granules for 3 MiB");
    // The next request starts in the free MiB at the end and maps one more granule.
    let b = c.malloc(3 * MIB);
    assert_eq!(b.address, a.address + a.size, "blocks are contiguous");
    assert_eq!(reserved(&c), 6 * MIB);
    // Two maps (device allocations in the stats), one mapping each: a mapping is never
    // smaller than MIN_MAPPING but a map's last.
    assert_eq!(c.device().counters().maps, 2);
    assert_eq!(c.device().counters().allocs, 0, "no fixed segment");
    assert_eq!(
        c.stats().num_device_alloc,
        2,
        "maps count as device allocations"
    );
    assert_eq!(c.stats().segment.all.current, 0, "a range is not a segment");
    assert_eq!(c.device().mapped_bytes(), 6 * MIB);
}

#[test]
fn a_variable_workload_reserves_less_than_with_fixed_segments() {
    // Batches of growing, then shrinking, then growing sizes: fixed segments keep the early
    // ones cached; an expandable range reuses their bytes for the later ones.
    let run = |config: AllocatorConfig| {
        let c = Checked::new(1 << 32, config);
        let mut peak_reserved = 0u64;
        let mut peak_allocated = 0u64;
        for step in 0..40u64 {
            let batch = 1 + (step * 7) % 13;
            let live: Vec<_> = (0..4)
                .map(|i| c.malloc(batch * (3 * MIB + i * 100_000)).address)
                .collect();
            let s = c.stats();
            peak_reserved = peak_reserved.max(s.reserved_bytes.all.current as u64);
            peak_allocated = peak_allocated.max(s.allocated_bytes.all.current as u64);
            for a in live {
                c.free(a);
            }
        }
        (peak_reserved, peak_allocated)
    };
    let (fixed_peak, _) = run(fixed());
    let (expandable, allocated) = run(expandable());
    assert!(
        expandable < fixed_peak,
        "expandable {expandable} vs fixed {fixed_peak} bytes"
    );
    assert!(
        expandable <= allocated + 2 * GRANULARITY,
        "expandable reserves {expandable} for {allocated} allocated"
    );
}

#[test]
fn max_split_size_does_not_apply_inside_a_range() {
    let c = Checked::new(
        1 << 30,
        AllocatorConfig {
            max_split_size: 20 * MIB,
            ..expandable()
        },
    );
    let big = c.malloc(100 * MIB);
    c.free(big.address);
    let small = c.malloc(4 * MIB);
    assert_eq!(small.address, big.address, "carved from the big free block");
    assert_eq!(reserved(&c), 100 * MIB);
}

#[test]
fn empty_cache_unmaps_whole_free_granules_and_keeps_live_memory() {
    let c = Checked::new(1 << 30, expandable());
    let a = c.malloc(3 * MIB);
    let b = c.malloc(5 * MIB);
    let d = c.malloc(3 * MIB);
    assert_eq!(reserved(&c), 12 * MIB);
    c.free(b.address);
    c.empty_cache();
    // b covered [3, 8) MiB: the granules [4, 8) go; [3, 4) shares a granule with a.
    assert_eq!(reserved(&c), 8 * MIB);
    assert_eq!(c.device().mapped_bytes(), 8 * MIB);
    assert!(c.device().is_backed(a.address, a.size) && c.device().is_backed(d.address, d.size));
    assert_eq!(c.stats().num_device_free, 1, "b's map: one mapping");
    // Freed memory comes back by mapping the hole again: the next 4 MiB request maps it.
    let e = c.malloc(4 * MIB);
    assert_eq!(e.address, a.address + a.size, "the hole is reused");
    assert_eq!(reserved(&c), 12 * MIB);
    for x in [a, d, e] {
        c.free(x.address);
    }
    c.empty_cache();
    assert_eq!(reserved(&c), 0);
    assert_eq!(c.device().used(), 0, "everything unmapped");
}

/// Driver calls so far: mappings made, aliases made, unmaps.
pub(crate) fn driver_calls(c: &Checked) -> (u64, u64, u64) {
    let k = c.device().counters();
    (k.maps, k.aliases, k.unmaps)
}

/// Three 8 MiB blocks, the middle one freed, then a 16 MiB request: recycling moves the free
/// memory into the new map (an alias, no unmap) and parks its place. Returns a, c, d.
fn recycle_by_a_move(c: &Checked) -> (u64, u64, u64) {
    let a = c.malloc(8 * MIB);
    let b = c.malloc(8 * MIB);
    let third = c.malloc(8 * MIB);
    c.free(b.address);
    let d = c.malloc(16 * MIB);
    assert_eq!(d.address, third.address + 8 * MIB);
    assert_eq!(
        driver_calls(c),
        (4, 1, 0),
        "b's memory moved into d's map, which made one new mapping"
    );
    assert_eq!(
        c.device().memory_of(b.address, 8 * MIB),
        c.device().memory_of(d.address, 8 * MIB),
        "b's place is parked: still mapped, to the memory now at the start of d"
    );
    assert_eq!(reserved(c), 32 * MIB, "b's memory counts once");
    assert_eq!(c.device().mapped_bytes(), 32 * MIB);
    (a.address, third.address, d.address)
}

/// Note [Moving memory instead of unmapping it]: memory that moved flips back to its parked
/// place when a map needs the place and the memory is free where it went, with no driver call.
#[test]
fn moved_memory_flips_back_to_its_parked_place_without_a_driver_call() {
    let c = Checked::new(1 << 30, expandable());
    let (a, _third, d) = recycle_by_a_move(&c);
    // d's first 8 MiB (b's memory) becomes free between two live blocks; a is freed.
    c.free(d);
    let e = c.malloc(8 * MIB);
    let f = c.malloc(8 * MIB);
    assert_eq!((e.address, f.address), (d, d + 8 * MIB));
    c.free(e.address);
    c.free(a);
    let calls = driver_calls(&c);
    // 16 MiB fit in no free block: the map of b's parked place joins a's free memory, and the
    // memory at e's place flips back.
    let g = c.malloc(16 * MIB);
    assert_eq!(g.address, a, "served from a and b's places");
    assert_eq!(driver_calls(&c), calls, "no driver call");
    assert_eq!(reserved(&c), 32 * MIB);
    for x in [g.address, f.address, _third] {
        c.free(x);
    }
    c.empty_cache();
    assert_eq!(reserved(&c), 0);
    assert_eq!(
        c.device().used(),
        0,
        "every place of the memory unmapped, the parked ones too"
    );
}

/// A map goes around a parked place whose memory is in use elsewhere (it would have to be
/// unmapped first, after a wait for the device if it was used lately); where there is no other
/// room, the place is cleared (its mapping unmapped, which frees nothing) and new memory mapped
/// there. The check after every step proves no live blocks share memory.
#[test]
fn a_map_goes_around_a_parked_place_in_use_and_clears_it_only_when_there_is_no_room() {
    for (capacity, no_room) in [(1 << 30, false), (48 * MIB, true)] {
        // 48 MiB: the range is 54 MiB, and [40, 54) cannot hold 16 MiB.
        let c = Checked::new(capacity, expandable());
        let (a, _third, d) = recycle_by_a_move(&c);
        c.free(d);
        let e = c.malloc(8 * MIB);
        let f = c.malloc(8 * MIB);
        assert_eq!((e.address, f.address), (d, d + 8 * MIB));
        c.free(a);
        let (maps, aliases, unmaps) = driver_calls(&c);
        let g = c.malloc(16 * MIB);
        if no_room {
            assert_eq!(g.address, a);
            assert_eq!(
                driver_calls(&c),
                (maps + 1, aliases, unmaps + 1),
                "the parked place unmapped, new memory mapped there"
            );
        } else {
            assert_eq!(g.address, f.address + 8 * MIB, "mapped past f");
            assert_eq!(driver_calls(&c).2, unmaps, "nothing unmapped");
        }
        assert_eq!(c.device().mapped_bytes(), reserved(&c));
    }
}

/// A map that ends inside a parked place maps only the granules its request needs: the place
/// is cleared whole and the rest of it is address space again. Mapping the whole place would
/// take reserved memory over the limit here (a spurious OOM the property test found).
#[test]
fn a_map_into_part_of_a_parked_place_maps_only_what_the_request_needs() {
    let limited = AllocatorConfig {
        per_process_memory_fraction: 0.5, // 44 MiB
        ..expandable()
    };
    let c = Checked::new(88 * MIB, limited);
    // a, b's parked place [8, 16) (its memory in d, live), third, d; then 6 MiB past d.
    let (a, _third, d) = recycle_by_a_move(&c);
    assert_eq!(c.malloc(6 * MIB).address, d + 16 * MIB);
    c.free(a);
    assert_eq!(
        c.malloc(4 * MIB).address,
        a,
        "4 MiB of a's memory free after it"
    );
    assert_eq!(reserved(&c), 38 * MIB);
    let (maps, aliases, unmaps) = driver_calls(&c);
    // 8 MiB: a's free 4 MiB and 4 MiB of the parked place (42 MiB reserved); the whole place,
    // or 8 MiB past the last block, would take 46 MiB.
    let e = c.malloc(8 * MIB);
    assert_eq!(e.address, a + 4 * MIB);
    assert_eq!(reserved(&c), 42 * MIB);
    assert_eq!(
        driver_calls(&c),
        (maps + 1, aliases, unmaps + 1),
        "the parked place unmapped whole, new memory mapped in its first half"
    );
    assert!(c.device().is_backed(a + 8 * MIB, 4 * MIB));
    assert!(
        !c.device().is_backed(a + 12 * MIB, 4 * MIB),
        "its rest unmapped"
    );
    // The rest of the place is address space like any other.
    c.free(e.address);
    assert_eq!(c.malloc(10 * MIB).address, a + 4 * MIB);
    assert_eq!(reserved(&c), 44 * MIB, "at the limit");
    assert_eq!(c.device().mapped_bytes(), reserved(&c));
}

/// The control: a device that cannot alias memory recycles by unmapping, and the same steps
/// call the driver.
#[test]
fn without_aliases_recycling_unmaps_and_maps_again() {
    let device = SimDevice::new(1 << 30).with_map_granularity(GRANULARITY);
    device.set_aliasing(false);
    let c = Checked::on(device, expandable());
    let a = c.malloc(8 * MIB);
    let b = c.malloc(8 * MIB);
    c.malloc(8 * MIB);
    c.free(b.address);
    c.malloc(16 * MIB);
    assert_eq!(
        driver_calls(&c),
        (5, 0, 1),
        "b unmapped, 16 MiB of new memory"
    );
    assert_eq!(reserved(&c), 32 * MIB);
    c.free(a.address);
}

#[test]
fn the_oom_ladder_unmaps_free_memory_before_it_fails() {
    // 64 MiB device: a free 2 MiB granule in the small pool, and 30 MiB free before a live
    // 30 MiB block in the large pool. A 32 MiB request fits only once both are unmapped.
    let c = Checked::new(64 * MIB, expandable());
    let small = c.malloc(4096);
    let first = c.malloc(30 * MIB);
    let _second = c.malloc(30 * MIB);
    c.free(small.address);
    c.free(first.address);
    let held = c.malloc(32 * MIB);
    assert_eq!(
        c.stats().num_alloc_retries,
        1,
        "the ladder released memory first"
    );
    assert_eq!(
        c.stats().num_device_free,
        5,
        "the small pool's granule and the 4 mappings of the first 30 MiB (8, 8, 8 and 6 MiB)"
    );
    assert_eq!(reserved(&c), 62 * MIB);
    // Now it truly cannot fit.
    match c.try_malloc(4 * MIB) {
        Err(AllocError::OutOfMemory(report)) => {
            assert_eq!(report.segment_size, 4 * MIB);
            assert_eq!(report.device_free, 2 * MIB);
        }
        other => panic!("expected OOM, got {other:?}"),
    }
    c.free(held.address);
    c.malloc(4 * MIB);
}

#[test]
fn a_failed_map_leaves_the_range_unmapped_and_the_request_fails_cleanly() {
    let c = Checked::new(1 << 30, expandable());
    c.device().fail_next_allocs(3);
    assert!(matches!(
        c.try_malloc(8 * MIB),
        Err(AllocError::OutOfMemory(_))
    ));
    assert_eq!(reserved(&c), 0);
    assert_eq!(c.device().mapped_bytes(), 0);
    c.malloc(8 * MIB);
}

#[test]
fn each_stream_and_pool_has_its_own_range() {
    let c = Checked::new(1 << 30, expandable());
    let on_a = c.malloc_on(3 * MIB, 0x11);
    let on_b = c.malloc_on(3 * MIB, 0x22);
    let sync = c.malloc(3 * MIB);
    let small = c.malloc_on(4096, 0x11);
    let ranges: Vec<_> = c
        .alloc
        .snapshot()
        .into_iter()
        .filter(|s| s.expandable)
        .map(|s| (s.stream, s.pool, s.address))
        .collect();
    assert_eq!(ranges.len(), 4, "{ranges:x?}");
    for a in [on_a, on_b, sync, small] {
        assert!(
            ranges
                .iter()
                .any(|&(stream, pool, address)| stream == a.stream
                    && pool == a.pool
                    && address == a.segment_address)
        );
    }
    // A stream's free memory never serves another stream.
    c.free_on(on_a.address, 0x11);
    let again = c.malloc_on(3 * MIB, 0x22);
    assert_ne!(again.segment_address, on_a.segment_address);
    assert_eq!(NO_STREAM, sync.stream);
}

#[test]
fn the_gate_keeps_memory_freed_before_the_first_stream_from_new_requests() {
    let c = Checked::manual(
        1 << 30,
        AllocatorConfig {
            reuse: ReusePolicy::Auto,
            ..expandable()
        },
    );
    let a = c.malloc(3 * MIB);
    c.free(a.address);
    // The first stream appears: the free 4 MiB (maybe still used by queued work) are gated. A
    // 5 MiB request would start there and map one granule more; under the gate it must not.
    // (`malloc` would wait for the gate before growing; growing at once is what a thread does
    // when another one took the lock meanwhile, and what `simulate` replays.)
    c.alloc.start_fencing().unwrap();
    let b = c
        .alloc
        .malloc_from_new_segment(5 * MIB, NO_STREAM, 0)
        .unwrap();
    c.check();
    assert!(
        b.address >= a.address + 4 * MIB,
        "gated memory was handed out again: {:#x} after {:#x}, counters {:?}",
        b.address - a.address,
        a.size,
        c.device().counters()
    );
    assert_eq!(c.device().counters().waits, 0);
    c.device().complete_fences();
    c.check();
}

#[test]
fn a_device_without_virtual_memory_gets_fixed_segments() {
    let alloc = Allocator::new(SimDevice::new(1 << 30), expandable());
    assert!(!alloc.expandable());
    let a = alloc.malloc(3 * MIB, 0).unwrap();
    assert_eq!(alloc.device().counters().allocs, 1);
    assert_eq!(alloc.stats().segment.all.current, 1);
    alloc.free(a.address).unwrap();
    alloc.check_invariants().unwrap();
    let with_vmm = Allocator::new(
        SimDevice::new(1 << 30).with_map_granularity(GRANULARITY),
        expandable(),
    );
    assert!(with_vmm.expandable());
}

#[test]
fn unmapped_address_space_is_nobodys() {
    let c = Checked::new(1 << 30, expandable());
    let a = c.malloc(3 * MIB);
    let beyond = a.segment_address + 64 * MIB;
    assert!(c.alloc.lookup(beyond).is_none());
    assert!(matches!(
        c.alloc.free(beyond),
        Err(cachealloc_core::FreeError::NotOurs(_))
    ));
    let states: Vec<_> = c.alloc.snapshot()[0]
        .blocks
        .iter()
        .map(|b| b.state)
        .collect();
    assert_eq!(
        states,
        [BlockState::Active, BlockState::Free, BlockState::Unmapped]
    );
}

/// Threads racing around moves and releases: a parked place taken out for unmapping keeps its
/// addresses until it is unmapped (another thread mapped over one before: `cuMemMap` refused
/// on a GPU, and `SimDevice` refuses a map over mapped granules). Every request either succeeds
/// or is out of memory; nothing is left mapped at the end.
#[test]
fn threads_racing_around_moves_never_map_over_a_mapped_place() {
    let device = SimDevice::new(256 * MIB).with_map_granularity(GRANULARITY);
    device.set_slow_calls(true);
    let alloc = Allocator::new(device, expandable());
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let alloc = &alloc;
            s.spawn(move || {
                let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ t;
                let mut live: Vec<u64> = Vec::new();
                for i in 0..60_000u32 {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    if live.len() > 6 || (seed.is_multiple_of(3) && !live.is_empty()) {
                        let at = (seed as usize / 3) % live.len();
                        alloc.free(live.swap_remove(at)).expect("free");
                    } else {
                        let size = (seed >> 8) % (24 * MIB) + 1;
                        match alloc.malloc(size, t) {
                            Ok(a) => live.push(a.address),
                            Err(AllocError::OutOfMemory(_)) => {}
                            Err(e) => panic!("thread {t}, request {i} of {size} bytes: {e}"),
                        }
                    }
                    if i.is_multiple_of(2000) {
                        alloc.empty_cache().expect("empty_cache");
                    }
                }
                for address in live {
                    alloc.free(address).expect("free");
                }
            });
        }
    });
    alloc.check_invariants().expect("invariants");
    alloc.empty_cache().expect("empty_cache");
    assert_eq!(alloc.stats().reserved_bytes.all.current, 0);
    assert_eq!(alloc.device().used(), 0, "every place unmapped");
    assert!(
        alloc.device().counters().aliases > 0,
        "no memory moved: the test no longer tests moves"
    );
}

/// Blocks that drift up their range leave parked places behind at every move; before each map
/// the oldest idle ones beyond `PARKED_LIMIT` are unmapped, so there are never more than the
/// limit and what that map moved.
#[test]
fn parked_places_are_bounded_when_memory_keeps_moving() {
    use cachealloc_core::pools::expandable::moves::PARKED_LIMIT;
    let c = Checked::new(1 << 40, expandable());
    // Each block a little bigger than the last, the last freed once the next is live: the new
    // block fits no hole, so every step maps past the peak and recycles the hole by moves.
    let mut last = c.malloc(8 * MIB);
    let mut most = 0;
    for i in 1..(PARKED_LIMIT as u64 + 300) {
        let moved_before = c.device().counters().aliases;
        let next = c.malloc(8 * MIB + i * 2 * MIB);
        let moved = (c.device().counters().aliases - moved_before) as usize;
        let parked = c.device().second_mappings();
        assert!(
            parked <= PARKED_LIMIT + moved,
            "step {i}: {parked} parked places, {moved} of them just now"
        );
        most = most.max(parked);
        c.free(last.address);
        last = next;
    }
    assert!(
        most > PARKED_LIMIT,
        "at most {most} parked places: the test no longer reaches the limit"
    );
}

/// PyTorch's `_set_allocator_settings("expandable_segments:…")` at run time: growth switches
/// kind, and segments of both kinds live side by side, each block under its own segment's
/// rules (the invariants hold after every step).
#[test]
fn expandable_segments_switched_at_run_time_live_beside_fixed_ones() {
    let c = Checked::new(1 << 34, fixed());
    let in_expandable = |address: u64| {
        c.alloc
            .snapshot()
            .into_iter()
            .find(|s| address >= s.address && address < s.address + s.total_size)
            .expect("a segment holds the block")
            .expandable
    };
    let fixed = c.malloc(30 * MIB);
    assert!(!in_expandable(fixed.address));
    assert!(
        c.alloc.set_expandable(Expandable::On),
        "the simulated device can map"
    );
    assert!(c.alloc.expandable());
    let mapped = c.malloc(30 * MIB);
    assert!(
        in_expandable(mapped.address),
        "growth maps once switched on"
    );
    let small = c.malloc(MIB / 2);
    assert!(in_expandable(small.address));
    c.free(fixed.address);
    // The fixed segment's free 30 MiB block still serves a request its rules allow.
    let again = c.malloc(30 * MIB);
    assert_eq!(again.address, fixed.address);
    assert!(!c.alloc.set_expandable(Expandable::Off));
    assert!(!c.alloc.expandable());
    let grown = c.malloc(50 * MIB);
    assert!(
        !in_expandable(grown.address),
        "growth takes fixed segments once switched off"
    );
    for a in [mapped, small, again, grown] {
        c.free(a.address);
    }
    c.empty_cache();
    assert_eq!(reserved(&c), 0, "empty_cache gives back both kinds");
    assert!(
        c.alloc.set_expandable(Expandable::On),
        "and on again, with the geometry kept"
    );
    let last = c.malloc(3 * MIB);
    assert!(in_expandable(last.address));
    c.free(last.address);
}

#[test]
fn expandable_segments_at_run_time_need_a_device_that_maps() {
    let c = Checked::on(SimDevice::new(1 << 30), fixed());
    assert!(
        !c.alloc.set_expandable(Expandable::On),
        "no virtual memory: fixed segments"
    );
    assert!(!c.alloc.expandable());
    let a = c.malloc(3 * MIB);
    c.free(a.address);
}
