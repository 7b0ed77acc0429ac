//! Code objects' deaths, heard from the interpreter (Python 3.12+), so that a warm capture
//! need not check each frame's code object.
//!
//! # Note [Code objects' deaths]
//!
//! A warm capture finds its stack by what it read off the thread's frames: each frame's code
//! object address and instruction offset. An address alone does not name a code object for
//! ever: once one is freed, another may be created at the same address, and a stack cached for
//! the first would be handed to the second. So, by default, each frame's key also holds what
//! identifies the code object's contents (its name, file and line-table pointers and first
//! line: [`super::Python::check`]) — four more reads of the code object per frame, and a key
//! three times as long to hash and compare, on every allocation.
//!
//! From Python 3.12 the interpreter tells watchers when a code object is destroyed
//! (`PyCode_AddWatcher`, `PY_CODE_EVENT_DESTROY`). The Python integration installs
//! [`cachealloc_python_watch_code`](crate::ffi) at start-up (with the GIL held, as the call
//! requires); from then on each death bumps [`epoch`], a capture's key is the addresses and
//! offsets alone, and the interner forgets every cached key whenever the epoch it last saw
//! differs from the capture's. That is enough: a frame's code object is alive while the frame
//! is, so an address on a thread's stack that once named another code object was freed — and
//! the epoch bumped — before this frame existed, hence before the capture read the epoch. An
//! epoch of 0 means nobody watches: keys carry the checks, as on Python 3.10 and 3.11.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

/// `PY_CODE_EVENT_DESTROY` in CPython's `PyCodeEvent`.
const PY_CODE_EVENT_DESTROY: c_int = 1;

/// 0 while no watcher is installed; from then on 1 plus the number of code objects destroyed.
static EPOCH: AtomicU64 = AtomicU64::new(0);

/// The current epoch (0: code objects' deaths are not heard; keys must carry the checks).
#[inline]
pub fn epoch() -> u64 {
    EPOCH.load(Ordering::Acquire)
}

/// The watcher: called by the interpreter, with the GIL, for each code object event.
extern "C" fn on_code_event(event: c_int, _code: *mut c_void) -> c_int {
    if event == PY_CODE_EVENT_DESTROY {
        EPOCH.fetch_add(1, Ordering::AcqRel);
    }
    0
}

/// Install the watcher in the running interpreter. The caller must hold the GIL. `Err` says
/// why not (no `PyCode_AddWatcher` before 3.12; the interpreter's watcher places all taken —
/// the interpreter then has an exception set, which the caller's Python sees).
pub fn watch() -> Result<(), &'static str> {
    if epoch() != 0 {
        return Ok(());
    }
    let add = super::symbol(c"PyCode_AddWatcher").ok_or("Python before 3.12")?;
    type Callback = extern "C" fn(c_int, *mut c_void) -> c_int;
    // SAFETY: `PyCode_AddWatcher` is `int (PyCode_WatchCallback)` in CPython 3.12+, whose
    // callback type is `int (PyCodeEvent, PyCodeObject *)` (an enum is a C int); the caller
    // holds the GIL, as it requires.
    let id = unsafe {
        let add: unsafe extern "C" fn(Callback) -> c_int = std::mem::transmute(add);
        add(on_code_event)
    };
    if id < 0 {
        return Err("no code watcher place left");
    }
    EPOCH.store(1, Ordering::Release);
    Ok(())
}
