//! [`CudaDevice`]: the real device behind `cachealloc-core`'s [`Device`] trait — segments from
//! the real `cudaMalloc`/`cudaFree`, fences from CUDA events ([`crate::driver`]).
//!
//! Segment calls happen on the thread whose current device this is (the allocator of a device
//! is chosen by the caller's current device), so the real runtime allocates on the right device.
//!
//! While a stream captures a CUDA graph (see [`crate::streams`]), every call here runs in the
//! relaxed capture mode ([`driver::relaxed`]), and segment releases are deferred to the end of
//! the last capture: `cudaFree` synchronizes the device, which a capture cannot allow.

use std::ffi::c_void;
use std::sync::Arc;

use cachealloc_core::{Device, DeviceError, MemInfo};

use crate::cuda;
use crate::driver::{self, Driver, Fence, Fences, Stream};
use crate::real;
use crate::streams::StreamRegistry;

/// One GPU as the allocator core sees it.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: i32,
    fences: Fences,
    streams: Arc<StreamRegistry>,
    /// Segments released while a capture was under way, to free when it ends.
    deferred_releases: std::sync::Mutex<Vec<u64>>,
}

impl CudaDevice {
    /// The device `ordinal`.
    pub fn new(driver: Driver, ordinal: i32, streams: Arc<StreamRegistry>) -> Self {
        CudaDevice {
            ordinal,
            fences: Fences::new(driver, ordinal),
            streams,
            deferred_releases: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Run `f` in the relaxed capture mode while any capture is under way.
    fn capture_safe<T>(&self, f: impl FnOnce() -> T) -> T {
        if self.streams.captures_active() {
            driver::relaxed(f)
        } else {
            f()
        }
    }

    /// Free the segments whose release waited for the end of a capture. Returns how many
    /// could not be freed.
    pub fn release_deferred(&self) -> usize {
        let segments = std::mem::take(
            &mut *self
                .deferred_releases
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        segments
            .into_iter()
            .filter(|&address| self.free_now(address).is_err())
            .count()
    }

    fn free_now(&self, address: u64) -> Result<(), DeviceError> {
        let free = real::cudaFree().ok_or_else(|| missing("cudaFree"))?;
        // SAFETY: `address` is a segment the real cudaMalloc returned and we still own.
        match unsafe { free(address as *mut c_void) } {
            cuda::SUCCESS | cuda::ERROR_CUDART_UNLOADING => Ok(()),
            other => Err(runtime_error(other, "cudaFree")),
        }
    }
}

fn missing(name: &str) -> DeviceError {
    DeviceError::Other {
        code: cuda::ERROR_INITIALIZATION,
        message: format!("the CUDA runtime lacks {name}"),
    }
}

fn runtime_error(code: cuda::CudaError, what: &str) -> DeviceError {
    DeviceError::Other {
        code,
        message: format!("{what} returned CUDA error {code}"),
    }
}

impl Device for CudaDevice {
    type Fence = Fence;

    fn mem_info(&self) -> MemInfo {
        let Some(get) = real::cudaMemGetInfo() else {
            return MemInfo::default();
        };
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers for the duration of the call.
        if unsafe { get(&mut free, &mut total) } != cuda::SUCCESS {
            return MemInfo::default();
        }
        MemInfo {
            free: free as u64,
            total: total as u64,
        }
    }

    fn allocate_segment(&self, size: u64) -> Result<u64, DeviceError> {
        let malloc = real::cudaMalloc().ok_or_else(|| missing("cudaMalloc"))?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; `size` fits in usize on the 64-bit platforms we build for.
        let code = self.capture_safe(|| unsafe { malloc(&mut ptr, size as usize) });
        match code {
            cuda::SUCCESS if !ptr.is_null() => Ok(ptr as u64),
            cuda::ERROR_MEMORY_ALLOCATION => {
                // Clear the runtime's record of the failure, as PyTorch does, so the
                // application's next cudaGetLastError does not report an OOM we recovered from.
                if let Some(clear) = real::cudaGetLastError() {
                    // SAFETY: takes no arguments.
                    unsafe { clear() };
                }
                Err(DeviceError::OutOfMemory)
            }
            other => Err(runtime_error(other, "cudaMalloc")),
        }
    }

    fn free_segment(&self, address: u64, _size: u64) -> Result<(), DeviceError> {
        if self.streams.captures_active() {
            self.deferred_releases
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(address);
            return Ok(());
        }
        self.free_now(address)
    }

    fn record_fence(&self) -> Result<Fence, DeviceError> {
        self.capture_safe(|| {
            self.fences
                .record(&self.streams.fence_targets(self.ordinal))
        })
    }

    fn record_stream_fence(&self, stream: u64) -> Result<Fence, DeviceError> {
        let stream = Stream(stream as usize);
        if self.streams.is_capturing(stream) {
            // An event recorded now would join the capture: a full fence instead (it leaves the
            // capturing stream out, and the barrier at the capture's start covers its earlier
            // work).
            return self.record_fence();
        }
        self.capture_safe(|| self.fences.record(&[stream]))
    }

    fn stream_wait(&self, stream: u64, fence: &Fence) -> Result<(), DeviceError> {
        self.capture_safe(|| self.fences.make_wait(Stream(stream as usize), fence))
    }

    fn fence_completed(&self, fence: &Fence) -> bool {
        self.capture_safe(|| self.fences.completed(fence))
    }

    fn wait_fence(&self, fence: &Fence) -> Result<(), DeviceError> {
        self.capture_safe(|| self.fences.wait(fence))
    }

    fn release_fence(&self, fence: Fence) {
        self.fences.release(fence);
    }
}
