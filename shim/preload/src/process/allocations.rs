//! Serving allocations and frees: from the pools when pooling, through to the real functions
//! (traced) when not; the cached free bytes `cudaMemGetInfo` adds; emptying the cache; stats.

use std::sync::atomic::Ordering;

use cachealloc_core::{AllocError, Allocator, FreeError, Stats};

use super::Shim;
use crate::backend::CudaDevice;
use crate::cuda::driver::CuResult;
use crate::cuda::{self, CudaError};
use crate::log;
use crate::trace::DeviceObserver;

/// What tells the program's out-of-memory observers, set by the C API when the first observer
/// is attached (this module does not call foreign code itself).
pub static OOM_OBSERVERS: std::sync::OnceLock<fn(i32, u64, u64, u64)> = std::sync::OnceLock::new();

impl Shim {
    /// Serve `cudaMalloc(size)` ([`NO_STREAM`](cachealloc_core::NO_STREAM)) or
    /// `cudaMallocAsync(size, stream)` from the current device's pool.
    pub fn malloc(&self, size: u64, stream: u64) -> Result<u64, CudaError> {
        self.malloc_on(self.current_device()?, size, stream)
    }

    /// Serve an allocation for `stream` from `device`'s pool.
    /// A thread allocating to a `MemPool` gets its stream-ordered allocations there (Note
    /// [PyTorch MemPools]); when the ordinary pool is out of memory, a `use_on_oom` pool may
    /// lend a cached block.
    pub fn malloc_on(&self, device: i32, size: u64, stream: u64) -> Result<u64, CudaError> {
        self.free_recorded_when_done(false);
        if stream != cachealloc_core::NO_STREAM
            && let Some(served) = self.thread_pool_malloc(device, size, stream)
        {
            return self.observed(device, size, stream, served);
        }
        self.ipc_collect_if_pending();
        let pool = self.pool(device)?;
        let served = match self.serve(&pool.alloc, device, size, stream) {
            // Blocks other processes let go of since: free them, and try again.
            Err(cuda::ERROR_MEMORY_ALLOCATION) if self.ipc_collect_all() > 0 => {
                self.serve(&pool.alloc, device, size, stream)
            }
            served => served,
        };
        let served = self.after_releasing_unused(served, &pool.alloc, device, size, stream);
        // Blocks waiting for their recorded streams' work: wait for it, and try again.
        let served = match served {
            Err(cuda::ERROR_MEMORY_ALLOCATION) if self.free_recorded_when_done(true) > 0 => {
                self.serve(&pool.alloc, device, size, stream)
            }
            served => served,
        };
        let served = match served {
            Err(cuda::ERROR_MEMORY_ALLOCATION) => self
                .oom_fallback(device, size, stream)
                .ok_or(cuda::ERROR_MEMORY_ALLOCATION),
            served => served,
        };
        self.observed(device, size, stream, served)
    }

    /// `served`, after telling the program's out-of-memory observers when it is out of memory
    /// (PyTorch's `_cuda_attach_out_of_memory_observer`): the device, the request, the device's
    /// limit and its free memory. PyTorch's profiler hears of stream-ordered requests only
    /// (PyTorch's own: cachealloc-core's Note [PyTorch's view of the statistics]).
    pub(super) fn observed(
        &self,
        device: i32,
        size: u64,
        stream: u64,
        served: Result<u64, CudaError>,
    ) -> Result<u64, CudaError> {
        if stream != cachealloc_core::NO_STREAM
            && let Some(profiler) = self.memory_profiler()
        {
            match served {
                Ok(address) => self.profile_alloc(profiler, device, address),
                Err(cuda::ERROR_MEMORY_ALLOCATION) => {
                    self.profile_out_of_memory(profiler, device, size)
                }
                Err(_) => {}
            }
        }
        if served == Err(cuda::ERROR_MEMORY_ALLOCATION)
            && let Some(notify) = OOM_OBSERVERS.get()
            && let Some(alloc) = self.allocator_of(device)
        {
            let info = cachealloc_core::Device::mem_info(alloc.device());
            notify(device, size, alloc.limit().min(info.total), info.free);
        }
        served
    }

