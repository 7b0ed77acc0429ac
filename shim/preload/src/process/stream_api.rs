//! The shim's side of what PyTorch's `cudaMallocAsync` route and CUDA graphs need: stream keys,
//! graph captures, the default memory pool's statistics and trim, and the stack of the Python
//! thread in `backward()`.

use cachealloc_core::{Allocator, NO_STREAM, Stats};

use super::Shim;
use crate::backend::CudaDevice;
use crate::cuda::{self, CudaError};
use crate::log;
use crate::streams::Stream;
use crate::trace::DeviceObserver;

impl Shim {
    /// The calling Python thread enters `backward()` (announced by the Python integration):
    /// until [`Shim::backward_end`], threads without frames of their own — the autograd
    /// engine's — get its stack. Returns the stack it replaces.
    pub fn backward_begin(&self) -> u32 {
        let (Some(stacks), Ok(trace)) = (&self.stacks, &self.trace) else {
            return 0;
        };
        // The innermost Python frame is the integration's wrapper: leave it out.
        let stack = stacks.capture_skipping(trace, 1);
        stacks.set_backward(stack)
    }

    /// The `backward()` announced by [`Shim::backward_begin`] returned: put back `previous`.
    pub fn backward_end(&self, previous: u32) {
        if let Some(stacks) = &self.stacks {
            stacks.set_backward(previous);
        }
    }

    /// The pool key of a stream handle given to `cudaMallocAsync`/`cudaFreeAsync`: the legacy
    /// default stream's two names (0 and `cudaStreamLegacy`) are one stream; the per-thread
    /// default stream's handle names a different stream on each thread, so its blocks are
    /// treated as the synchronous API's ([`NO_STREAM`]: fenced).
    pub fn stream_key(&self, stream: usize) -> u64 {
        match stream {
            0 | cuda::STREAM_LEGACY => cuda::STREAM_LEGACY as u64,
            cuda::STREAM_PER_THREAD => NO_STREAM,
            other => other as u64,
        }
    }

    /// Whether `stream` is capturing a CUDA graph (one atomic load when no capture is under
    /// way).
    #[inline]
    pub fn is_capturing(&self, stream: usize) -> bool {
        self.streams.is_capturing(Stream(stream))
    }

    /// `stream` is about to begin capturing a graph: every block freed from now on waits for a
    /// fence recorded now, which covers the work enqueued on the stream before its capture
    /// (later fences leave the capturing stream out).
    pub fn capture_beginning(&self, stream: usize) {
        for pool in self.pools() {
            if let Err(e) = pool.alloc.fence_barrier() {
                log::error!("could not fence before a graph capture: {e}");
            }
        }
        let device = self.current_device().unwrap_or(0);
        self.streams.capture_began(Stream(stream), device);
    }

    /// `stream`'s capture ended; after the last one, release the segments whose release it
    /// deferred.
    pub fn capture_ended(&self, stream: usize) {
        if self.streams.capture_ended(Stream(stream)) {
            for pool in self.pools() {
                let failed = pool.alloc.device().release_deferred();
                if failed > 0 {
                    log::error!(
                        "{failed} segments released during a graph capture could not be freed"
                    );
                }
            }
        }
    }

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

    /// The device whose default memory pool `pool` is, if it is one we pool for.
    pub fn default_pool_device(&self, pool: usize) -> Option<i32> {
        let device = self.default_pool_owner(pool)?;
        self.allocator_of(device).map(|_| device)
    }

    /// The allocator of `device`, if it exists.
    pub(super) fn allocator_of(
        &self,
        device: i32,
    ) -> Option<&Allocator<CudaDevice, DeviceObserver>> {
        let slot = self.devices.get(usize::try_from(device).ok()?)?;
        slot.get().map(|p| &p.alloc)
    }

    /// `device`'s stats, if it has a pool.
    pub fn device_stats(&self, device: i32) -> Option<Stats> {
        self.allocator_of(device).map(|a| a.stats())
    }

    /// Reset `device`'s peak stats.
    pub fn reset_peak_stats(&self, device: i32) {
        if let Some(a) = self.allocator_of(device) {
            a.reset_peak_stats();
        }
    }

    /// Release `device`'s cached free segments (PyTorch's `empty_cache` through
    /// `cudaMemPoolTrimTo`).
    pub fn empty_device_cache(&self, device: i32) -> Result<(), CudaError> {
        let Some(alloc) = self.allocator_of(device) else {
            return Ok(());
        };
        alloc.empty_cache().map(drop).map_err(|e| {
            log::error!("empty_cache: {e}");
            cuda::ERROR_INITIALIZATION
        })
    }
}
