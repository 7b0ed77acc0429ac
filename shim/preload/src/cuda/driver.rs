//! The CUDA driver API's part of the ABI: its result codes ([`CuResult`], a type of its own so
//! that a driver code can never be returned to a runtime caller by mistake), device pointers,
//! handles and pointer attributes. Values are CUDA's own (`cuda.h`).

use std::ffi::{c_int, c_void};

use super::CudaError;

/// `CUresult`: what every driver function returns. Its codes are the driver's, a space of their
/// own: many equal the runtime's `cudaError_t` of the same meaning, but not all, so a code
/// crosses from one API to the other only through [`CuResult::to_runtime`] or
/// [`CudaError::to_driver`].
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CuResult(pub c_int);

/// `CUDA_SUCCESS`.
pub const SUCCESS: CuResult = CuResult(0);
/// `CUDA_ERROR_INVALID_VALUE`.
pub const ERROR_INVALID_VALUE: CuResult = CuResult(1);
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const ERROR_OUT_OF_MEMORY: CuResult = CuResult(2);
/// `CUDA_ERROR_NOT_INITIALIZED`.
pub const ERROR_NOT_INITIALIZED: CuResult = CuResult(3);
/// `CUDA_ERROR_DEINITIALIZED`: the driver is shutting down (late frees at process exit).
pub const ERROR_DEINITIALIZED: CuResult = CuResult(4);
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const ERROR_NOT_SUPPORTED: CuResult = CuResult(801);
/// `CUDA_ERROR_NOT_FOUND`: what a hook answers when the real function does not exist.
pub const ERROR_NOT_FOUND: CuResult = CuResult(500);
/// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`.
pub const ERROR_PEER_ACCESS_ALREADY_ENABLED: CuResult = CuResult(704);
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
pub const ERROR_STREAM_CAPTURE_UNSUPPORTED: CuResult = CuResult(900);
/// `CUDA_ERROR_UNKNOWN`.
pub const ERROR_UNKNOWN: CuResult = CuResult(999);

impl super::ResultCode for CuResult {
    fn is_success(self) -> bool {
        self == SUCCESS
    }
}

impl CuResult {
    /// The runtime's code for the same outcome, where the shim answers a runtime call with what
    /// a driver call said. Codes with no runtime counterpart the shim knows become
    /// `cudaErrorUnknown`.
    pub fn to_runtime(self) -> CudaError {
        match self {
            SUCCESS => super::SUCCESS,
            ERROR_INVALID_VALUE => super::ERROR_INVALID_VALUE,
            ERROR_OUT_OF_MEMORY => super::ERROR_MEMORY_ALLOCATION,
            ERROR_NOT_INITIALIZED | ERROR_NOT_FOUND => super::ERROR_INITIALIZATION,
            ERROR_DEINITIALIZED => super::ERROR_CUDART_UNLOADING,
            ERROR_NOT_SUPPORTED => super::ERROR_NOT_SUPPORTED,
            ERROR_STREAM_CAPTURE_UNSUPPORTED => super::ERROR_STREAM_CAPTURE_UNSUPPORTED,
            _ => super::ERROR_UNKNOWN,
        }
    }
}

impl CudaError {
    /// The driver's code for the same outcome, where the shim answers a driver call with what
    /// the runtime (or the shim speaking as the runtime) said. Codes with no driver counterpart
    /// the shim knows become `CUDA_ERROR_UNKNOWN`.
    pub fn to_driver(self) -> CuResult {
        match self {
            super::SUCCESS => SUCCESS,
            super::ERROR_INVALID_VALUE => ERROR_INVALID_VALUE,
            super::ERROR_MEMORY_ALLOCATION => ERROR_OUT_OF_MEMORY,
            super::ERROR_INITIALIZATION => ERROR_NOT_INITIALIZED,
            super::ERROR_CUDART_UNLOADING => ERROR_DEINITIALIZED,
            super::ERROR_NOT_SUPPORTED => ERROR_NOT_SUPPORTED,
            super::ERROR_STREAM_CAPTURE_UNSUPPORTED => ERROR_STREAM_CAPTURE_UNSUPPORTED,
            _ => ERROR_UNKNOWN,
        }
    }
}

impl std::fmt::Display for CuResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CUDA driver error {}", self.0)
    }
}

/// `CUdeviceptr`.
pub type DevicePtr = u64;
/// `CUstream`, `CUcontext`, `CUgraph`: opaque handles.
pub type Handle = *mut c_void;

/// `CU_POINTER_ATTRIBUTE_BUFFER_ID` (an `unsigned long long`, unique per allocation).
pub const POINTER_ATTRIBUTE_BUFFER_ID: c_int = 7;
/// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` (a `CUdeviceptr`).
pub const POINTER_ATTRIBUTE_RANGE_START_ADDR: c_int = 11;
/// `CU_POINTER_ATTRIBUTE_RANGE_SIZE` (a `size_t`).
pub const POINTER_ATTRIBUTE_RANGE_SIZE: c_int = 12;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_cross_between_the_apis_by_meaning() {
        // Out of memory is 2 in both APIs, but "not found" is 500 in the driver's and has no
        // runtime twin: it must become an initialization error, not cudaErrorSymbolNotFound.
        assert_eq!(
            ERROR_OUT_OF_MEMORY.to_runtime(),
            crate::cuda::ERROR_MEMORY_ALLOCATION
        );
        assert_eq!(
            ERROR_NOT_FOUND.to_runtime(),
            crate::cuda::ERROR_INITIALIZATION
        );
        assert_eq!(CuResult(12345).to_runtime(), crate::cuda::ERROR_UNKNOWN);
        for code in [
            SUCCESS,
            ERROR_INVALID_VALUE,
            ERROR_OUT_OF_MEMORY,
            ERROR_DEINITIALIZED,
        ] {
            assert_eq!(code.to_runtime().to_driver(), code);
        }
    }
}
