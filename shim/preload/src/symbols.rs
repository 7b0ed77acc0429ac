//! Symbol resolution: which function a caller gets. The doors through which a program reaches
//! CUDA's allocation functions, how each one is made to lead to the pools, and whether a driver
//! call goes to our hooks or straight to the driver.
//!
//! This module is the one both the ABI layer ([`crate::ffi`]) and the real-call layer
//! ([`crate::real`]) use; it uses neither. Its parts: [`libc_dlsym`] (the real `dlsym`) and
//! [`libcuda`] (our handle of libcuda and its own symbols).
//!
//! | door | who uses it | how we stand in it |
//! |---|---|---|
//! | runtime symbols | programs, PyTorch, through a shared `libcudart` (`cudaMalloc`, `cudaMallocAsync`) | our exported `cuda*` functions come first in the global scope ([`crate::ffi`]) |
//! | driver symbols | programs linked with `-lcuda` (`cuMemAlloc_v2` …) | our exported `cu*` functions ([`crate::ffi::driver`]) |
//! | `dlsym` | libraries that `dlopen` libcuda and look functions up themselves (cuBLAS, XLA) | our exported `dlsym` |
//! | driver entry points | every CUDA runtime, shared or linked statically (CuPy's modules, `nvcc`'s default), and `cudaGetDriverEntryPoint` users: they get `cuGetProcAddress_v2` by `dlsym` and resolve each driver function through it | our wrappers of `cuGetProcAddress*`, handed out by our `dlsym` and by themselves |
//!
//! # Substitution
//!
//! A lookup through the last two doors goes to the real resolver first; its answer is replaced
//! only when the lookup succeeded and the function it found is *exactly* one of the driver
//! functions we wrap — decided by comparing the pointer with libcuda's own exported symbol of
//! that name ([`Interposed`]), never by the name asked for. So ABI versions, the
//! per-thread-default-stream flag, `symbolStatus` and NULL results are the real driver's: a
//! request for `"cuMemAlloc"` at version 2000 finds the 32-bit `cuMemAlloc` and is left alone;
//! one with `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` finds `cuMemAllocAsync_ptsz` and gets
//! our `_ptsz` wrapper. Everything else passes through untouched.
//!
//! # `dlsym` itself
//!
//! `dlsym(RTLD_NEXT, …)` and `dlsym(RTLD_DEFAULT, …)` depend on who calls: glibc looks at the
//! return address. Our `dlsym` is a naked function that tail-jumps to the real one for those
//! two handles, so glibc sees the original caller ([`crate::ffi::entry_points`]). Only lookups on
//! an explicit handle reach [`dlsym_lookup`], and lookups made by this library itself (cudarc's
//! own, the runtime's) get real answers.
//!
//! # One allocation, one entry
//!
//! With a shared runtime, `cudaMalloc` reaches our runtime hook and the runtime is never asked;
//! when the shim itself calls into the runtime (a pass-through), the runtime's driver calls come
//! back to our driver wrappers, which then go straight to the driver ([`inside_runtime`]). The
//! pools' own segments come from libcuda's real functions ([`crate::real::driver`]).

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

pub mod libc_dlsym;
pub mod libcuda;

pub use libc_dlsym::real_dlsym;

/// A way in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Door {
    /// `cudaMalloc*` exported by us in place of a shared runtime's (and the C API).
    Runtime,
    /// `cuMemAlloc*` called through the symbols we export (programs linked with `-lcuda`).
    DriverSymbol,
    /// `cuMemAlloc*` found by `dlsym` on a handle of libcuda.
    Dlsym,
    /// `cuMemAlloc*` found through `cuGetProcAddress*` (any CUDA runtime, shared or static, and
    /// `cudaGetDriverEntryPoint*`).
    EntryPoint,
}

impl Door {
    /// Every door, in the order of the exit summary.
    pub const ALL: [Door; 4] = [
        Door::Runtime,
        Door::DriverSymbol,
        Door::Dlsym,
        Door::EntryPoint,
    ];

