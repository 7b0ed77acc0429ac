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
            self.refresh_idle(u.range, device);
            let idle_before = self.range_idle(u.range).idle_before;
            wait |= u.free_since >= idle_before;
            // A parked place was last used before it was parked (see moves.rs).
            wait |= u.aliases.iter().any(|a| a.since >= idle_before);
        }
        wait
    }
}
