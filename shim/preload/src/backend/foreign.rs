//! A program's own allocator for a private pool's segments ([`ForeignAllocator`]): what a
//! `MemPool(allocator)` takes its memory from.

use std::cell::Cell;
use std::ffi::{c_int, c_void};

/// A program's own allocator for a private pool's segments, given to `MemPool(allocator)`: say
/// `ncclMemAlloc` for NCCL's registered buffers. Its functions are called for whole segments;
/// the pool splits and caches them as any other.
#[derive(Clone, Copy, Debug)]
pub enum ForeignAllocator {
    /// PyTorch's `CUDAPluggableAllocator` pair, as the Python integration reads it.
    Pluggable {
        /// `void* alloc(ssize_t size, int device, cudaStream_t stream)`: null when it cannot.
        alloc: unsafe extern "C" fn(isize, c_int, *mut c_void) -> *mut c_void,
        /// `void free(void* ptr, ssize_t size, int device, cudaStream_t stream)`.
        free: unsafe extern "C" fn(*mut c_void, isize, c_int, *mut c_void),
    },
    /// The same with a context first: how the C++ allocator for PyTorch hands over any of
    /// PyTorch's allocator objects (the process group's NCCL allocator is not a pluggable one
    /// that Python can read).
    WithContext {
        /// `void* alloc(void* context, ssize_t size, int device, cudaStream_t stream)`.
        alloc: unsafe extern "C" fn(*mut c_void, isize, c_int, *mut c_void) -> *mut c_void,
        /// `void free(void* context, void* ptr, ssize_t size, int device, cudaStream_t stream)`.
        free: unsafe extern "C" fn(*mut c_void, *mut c_void, isize, c_int, *mut c_void),
        /// The context, as an address: it lives as long as the process.
        context: usize,
    },
}

impl ForeignAllocator {
    /// A segment of `size` bytes on `device`, or 0 when the allocator has none.
    pub fn alloc(&self, size: u64, device: c_int) -> u64 {
        as_foreign(|| match *self {
            // SAFETY: the program's alloc function with PyTorch's pluggable signature (size,
            // device, stream); it returns memory it owns until its free function.
            Self::Pluggable { alloc, .. } => unsafe {
                alloc(size as isize, device, std::ptr::null_mut())
            },
            // SAFETY: the same, with the context the caller gave for it (which lives as long as
            // the process).
            Self::WithContext { alloc, context, .. } => unsafe {
                alloc(
                    context as *mut c_void,
                    size as isize,
                    device,
                    std::ptr::null_mut(),
                )
            },
        }) as u64
    }

    /// Give back a segment [`ForeignAllocator::alloc`] returned with this size and device (null
    /// stream: the caller made sure it is idle).
    pub fn free(&self, address: u64, size: u64, device: c_int) {
        as_foreign(|| match *self {
            // SAFETY: the program's free function, given a segment its alloc function returned
            // with this size and device, as PyTorch's pluggable allocator does.
            Self::Pluggable { free, .. } => unsafe {
                free(
                    address as *mut c_void,
                    size as isize,
                    device,
                    std::ptr::null_mut(),
                )
            },
            // SAFETY: the same, with the alloc function's context.
            Self::WithContext { free, context, .. } => unsafe {
                free(
                    context as *mut c_void,
                    address as *mut c_void,
                    size as isize,
                    device,
                    std::ptr::null_mut(),
                )
            },
        })
    }
}

thread_local! {
    /// Whether the calling thread is inside a [`ForeignAllocator`]'s function.
    static IN_FOREIGN_ALLOCATOR: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread runs a program's own allocator for one of our pools: its CUDA
/// calls (a `cudaMalloc` or `cudaFree` of the segment itself) go to CUDA, never to our pools.
#[inline]
pub fn in_foreign_allocator() -> bool {
    // Until a private pool has a foreign allocator, its bit says no (Note [Rare conditions in
    // one word]).
    crate::rare::any(crate::rare::FOREIGN) && in_foreign_allocator_now()
}

/// [`in_foreign_allocator`]'s thread-local, never inlined (Note [Rare conditions in one word]).
#[inline(never)]
fn in_foreign_allocator_now() -> bool {
    IN_FOREIGN_ALLOCATOR.try_with(Cell::get).unwrap_or(false)
}

/// Run `f` marked as inside a foreign allocator (see [`in_foreign_allocator`]).
fn as_foreign<T>(f: impl FnOnce() -> T) -> T {
    super::with_thread_flag(&IN_FOREIGN_ALLOCATOR, f)
}