    /// `served`, or, when it ran out of memory and graph pools no longer in use held some
    /// (Note [Private pools]), the request served again from `alloc` once they let it go.
    pub(super) fn after_releasing_unused(
        &self,
        served: Result<u64, CudaError>,
        alloc: &Allocator<CudaDevice, DeviceObserver>,
        device: i32,
        size: u64,
        stream: u64,
    ) -> Result<u64, CudaError> {
        match served {
            Err(cuda::ERROR_MEMORY_ALLOCATION)
                if self.release_unused_private_pools(true, Some(device)) > 0 =>
            {
                self.serve(alloc, device, size, stream)
            }
            served => served,
        }
    }

    /// Serve an allocation for `stream` from `alloc`, one of `device`'s allocators; report what
    /// went wrong, and answer as the runtime would.
    pub(super) fn serve(
        &self,
        alloc: &Allocator<CudaDevice, DeviceObserver>,
        device: i32,
        size: u64,
        stream: u64,
    ) -> Result<u64, CudaError> {
        let mut changes = cachealloc_core::SegmentChanges::default();
        let stack = self.capture_stack();
        let result = if stream == cachealloc_core::NO_STREAM {
            // Memory the synchronous API makes is the libraries' own, which PyTorch's memory
            // fraction leaves out (Note [Whose memory a limit counts]).
            crate::backend::budget::for_synchronous_request(|| {
                alloc.malloc_on_stream(size, stream, u64::from(stack), &mut changes)
            })
        } else {
            alloc.malloc_on_stream(size, stream, u64::from(stack), &mut changes)
        };
        for (segment, e) in &changes.release_errors {
            log::error!(
                "device {device}: releasing segment {:#x}: {e}",
                segment.address
            );
        }
        for ((address, _), e) in &changes.unmap_errors {
            if !matches!(e, cachealloc_core::DeviceError::Other { code, .. }
                if CuResult(*code) == cuda::driver::ERROR_STREAM_CAPTURE_UNSUPPORTED)
            {
                log::error!("device {device}: unmapping {address:#x}: {e}");
            }
        }
        match result {
            Ok(a) => Ok(a.address),
            Err(AllocError::OutOfMemory(report)) => {
                log::info!("device {device}: {report}");
                Err(cuda::ERROR_MEMORY_ALLOCATION)
            }
            Err(AllocError::Device(e)) => {
                log::error!("device {device}: {e}");
                Err(match e {
                    // The device's codes are the driver's (its calls are).
                    cachealloc_core::DeviceError::Other { code, .. } => CuResult(code).to_runtime(),
                    cachealloc_core::DeviceError::OutOfMemory => cuda::ERROR_MEMORY_ALLOCATION,
                })
            }
        }
    }

    /// Free `address` if it is ours, synchronously ([`NO_STREAM`](cachealloc_core::NO_STREAM))
    /// or ordered on `stream`.
    /// `None`: not ours (pass it on). Pools are found by the address ranges their segments
    /// covered, not by the current device (a pointer may be freed while another device is
    /// current).
    /// A block another process still holds (IPC) is freed when it lets go.
    pub fn free(&self, address: u64, stream: u64) -> Option<CudaError> {
        self.program_free(address, stream, None)
    }

    /// [`Shim::free`] of `address` on `stream`, which is capturing a graph: the free is a
    /// synchronous one for the pools (it happens at capture time; the graph orders the block's
    /// uses), but `record_stream`'s wait follows the capture's graph from `stream`'s work (Note
    /// [Recorded streams]).
    pub fn free_in_capture(&self, address: u64, stream: usize) -> Option<CudaError> {
        self.program_free(address, cachealloc_core::NO_STREAM, Some(stream))
    }

    /// A free the program asked for: told to PyTorch's profiler when it records memory and the
    /// free is PyTorch's (stream-ordered, or in a capture).
    fn program_free(
        &self,
        address: u64,
        stream: u64,
        capturing: Option<usize>,
    ) -> Option<CudaError> {
        let pytorchs = stream != cachealloc_core::NO_STREAM || capturing.is_some();
        let Some(profiler) = self.memory_profiler().filter(|_| pytorchs) else {
            return self.free_from(address, stream, capturing);
        };
        let block = self.live_block(address);
        let freed = self.free_from(address, stream, capturing);
        if freed == Some(cuda::SUCCESS)
            && let Some(block) = block
        {
            self.profile_free(profiler, address, block);
        }
        freed
    }

    /// [`Shim::free`] (on a capturing stream with `capturing`), whoever asks for it: the
    /// program, or the library releasing a free that waited.
    pub(super) fn free_from(
        &self,
        address: u64,
        stream: u64,
        capturing: Option<usize>,
    ) -> Option<CudaError> {
        if let Some(deferred) = self.free_after_recorded_streams(address, stream, capturing) {
            return Some(deferred);
        }
        if let Some(held) = self.ipc_hold(address, stream) {
            return Some(held);
        }
        let freed = self.with_free_stack(|| self.free_pooled(address, stream));
        self.ipc_collect();
        freed
    }

