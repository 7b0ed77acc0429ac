//! The policy the pools apply to each request — `max_split_size`, `roundup_power2_divisions`,
//! `garbage_collection_threshold` — which the program may change at run time (PyTorch's
//! `_set_allocator_settings`); read under the pools' lock.

use super::{BlockState, NIL, Pools};
use crate::config::AllocatorConfig;
use crate::sizes;

impl<F: Clone> Pools<F> {
    /// The program changes the allocator's settings at run time (PyTorch's
    /// `_set_allocator_settings`): `max_split_size`, `roundup_power2_divisions` and
    /// `garbage_collection_threshold` of `config` apply to requests from now on, as PyTorch's
    /// allocator reads its settings at each request; blocks already split or cached stay as
    /// they are.
    ///
    /// What counts as oversize changes with `max_split_size`: the oversize statistics are
    /// recounted under the new limit (the blocks and segments now oversize, counted as if they
    /// had just been allocated, those no longer oversize as freed), so that a later free
    /// decrements what its allocation counts under the limit in force.
    pub fn set_policy(&mut self, config: &AllocatorConfig) {
        self.max_split_size = config.max_split_size;
        self.stats.max_split_size = config.max_split_size;
        self.roundup = config.roundup.clone();
        self.garbage_collection_threshold = config.garbage_collection_threshold;
        let (mut allocations, mut segments) = (0i64, 0i64);
        for seg in self.segments.iter().flatten() {
            if !seg.expandable && sizes::is_oversize(seg.size, self.max_split_size) {
                segments += 1;
            }
            let mut id = seg.first;
            while id != NIL {
                let b = &self.blocks[id as usize];
                if b.state == BlockState::Active && sizes::is_oversize(b.size, self.max_split_size)
                {
                    allocations += 1;
                }
                id = b.next;
            }
        }
        for (stat, now) in [
            (&mut self.stats.oversize_allocations, allocations),
            (&mut self.stats.oversize_segments, segments),
        ] {
            match now - stat.current {
                more if more > 0 => stat.increase(more as u64),
                fewer => stat.decrease((-fewer) as u64),
            }
        }
    }

    /// `size` rounded as the policy in force rounds requests.
    pub fn round(&self, size: u64) -> u64 {
        sizes::round_size(size, &self.roundup)
    }

    /// The garbage-collection threshold in force (0: off).
    pub fn garbage_collection_threshold(&self) -> f64 {
        self.garbage_collection_threshold
    }
}
