//! The [`Device`] trait: the allocator's only source of device memory and of reuse fences.
//!
//! The shim implements it over the real CUDA runtime and driver (`cudaMalloc`, `cudaFree`,
//! events); tests, `cachealloc simulate` and the benchmarks use [`crate::SimDevice`].
//!
//! Methods take `&self`: the allocator calls segment allocation and release *without* holding its
//! own lock (a real `cudaFree` synchronizes the whole device and may take milliseconds), so an
//! implementation must be usable from several threads at once.

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
        /// The backend's error code (a `cudaError_t` for the CUDA backend).
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
}
