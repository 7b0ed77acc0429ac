//! The C API's call that hands the library PyTorch's profiler functions (c10's
//! `memoryProfilingEnabled`, `reportMemoryUsageToProfiler`, `reportOutOfMemoryToProfiler`), made
//! by the Python integration once `libc10.so` is loaded; the shim then reports allocations and
//! frees to the profiler as PyTorch's native allocator does (see [`crate::process`]'s
//! `torch_profiler`). The functions are C++ free functions of the platform's C calling
//! convention; their one class argument, `c10::Device` (a device type and an index, one byte
//! each, trivially copyable), travels by value as a C struct of two bytes does.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use crate::ffi::guarded;
use crate::process::{self, TorchProfiler};

/// `c10::Device`: `c10::DeviceType` and `c10::DeviceIndex`, both `int8_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct C10Device {
    kind: i8,
    index: i8,
}

/// `c10::DeviceType::CUDA`.
const CUDA: i8 = 1;

type Enabled = unsafe extern "C" fn() -> bool;
type Usage = unsafe extern "C" fn(*mut c_void, i64, usize, usize, C10Device);
type OutOfMemory = unsafe extern "C" fn(i64, usize, usize, C10Device);

/// The three functions, as given.
struct Functions {
    enabled: Enabled,
    usage: Usage,
    out_of_memory: OutOfMemory,
}

static FUNCTIONS: OnceLock<Functions> = OnceLock::new();

fn cuda_device(device: i32) -> C10Device {
    C10Device {
        kind: CUDA,
        index: device as i8,
    }
}

fn enabled() -> bool {
    FUNCTIONS.get().is_some_and(|f| {
        // SAFETY: c10's `memoryProfilingEnabled`, as the integration found it by its C++ name;
        // it takes nothing and reads the calling thread's profiler state.
        unsafe { (f.enabled)() }
    })
}

fn usage(address: u64, bytes: i64, allocated: u64, reserved: u64, device: i32) {
    if let Some(f) = FUNCTIONS.get() {
        // SAFETY: c10's `reportMemoryUsageToProfiler(void*, int64_t, size_t, size_t, Device)`;
        // the address is only recorded by the profiler, never dereferenced.
        unsafe {
            (f.usage)(
                address as *mut c_void,
                bytes,
                allocated as usize,
                reserved as usize,
                cuda_device(device),
            )
        }
    }
}

fn out_of_memory(bytes: i64, allocated: u64, reserved: u64, device: i32) {
    if let Some(f) = FUNCTIONS.get() {
        // SAFETY: c10's `reportOutOfMemoryToProfiler(int64_t, size_t, size_t, Device)`.
        unsafe {
            (f.out_of_memory)(
                bytes,
                allocated as usize,
                reserved as usize,
                cuda_device(device),
            )
        }
    }
}

/// Report the pools' allocations and frees to PyTorch's profiler: `enabled`, `usage` and
/// `out_of_memory` are the addresses of c10's `memoryProfilingEnabled`,
/// `reportMemoryUsageToProfiler` and `reportOutOfMemoryToProfiler` in the process's
/// `libc10.so`. Returns 0; 1 if any address is null or functions were given before (the first
/// stay).
///
/// # Safety
/// The addresses must be those functions of the `libc10.so` loaded in this process, which stays
/// loaded while the process runs.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_torch_profiler(
    enabled_fn: usize,
    usage_fn: usize,
    out_of_memory_fn: usize,
) -> c_int {
    if enabled_fn == 0 || usage_fn == 0 || out_of_memory_fn == 0 {
        return 1;
    }
    guarded(
        "cachealloc_torch_profiler",
        || {
            // SAFETY: the caller's contract: non-null addresses of functions of these types.
            let functions = unsafe {
                Functions {
                    enabled: std::mem::transmute::<usize, Enabled>(enabled_fn),
                    usage: std::mem::transmute::<usize, Usage>(usage_fn),
                    out_of_memory: std::mem::transmute::<usize, OutOfMemory>(out_of_memory_fn),
                }
            };
            if FUNCTIONS.set(functions).is_err() {
                return 1;
            }
            crate::rare::note(crate::rare::PROFILER);
            let _ = process::TORCH_PROFILER.set(TorchProfiler {
                enabled,
                usage,
                out_of_memory,
            });
            0
        },
        || 1,
    )
}
