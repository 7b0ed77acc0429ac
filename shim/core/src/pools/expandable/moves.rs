//! Recycling without the driver's slowest calls: memory moves between places of a range by
//! being mapped at a second place, and the place it left keeps its mapping, *parked*.
//!
//! # Note [Moving memory instead of unmapping it]
//!
//! Recycling (see [Note [Expandable segments]](super#note-expandable-segments)) keeps reserved
//! memory at its peak by giving up free memory in one place of a range to map memory in
//! another. Done with the driver's obvious calls, each recycled mapping costs an unmap and a
//! release (the memory goes back to the device), and the new place a create and a map: about
//! 40 µs a mapping each way on an H100. A workload that cycles through shapes (GPT-2 trained on
//! five sequence lengths in turn) needs the same places again and again, so it paid that every
//! few steps for as long as it ran: 1.3 % of its step time.
//!
//! CUDA lets one memory be mapped at several places at once (`cuMemRetainAllocationHandle`
//! then `cuMemMap`). So recycling *moves* memory instead ([`Device::alias`](crate::Device::alias)): the free mapping
//! is mapped again at the new place, which then holds it, and the old place is **parked**:
//! still mapped, by the driver, to the same memory, but unmapped as far as the pools know (an
//! [`BlockState::Unmapped`] block), so nothing is ever handed out there. No memory is created or
//! released, and nothing has to wait for the device: handing the memory of a free block out at
//! another place of the same range is a reuse like any other, safe for the range's stream by the
//! same stream order (and, for the range of synchronous allocations, by the same fences), since
//! the pools take only free blocks, never one under the gate.
//!
//! When a map later needs a parked place back, and the memory's holder lies in a free block of
//! the range, the memory **flips** back: the holder's place is parked and the parked place holds
//! the memory again, with no driver call at all ([`Pools::flip_into`]; [`Pools::plan_map`]
//! counts such places as memory it has). Whether that happens depends on the workload: on the
//! recorded GPT-2 run it never does, because its largest blocks drift up their range from cycle
//! to cycle and memory keeps moving with them (163 moves in 20 steps). A move costs about 30 µs,
//! nearly all of it the `cuMemSetAccess` of the new place, which the driver charges per mapping
//! even when one call covers a map's whole run (`scripts/gpu/map_parts.cu`, BENCHMARKS.md).
//!
//! A parked place whose holder is in use cannot flip. A map goes around it if it can, since it
//! would have to *clear* the place first: unmap its mapping (that frees nothing: the holder keeps
//! the memory), after the same idle check as any unmap, since kernels queued before the memory
//! moved may still use the place ([`Pools::take_clears`]). A map that ends inside a place still
//! maps only the granules its request needs ([`Pools::plan_map`]): the driver unmaps the whole
//! place, so its part past the map is held as a busy block until then, and is plain address
//! space after. Memory that really goes back to the device (released by `empty_cache` or the
//! out-of-memory ladder, or recycled where it cannot move) is unmapped at its parked places
//! first ([`Unmapping::aliases`]): the driver frees memory only with its last mapping. Until the
//! driver has unmapped it, a parked place taken out of the pools stays a busy block, so that no
//! other thread maps over it meanwhile (`Pools::hold_place`). At most [`PARKED_LIMIT`] places
//! stay parked.
//!
//! Invariants ([`Pools::check_invariants`]): parked places are disjoint from each other and
//! from the mappings, each lies wholly inside one unmapped block of its range (a plan that
//! reaches into one is given up, or the place taken out for clearing, before the lock is
//! released), and each holder is a mapping of the same range and size. The conformance suite
//! checks on [`SimDevice`](crate::sim::SimDevice), which knows the memory behind every address,
//! that no two live blocks ever share memory.

use std::collections::BTreeMap;

use super::{MapPlan, NIL, Pools, Unmapping};
use crate::pools::{BlockId, BlockState, SegmentId};
use crate::sizes::PoolKind;

