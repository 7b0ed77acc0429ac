//! The [`Device`] trait: the allocator's only source of device memory and of reuse fences.
//!
//! The shim implements it over the real CUDA runtime and driver (`cudaMalloc`, `cudaFree`,
//! events); tests, `cachealloc simulate` and the benchmarks use [`crate::SimDevice`].
//!
//! Methods take `&self`: the allocator calls segment allocation and release *without* holding its
//! own lock (a real `cudaFree` synchronizes the whole device and may take milliseconds), so an
//! implementation must be usable from several threads at once.
//!
//! A device may also offer *virtual memory* (CUDA's `cuMemAddressReserve`, `cuMemCreate`,
//! `cuMemMap`): [`Device::map_granularity`] says so, and the allocator then grows
//! *expandable segments* instead of allocating new ones (see
//! [Note [Expandable segments]](crate::pools::expandable#note-expandable-segments)).

use std::fmt;

/// Why the device refused a segment.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// Not enough device memory (`cudaErrorMemoryAllocation`). The allocator's OOM ladder
    /// reacts to this one by releasing cached memory and retrying.
    #[error("device out of memory")]
    OutOfMemory,
    /// Any other failure; passed to the caller unchanged, with the backend's code and text.
    #[error("device error {code}: {message}")]
    Other {
        /// The backend's error code (for the CUDA backend a `CUresult`: its calls are the
        /// driver's).
        code: i32,
        /// What the backend said.
        message: String,
    },
}

/// Device memory as the backend reports it (`cudaMemGetInfo`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes the device could still hand out.
    pub free: u64,
    /// Bytes of device memory in all.
    pub total: u64,
}

/// A limit that all pools of a device share (see [`Device::shared_limit`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedLimit {
    /// Bytes all the device's pools may hold together.
    pub limit: u64,
    /// Bytes they hold now, as the limit counts them.
    pub held: u64,
    /// Whether the limit counts the memory of synchronous requests too ([`crate::NO_STREAM`]);
    /// else only that of stream-ordered ones (PyTorch's memory fraction: Note [PyTorch's view
    /// of the statistics]).
    pub counts_synchronous: bool,
}

/// A source of device memory and of reuse fences for one device.
///
/// A *fence* marks "all GPU work enqueued so far, on every stream that may touch our memory".
/// Freed blocks wait behind a fence before they are handed out again (see
/// [Note [Reuse fences]](crate::pools#note-reuse-fences)).
pub trait Device: Send + Sync {
    /// The backend's fence handle (a set of CUDA events for the real device).
    type Fence: Clone + Send + fmt::Debug;

    /// Total and free memory of the device.
    fn mem_info(&self) -> MemInfo;

    /// A limit on the memory that every pool of the device holds together, when one is set
    /// (PyTorch's memory fraction counts a device's private pools too), and what they all
    /// hold now; the device refuses a segment or map beyond it as out of memory. The default:
    /// none (each allocator's own limit alone applies).
    fn shared_limit(&self) -> Option<SharedLimit> {
        None
    }

    /// Allocate a segment of exactly `size` bytes; returns its address.
    fn allocate_segment(&self, size: u64) -> Result<u64, DeviceError>;

    /// Release a segment previously returned by [`Device::allocate_segment`].
    fn free_segment(&self, address: u64, size: u64) -> Result<(), DeviceError>;

    /// Record a fence after all work enqueued so far.
    fn record_fence(&self) -> Result<Self::Fence, DeviceError>;

    /// Whether the work before `fence` has finished. Must not block.
    fn fence_completed(&self, fence: &Self::Fence) -> bool;

    /// Block until the work before `fence` has finished.
    fn wait_fence(&self, fence: &Self::Fence) -> Result<(), DeviceError>;

    /// Give back the resources of a fence that is no longer needed (completed or abandoned).
    fn release_fence(&self, fence: Self::Fence) {
        drop(fence);
    }

    /// Record a fence after the work enqueued so far on `stream` alone (for blocks freed on
    /// that stream; see [Note [Stream-ordered reuse]](crate::pools#note-stream-ordered-reuse)).
    /// The default records a full fence, which is always enough.
    fn record_stream_fence(&self, stream: u64) -> Result<Self::Fence, DeviceError> {
        let _ = stream;
        self.record_fence()
    }

    /// Order `stream`'s later work after `fence` on the device, without waiting on the host
    /// (`cudaStreamWaitEvent`). The default waits on the host, which is always enough.
    fn stream_wait(&self, stream: u64, fence: &Self::Fence) -> Result<(), DeviceError> {
        let _ = stream;
        self.wait_fence(fence)
    }

    // ----- virtual memory (expandable segments) ----------------------------------------------

    /// The unit in which [`Device::map`] and [`Device::unmap`] work (CUDA's allocation
    /// granularity, 2 MiB on current GPUs), or `None` when the device cannot map memory into
    /// reserved address ranges. The default: `None`.
    fn map_granularity(&self) -> Option<u64> {
        None
    }

    /// Expandable segments were asked for at run time: offer mapping from now on if the device
    /// can, and return [`Device::map_granularity`]. The default: what that says already.
    fn offer_mapping(&self) -> Option<u64> {
        self.map_granularity()
    }

