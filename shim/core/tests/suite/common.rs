//! Shared helpers: config presets and an allocator that checks its invariants after every step.

use cachealloc_core::sizes::Roundup;
use cachealloc_core::{
    AllocError, Allocation, Allocator, AllocatorConfig, FenceMode, Freed, ReusePolicy, SimDevice,
    Stats,
};

pub(crate) const MIB: u64 = 1 << 20;

/// The config presets every suite runs over.
pub(crate) fn presets() -> Vec<(&'static str, AllocatorConfig)> {
    let base = AllocatorConfig::default();
    vec![
        ("default", base.clone()),
        (
            "max_split",
            AllocatorConfig {
                max_split_size: 40 * MIB,
                ..base.clone()
            },
        ),
        (
            "roundup",
            AllocatorConfig {
                roundup: Roundup::Uniform(4),
                ..base.clone()
            },
        ),
        (
            "roundup_list",
            AllocatorConfig {
                roundup: Roundup::PerInterval(vec![1, 2, 4, 8]),
                ..base.clone()
            },
        ),
        (
            "gc",
            AllocatorConfig {
                garbage_collection_threshold: 0.6,
                ..base.clone()
            },
        ),
        (
            "limit",
            AllocatorConfig {
                per_process_memory_fraction: 0.5,
                ..base.clone()
            },
        ),
        (
            "fenced",
            AllocatorConfig {
                reuse: ReusePolicy::Fenced,
                ..base.clone()
            },
        ),
        (
            "all",
            AllocatorConfig {
                max_split_size: 64 * MIB,
                roundup: Roundup::Uniform(2),
                garbage_collection_threshold: 0.8,
                per_process_memory_fraction: 0.75,
                reuse: ReusePolicy::Fenced,
                ..base
            },
        ),
    ]
}

/// An allocator over a `SimDevice` that checks its invariants after every operation.
pub(crate) struct Checked {
    pub(crate) alloc: Allocator<SimDevice>,
}

impl Checked {
    pub(crate) fn new(capacity: u64, config: AllocatorConfig) -> Self {
        Checked {
            alloc: Allocator::new(SimDevice::new(capacity), config),
        }
    }

    pub(crate) fn manual(capacity: u64, config: AllocatorConfig) -> Self {
        Checked {
            alloc: Allocator::new(
                SimDevice::with_fence_mode(capacity, FenceMode::Manual),
                config,
            ),
        }
    }

    pub(crate) fn check(&self) {
        if let Err(e) = self.alloc.check_invariants() {
            panic!("invariant violated: {e}");
        }
    }

    pub(crate) fn malloc(&self, size: u64) -> Allocation {
        let a = self
            .try_malloc(size)
            .unwrap_or_else(|e| panic!("malloc({size}) failed: {e}"));
        assert!(a.size >= size, "block smaller than the request");
        a
    }

    pub(crate) fn try_malloc(&self, size: u64) -> Result<Allocation, AllocError> {
        let r = self.alloc.malloc(size, 0);
        self.check();
        r
    }

    pub(crate) fn free(&self, address: u64) -> Freed {
        let f = self
            .alloc
            .free(address)
            .unwrap_or_else(|e| panic!("free failed: {e}"));
        self.check();
        f
    }

    pub(crate) fn empty_cache(&self) {
        self.alloc.empty_cache().unwrap();
        self.check();
    }

    pub(crate) fn stats(&self) -> Stats {
        self.alloc.stats()
    }

    pub(crate) fn device(&self) -> &SimDevice {
        self.alloc.device()
    }
}