/// How many parked places the pools keep: beyond this, the oldest of those known to be idle
/// are unmapped ([`Pools::take_idle_excess_parked`]), so that a workload whose memory keeps
/// moving to new places (one whose blocks drift through the range) does not leave ever more
/// mappings behind. PyTorch's expandable segments keep one mapping per 2 MiB granule, about
/// 5 000 for 10 GB; a thousand more is of the same order.
pub const PARKED_LIMIT: usize = 1024;

/// A parked place: memory that moved away is still mapped here. See the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::pools) struct Parked {
    /// Its size: the memory's.
    pub(in crate::pools) size: u64,
    /// The mapping (in `Pools::mappings`) that holds the memory now.
    pub(in crate::pools) holder: u64,
    /// The range.
    pub(in crate::pools) range: SegmentId,
    /// The place was free since this stamp (the free-list clock) before it was parked: kernels
    /// queued before then may still use it.
    pub(in crate::pools) since: u64,
}

/// A parked place of memory that goes back to the device: unmapped before the memory's holder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Alias {
    /// Where.
    pub address: u64,
    /// The memory's size.
    pub size: u64,
    /// Free since this stamp (see [`Parked::since`]).
    pub(in crate::pools) since: u64,
    /// The busy unmapped block that keeps the place from other maps until it is unmapped
    /// ([`Pools::hold_place`]).
    pub(in crate::pools) block: BlockId,
}

/// Memory moved into a map: the free mapping at `from` is mapped at `to` as well
/// ([`Device::alias`](crate::Device::alias)), and `from` is parked once the map is done.
#[derive(Debug, PartialEq, Eq)]
pub struct Move {
    /// The mapping the memory comes from.
    pub from: u64,
    /// Where it goes, inside the map.
    pub to: u64,
    /// Its size.
    pub size: u64,
    /// The mapping, taken out of its free block.
    pub(in crate::pools) taken: Unmapping,
}

/// Memory that flipped back to a parked place ([`Pools::flip_into`]): `from` is parked now,
/// `to` mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flip {
    /// The place the memory left.
    pub from: u64,
    /// The parked place that has it now.
    pub to: u64,
    /// Its size.
    pub size: u64,
}

impl<F: Clone> Pools<F> {
    /// The parked places that overlap `[low, high)`, by address.
    fn parked_in(&self, low: u64, high: u64) -> Vec<(u64, Parked)> {
        let first = self
            .parked
            .range(..low)
            .next_back()
            .filter(|(a, p)| **a + p.size > low)
            .map(|(a, p)| (*a, *p));
        first
            .into_iter()
            .chain(self.parked.range(low..high).map(|(a, p)| (*a, *p)))
            .collect()
    }

    /// Whether moving memory between the places of this range now is reuse the pools allow:
    /// not for the range of synchronous allocations while the gate is up.
    pub(in crate::pools) fn may_move(&self, range: SegmentId) -> bool {
        !(self.gated && self.segment(range).stream == super::NO_STREAM)
    }

    /// The free block that holds the whole mapping at `holder` (`size` bytes), unless it is
    /// `except`.
    fn free_block_holding(&self, holder: u64, size: u64, except: BlockId) -> Option<BlockId> {
        let id = self.find_block(holder)?;
        let b = &self.blocks[id as usize];
        (b.state == BlockState::Free
            && !b.busy
            && id != except
            && b.address <= holder
            && holder + size <= b.address + b.size)
            .then_some(id)
    }

    /// The free blocks of `stream`'s `pool` ranges, by address (`(end, block)`), to tell which
    /// parked places can flip; `None` when there is nothing to flip.
    pub(in crate::pools) fn flippable_holders(
        &self,
        stream: u64,
        pool: PoolKind,
    ) -> Option<BTreeMap<u64, (u64, BlockId)>> {
        if self.parked.is_empty() || !self.expandable.is_some_and(|g| g.moves) {
            return None;
        }
        let mut free = BTreeMap::new();
        for &(_, _, range) in (self.ranges.iter()).filter(|&&(s, p, _)| s == stream && p == pool) {
            let mut id = self.segment(range).first;
            while id != NIL {
                let b = &self.blocks[id as usize];
                if b.state == BlockState::Free && !b.busy {
                    free.insert(b.address, (b.address + b.size, id));
                }
                id = b.next;
            }
        }
        Some(free)
    }

