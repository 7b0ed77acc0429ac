//! The C API's calls that tell the library about the program (see
//! [`crate::process::program_context`]): module scopes, phases and what blocks hold, called by
//! the Python integration's hooks (each is one trace record, nothing without a trace); and
//! what is left out of stacks: the integration's own frames, and every stack while a benchmark
//! pauses them.

use std::ffi::{CStr, c_char, c_int, c_uint};

use crate::cuda::{self, CudaError};
use crate::ffi::guarded;
use crate::process::{self, program_context};

/// The id (≥ 1) of the module path `name` (`LlamaForCausalLM.model.layers.3.mlp`), the same
/// for the same name for the life of the process; 0 for a null or non-UTF-8 name.
///
/// # Safety
/// `name` must be null or a valid NUL-terminated string.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_scope_define(name: *const c_char) -> c_uint {
    if name.is_null() {
        return 0;
    }
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    let Ok(name) = unsafe { CStr::from_ptr(name) }.to_str() else {
        return 0;
    };
    guarded(
        "cachealloc_scope_define",
        || Ok::<_, CudaError>(program_context::define_scope(name)),
        || Ok(0),
    )
    .unwrap_or(0)
}

/// The calling thread is now inside the module `scope` (an id of [`cachealloc_scope_define`]; 0:
/// outside any module), as its next allocation will say in the trace. Returns 0, or
/// `cudaErrorInvalidValue` for an unknown id. (The Python integration writes the thread's
/// slot instead: [`cachealloc_scope_slot`].)
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_scope_set(scope: c_uint) -> CudaError {
    guarded(
        "cachealloc_scope_set",
        || {
            if program_context::scope_known(scope) {
                program_context::scope_set(scope);
                cuda::SUCCESS
            } else {
                cuda::ERROR_INVALID_VALUE
            }
        },
        || cuda::SUCCESS,
    )
}

/// The address of the calling thread's scope slot: a 32-bit word, valid while the thread
/// lives, that only this thread may write, with a scope id of [`cachealloc_scope_define`] (0:
/// none). Writing it is [`cachealloc_scope_set`] without a call: what the Python integration's
/// module hooks do at each module call (see `trace::scopes`).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_scope_slot() -> *mut c_uint {
    guarded(
        "cachealloc_scope_slot",
        || Ok::<_, CudaError>(program_context::scope_slot().cast_mut().cast::<c_uint>()),
        || Ok(std::ptr::null_mut()),
    )
    .unwrap_or(std::ptr::null_mut())
}

/// The program's phase is now `phase` — 0 none, 1 forward, 2 backward, 3 an optimizer's step —
/// in training step `step` (optimizer steps taken so far); every thread's scope ends with it.
/// Returns 0, or `cudaErrorInvalidValue` for another phase.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_phase_set(phase: c_uint, step: u64) -> CudaError {
    let Ok(phase) = u8::try_from(phase) else {
        return cuda::ERROR_INVALID_VALUE;
    };
    fact("cachealloc_phase_set", |shim: &process::Shim| {
        shim.set_phase(phase, step)
    })
}

/// The blocks of `device` that hold the `count` addresses at `addresses` (a block's start or
/// inside it) hold tensors of `category` — 1 parameter (or buffer), 2 optimizer state, 3
/// gradient, 4 input, 5 saved for backward — for their whole life. Returns 0, or
/// `cudaErrorInvalidValue` for another category, a negative device or null addresses.
///
/// # Safety
/// `addresses` must be valid for `count` reads of `u64` (or `count` is 0).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cachealloc_tag(
    device: c_int,
    category: c_uint,
    addresses: *const u64,
    count: usize,
) -> CudaError {
    let (Ok(device), Ok(category)) = (u32::try_from(device), u8::try_from(category)) else {
        return cuda::ERROR_INVALID_VALUE;
    };
    if count == 0 {
        return cuda::SUCCESS;
    }
    if addresses.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    // SAFETY: non-null and valid for `count` reads per the caller's contract.
    let addresses = unsafe { std::slice::from_raw_parts(addresses, count) };
    fact("cachealloc_tag", |shim: &process::Shim| {
        shim.tag(device, category, addresses)
    })
}

