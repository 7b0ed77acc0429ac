//! Settings the program changes at run time (PyTorch's `_set_allocator_settings`): the
//! request policy ([`Allocator::set_policy`]) and expandable segments
//! ([`Allocator::set_expandable`]); and how a private pool's expandable segments keep their
//! memory ([`Allocator::keep_maps`]).

use super::Allocator;
use crate::config::{AllocatorConfig, Expandable};
use crate::device::Device;
use crate::events::Observer;
use crate::pools::expandable::Geometry;

impl<D: Device, O: Observer> Allocator<D, O> {
    /// Apply `config`'s `max_split_size`, `roundup_power2_divisions` and
    /// `garbage_collection_threshold` to requests from now on (PyTorch's
    /// `_set_allocator_settings`); the allocator's other settings stay as they were made.
    pub fn set_policy(&self, config: &AllocatorConfig) {
        self.pools.lock().set_policy(config);
    }

    /// Keep what is mapped into expandable segments until [`Allocator::empty_cache`], mapping
    /// in PyTorch's pages, from now on: a private pool's allocator, whose blocks a graph may
    /// replay into after they were freed (see [Note [Kept
    /// maps]](crate::pools::expandable#note-kept-maps)).
    pub fn keep_maps(&self) {
        self.pools.lock().keep_maps();
    }

    /// The program turns expandable segments on or off at run time (PyTorch's
    /// `_set_allocator_settings("expandable_segments:…")`): from now on the allocator grows by
    /// mapping into expandable segments, or by fixed segments. Segments of the other kind stay
    /// and serve what they hold, each block under its own segment's rules (Note [Expandable
    /// segments]). With [`Expandable::StreamOrdered`] only stream-ordered requests map. Returns
    /// whether it grows expandable segments now (not where the device cannot map memory).
    pub fn set_expandable(&self, mode: Expandable) -> bool {
        let mut pools = self.pools.lock();
        if !mode.any() {
            pools.disable_expandable();
            return false;
        }
        let synchronous_fixed = mode == Expandable::StreamOrdered;
        if let Some(geometry) = pools.expandable() {
            pools.enable_expandable(geometry);
            pools.set_synchronous_fixed(synchronous_fixed);
            return true;
        }
        drop(pools);
        let Some(granularity) = self.device.offer_mapping() else {
            return false;
        };
        let geometry = Geometry {
            moves: self.device.can_alias(),
            ..Geometry::for_device(granularity, self.device.mem_info().total)
        };
        let mut pools = self.pools.lock();
        let geometry = pools.expandable().unwrap_or(geometry);
        pools.enable_expandable(geometry);
        pools.set_synchronous_fixed(synchronous_fixed);
        true
    }
}
