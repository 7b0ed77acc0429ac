//! Held frees under the lock, with the events the observer hears; see
//! [Note [Held frees]](crate::pools::held#note-held-frees).

use super::Allocator;
use crate::device::Device;
use crate::events::{Event, Observer};
use crate::pools::{FreeError, Freed};

impl<D: Device, O: Observer> Allocator<D, O> {
    /// The program freed `address` on `stream`, but work the caller knows of (other streams')
    /// may still use it: the block stops counting as allocated and is not reused until
    /// [`Allocator::release_held`]. The observer hears a pending free. A pointer that is not
    /// ours, a double free and an interior pointer are refused with nothing changed.
    pub fn free_held(&self, address: u64, stream: u64) -> Result<Freed, FreeError> {
        let mut pools = self.pools.lock();
        let freed = pools.free_held(address, stream)?;
        self.observer.on_event(Event::FreeRequested(&freed));
        Ok(freed)
    }

    /// The work that held the block at `address` is done: it goes where its free would have
    /// sent it now (its free list, heard as a completed free, or behind a fence). Returns false
    /// if no block is held there.
    pub fn release_held(&self, address: u64) -> bool {
        let mut pools = self.pools.lock();
        let mut completed = Vec::new();
        let found = pools.release_held(address, &mut completed);
        for (address, size) in completed {
            self.observer
                .on_event(Event::FreeCompleted { address, size });
        }
        found
    }
}
