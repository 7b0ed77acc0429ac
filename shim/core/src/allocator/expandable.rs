//! The allocator's side of expandable segments: reserving a stream's address range, mapping
//! memory for a request and unmapping cached memory, each with the lock released, as segment
//! allocation and release are. See
//! [Note [Expandable segments]](crate::pools::expandable#note-expandable-segments).

use super::{Allocator, Locked, Request, SegmentChanges, Served};
use crate::device::{Device, DeviceError};
use crate::events::{Event, Observer};
use crate::pools::expandable::moves::Flip;
use crate::pools::expandable::{MapOutcome, MapPlan, Unmapping};
use crate::pools::{BlockState, SegmentSnapshot};
use crate::sizes::PoolKind;

/// How many times a request maps memory before it gives up on this rung: a map is repeated
/// only when another thread took the free memory the first map was meant to join. (A new
/// range is reserved only when the stream's ranges have no room, which a reserved range then
/// has: that loop ends too.)
const MAP_ATTEMPTS: usize = 4;

impl<D: Device, O: Observer> Allocator<D, O> {
    /// Rungs 5–7 with expandable segments: map the memory a request still needs into its
    /// stream's range (reserving the range first if need be) and serve the request from it.
    /// `Ok(None)` means out of memory (by the limit or the device).
    pub(super) fn map_and_serve<'a>(
        &'a self,
        mut pools: Locked<'a, D::Fence>,
        request: &Request,
        changes: &mut SegmentChanges,
        is_retry: bool,
    ) -> Served<'a, D::Fence> {
        if is_retry {
            pools.stats.num_alloc_retries += 1;
        }
        let &Request {
            size,
            rounded,
            tag,
            stream,
            ..
        } = request;
        let mut attempts = 0;
        let mut reserved_one = false;
        let mut may_flip = true;
        while attempts < MAP_ATTEMPTS {
            let plan = match pools.plan_map(rounded, stream, self.limit) {
                MapOutcome::Planned(plan) => plan,
                MapOutcome::OverLimit => break,
                MapOutcome::NeedsRange => {
                    // A fresh range holds any request that fits in a device: one is enough.
                    let Some(geometry) = pools.expandable().filter(|_| !reserved_one) else {
                        break;
                    };
                    reserved_one = true;
                    let (reserved, relocked) =
                        self.unlocked(pools, || self.device.reserve_range(geometry.range_size));
                    pools = relocked;
                    match reserved {
                        Ok(address) => pools.add_range(address, rounded, stream, tag),
                        Err(e) => return (Err(e), pools),
                    }
                    continue;
                }
            };
            // Memory that moved away from the places this plan needs flips back first, with
            // no driver call; then the plan is made again (once: see moves.rs).
            let mut plan = if may_flip {
                may_flip = false;
                let pool = plan.pool;
                match pools.flip_into(plan) {
                    Ok(flips) => {
                        self.report_flips(&flips, pool, changes);
                        if let Some(allocation) = pools.alloc_cached(rounded, size, tag, stream) {
                            return (Ok(Some(self.served(allocation))), pools);
                        }
                        continue;
                    }
                    Err(plan) => plan,
                }
            } else {
                plan
            };
            attempts += 1;
            // Pools that keep their maps give nothing back here (Note [Kept maps]), and so
            // have no parked places and need no idle horizon.
            let recycles = !pools.keeps_maps();
            if recycles {
                pools.note_range_mapped(&plan, &self.device);
            }
            // Parked places in the way are unmapped (their memory stays where it is).
            let mut to_unmap = pools.take_clears(&plan);
            // Too many parked places: the oldest idle ones go (no wait, and no matter if not).
            let excess = pools.take_idle_excess_parked(&self.device);
            pools = self.unmap_taken(pools, excess, changes).1;
            let beyond_peak = pools
                .reserved()
                .saturating_sub(pools.stats.reserved_bytes.all.peak as u64);
            if recycles && beyond_peak > 0 {
                // A new high-water mark: give back free memory first, moving what fits into
                // the plan (see the Notes).
                let holes = pools.take_to_recycle(&plan, beyond_peak);
                let rest = pools.plan_moves(&mut plan, holes, &self.device);
                // What cannot move is unmapped only if that needs no wait for the device.
                to_unmap.extend(pools.keep_busy_mapped(rest, &self.device));
                for m in &plan.moves {
                    self.observer.on_event(Event::SegmentUnmap {
                        address: m.from,
                        size: m.size,
                        pool: plan.pool,
                    });
                }
            }
            let (cleared, relocked) = self.unmap_taken(pools, to_unmap, changes);
            pools = relocked;
            if !cleared {
                // A parked place in the plan's way is still mapped: it cannot be mapped now.
                self.unreport_moves(&plan);
                pools.map_failed(plan);
                break;
            }
            let (address, map_size, pool) = (plan.address, plan.size, plan.pool);
            let granularity = pools.expandable().map_or(map_size, |g| g.granularity);
            let (mapped, relocked) = self.unlocked(pools, || self.map_all(&plan, granularity));
            pools = relocked;
            match mapped {
                Ok(()) => {
                    changes.mapped.push((address, map_size));
                    (changes.unmapped).extend(plan.moves.iter().map(|m| (m.from, m.size)));
                    self.observer.on_event(Event::SegmentMap {
                        address,
                        size: map_size,
                        pool,
                        tag,
                    });
                    if let Some(allocation) = pools.map_done(plan, rounded, size, tag) {
                        return (Ok(Some(self.served(allocation))), pools);
                    }
                }
                Err(DeviceError::OutOfMemory) => {
                    self.unreport_moves(&plan);
                    pools.map_failed(plan);
                    break;
                }
                Err(e) => {
                    self.unreport_moves(&plan);
                    pools.map_failed(plan);
                    return (Err(e), pools);
                }
            }
        }
        (Ok(None), pools)
    }

    /// Unmap the whole granules of free memory in every expandable segment, with the lock
    /// released.
    pub(super) fn unmap_unlocked<'a>(
        &'a self,
        mut pools: Locked<'a, D::Fence>,
        changes: &mut SegmentChanges,
    ) -> Locked<'a, D::Fence> {
        let taken = pools.take_unmappable(&[PoolKind::Large, PoolKind::Small]);
        self.unmap_taken(pools, taken, changes).1
    }

    /// Unmap memory taken out of the pools (and the parked places of it), with the lock
    /// released. Answers whether every parked place among `taken` was unmapped.
    fn unmap_taken<'a>(
        &'a self,
        mut pools: Locked<'a, D::Fence>,
        taken: Vec<Unmapping>,
        changes: &mut SegmentChanges,
    ) -> (bool, Locked<'a, D::Fence>) {
        if taken.is_empty() {
            return (true, pools);
        }
        for u in taken.iter().filter(|u| !u.is_parked_place()) {
            self.observer.on_event(Event::SegmentUnmap {
                address: u.address,
                size: u.size,
                pool: u.pool,
            });
        }
        let wait = pools.unmapping_needs_wait(&taken, &self.device);
        let (results, mut pools) = self.unlocked(pools, || {
            // See Note [Unmapping without a wait]: idle memory needs no wait, the rest one.
            let waited = if wait {
                self.device.synchronize()
            } else {
                Ok(())
            };
            taken
                .iter()
                .map(|u| {
                    if let Err(e) = &waited {
                        return Err((e.clone(), 0));
                    }
                    // Its parked places first: the driver frees memory with its last mapping.
                    for (i, alias) in u.aliases.iter().enumerate() {
                        self.device
                            .unmap(alias.address, alias.size)
                            .map_err(|e| (e, i))?;
                    }
                    (self.device.unmap(u.address, u.size)).map_err(|e| (e, u.aliases.len()))
                })
                .collect::<Vec<_>>()
        });
        let mut cleared = true;
        for (u, result) in taken.into_iter().zip(results) {
            match result {
                Ok(()) => {
                    if !u.is_parked_place() {
                        changes.unmapped.push((u.address, u.size));
                    }
                    pools.unmap_done(u);
                }
                Err((e, aliases_unmapped)) => {
                    if u.is_parked_place() {
                        cleared = false;
                    } else {
                        // The memory is still there and back in the pools: say so in the trace.
                        self.observer.on_event(Event::SegmentMap {
                            address: u.address,
                            size: u.size,
                            pool: u.pool,
                            tag: 0,
                        });
                    }
                    changes.unmap_errors.push(((u.address, u.size), e));
                    pools.unmap_failed_after(u, aliases_unmapped);
                }
            }
        }
        (cleared, pools)
    }

    /// Report memory that flipped back to parked places: unmapped where it was, mapped where
    /// it is.
    fn report_flips(&self, flips: &[Flip], pool: PoolKind, changes: &mut SegmentChanges) {
        for f in flips {
            self.observer.on_event(Event::SegmentUnmap {
                address: f.from,
                size: f.size,
                pool,
            });
            self.observer.on_event(Event::SegmentMap {
                address: f.to,
                size: f.size,
                pool,
                tag: 0,
            });
            changes.unmapped.push((f.from, f.size));
            changes.mapped.push((f.to, f.size));
        }
    }

    /// A plan failed: the memory it was to move is back where it was; say so in the trace.
    fn unreport_moves(&self, plan: &MapPlan) {
        for m in &plan.moves {
            self.observer.on_event(Event::SegmentMap {
                address: m.from,
                size: m.size,
                pool: plan.pool,
                tag: 0,
            });
        }
    }
}

impl<D: Device, O: Observer> Allocator<D, O> {
    /// Make the memory of `plan` — the memory it moves, then its new mappings — or none of it.
    fn map_all(&self, plan: &MapPlan, granularity: u64) -> Result<(), DeviceError> {
        let moves: Vec<(u64, u64, u64)> = (plan.moves.iter())
            .map(|m| (m.from, m.to, m.size))
            .collect();
        let mappings: Vec<(u64, u64)> = plan.mappings(granularity).collect();
        self.device.map_with_moves(&moves, &mappings)
    }
}

/// The maximal runs of mapped blocks of an expandable segment: (address, size).
pub(super) fn mapped_runs(segment: &SegmentSnapshot) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for b in segment
        .blocks
        .iter()
        .filter(|b| b.state != BlockState::Unmapped)
    {
        match runs.last_mut() {
            Some((start, size)) if *start + *size == b.address => *size += b.size,
            _ => runs.push((b.address, b.size)),
        }
    }
    runs
}
