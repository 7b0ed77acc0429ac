//! [`CudaDevice`]: the real device behind `cachealloc-core`'s [`Device`] trait — segments from
//! the real `cudaMalloc`/`cudaFree`, fences from CUDA events ([`crate::driver`]).
//!
//! Segment calls happen on the thread whose current device this is (the allocator of a device
//! is chosen by the caller's current device), so the real runtime allocates on the right device.

use std::ffi::c_void;
use std::sync::Arc;

use cachealloc_core::{Device, DeviceError, MemInfo};

use crate::cuda;
use crate::driver::{Driver, Fence, Fences};
use crate::real;
use crate::streams::StreamRegistry;

/// One GPU as the allocator core sees it.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: i32,
    fences: Fences,
    streams: Arc<StreamRegistry>,
}

impl CudaDevice {
    /// The device `ordinal`.
    pub fn new(driver: Driver, ordinal: i32, streams: Arc<StreamRegistry>) -> Self {
        CudaDevice {
            ordinal,
            fences: Fences::new(driver, ordinal),
            streams,
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
        let code = unsafe { malloc(&mut ptr, size as usize) };
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
        let free = real::cudaFree().ok_or_else(|| missing("cudaFree"))?;
        // SAFETY: `address` is a segment the real cudaMalloc returned and we still own.
        match unsafe { free(address as *mut c_void) } {
            cuda::SUCCESS | cuda::ERROR_CUDART_UNLOADING => Ok(()),
            other => Err(runtime_error(other, "cudaFree")),
        }
    }

    fn record_fence(&self) -> Result<Fence, DeviceError> {
        self.fences.record(&self.streams.non_blocking(self.ordinal))
    }

    fn fence_completed(&self, fence: &Fence) -> bool {
        self.fences.completed(fence)
    }

    fn wait_fence(&self, fence: &Fence) -> Result<(), DeviceError> {
        self.fences.wait(fence)
    }

    fn release_fence(&self, fence: Fence) {
        self.fences.release(fence);
    }
}
