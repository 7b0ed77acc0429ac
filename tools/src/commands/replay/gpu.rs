//! The replay's only contact with CUDA: libcuda's driver API through cudarc's raw bindings
//! (`cudarc::driver::sys`, which `dlopen`s libcuda and looks each function up with `dlsym` on
//! its handle: under `LD_PRELOAD=libcachealloc.so` those lookups are the shim's `dlsym` door),
//! and the shim's C API through `dlsym(RTLD_DEFAULT, …)`. Every `unsafe` block of the replay is
//! here; the types above it are safe.
//!
//! Device pointers are plain `u64`s: handing the driver a pointer it did not give out, or a range
//! outside an allocation, is an error it reports (or a device fault), never a host memory error,
//! so the wrappers taking them are safe functions.

use std::ffi::{CStr, c_char, c_void};

use cudarc::driver::sys;

/// A driver call that failed: which, and the driver's code.
#[derive(Debug, Clone)]
pub struct CudaError {
    /// The function.
    pub call: &'static str,
    /// The driver's result.
    pub code: sys::CUresult,
}

impl CudaError {
    /// Whether the driver ran out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        self.code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
    }
}

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed: {:?}", self.call, self.code)
    }
}

fn check(code: sys::CUresult, call: &'static str) -> Result<(), CudaError> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError { call, code })
    }
}

/// The driver functions the replay calls (checked once, so that a missing one is an error
/// message rather than cudarc's panic).
const REQUIRED: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuMemsetD8_v2",
    "cuMemsetD8Async",
    "cuMemcpyDtoH_v2",
];

/// The stream-ordered allocator's functions (CUDA 11.2+), needed by the `async` and
/// `cachealloc` backends.
const STREAM_ORDERED: &[&str] = &[
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuDeviceGetDefaultMemPool",
    "cuMemPoolSetAttribute",
];

/// Proof that libcuda is loaded and initialized, with the functions the replay calls.
#[derive(Clone, Copy, Debug)]
pub struct Driver {
    /// Whether the stream-ordered allocator's functions are present.
    pub stream_ordered: bool,
}

impl Driver {
    /// Load libcuda and initialize it; the error says what is missing.
    pub fn load() -> Result<Driver, String> {
        // SAFETY: only dlopens libcuda (by cudarc's list of names); none of its code runs
        // beyond the loader's.
        if !unsafe { sys::is_culib_present() } {
            return Err(
                "libcuda (the CUDA driver) could not be loaded: replay needs a GPU's driver \
                 (libcuda.so on the loader's path)"
                    .into(),
            );
        }
        // SAFETY: the library is present (checked above), so culib() returns it.
        let lib = unsafe { sys::culib() };
        let present = |name: &str| {
            // SAFETY: looking a symbol up runs no code; the pointer is not used.
            unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_ok()
        };
        if let Some(missing) = REQUIRED.iter().find(|n| !present(n)) {
            return Err(format!("the CUDA driver lacks {missing}"));
        }
        // SAFETY: cuInit is present (checked above); 0 is its only valid flag value.
        check(unsafe { sys::cuInit(0) }, "cuInit").map_err(|e| e.to_string())?;
        Ok(Driver {
            stream_ordered: STREAM_ORDERED.iter().all(|n| present(n)),
        })
    }

    /// Number of devices.
    pub fn device_count(self) -> Result<i32, CudaError> {
        let mut n = 0;
        // SAFETY: valid out-pointer; the driver is initialized (a `Driver` exists).
        check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
        Ok(n)
    }

    /// The primary context of device `ordinal` (retained for the life of the process).
    pub fn primary_context(self, ordinal: i32) -> Result<Context, CudaError> {
        let mut device: sys::CUdevice = 0;
        check(
            // SAFETY: valid out-pointer; the driver is initialized.
            unsafe { sys::cuDeviceGet(&mut device, ordinal) },
            "cuDeviceGet",
        )?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        check(
            // SAFETY: valid out-pointer and a device the driver just named.
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) },
            "cuDevicePrimaryCtxRetain",
        )?;
        Ok(Context {
            ctx,
            device,
            driver: self,
        })
    }
}