    /// How many bytes from `address` (at most `size`) are parked places, one after the other,
    /// whose memory lies in a free block of `holders` other than `except`: memory a map there
    /// gets by flips, with no driver call.
    pub(in crate::pools) fn flippable_prefix(
        &self,
        address: u64,
        size: u64,
        except: BlockId,
        holders: &BTreeMap<u64, (u64, BlockId)>,
    ) -> u64 {
        let mut at = address;
        for (&place, p) in self.parked.range(address..address + size) {
            let held_in_free_block = holders
                .range(..=p.holder)
                .next_back()
                .is_some_and(|(_, &(end, id))| p.holder + p.size <= end && id != except);
            if place != at || !held_in_free_block {
                break;
            }
            at += p.size;
        }
        (at - address).min(size)
    }

    /// Flip memory back to the parked places inside `plan` whose holders lie in free blocks
    /// (never the free block the plan would join). If any can, the plan is given up (its
    /// memory is address space again) and the flips are made: the caller plans again, and the
    /// memory now there counts. Otherwise the plan comes back.
    pub fn flip_into(&mut self, plan: MapPlan) -> Result<Vec<Flip>, MapPlan> {
        let range = self.blocks[plan.block as usize].segment;
        if self.parked.is_empty() || !self.may_move(range) {
            return Err(plan);
        }
        let joined = match self.blocks[plan.block as usize].prev {
            prev if prev != NIL && self.blocks[prev as usize].state == BlockState::Free => prev,
            _ => NIL,
        };
        let flippable: Vec<(u64, Parked)> = self
            .parked_in(plan.address, plan.address + plan.size)
            .into_iter()
            .filter(|(_, p)| self.free_block_holding(p.holder, p.size, joined).is_some())
            .collect();
        if flippable.is_empty() {
            return Err(plan);
        }
        self.map_failed(plan);
        let mut flips = Vec::with_capacity(flippable.len());
        for (to, p) in flippable {
            // Another flip of this loop may have taken the holder's block apart: look again.
            let Some(block) = self.free_block_holding(p.holder, p.size, joined) else {
                continue;
            };
            let since = self.blocks[block as usize].free_since;
            let left = self.take_range(block, p.holder, p.holder + p.size);
            self.make_unmapped(left);
            self.claim_parked(to, p.size);
            self.mappings.remove(&p.holder);
            self.mappings.insert(to, p.size);
            self.parked.remove(&to);
            self.park(p.holder, p.size, to, p.range, since);
            flips.push(Flip {
                from: p.holder,
                to,
                size: p.size,
            });
        }
        Ok(flips)
    }

    /// The parked places inside `plan` that did not flip: taken out of the pools' parked
    /// places, to be unmapped before the plan is mapped (their memory stays with its holders).
    /// The driver unmaps a place only whole, so the part of one past the plan's end (the plan
    /// maps only what the request needs) is held meanwhile, as a busy block.
    pub fn take_clears(&mut self, plan: &MapPlan) -> Vec<Unmapping> {
        let (pool, end) = (plan.pool, plan.address + plan.size);
        self.parked_in(plan.address, end)
            .into_iter()
            .map(|(address, p)| {
                self.parked.remove(&address);
                let past = (address + p.size).saturating_sub(end);
                let block = if past > 0 {
                    self.hold_place(end, past)
                } else {
                    NIL
                };
                parked_place_unmapping(address, &p, pool, block)
            })
            .collect()
    }

