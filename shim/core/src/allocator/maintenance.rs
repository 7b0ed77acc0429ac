//! The allocator's maintenance operations, outside the allocation path: emptying the cache,
//! closing fence batches, switching to fenced reuse, and forgetting everything after a device
//! reset.

use super::expandable::mapped_runs;
use super::{Allocator, SegmentChanges};
use crate::device::{Device, DeviceError};
use crate::events::{Event, Observer};
use crate::pools::ReleasedSegment;
use crate::sizes::PoolKind;

impl<D: Device, O: Observer> Allocator<D, O> {
    /// Release every cached free segment to the device (`torch.cuda.empty_cache`), after waiting
    /// for all pending fences.
    pub fn empty_cache(&self) -> Result<SegmentChanges, DeviceError> {
        let mut changes = SegmentChanges::default();
        let mut pools = self.pools.lock();
        pools.close_open_batches(&self.device)?;
        while let Some(fence) = pools
            .oldest_pending_fence()
            .or_else(|| pools.any_cross_fence())
        {
            pools.stats.num_fence_waits += 1;
            let (waited, relocked) = self.unlocked(pools, || self.device.wait_fence(&fence));
            pools = relocked;
            waited?;
            self.collect_completed(&mut pools, &mut changes);
        }
        let all = pools.take_free_segments(&[PoolKind::Large, PoolKind::Small]);
        let pools = self.release_unlocked(pools, all, &mut changes);
        drop(self.unmap_unlocked(pools, &mut changes));
        Ok(changes)
    }

    /// Give the address space of the expandable segments that have nothing mapped back to the
    /// device, with the lock released (a private pool emptied for good: Note [Kept maps]).
    /// Returns how many ranges the device refused to free (their address space is lost).
    pub fn free_empty_ranges(&self) -> usize {
        let empty = self.pools.lock().take_empty_ranges(&self.device);
        (empty.into_iter())
            .filter(|&(address, size)| self.device.free_range(address, size).is_err())
            .count()
    }

    /// Close the open fence batch now (for example before a long pause, or at a stream
    /// synchronization the caller saw), and collect completed ones.
    pub fn flush_fences(&self) -> Result<SegmentChanges, DeviceError> {
        let mut changes = SegmentChanges::default();
        let mut pools = self.pools.lock();
        pools.close_open_batches(&self.device)?;
        self.collect_completed(&mut pools, &mut changes);
        Ok(changes)
    }

    /// Put every block freed from now on behind a fence recorded now (see
    /// [`Pools::close_batch_as_barrier`](crate::pools::Pools::close_batch_as_barrier)).
    pub fn fence_barrier(&self) -> Result<(), DeviceError> {
        self.pools.lock().close_batch_as_barrier(&self.device)
    }

    /// The application is about to destroy `stream`: nothing recorded for later may name it
    /// (see [`Pools::close_cross_batch_before_destroy`](crate::pools::Pools::close_cross_batch_before_destroy)).
    pub fn stream_destroying(&self, stream: u64) -> Result<(), DeviceError> {
        self.pools
            .lock()
            .close_cross_batch_before_destroy(stream, &self.device)
    }

    /// Switch to fenced reuse (see [`Pools::start_fencing`](crate::pools::Pools::start_fencing)); a no-op unless the policy is
    /// `auto` and fencing has not started.
    pub fn start_fencing(&self) -> Result<(), DeviceError> {
        self.pools.lock().start_fencing(&self.device)
    }

    /// Forget every segment without releasing it (the device context was reset). The observer
    /// hears every live block end and every segment go (the mapped parts of expandable ones
    /// unmapped).
    pub fn forget_all(&self) {
        let mut pools = self.pools.lock();
        for segment in pools.snapshot() {
            for block in segment.blocks.iter().filter(|b| {
                matches!(
                    b.state,
                    crate::BlockState::Active | crate::BlockState::PendingFree
                )
            }) {
                self.observer.on_event(Event::FreeCompleted {
                    address: block.address,
                    size: block.size,
                });
            }
            if segment.expandable {
                for (address, size) in mapped_runs(&segment) {
                    self.observer.on_event(Event::SegmentUnmap {
                        address,
                        size,
                        pool: segment.pool,
                    });
                }
                continue;
            }
            let released = ReleasedSegment {
                address: segment.address,
                size: segment.total_size,
                pool: segment.pool,
            };
            self.observer.on_event(Event::SegmentFree(&released));
        }
        pools.forget_all();
    }
}
