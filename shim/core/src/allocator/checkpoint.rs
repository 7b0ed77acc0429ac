//! Checkpoints of the pools and putting them back to one, under the lock, with the events the
//! observer hears; see [Note [Pool checkpoints]](crate::pools::checkpoint#note-pool-checkpoints).

use super::Allocator;
use crate::device::Device;
use crate::events::{Event, Observer};
use crate::pools::{Checkpoint, RestoreError, Restored};

impl<D: Device, O: Observer> Allocator<D, O> {
    /// The pools' layout now, for [`Allocator::restore`] (`None` while a block waits for a
    /// fence); see [Note [Pool checkpoints]](crate::pools::checkpoint#note-pool-checkpoints).
    pub fn checkpoint(&self) -> Option<Checkpoint> {
        self.pools.lock().checkpoint()
    }

    /// Put the pools back to `checkpoint`: free every allocated block, then allocate the
    /// checkpoint's blocks again at their addresses. The observer hears each free and each
    /// allocation, in that order.
    pub fn restore(&self, checkpoint: &Checkpoint) -> Result<Restored, RestoreError> {
        let mut pools = self.pools.lock();
        let restored = pools.restore(checkpoint)?;
        for freed in &restored.freed {
            self.observer.on_event(Event::FreeRequested(freed));
        }
        for allocation in &restored.allocated {
            self.observer.on_event(Event::Alloc(allocation));
        }
        Ok(restored)
    }
}