    /// Beyond [`PARKED_LIMIT`], the oldest parked places that are idle (no wait needed), taken
    /// out of the pools for unmapping (their memory stays with its holders).
    pub fn take_idle_excess_parked<D: crate::Device<Fence = F>>(
        &mut self,
        device: &D,
    ) -> Vec<Unmapping> {
        let Some(excess) = self.parked.len().checked_sub(PARKED_LIMIT) else {
            return Vec::new();
        };
        let mut oldest: Vec<(u64, u64)> = (self.parked.iter())
            .map(|(&address, p)| (p.since, address))
            .collect();
        oldest.sort_unstable();
        let mut taken = Vec::new();
        for (since, address) in oldest {
            if taken.len() == excess {
                break;
            }
            let range = self.parked[&address].range;
            self.refresh_idle(range, device);
            if since >= self.range_idle(range).idle_before {
                continue;
            }
            let p = self.parked.remove(&address).expect("listed above");
            let block = self.hold_place(address, p.size);
            let pool = self.segment(range).pool;
            taken.push(parked_place_unmapping(address, &p, pool, block));
        }
        taken
    }

    /// `taken` (mappings whose memory goes back to the device) with their parked places, which
    /// are no longer the pools'.
    pub(in crate::pools) fn with_aliases(&mut self, mut taken: Vec<Unmapping>) -> Vec<Unmapping> {
        if self.parked.is_empty() {
            return taken;
        }
        for u in taken.iter_mut().filter(|u| u.block != NIL) {
            let places: Vec<(u64, Parked)> = (self.parked.iter())
                .filter(|(_, p)| p.holder == u.address)
                .map(|(a, p)| (*a, *p))
                .collect();
            for (address, p) in places {
                self.parked.remove(&address);
                let block = self.hold_place(address, p.size);
                u.aliases.push(Alias {
                    address,
                    size: p.size,
                    since: p.since,
                    block,
                });
            }
        }
        taken
    }

    /// The moves of a mapped plan are done: each mapping's memory is held at its new place,
    /// and the place it left (a busy unmapped block) is parked.
    pub(in crate::pools) fn moves_done(&mut self, moves: Vec<Move>) {
        for m in moves {
            let Unmapping {
                block,
                range,
                free_since,
                ..
            } = m.taken;
            self.make_unmapped(block);
            self.mappings.remove(&m.from);
            self.mappings.insert(m.to, m.size);
            self.park(m.from, m.size, m.to, range, free_since);
        }
    }

    /// The plan with these moves failed: the mappings go back to their free blocks.
    pub(in crate::pools) fn moves_failed(&mut self, moves: Vec<Move>) {
        for m in moves {
            self.unmap_failed(m.taken);
        }
    }

    /// Unmapping the parked place `u` failed: it stays parked.
    pub(in crate::pools) fn restore_parked(&mut self, u: &Unmapping) {
        self.parked.insert(
            u.address,
            Parked {
                size: u.size,
                holder: u.holder,
                range: u.range,
                since: u.free_since,
            },
        );
    }

    /// The memory of `u` stays (its unmap failed or was not tried): so does its parked place
    /// `alias`.
    pub(in crate::pools) fn restore_alias(&mut self, alias: &Alias, u: &Unmapping) {
        self.parked.insert(
            alias.address,
            Parked {
                size: alias.size,
                holder: u.address,
                range: u.range,
                since: alias.since,
            },
        );
    }

    /// Park the place `address` of `size` bytes, whose memory `holder` now holds; places
    /// parked for the memory before follow it to its holder.
    fn park(&mut self, address: u64, size: u64, holder: u64, range: SegmentId, since: u64) {
        for p in self.parked.values_mut().filter(|p| p.holder == address) {
            p.holder = holder;
        }
        self.parked.insert(
            address,
            Parked {
                size,
                holder,
                range,
                since,
            },
        );
    }

    /// A parked place `[address, address + size)`, wholly inside an unmapped block, holds its
    /// memory again: it becomes a free block there, merged with its free neighbours, stamped
    /// as freed now (its memory was in use at its holder's place until lately).
    fn claim_parked(&mut self, address: u64, size: u64) {
        let id = self.split_unmapped(address, size);
        let at = self.blocks[id as usize].stat_at();
        let b = &mut self.blocks[id as usize];
        b.state = BlockState::Free;
        b.free_since = self.lookups;
        self.stats.reserved_bytes.increase(at, size);
        self.make_free(id);
    }

