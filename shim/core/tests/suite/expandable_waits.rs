//! Expandable segments' waits for the device: an unmap waits only when the memory may still be
//! in use (Note [Unmapping without a wait]), and recycling never waits (Note [Recycling never
//! waits]).

use cachealloc_core::SimDevice;
use cachealloc_core::sim::FenceMode;

use crate::common::{Checked, GRANULARITY, MIB};
use crate::expandable::{driver_calls, expandable, reserved};

/// Expandable segments on a device whose fences complete only when told to (so that memory
/// stays "maybe in use") and that cannot move memory (so that recycling unmaps).
fn manual_fences_without_moves() -> Checked {
    let device =
        SimDevice::with_fence_mode(1 << 30, FenceMode::Manual).with_map_granularity(GRANULARITY);
    device.set_aliasing(false);
    Checked::on(device, expandable())
}

/// Note [Unmapping without a wait]: an unmap waits for the device only when the memory became
/// free after the stamp of the range's last completed idle fence. (Recycling unmaps here: the
/// device cannot move memory.)
#[test]
fn unmapping_waits_for_the_device_only_when_the_memory_may_be_in_use() {
    let c = manual_fences_without_moves();
    let synchronizes = || c.device().counters().synchronizes;
    let a = c.malloc(4 * MIB); // maps: the range's idle fence, stamped before any free
    c.malloc(4 * MIB);
    let x = c.malloc(8 * MIB);
    assert_eq!(reserved(&c), 16 * MIB);
    c.free(x.address);
    c.device().complete_fences();
    c.empty_cache();
    assert_eq!(
        synchronizes(),
        1,
        "freed after the only stamp: it may be in use"
    );
    assert_eq!(reserved(&c), 8 * MIB);
    // A map after a's free stamps a new fence; once it completes, a's memory is idle.
    c.free(a.address);
    let y = c.malloc(8 * MIB);
    c.device().complete_fences();
    // Nothing free fits 8 MiB, and mapping it would pass the peak: a's memory is recycled,
    // without a wait.
    let z = c.malloc(8 * MIB);
    assert_eq!(synchronizes(), 1, "idle memory is unmapped without a wait");
    assert!(!c.device().is_backed(a.address, a.size));
    assert_eq!(
        reserved(&c),
        20 * MIB,
        "a recycled: only b, y and z are mapped"
    );
    // The control: y, freed after the last stamp, waits although every fence completed.
    c.free(y.address);
    c.device().complete_fences();
    c.empty_cache();
    assert_eq!(synchronizes(), 2);
    assert!(c.device().is_backed(z.address, z.size));
}

/// Note [Recycling never waits]: memory that cannot move and may still be in use is not
/// recycled (that would wait for the device): it stays mapped and free, and reserved memory
/// passes the old peak. Once idle, such memory is recycled by an unmap, still without a wait.
#[test]
fn recycling_leaves_memory_that_may_be_in_use_mapped_rather_than_wait() {
    let c = manual_fences_without_moves();
    let synchronizes = || c.device().counters().synchronizes;
    c.malloc(8 * MIB); // maps: the range's idle fence, stamped before any free
    let b = c.malloc(8 * MIB);
    c.malloc(8 * MIB);
    c.free(b.address);
    let d = c.malloc(16 * MIB);
    assert_eq!(synchronizes(), 0, "no wait for the device");
    assert_eq!(driver_calls(&c).2, 0, "nothing unmapped");
    assert!(c.device().is_backed(b.address, b.size), "b's memory stays");
    assert_eq!(
        reserved(&c),
        40 * MIB,
        "past the old peak of 24 MiB by b's 8"
    );
    // b's memory is free in the pools, as it was: 8 MiB come from it with no map.
    let maps = driver_calls(&c).0;
    let e = c.malloc(8 * MIB);
    assert_eq!(e.address, b.address);
    assert_eq!(driver_calls(&c).0, maps);
    // Freed again: a map past the peak keeps it while it may be in use, and records a fence
    // stamped after its free.
    c.free(e.address);
    c.device().complete_fences();
    c.malloc(9 * MIB);
    assert!(c.device().is_backed(b.address, b.size));
    assert_eq!(reserved(&c), 50 * MIB);
    // That fence completed, b's memory is idle: the next map past the peak recycles it by an
    // unmap, without a wait.
    c.device().complete_fences();
    c.malloc(12 * MIB);
    assert_eq!(synchronizes(), 0, "idle memory: no wait");
    assert!(
        !c.device().is_backed(b.address, b.size),
        "b's memory recycled"
    );
    assert_eq!(driver_calls(&c).2, 1);
    assert!(c.device().is_backed(d.address, d.size));
}