/// Tell the started shim one fact (nothing before the first CUDA call: no trace yet).
fn fact(
    what: &str,
    tell: impl FnOnce(&process::Shim) -> Result<(), program_context::BadFact>,
) -> CudaError {
    guarded(
        what,
        || match process::started_shim().map(tell) {
            Some(Err(_)) => cuda::ERROR_INVALID_VALUE,
            _ => cuda::SUCCESS,
        },
        || cuda::SUCCESS,
    )
}

/// Leave the frames of the Python code object at `code` (`id(fn.__code__)`) out of every stack
/// recorded from now on: the Python integration's wrapper of `nn.Module._call_impl`, which would
/// otherwise sit between each module's frames. Returns 0, or `cudaErrorInvalidValue` for a null
/// address or when four code objects are hidden already.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_python_hide_code(code: usize) -> CudaError {
    if code == 0 {
        return cuda::ERROR_INVALID_VALUE;
    }
    guarded(
        "cachealloc_python_hide_code",
        || {
            if crate::stacks::hide_python_code(code) {
                cuda::SUCCESS
            } else {
                cuda::ERROR_INVALID_VALUE
            }
        },
        || cuda::SUCCESS,
    )
}

/// Pause stack capture (`paused` non-zero) or resume it; returns 1 if it was paused before, 0
/// if not. While paused, records go on with no stack. A benchmark's switch: the cost of stacks
/// measured step by step within one process (`scripts/gpu/recorder_cost.py`).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_stacks_pause(paused: c_int) -> c_int {
    guarded(
        "cachealloc_stacks_pause",
        || c_int::from(crate::stacks::pause(paused != 0)),
        || 0,
    )
}

/// Pause the trace's allocation records (`paused` non-zero) or resume them; returns 1 if they
/// were paused before, 0 if not. While paused, allocations and the frees of blocks allocated
/// meanwhile go unrecorded and no stack is captured; segments, OOMs and the program's context
/// are still recorded, and the trace says when it paused and resumed. A benchmark's switch:
/// what the trace costs, measured step by step within one process
/// (`scripts/gpu/recorder_cost.py`). Before the trace exists (the first CUDA call) it only sets
/// the switch.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_trace_pause(paused: c_int) -> c_int {
    guarded(
        "cachealloc_trace_pause",
        || match process::shim() {
            Some(shim) => c_int::from(shim.pause_trace(paused != 0)),
            None => c_int::from(crate::trace::pause::set_paused(paused != 0)),
        },
        || 0,
    )
}

/// The program changed its memory-history settings (`torch.cuda.memory._record_memory_history`,
/// through the Python integration): capture the freeing code's stack at each free and
/// `empty_cache` from now on when `free_stacks` is non-zero (PyTorch's `context="all"`), and
/// native frames in every stack when `native_frames` is non-zero (`stacks="all"`; with neither
/// the configuration's `stacks` applies). Returns the trace's clock now (ns, the records' time
/// base), so that the integration can tell `cachealloc snapshot --history` when each setting
/// began.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_memory_history(free_stacks: c_int, native_frames: c_int) -> u64 {
    guarded(
        "cachealloc_memory_history",
        || {
            if let Some(shim) = process::shim() {
                shim.memory_history(free_stacks != 0, native_frames != 0);
            }
            cachealloc_recorder::monotonic_ns()
        },
        || 0,
    )
}

/// The trace's clock now (ns, the records' time base), so that the Python integration can tell
/// `cachealloc snapshot --metadata` when the program's memory metadata changed
/// (`torch.cuda.memory._set_memory_metadata`).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_trace_time() -> u64 {
    guarded(
        "cachealloc_trace_time",
        cachealloc_recorder::monotonic_ns,
        || 0,
    )
}

/// Hear from the interpreter when Python code objects are destroyed (CPython 3.12+), so that
/// warm stack captures need not check each frame's code object (Note [Code objects' deaths]).
/// Call with the GIL held (the Python integration calls it through `ctypes.PyDLL` at
/// start-up). Returns 0, or `cudaErrorNotSupported` where the interpreter has no code
/// watchers or none left.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn cachealloc_python_watch_code() -> CudaError {
    guarded(
        "cachealloc_python_watch_code",
        || match crate::stacks::python::code_deaths::watch() {
            Ok(()) => cuda::SUCCESS,
            Err(why) => {
                crate::log::debug!("Python code objects' deaths not heard: {why}");
                cuda::ERROR_NOT_SUPPORTED
            }
        },
        || cuda::ERROR_NOT_SUPPORTED,
    )
}
