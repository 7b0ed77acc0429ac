//! Which memory fills a map past the peak: the free mappings recycling took, moved in largest
//! first ([`Pools::plan_moves`]), and new memory for what they leave.
//!
//! # Note [A map takes a busy mapping whole]
//!
//! Recycling takes whole free mappings, oldest first, until they cover what the map needs past
//! the peak, and moves them in largest first: they seldom add up to the map exactly. The gap
//! was new memory, and the mapping left over was unmapped if idle, else (Note [Recycling never
//! waits]) kept mapped, free, beside the new memory: reserved memory then passed the peak by the
//! gap, and the peak stayed there. On a run of variable shapes that recycles at every cycle
//! this was a ratchet: the Llama of `scripts/gpu/models.py` crept ~26 MB per 1 000 steps on an
//! H200, and `cachealloc simulate --repeat` showed the same on its recorded run (BENCHMARKS.md,
//! fourteenth session). So when a leftover mapping may still be in use, the map grows into the
//! unmapped space after it by what that mapping lacks to fit, and the mapping moves in whole
//! (the smallest such one): no new memory, reserved memory stays at its peak, and the few
//! extra bytes are free memory at the map's end. An idle leftover is still unmapped and the gap
//! made new, which keeps reserved memory lower. A map with no unmapped space after it (a
//! parked place, or the range's end) keeps the old way.

use super::moves::Move;
use super::{MapPlan, NIL, Pools, Unmapping};
use crate::device::Device;
use crate::pools::BlockState;

impl MapPlan {
    /// Move the memory of `u` into the plan, at the start of what is still to be made new.
    fn push_move(&mut self, u: Unmapping) {
        let size = u.size;
        self.moves.push(Move {
            from: u.address,
            to: self.fresh_from,
            size,
            taken: u,
        });
        self.fresh_from += size;
    }
}

impl<F: Clone> Pools<F> {
    /// Of the mappings taken for recycling, move those that fit into `plan`'s memory (the
    /// largest first, from its start); the plan maps new memory only for the rest of it, unless
    /// a mapping that did not fit may still be in use: then the plan grows to take it whole
    /// (Note [A map takes a busy mapping whole]). The mappings that did not fit come back, to be
    /// unmapped, with their parked places.
    pub fn plan_moves<D: Device<Fence = F>>(
        &mut self,
        plan: &mut MapPlan,
        taken: Vec<Unmapping>,
        device: &D,
    ) -> Vec<Unmapping> {
        let range = self.blocks[plan.block as usize].segment;
        if !self.may_move(range) || !self.expandable.is_some_and(|g| g.moves) {
            return self.with_aliases(taken);
        }
        let mut taken = taken;
        taken.sort_by_key(|u| std::cmp::Reverse((u.size, u.address)));
        let end = plan.address + plan.size;
        let mut rest = Vec::new();
        for u in taken {
            if plan.fresh_from + u.size <= end && u.range == range {
                plan.push_move(u);
            } else {
                rest.push(u);
            }
        }
        // Note [A map takes a busy mapping whole]: the smallest one that may still be in use.
        let gap = plan.address + plan.size - plan.fresh_from;
        if gap > 0 {
            rest.sort_by_key(|u| (u.size, u.address));
            let busy = (0..rest.len())
                .find(|&i| rest[i].range == range && self.may_be_in_use(&rest[i], device));
            if let Some(i) = busy
                && self.extend_plan(plan, rest[i].size - gap)
            {
                plan.push_move(rest.remove(i));
            }
        }
        self.with_aliases(rest)
    }

    /// Grow `plan` by `extra` bytes of the unmapped address space right after it, if that is
    /// there, not being mapped or unmapped, and holds no parked place.
    fn extend_plan(&mut self, plan: &mut MapPlan, extra: u64) -> bool {
        let end = plan.address + plan.size;
        let next = self.blocks[plan.block as usize].next;
        if next == NIL {
            return false;
        }
        let n = &self.blocks[next as usize];
        if n.state != BlockState::Unmapped || n.busy || n.address != end || n.size < extra {
            return false;
        }
        if self.parked.range(end..end + extra).next().is_some() {
            return false;
        }
        let segment = n.segment;
        self.segment_mut(segment).unmapped.remove(&end);
        if self.blocks[next as usize].size == extra {
            let after = self.blocks[next as usize].next;
            self.blocks[plan.block as usize].next = after;
            if after != NIL {
                self.blocks[after as usize].prev = plan.block;
            }
            self.spare_blocks.push(next);
        } else {
            let n = &mut self.blocks[next as usize];
            n.address += extra;
            n.size -= extra;
            self.segment_mut(segment).unmapped.insert(end + extra, next);
        }
        self.blocks[plan.block as usize].size += extra;
        self.growing += extra;
        plan.size += extra;
        true
    }
}