/// A device's primary context (never released: the process ends with the replay).
#[derive(Debug)]
pub struct Context {
    ctx: sys::CUcontext,
    device: sys::CUdevice,
    driver: Driver,
}

// SAFETY: a CUDA context handle may be used from any thread (the driver synchronizes), and this
// one is never released.
unsafe impl Send for Context {}
// SAFETY: as above; `&Context` only makes it current or reads its device.
unsafe impl Sync for Context {}

impl Context {
    /// The driver it came from.
    pub fn driver(&self) -> Driver {
        self.driver
    }

    /// Make it the calling thread's current context (each replay thread does, once).
    pub fn make_current(&self) -> Result<(), CudaError> {
        // SAFETY: a context retained by `primary_context` and never released.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// Wait for all work of the context.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: no arguments; the caller's context is current (replay threads set it).
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }

    /// Free and total device memory, as the driver (or the shim standing in for it) says.
    pub fn mem_info(&self) -> Result<(u64, u64), CudaError> {
        let (mut free, mut total) = (0usize, 0usize);
        check(
            // SAFETY: valid out-pointers; the driver is initialized.
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
            "cuMemGetInfo_v2",
        )?;
        Ok((free as u64, total as u64))
    }

    /// Keep freed memory in the device's default memory pool (the stream-ordered allocator's)
    /// instead of returning it at each synchronization: its release threshold set to
    /// `u64::MAX`, as PyTorch's `cudaMallocAsync` backend does.
    pub fn keep_default_pool_memory(&self) -> Result<(), CudaError> {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        check(
            // SAFETY: valid out-pointer; the function is present (`async` checks `stream_ordered`).
            unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.device) },
            "cuDeviceGetDefaultMemPool",
        )?;
        let mut threshold: u64 = u64::MAX;
        check(
            // SAFETY: the pool the driver just gave; the value points at a cuuint64_t, as the
            // release threshold attribute takes.
            unsafe {
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&raw mut threshold).cast(),
                )
            },
            "cuMemPoolSetAttribute",
        )
    }
}

/// A stream to issue stream-ordered calls on: the legacy default stream (the null handle), one
/// of the special handles a trace may name (`CU_STREAM_LEGACY` 0x1, `CU_STREAM_PER_THREAD`
/// 0x2), or a stream created for the replay (destroyed when dropped).
#[derive(Debug)]
pub struct Stream {
    handle: sys::CUstream,
    created: bool,
}

// SAFETY: stream handles may be used from any thread of their context; a created stream is
// destroyed only by `drop`, which needs the stream back from every borrower.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// The null stream (stream 0 of a trace).
    pub fn null() -> Stream {
        Stream {
            handle: std::ptr::null_mut(),
            created: false,
        }
    }

    /// A special handle the driver knows (0x1 legacy, 0x2 per-thread), if `handle` is one.
    pub fn special(handle: u64) -> Option<Stream> {
        (handle == 1 || handle == 2).then(|| Stream {
            handle: handle as usize as sys::CUstream,
            created: false,
        })
    }

    /// A new stream on the calling thread's current context (`flags`: the recorded creation
    /// flags; 1 is non-blocking).
    pub fn create(_ctx: &Context, flags: u32) -> Result<Stream, CudaError> {
        let mut handle: sys::CUstream = std::ptr::null_mut();
        check(
            // SAFETY: valid out-pointer; flags are the driver's to check.
            unsafe { sys::cuStreamCreate(&mut handle, flags & 1) },
            "cuStreamCreate",
        )?;
        Ok(Stream {
            handle,
            created: true,
        })
    }

    /// Whether this is the null stream (synchronous calls serve it for `cachealloc`).
    pub fn is_null(&self) -> bool {
        self.handle.is_null()
    }

    /// Wait for the stream's work.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        check(
            // SAFETY: a live stream handle (created streams live until drop) or a special one.
            unsafe { sys::cuStreamSynchronize(self.handle) },
            "cuStreamSynchronize",
        )
    }

    /// `cuMemAllocAsync` on this stream.
    pub fn alloc_async(&self, size: u64) -> Result<u64, CudaError> {
        let mut ptr: sys::CUdeviceptr = 0;
        check(
            // SAFETY: valid out-pointer and a live stream; present (checked by the backends).
            unsafe { sys::cuMemAllocAsync(&mut ptr, size as usize, self.handle) },
            "cuMemAllocAsync",
        )?;
        Ok(ptr)
    }

    /// `cuMemFreeAsync` on this stream.
    pub fn free_async(&self, ptr: u64) -> Result<(), CudaError> {
        check(
            // SAFETY: a live stream; the driver checks the pointer (see the module docs).
            unsafe { sys::cuMemFreeAsync(ptr, self.handle) },
            "cuMemFreeAsync",
        )
    }

    /// Set `n` bytes at `ptr` to `value`: `cuMemsetD8Async` on this stream, or the synchronous
    /// `cuMemsetD8_v2` for the null stream.
    pub fn memset(&self, ptr: u64, value: u8, n: u64) -> Result<(), CudaError> {
        if self.is_null() {
            check(
                // SAFETY: device memory only; the driver checks the range (see the module docs).
                unsafe { sys::cuMemsetD8_v2(ptr, value, n as usize) },
                "cuMemsetD8_v2",
            )
        } else {
            check(
                // SAFETY: as above, on a live stream.
                unsafe { sys::cuMemsetD8Async(ptr, value, n as usize, self.handle) },
                "cuMemsetD8Async",
            )
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.created {
            // SAFETY: a stream we created, destroyed once; no borrower is left (drop).
            unsafe { sys::cuStreamDestroy_v2(self.handle) };
        }
    }
}