    /// Run `f` (a free, `empty_cache`) with the calling thread's stack as the stack of the
    /// records it makes, when the program asked for free stacks (`crate::stacks::free_stacks`).
    pub(super) fn with_free_stack<T>(&self, f: impl FnOnce() -> T) -> T {
        if !crate::stacks::frees::free_stacks() {
            return f();
        }
        let before = crate::stacks::frees::set_at_free(self.capture_stack());
        let result = f();
        crate::stacks::frees::set_at_free(before);
        result
    }

    /// [`Shim::free`] without the IPC check.
    pub(super) fn free_pooled(&self, address: u64, stream: u64) -> Option<CudaError> {
        let candidates = self.pools().filter(|p| p.may_contain(address));
        for pool in candidates {
            match pool.alloc.free_on_stream(address, stream) {
                Ok(_) => return Some(cuda::SUCCESS),
                Err(FreeError::NotOurs(_)) => continue,
                Err(bad) => {
                    log::error!("cudaFree refused: {bad}; nothing was changed");
                    return Some(cuda::ERROR_INVALID_VALUE);
                }
            }
        }
        self.private_free(address, stream)
    }

    /// Count (and trace) an allocation that passed through (`pool:off`, degraded, or while the
    /// program had caching off) to
    /// `real`, the real `cudaMalloc` or `cuMemAlloc_v2`. A raw allocation is a segment holding
    /// one block: both are recorded.
    pub fn passthrough_malloc<E>(
        &self,
        size: u64,
        real: impl FnOnce() -> Result<u64, E>,
    ) -> Result<u64, E> {
        if self.healthy() {
            // Passed through while the program had caching off.
            self.uncached_mallocs.fetch_add(1, Ordering::Relaxed);
        } else {
            self.passthrough_mallocs.fetch_add(1, Ordering::Relaxed);
        }
        let Ok(trace) = &self.trace else {
            return real();
        };
        let stack = self.capture_stack();
        let address = real()?;
        if address == 0 {
            return Ok(0); // cudaMalloc(0)
        }
        let device = self.current_device().unwrap_or(0) as u32;
        self.passthrough
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(address, (size, device));
        trace.raw_allocation(device, address, size, stack);
        Ok(address)
    }

    /// Trace the free of an allocation that passed through, if it was traced; call before the
    /// real `cudaFree`, so that no reuse of the address can be recorded before it.
    pub fn passthrough_free(&self, address: u64) {
        let Ok(trace) = &self.trace else { return };
        let Some((size, device)) = self
            .passthrough
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&address)
        else {
            return;
        };
        trace.raw_free(device, address, size);
    }

    /// Cached-but-free bytes of the current device, for `cudaMemGetInfo`.
    pub fn cached_free_bytes(&self) -> u64 {
        self.current_device()
            .map_or(0, |device| self.cached_free_bytes_on(device))
    }

    /// Cached-but-free bytes of `device`, for `cudaMemGetInfo` and `cuMemGetInfo_v2`.
    pub fn cached_free_bytes_on(&self, device: i32) -> u64 {
        if !self.report_cached_as_free {
            return 0;
        }
        self.allocator_of(device)
            .map_or(0, |a| a.cached_free_bytes())
    }

    /// Release every cached free segment on every device.
    /// Private pools still in use keep theirs (Note [Private pools]).
    pub fn empty_cache(&self) -> Result<(), CudaError> {
        self.ipc_collect_all();
        // As PyTorch's native `empty_cache`, wait for the work of recorded streams first.
        self.free_recorded_when_done(true);
        self.with_free_stack(|| {
            for alloc in self.allocators() {
                alloc.empty_cache().map_err(|e| {
                    log::error!("empty_cache: {e}");
                    cuda::ERROR_INITIALIZATION
                })?;
            }
            self.release_unused_private_pools(true, None);
            Ok(())
        })
    }

    /// Stats of every device that has a pool: `(device, stats)`.
    pub fn stats(&self) -> Vec<(usize, Stats)> {
        self.devices
            .iter()
            .enumerate()
            .filter(|(_, slot)| slot.get().is_some())
            .filter_map(|(d, _)| Some((d, self.device_stats(d as i32)?)))
            .collect()
    }
}