    /// Reserve `size` bytes of address space (a multiple of the granularity) with no memory
    /// behind it; returns its start, aligned to the granularity.
    fn reserve_range(&self, size: u64) -> Result<u64, DeviceError> {
        let _ = size;
        Err(DeviceError::unsupported("reserve_range"))
    }

    /// Give back a range from [`Device::reserve_range`]; nothing in it is mapped.
    fn free_range(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        let _ = (address, size);
        Err(DeviceError::unsupported("free_range"))
    }

    /// Back `[address, address + size)` (granularity-aligned, inside a reserved range, not
    /// mapped) with new device memory, readable and writable by this device: one *mapping*.
    /// Fails with [`DeviceError::OutOfMemory`] when the memory is not there, leaving nothing
    /// mapped.
    fn map(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        let _ = (address, size);
        Err(DeviceError::unsupported("map"))
    }

    /// Make the adjacent `mappings` (address order, each as [`Device::map`] makes one), or none
    /// of them: on a failure, those made are unmapped (they are new: nothing uses them) and the
    /// error returned. The default maps them one by one; an implementation may share the work
    /// of a run (the shim grants access to the whole run in one call).
    fn map_run(&self, mappings: &[(u64, u64)]) -> Result<(), DeviceError> {
        for (i, &(address, size)) in mappings.iter().enumerate() {
            if let Err(e) = self.map(address, size) {
                for &(address, size) in &mappings[..i] {
                    let _ = self.unmap(address, size);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Whether [`Device::alias`] works here. The default: no.
    fn can_alias(&self) -> bool {
        false
    }

    /// Map the memory of the whole mapping at `from` (`size` bytes, as [`Device::map`] or
    /// `alias` made it) at `to` as well (granule-aligned, inside a reserved range, not mapped),
    /// readable and writable by this device: no new memory, the same bytes at two places,
    /// each unmapped on its own; the memory goes back to the device with its last mapping. See
    /// [Note [Moving memory instead of unmapping it]](crate::pools::expandable::moves#note-moving-memory-instead-of-unmapping-it).
    fn alias(&self, from: u64, to: u64, size: u64) -> Result<(), DeviceError> {
        let _ = (from, to, size);
        Err(DeviceError::unsupported("alias"))
    }

    /// Make the memory of one map: first the `moves` (`(from, to, size)`: memory mapped at
    /// `from`, mapped at `to` as well, as [`Device::alias`] does), then the new `mappings` (as
    /// [`Device::map_run`] makes them), all adjacent in address order; or none of it: on a
    /// failure, what was made is unmapped (nothing uses it) and the error returned. The default
    /// makes them one by one; an implementation may share the work of the whole run (the shim
    /// grants access to it in one call).
    fn map_with_moves(
        &self,
        moves: &[(u64, u64, u64)],
        mappings: &[(u64, u64)],
    ) -> Result<(), DeviceError> {
        for (i, &(from, to, size)) in moves.iter().enumerate() {
            if let Err(e) = self.alias(from, to, size) {
                for &(_, to, size) in &moves[..i] {
                    let _ = self.unmap(to, size);
                }
                return Err(e);
            }
        }
        self.map_run(mappings).inspect_err(|_| {
            for &(_, to, size) in moves {
                let _ = self.unmap(to, size);
            }
        })
    }

    /// Unmap one whole mapping, `[address, address + size)` exactly as a [`Device::map`] or
    /// [`Device::alias`] call made it (the driver unmaps nothing less); its memory goes back to
    /// the device unless it is still mapped elsewhere. No work on the device may
    /// still use it: an unmap, unlike `cudaFree`, does not wait for kernels, so the caller took
    /// it out of the pools and made sure it is idle — by [`Device::synchronize`], or by a
    /// completed idle fence (see
    /// [Note [Unmapping without a wait]](crate::pools::expandable::idle#note-unmapping-without-a-wait)).
    fn unmap(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        let _ = (address, size);
        Err(DeviceError::unsupported("unmap"))
    }

    /// Wait until all work on the device has finished (`cuCtxSynchronize`), before unmapping
    /// memory that may still be in use. The default: nothing to wait for.
    fn synchronize(&self) -> Result<(), DeviceError> {
        Ok(())
    }

    /// A fence after all work enqueued so far on `stream` ([`NO_STREAM`](crate::NO_STREAM): on
    /// every stream), telling when the memory freed on it so far is idle; `None` when none can
    /// be recorded now (a graph capture is under way). The default: [`Device::record_fence`]
    /// or [`Device::record_stream_fence`].
    fn record_idle_fence(&self, stream: u64) -> Result<Option<Self::Fence>, DeviceError> {
        if stream == crate::NO_STREAM {
            self.record_fence().map(Some)
        } else {
            self.record_stream_fence(stream).map(Some)
        }
    }
}

impl DeviceError {
    /// The device does not implement `what`.
    pub fn unsupported(what: &str) -> Self {
        DeviceError::Other {
            code: 801,
            message: format!("{what} is not supported by this device"),
        }
    }
}