/// `cuMemAlloc_v2`: what `cudaMalloc` does.
pub fn alloc(size: u64) -> Result<u64, CudaError> {
    let mut ptr: sys::CUdeviceptr = 0;
    check(
        // SAFETY: valid out-pointer; the calling thread's context is current.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, size as usize) },
        "cuMemAlloc_v2",
    )?;
    Ok(ptr)
}

/// `cuMemFree_v2`: what `cudaFree` does.
pub fn free(ptr: u64) -> Result<(), CudaError> {
    // SAFETY: the driver checks the pointer (see the module docs).
    check(unsafe { sys::cuMemFree_v2(ptr) }, "cuMemFree_v2")
}

/// The byte at device address `ptr` (a synchronous copy to the host).
pub fn read_byte(ptr: u64) -> Result<u8, CudaError> {
    let mut byte = 0u8;
    check(
        // SAFETY: the destination is one writable byte of ours; the driver checks the source.
        unsafe { sys::cuMemcpyDtoH_v2((&raw mut byte).cast(), ptr, 1) },
        "cuMemcpyDtoH_v2",
    )?;
    Ok(byte)
}

/// The preloaded shim's statistics (`cachealloc_stats_json`, PyTorch's `memory_stats()` keys per
/// device), or `None` when no libcachealloc.so is loaded in this process.
pub fn shim_stats_json() -> Option<String> {
    type StatsJson = unsafe extern "C" fn(*mut c_char, usize) -> usize;
    // SAFETY: a NUL-terminated name; looking a symbol up runs no code.
    let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"cachealloc_stats_json".as_ptr()) };
    if symbol.is_null() {
        return None;
    }
    // SAFETY: the shim exports `cachealloc_stats_json` with this signature
    // (shim/preload/src/ffi/runtime.rs).
    let stats_json: StatsJson = unsafe { std::mem::transmute::<*mut c_void, StatsJson>(symbol) };
    let mut buf = vec![0 as c_char; 1 << 16];
    for _ in 0..4 {
        // SAFETY: the buffer is valid for its length; the function writes at most that many
        // bytes, NUL included, and returns the length the whole text needs.
        let needed = unsafe { stats_json(buf.as_mut_ptr(), buf.len()) };
        if needed <= buf.len() {
            // SAFETY: the function NUL-terminated what it wrote inside the buffer.
            let text = unsafe { CStr::from_ptr(buf.as_ptr()) };
            return Some(text.to_string_lossy().into_owned());
        }
        buf = vec![0 as c_char; needed];
    }
    None
}
