//! Each thread's capture buffers, reached without a call into the loader.
//!
//! A capture's buffers are a thread's own, reused: once warm, a capture neither zeroes nor
//! allocates them. Where they are is a pointer in the static TLS block (Note [Thread-locals in
//! static TLS]): null until the thread's first capture, then the buffers, which an ordinary
//! thread-local owns and frees at the thread's exit, after it has set the pointer to `GONE`.

use std::cell::{Cell, RefCell};

use super::python::{self, RawFrame};
use super::recent::RecentStacks;
use crate::ffi::static_tls::{ExitOwner, static_thread_local};

/// A thread's capture buffers: return addresses, Python frames, and the raw stack key (the
/// addresses, then per Python frame its code object, offset and `CodeCheck`); the stacks it
/// captured last (Note [The thread's recent stacks]); and the code objects its walks have read
/// ([`python::KnownCode`]).
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) ips: Vec<u64>,
    pub(super) py: Vec<RawFrame>,
    pub(super) raw: Vec<u64>,
    pub(super) recent: RecentStacks,
    pub(super) known: python::KnownCode,
}

type Buffers = RefCell<Scratch>;

static_thread_local! {
    /// The calling thread's buffers: null before its first capture, `GONE` after its exit
    /// has freed them.
    static BUFFERS: Cell<*mut Buffers>, symbol "cachealloc_tls_stack_buffers";
}

/// What [`BUFFERS`] holds once the thread's owner has freed the buffers: the type's alignment
/// as an address, never an allocation's.
const GONE: *mut Buffers = std::ptr::dangling_mut();

std::thread_local! {
    /// Owns the calling thread's buffers; frees them at the thread's exit.
    static OWNER: ExitOwner<Buffers> = const { ExitOwner::new(|| BUFFERS.with(|b| b.set(GONE))) };
}

/// `f` of the calling thread's buffers; `None` once the thread's exit has freed them (a
/// thread-local destructor that frees device memory: that allocation goes without a stack), or
/// while a capture on this thread already has them.
#[inline]
pub(super) fn with<R>(f: impl FnOnce(&mut Scratch) -> R) -> Option<R> {
    let mut buffers = BUFFERS.with(Cell::get);
    if buffers.is_null() {
        buffers = first_use()?;
    }
    if buffers == GONE {
        return None;
    }
    // SAFETY: `buffers` is this thread's live allocation from `first_use`: it is freed only by
    // the thread's `OWNER`, which sets `BUFFERS` to `GONE` first, and no other thread has its
    // address. The `RefCell` refuses a second borrow (a capture re-entered on this thread).
    let buffers = unsafe { &*buffers };
    let mut scratch = buffers.try_borrow_mut().ok()?;
    Some(f(&mut scratch))
}

/// The thread's first capture: allocate its buffers and give them to its owner. `None` if the
/// owner is already gone (the thread is exiting).
#[cold]
#[inline(never)]
fn first_use() -> Option<*mut Buffers> {
    OWNER
        .try_with(|owner| {
            let buffers = owner.own(RefCell::new(Scratch::default()));
            BUFFERS.with(|b| b.set(buffers));
            buffers
        })
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_per_thread_kept_and_not_reentered() {
        let mark = |n: u64| with(|s| s.raw.push(n)).is_some();
        assert!(mark(7));
        assert!(mark(8));
        assert_eq!(
            with(|s| s.raw.clone()),
            Some(vec![7, 8]),
            "kept between uses"
        );
        let other = std::thread::spawn(move || {
            let fresh = with(|s| s.raw.is_empty());
            let nested = with(|_| with(|_| ()).is_some());
            (fresh, nested)
        })
        .join()
        .unwrap();
        assert_eq!(
            other,
            (Some(true), Some(false)),
            "fresh buffers; no second borrow"
        );
    }
}