    /// A parked place taken out of the pools for unmapping keeps its addresses from other maps
    /// until then (the driver still has it mapped): as a busy unmapped block, returned;
    /// [`Pools::release_place`] gives it back.
    fn hold_place(&mut self, address: u64, size: u64) -> BlockId {
        let id = self.split_unmapped(address, size);
        self.blocks[id as usize].busy = true;
        id
    }

    /// The place held by [`Pools::hold_place`] (if any) is unmapped address space again.
    pub(in crate::pools) fn release_place(&mut self, block: BlockId) {
        if block != NIL {
            self.make_unmapped(block);
        }
    }

    /// Split `[address, address + size)` out of the (idle) unmapped block holding it; returns
    /// it, out of the index of unmapped blocks (the ends stay in).
    fn split_unmapped(&mut self, address: u64, size: u64) -> BlockId {
        let id = self
            .find_block(address)
            .expect("a parked place is inside its range");
        let b = self.blocks[id as usize].clone();
        debug_assert!(b.state == BlockState::Unmapped && !b.busy);
        debug_assert!(b.address <= address && address + size <= b.address + b.size);
        self.segment_mut(b.segment).unmapped.remove(&b.address);
        if address > b.address {
            let head = self.new_block(super::Block {
                size: address - b.address,
                next: id,
                ..b.clone()
            });
            self.link_before(id, head);
            self.segment_mut(b.segment).unmapped.insert(b.address, head);
        }
        if address + size < b.address + b.size {
            let tail = self.new_block(super::Block {
                address: address + size,
                size: b.address + b.size - address - size,
                prev: id,
                ..b.clone()
            });
            self.link_after(id, tail);
            self.segment_mut(b.segment)
                .unmapped
                .insert(address + size, tail);
        }
        let c = &mut self.blocks[id as usize];
        c.address = address;
        c.size = size;
        id
    }

    /// The parked places' invariants (see the module docs).
    pub(in crate::pools) fn check_parked(&self) -> Result<(), String> {
        let mut previous_end = 0;
        for (&address, p) in &self.parked {
            if address < previous_end || p.size == 0 {
                return Err(format!(
                    "parked place {address:#x}+{} overlaps another",
                    p.size
                ));
            }
            previous_end = address + p.size;
            let end = address + p.size;
            let mapped = self.mappings.range(..end).next_back();
            if mapped.is_some_and(|(&a, &size)| a + size > address) {
                return Err(format!("parked place {address:#x} overlaps a mapping"));
            }
            if self.mappings.get(&p.holder) != Some(&p.size) {
                return Err(format!(
                    "parked place {address:#x}+{}: its holder {:#x} is not a mapping of its size",
                    p.size, p.holder
                ));
            }
            let inside_one_unmapped_block = self.find_block(address).is_some_and(|id| {
                let b = &self.blocks[id as usize];
                b.state == BlockState::Unmapped && b.segment == p.range && end <= b.address + b.size
            });
            let holder_in_range = self
                .find_block(p.holder)
                .is_some_and(|id| self.blocks[id as usize].segment == p.range);
            if !inside_one_unmapped_block || !holder_in_range {
                return Err(format!(
                    "parked place {address:#x}+{} is not inside one unmapped block of the range of its holder {:#x}",
                    p.size, p.holder
                ));
            }
        }
        Ok(())
    }
}

/// The unmapping of the parked place `address` (its memory stays with its holder), held by
/// `block` meanwhile (`NIL`: inside the plan that clears it; else what is past the plan, or
/// the whole place).
fn parked_place_unmapping(address: u64, p: &Parked, pool: PoolKind, block: BlockId) -> Unmapping {
    Unmapping {
        address,
        size: p.size,
        pool,
        block,
        range: p.range,
        free_since: p.since,
        parked: true,
        holder: p.holder,
        aliases: Vec::new(),
    }
}
