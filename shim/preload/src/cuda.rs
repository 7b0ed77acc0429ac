//! The parts of the CUDA ABI the shim speaks: here the runtime's error codes, handle types and
//! flags; the driver's in [`driver`]. Values are CUDA's own (they are part of the ABI and have
//! not changed across CUDA 11–13).
//!
//! The two APIs' result codes are two types, [`CudaError`] (`cudaError_t`) and
//! [`driver::CuResult`] (`CUresult`), both `#[repr(transparent)]` over the C `int`, so an
//! exported function returns exactly what C expects and the compiler refuses a driver code
//! returned to a runtime caller (or the reverse) unless it is converted by meaning.

use std::ffi::c_void;

pub mod driver;

/// `cudaError_t`: what every runtime function returns.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaError(pub i32);

/// What the two APIs' result codes share, for the hooks that serve both the same way.
pub trait ResultCode: Copy {
    /// Whether the call succeeded.
    fn is_success(self) -> bool;
}

impl ResultCode for CudaError {
    fn is_success(self) -> bool {
        self == SUCCESS
    }
}

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CUDA runtime error {}", self.0)
    }
}
/// `cudaStream_t`: an opaque handle.
pub type CudaStream = *mut c_void;

/// `cudaSuccess`.
pub const SUCCESS: CudaError = CudaError(0);
/// `cudaErrorInvalidValue`: also what we return for a double free or an interior pointer.
pub const ERROR_INVALID_VALUE: CudaError = CudaError(1);
/// `cudaErrorMemoryAllocation`.
pub const ERROR_MEMORY_ALLOCATION: CudaError = CudaError(2);
/// `cudaErrorInitializationError`: what we return when a real function cannot be found.
pub const ERROR_INITIALIZATION: CudaError = CudaError(3);
/// `cudaErrorCudartUnloading`: the runtime is shutting down (late frees at process exit).
pub const ERROR_CUDART_UNLOADING: CudaError = CudaError(4);
/// `cudaErrorNotSupported`.
pub const ERROR_NOT_SUPPORTED: CudaError = CudaError(801);
/// `cudaErrorStreamCaptureUnsupported`.
pub const ERROR_STREAM_CAPTURE_UNSUPPORTED: CudaError = CudaError(900);
/// `cudaErrorUnknown`.
pub const ERROR_UNKNOWN: CudaError = CudaError(999);

/// `cudaStreamNonBlocking`: the stream does not synchronize with the legacy default stream.
pub const STREAM_NON_BLOCKING: u32 = 0x1;
/// `cudaStreamLegacy` / `CU_STREAM_LEGACY`: the legacy default stream of the current context.
pub const STREAM_LEGACY: usize = 0x1;
/// `cudaStreamPerThread` / `CU_STREAM_PER_THREAD`: the calling thread's default stream.
pub const STREAM_PER_THREAD: usize = 0x2;

/// `cudaMemPool_t`: an opaque handle.
pub type MemPool = *mut c_void;
/// `cudaMemPoolAttrReservedMemCurrent` (a `cuuint64_t`).
pub const MEMPOOL_ATTR_RESERVED_MEM_CURRENT: i32 = 5;
/// `cudaMemPoolAttrReservedMemHigh`: the peak; setting it to 0 resets it.
pub const MEMPOOL_ATTR_RESERVED_MEM_HIGH: i32 = 6;
/// `cudaMemPoolAttrUsedMemCurrent`.
pub const MEMPOOL_ATTR_USED_MEM_CURRENT: i32 = 7;
/// `cudaMemPoolAttrUsedMemHigh`: the peak; setting it to 0 resets it.
pub const MEMPOOL_ATTR_USED_MEM_HIGH: i32 = 8;

/// `cudaMemAccessDesc`: what one location may do with a pool's memory.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MemAccessDesc {
    /// `cudaMemLocation::type` ([`MEM_LOCATION_TYPE_DEVICE`] for a device).
    pub location_type: i32,
    /// `cudaMemLocation::id`: the device ordinal, for a device.
    pub location_id: i32,
    /// `cudaMemAccessFlags`: [`MEM_ACCESS_NONE`], read (1) or read and write (3).
    pub flags: i32,
}
/// `cudaMemLocationTypeDevice`.
pub const MEM_LOCATION_TYPE_DEVICE: i32 = 1;
/// `cudaMemAccessFlagsProtNone`.
pub const MEM_ACCESS_NONE: i32 = 0;

/// `cudaIpcMemHandle_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IpcMemHandle {
    /// Opaque bytes.
    pub reserved: [u8; 64],
}
