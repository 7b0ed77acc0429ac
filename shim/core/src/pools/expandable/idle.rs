//! When the free memory of an expandable segment may be unmapped without waiting for the
//! device: each range's idle horizon.
//!
//! # Note [Unmapping without a wait]
//!
//! `cuMemUnmap` does not wait for kernels: memory still used by queued work must not be
//! unmapped. Waiting for the whole device first (`cuCtxSynchronize`) is always safe, but it
//! drains the GPU, which then idles while the unmaps and the map that follow are made (by
//! recycling, see [Note [Expandable segments]](super#note-expandable-segments), every few steps
//! of a variable workload). On GPT-2 training the driver calls themselves turned out to cost
//! more than the drain (BENCHMARKS.md); still, a wait that is not needed is not made.
//!
//! So each range keeps an **idle fence**: recorded when the range maps memory, on the range's
//! stream (on every stream, for the range of synchronous allocations,
//! [`NO_STREAM`](crate::NO_STREAM)), and stamped with the free-list clock
//! ([`Pools::lookups`](super::Pools)) at that moment. Once the fence has completed, every block
//! of the range that became free before the stamp is **idle**: a block freed on its own stream
//! had its last uses ordered before its free on that stream, hence before the fence; a block
//! freed synchronously or on another stream became free only once its reuse fence completed,
//! after its last use. (A merge stamps the merged block with the newest of its frees, so a
//! block's stamp never understates its last use.) An unmap whose mappings all lie in idle
//! blocks needs no wait; otherwise the device is synchronized, once for the whole batch.
//!
//! A range records a new idle fence only when it has none pending, so the horizon trails by
//! about one map; none is recorded while a graph capture is under way
//! ([`Device::record_idle_fence`] answers `None`): an event on a capturing stream would join
//! the graph.
//!
//! # Note [Recycling never waits]
//!
//! Releasing memory (`empty_cache`, the out-of-memory ladder) must give it back, so it waits
//! when it has to. Recycling only keeps reserved memory at its peak, and a wait for the device
//! costs far more than the memory is worth: the drain idles the GPU while the program's CPU
//! queues work again. On DDP training of GPT-2 on two H200s (five sequence lengths in turn),
//! the longest step mapped once per cycle and, every other cycle, unmapped memory freed during
//! the cycle, after a drain: those steps took about 2 ms longer (1.9 % of a 97 ms step) and
//! the run 0.5 % (BENCHMARKS.md, "DDP: recycling without a wait"). So recycling moves what it
//! can, unmaps what is idle, and leaves what may still be in use mapped and free where it
//! was ([`Pools::keep_busy_mapped`]): reserved memory then passes the old peak by that much,
//! and the next cycles, finding the higher peak, recycle less. What a drain would have given
//! back is bounded by the mappings a map takes (a sixty-fourth of a map each). Where such a
//! mapping is only left over because the others did not fill the map exactly, the map takes it
//! whole rather than make new memory beside it (Note [A map takes a busy mapping whole]): at
//! every map of a long run, that excess made a ratchet.

use super::{MapPlan, Pools, SegmentId, Unmapping};
use crate::device::Device;

/// One range's idle horizon.
#[derive(Debug)]
pub(in crate::pools) struct RangeIdle<F> {
    range: SegmentId,
    /// The fence recorded last, not known to be completed, and its stamp.
    pending: Option<(F, u64)>,
    /// Blocks of the range free since before this stamp are idle.
    pub(in crate::pools) idle_before: u64,
}

impl<F: Clone> Pools<F> {
    pub(in crate::pools) fn range_idle(&mut self, range: SegmentId) -> &mut RangeIdle<F> {
        let at = match self.idle.iter().position(|r| r.range == range) {
            Some(at) => at,
            None => {
                self.idle.push(RangeIdle {
                    range,
                    pending: None,
                    idle_before: 0,
                });
                self.idle.len() - 1
            }
        };
        &mut self.idle[at]
    }

    /// Forget `range`'s horizon (the range is gone); its pending fence, if any, is the
    /// caller's to release.
    pub(in crate::pools) fn forget_idle(&mut self, range: SegmentId) -> Option<F> {
        let at = self.idle.iter().position(|r| r.range == range)?;
        self.idle.swap_remove(at).pending.map(|(fence, _)| fence)
    }

    /// Move `range`'s horizon to its pending fence's stamp if that fence has completed.
    pub(in crate::pools) fn refresh_idle<D: Device<Fence = F>>(
        &mut self,
        range: SegmentId,
        device: &D,
    ) {
        let idle = self.range_idle(range);
        if let Some((fence, stamp)) = &idle.pending
            && device.fence_completed(fence)
        {
            idle.idle_before = *stamp;
            let (fence, _) = idle.pending.take().expect("checked above");
            device.release_fence(fence);
        }
    }

    /// The range of `plan` is mapping memory: record its idle fence, unless one is pending. A
    /// failure to record leaves the horizon where it is (unmaps then wait, as they always may).
    pub fn note_range_mapped<D: Device<Fence = F>>(&mut self, plan: &MapPlan, device: &D) {
        let range = self.blocks[plan.block as usize].segment;
        self.refresh_idle(range, device);
        if self.range_idle(range).pending.is_some() {
            return;
        }
        let stream = self.segment(range).stream;
        let stamp = self.lookups;
        if let Ok(Some(fence)) = device.record_idle_fence(stream) {
            self.range_idle(range).pending = Some((fence, stamp));
        }
    }

    /// Whether unmapping `taken` must wait for the device first: some of it may still be in
    /// use (see the Note).
    pub fn unmapping_needs_wait<D: Device<Fence = F>>(
        &mut self,
        taken: &[Unmapping],
        device: &D,
    ) -> bool {
        let mut wait = false;
        for u in taken {
            wait |= self.may_be_in_use(u, device);
        }
        wait
    }

    /// Of memory taken for recycling, what may still be in use stays mapped, back in the pools
    /// as it was; the rest is returned, to be unmapped without a wait. See [Note [Recycling
    /// never waits]](self#note-recycling-never-waits).
    pub fn keep_busy_mapped<D: Device<Fence = F>>(
        &mut self,
        taken: Vec<Unmapping>,
        device: &D,
    ) -> Vec<Unmapping> {
        let mut idle = Vec::with_capacity(taken.len());
        for u in taken {
            if self.may_be_in_use(&u, device) {
                self.keep_mapped(u);
            } else {
                idle.push(u);
            }
        }
        idle
    }

    /// Whether kernels queued before now may still use `u`'s memory or one of its parked
    /// places.
    pub(in crate::pools) fn may_be_in_use<D: Device<Fence = F>>(
        &mut self,
        u: &Unmapping,
        device: &D,
    ) -> bool {
        self.refresh_idle(u.range, device);
        let idle_before = self.range_idle(u.range).idle_before;
        // A parked place was last used before it was parked (see moves.rs).
        u.free_since >= idle_before || u.aliases.iter().any(|a| a.since >= idle_before)
    }
}