    /// Its name in the exit summary and the stats.
    pub fn name(self) -> &'static str {
        match self {
            Door::Runtime => "runtime cudaMalloc*",
            Door::DriverSymbol => "driver symbols cuMemAlloc*",
            Door::Dlsym => "dlsym",
            Door::EntryPoint => "driver entry points (cuGetProcAddress)",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

static ALLOCATIONS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// Count an allocation request that came through `door`.
#[inline]
pub fn count(door: Door) {
    ALLOCATIONS[door.index()].fetch_add(1, Ordering::Relaxed);
}

/// Allocation requests per door so far.
pub fn counts() -> [(Door, u64); 4] {
    Door::ALL.map(|d| (d, ALLOCATIONS[d.index()].load(Ordering::Relaxed)))
}

thread_local! {
    static INSIDE_RUNTIME: Cell<bool> = const { Cell::new(false) };
}

/// Threads inside a call the shim made into the runtime: while none is, [`inside_runtime`] needs
/// no thread-local lookup (which costs a call into the loader in a preloaded library).
static THREADS_INSIDE_RUNTIME: AtomicUsize = AtomicUsize::new(0);

/// Whether the calling thread is inside a call the shim made into the CUDA runtime: its driver
/// calls then go straight to the driver (the shim already handled the request).
#[inline]
pub fn inside_runtime() -> bool {
    THREADS_INSIDE_RUNTIME.load(Ordering::Acquire) != 0
        && INSIDE_RUNTIME.try_with(Cell::get).unwrap_or(false)
}

/// Whether the driver's doors are open (`driver_doors:on`, the default).
#[inline]
pub fn driver_doors_open() -> bool {
    crate::settings::get().config.driver_doors
}

/// Whether a driver call goes straight to the driver: inside a call of the shim's into the
/// runtime, or with `driver_doors:off`.
#[inline]
pub fn bypass_driver_hooks() -> bool {
    inside_runtime() || !driver_doors_open()
}

/// Run `f` (a call into the real runtime) with [`inside_runtime`] true on this thread.
pub fn through_runtime<T>(f: impl FnOnce() -> T) -> T {
    THREADS_INSIDE_RUNTIME.fetch_add(1, Ordering::AcqRel);
    let outer = INSIDE_RUNTIME
        .try_with(|c| c.replace(true))
        .unwrap_or(false);
    let result = f();
    let _ = INSIDE_RUNTIME.try_with(|c| c.set(outer));
    THREADS_INSIDE_RUNTIME.fetch_sub(1, Ordering::AcqRel);
    result
}

/// The base address of this library, to recognize our own lookups.
fn own_base() -> usize {
    static BASE: OnceLock<usize> = OnceLock::new();
    *BASE.get_or_init(|| object_base(own_base as *const c_void as usize).unwrap_or(0))
}

/// The base address of the loaded object containing `address`.
fn object_base(address: usize) -> Option<usize> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: `info` is a valid out-pointer; dladdr only reads the loader's tables.
    let found = unsafe { libc::dladdr(address as *const c_void, &mut info) };
    (found != 0).then_some(info.dli_fbase as usize)
}

/// The lookups of our `dlsym` that need more than a jump to libc's (an explicit handle; or any
/// lookup before libc's was found), with the caller's return address: the real answer, or our
/// wrapper when it is one of the driver functions we wrap and the lookup is not our own.
///
/// # Safety
/// `dlsym`'s contract (see [`real_dlsym`]).
pub unsafe fn dlsym_lookup(
    handle: *mut c_void,
    name: *const c_char,
    caller: usize,
    table: &'static [Interposed],
) -> *mut c_void {
    // SAFETY: forwarded contract.
    let Some(found) = (unsafe { real_dlsym(handle, name) }) else {
        return std::ptr::null_mut();
    };
    if handle.is_null() || handle == libc::RTLD_NEXT {
        return found;
    }
    // Only driver names can be ours; everything else (Python extension modules …) costs one
    // byte comparison.
    if name.is_null()
        // SAFETY: a NUL-terminated string, per the caller's contract.
        || !unsafe { CStr::from_ptr(name) }
            .to_bytes()
            .starts_with(b"cu")
    {
        return found;
    }
    if object_base(caller) == Some(own_base()) {
        return found;
    }
    substitute(found as usize, Door::Dlsym, table).map_or(found, |w| w as *mut c_void)
}

/// One driver function we wrap: its libcuda name and our wrapper for each door.
#[derive(Clone, Copy, Debug)]
pub struct Interposed {
    /// libcuda's exported name.
    pub name: &'static CStr,
    /// Our wrapper handed out through `dlsym`.
    pub through_dlsym: usize,
    /// Our wrapper handed out through `cuGetProcAddress*`.
    pub through_entry_points: usize,
}

/// libcuda's address of each function of `table` (the ABI layer's one table of what it wraps),
/// once libcuda is loaded.
fn real_addresses(table: &'static [Interposed]) -> Option<&'static [(usize, Interposed)]> {
    static ADDRESSES: OnceLock<Vec<(usize, Interposed)>> = OnceLock::new();
    if let Some(t) = ADDRESSES.get() {
        return Some(t);
    }
    libcuda::loaded_handle()?;
    Some(ADDRESSES.get_or_init(|| {
        table
            .iter()
            .filter_map(|&i| Some((libcuda::lookup_loaded(i.name)?, i)))
            .collect()
    }))
}

/// Our wrapper (from `table`) for the real driver function at `found`, as handed out through
/// `door`; `None` when it is not one we wrap.
pub fn substitute(found: usize, door: Door, table: &'static [Interposed]) -> Option<usize> {
    if !driver_doors_open() {
        return None;
    }
    let (_, interposed) = real_addresses(table)?
        .iter()
        .find(|(real, _)| *real == found)?;
    Some(match door {
        Door::Dlsym => interposed.through_dlsym,
        _ => interposed.through_entry_points,
    })
}

/// After a successful `cuGetProcAddress*` or `cudaGetDriverEntryPoint*`: replace the function
/// found by our wrapper (from `table`) if it is one we wrap.
///
/// # Safety
/// `pfn` must be null or valid for reads and writes of a pointer.
pub unsafe fn substitute_found(pfn: *mut *mut c_void, table: &'static [Interposed]) {
    if pfn.is_null() {
        return;
    }
    // SAFETY: non-null and valid, per the caller's contract.
    let found = unsafe { pfn.read() };
    if found.is_null() {
        return;
    }
    if let Some(wrapper) = substitute(found as usize, Door::EntryPoint, table) {
        // SAFETY: as above.
        unsafe { pfn.write(wrapper as *mut c_void) };
    }
}
