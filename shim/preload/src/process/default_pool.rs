//! The device's default memory pool, as PyTorch's `cudaMallocAsync` route sees it
//! (`cudaDeviceGetDefaultMemPool`, `cudaMemPoolGetAttribute`, `cudaMemPoolTrimTo`): which pool
//! is whose, and the statistics, peak resets and trims answered from our pools.

use cachealloc_core::Stats;

use super::Shim;
use crate::cuda::{self, CudaError};
use crate::log;

impl Shim {
    /// Note that `pool` is `device`'s default memory pool (`cudaDeviceGetDefaultMemPool`), whose
    /// statistics PyTorch's `cudaMallocAsync` backend reads.
    pub fn note_default_pool(&self, pool: usize, device: i32) {
        let mut pools = self.default_pools.lock().unwrap_or_else(|p| p.into_inner());
        if !pools.contains(&(pool, device)) {
            pools.push((pool, device));
        }
    }

    /// The device whose default memory pool `pool` is, if it was asked for
    /// (`cudaDeviceGetDefaultMemPool`).
    pub(super) fn default_pool_owner(&self, pool: usize) -> Option<i32> {
        let pools = self.default_pools.lock().unwrap_or_else(|p| p.into_inner());
        pools.iter().find(|(p, _)| *p == pool).map(|&(_, d)| d)
    }

    /// The device whose default memory pool `pool` is, if it is one we pool for (an ordinary
    /// pool, or only private ones: a program that has allocated only in graph captures).
    pub fn default_pool_device(&self, pool: usize) -> Option<i32> {
        let device = self.default_pool_owner(pool)?;
        (self.allocator_of(device).is_some() || self.has_private_pool_on(device)).then_some(device)
    }

    /// `device`'s stats (its ordinary pool's and its private pools'), if it has a pool of
    /// either kind.
    pub fn device_stats(&self, device: i32) -> Option<Stats> {
        let mut stats = match self.allocator_of(device) {
            Some(alloc) => alloc.stats(),
            None if self.has_private_pool_on(device) => Stats::default(),
            None => return None,
        };
        self.add_private_pools(device, &mut stats);
        Some(stats)
    }

    /// `device`'s stats as PyTorch counts them: its stream-ordered memory only, not what
    /// libraries allocate for themselves through the synchronous API (cachealloc-core's Note
    /// [PyTorch's view of the statistics]). What `torch.cuda.memory_stats()`, the default
    /// memory pool's attributes and PyTorch's profiler are told.
    pub fn pytorch_device_stats(&self, device: i32) -> Option<Stats> {
        self.device_stats(device).map(|s| s.stream_ordered_view())
    }

    /// Reset `device`'s peak stats (its capture pools' too).
    pub fn reset_peak_stats(&self, device: i32) {
        if let Some(a) = self.allocator_of(device) {
            a.reset_peak_stats();
        }
        self.for_each_private_pool(device, |a| a.reset_peak_stats());
    }

    /// Zero `device`'s accumulated stats (its capture pools' too):
    /// `torch.cuda.reset_accumulated_memory_stats`.
    pub fn reset_accumulated_stats(&self, device: i32) {
        if let Some(a) = self.allocator_of(device) {
            a.reset_accumulated_stats();
        }
        self.for_each_private_pool(device, |a| a.reset_accumulated_stats());
    }

    /// Release `device`'s cached free segments (PyTorch's `empty_cache` through
    /// `cudaMemPoolTrimTo`), after waiting for the work of recorded streams, as PyTorch's
    /// native `empty_cache` does (its frees held for that work then count as freed: PyTorch's
    /// `test_memory_stats` reads `active_bytes` after `empty_cache`).
    /// Graph pools no longer in use give theirs back too (Note [Private pools]).
    pub fn empty_device_cache(&self, device: i32) -> Result<(), CudaError> {
        self.free_recorded_when_done(true);
        self.with_free_stack(|| {
            self.release_unused_private_pools(true, Some(device));
            let Some(alloc) = self.allocator_of(device) else {
                return Ok(());
            };
            alloc.empty_cache().map(drop).map_err(|e| {
                log::error!("empty_cache: {e}");
                cuda::ERROR_INITIALIZATION
            })
        })
    }
}
