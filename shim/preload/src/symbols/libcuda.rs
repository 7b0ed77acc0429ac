//! Our own handle of libcuda and lookups of its symbols, through the real `dlsym`
//! ([`super::libc_dlsym`]), so that a lookup can never return one of our wrappers.
//!
//! `libcuda` is never loaded by a lookup made for the doors ([`loaded_handle`]): a pointer can
//! only be libcuda's if libcuda is loaded. It is loaded (if it is not yet) only for a hook that
//! is about to call the driver ([`lookup`]) — which means the application already reached it.

use std::ffi::{CStr, c_void};
use std::sync::OnceLock;

use super::libc_dlsym::real_dlsym;

const SONAME: &CStr = c"libcuda.so.1";

/// Our handle of libcuda if it is loaded (never loads it).
pub fn loaded_handle() -> Option<usize> {
    static HANDLE: OnceLock<usize> = OnceLock::new();
    if let Some(&h) = HANDLE.get() {
        return Some(h);
    }
    // SAFETY: NUL-terminated name; RTLD_NOLOAD only returns a handle to a library that is
    // already loaded (or NULL), running no code. The reference it takes is kept for the life of
    // the process.
    let h = unsafe { libc::dlopen(SONAME.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    if h.is_null() {
        return None;
    }
    Some(*HANDLE.get_or_init(|| h as usize))
}

/// Our handle of libcuda, loading it if needed.
fn handle() -> Option<usize> {
    if let Some(h) = loaded_handle() {
        return Some(h);
    }
    // SAFETY: NUL-terminated name. Loading libcuda runs its initializers, as the first driver
    // call of the application (which brought us here) would have.
    let h = unsafe { libc::dlopen(SONAME.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if h.is_null() {
        return None;
    }
    loaded_handle()
}

/// The address of `name` in the library behind `handle`.
fn lookup_in(handle: usize, name: &CStr) -> Option<usize> {
    // SAFETY: a live handle of ours from dlopen and a NUL-terminated name.
    let p = unsafe { real_dlsym(handle as *mut c_void, name.as_ptr()) }?;
    Some(p as usize)
}

/// The address of libcuda's own `name`, loading libcuda if needed.
pub fn lookup(name: &CStr) -> Option<usize> {
    lookup_in(handle()?, name)
}

/// The address of libcuda's own `name` if libcuda is loaded (never loads it).
pub fn lookup_loaded(name: &CStr) -> Option<usize> {
    lookup_in(loaded_handle()?, name)
}