/// Note [A map takes a busy mapping whole]: when the free mappings taken for a map past the
/// peak do not fill it exactly, and one left over may still be in use (so it would stay mapped),
/// the map grows to take that mapping whole instead of mapping new memory for the gap: reserved
/// memory stays at its peak, with no new mapping. Before, the gap was new memory and the busy
/// mapping stayed beside it, past the peak by the gap: a ratchet at every such map, which on a
/// long run of variable shapes crept ~26 MB per 1 000 steps (BENCHMARKS.md, fourteenth session).
/// Once idle, a leftover mapping is unmapped as before, and the gap is new memory.
#[test]
fn a_map_past_the_peak_takes_a_busy_leftover_mapping_whole() {
    let device =
        SimDevice::with_fence_mode(1 << 30, FenceMode::Manual).with_map_granularity(GRANULARITY);
    let c = Checked::on(device, expandable());
    let synchronizes = || c.device().counters().synchronizes;
    c.malloc(8 * MIB); // maps: the range's idle fence, stamped before any free
    let b = c.malloc(8 * MIB);
    c.malloc(8 * MIB);
    let d = c.malloc(8 * MIB);
    let e = c.malloc(8 * MIB);
    assert_eq!(reserved(&c), 40 * MIB);
    c.free(b.address);
    c.free(d.address);
    let (maps, aliases, unmaps) = driver_calls(&c);
    // 12 MiB fit in no free block: the map past the peak takes b's and d's mappings (16 MiB);
    // one moves into its first 8 MiB, and the other, which may still be in use, fills the
    // rest and 4 MiB more.
    let f = c.malloc(12 * MIB);
    assert_eq!(f.address, e.address + 8 * MIB, "mapped after e");
    assert_eq!(
        driver_calls(&c),
        (maps, aliases + 2, unmaps),
        "both mappings moved; no new memory, nothing unmapped"
    );
    assert_eq!(reserved(&c), 40 * MIB, "reserved stays at its peak");
    assert_eq!(synchronizes(), 0, "no wait for the device");
    // The 4 MiB beyond f are free mapped memory: the next 4 MiB come from them, with no map.
    let g = c.malloc(4 * MIB);
    assert_eq!(g.address, f.address + 12 * MIB);
    assert_eq!(driver_calls(&c).0, maps);

    // The control: on a device whose fences complete at once, the leftover mapping is idle
    // at the map (its fence, stamped then, has completed): it is unmapped, and the gap is new
    // memory, so reserved memory falls below the peak.
    let c = Checked::new(1 << 30, expandable());
    c.malloc(8 * MIB);
    let b = c.malloc(8 * MIB);
    c.malloc(8 * MIB);
    let d = c.malloc(8 * MIB);
    let e = c.malloc(8 * MIB);
    c.free(b.address);
    c.free(d.address);
    let (maps, aliases, unmaps) = driver_calls(&c);
    let f = c.malloc(12 * MIB);
    assert_eq!(f.address, e.address + 8 * MIB);
    assert_eq!(
        driver_calls(&c),
        (maps + 1, aliases + 1, unmaps + 1),
        "one mapping moved, the gap new, the idle one unmapped"
    );
    assert_eq!(reserved(&c), 36 * MIB);
}
