//! The real `dlsym`: libc's, found with `dlvsym` (our own exported `dlsym` stands in front of it;
//! see [`crate::ffi::entry_points`]). Every lookup the shim makes for itself goes through here,
//! so it can never be handed one of our own wrappers.

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

/// `dlsym`'s signature.
pub type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// The real `dlsym` (libc's), as an address for the naked `dlsym`; 0 until found.
pub static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// Find the real `dlsym` (glibc 2.34 and later, then older ones) and store it.
fn find() -> Option<DlsymFn> {
    for version in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
        // SAFETY: NUL-terminated strings; RTLD_NEXT asks for the definition after this
        // library, libc's.
        let p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
        if !p.is_null() {
            REAL_DLSYM.store(p as usize, Ordering::Release);
            // SAFETY: libc's `dlsym` has this signature.
            return Some(unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(p) });
        }
    }
    None
}

/// Find libc's `dlsym` now (the constructor does, so that the naked `dlsym` never needs the
/// slow path).
pub fn prepare() {
    find();
}

/// Look `name` up in `handle` with the real `dlsym`. `None` for a NULL answer.
///
/// # Safety
/// `dlsym`'s contract: `handle` a pseudo-handle or a live handle from `dlopen`, `name` a
/// NUL-terminated string.
pub unsafe fn real_dlsym(handle: *mut c_void, name: *const c_char) -> Option<*mut c_void> {
    let address = REAL_DLSYM.load(Ordering::Acquire);
    let real = if address != 0 {
        // SAFETY: only ever stores libc's `dlsym`, which has this signature.
        unsafe { std::mem::transmute::<usize, DlsymFn>(address) }
    } else {
        find()?
    };
    // SAFETY: the arguments are the caller's, passed on as `dlsym` takes them.
    let p = unsafe { real(handle, name) };
    (!p.is_null()).then_some(p)
}
