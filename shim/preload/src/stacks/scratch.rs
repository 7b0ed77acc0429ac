//! Each thread's capture buffers, reached without a call into the loader.
//!
//! A capture's buffers are a thread's own, reused: once warm, a capture neither zeroes nor
//! allocates them. They are lent by a pointer in the static TLS block (Note [Thread-locals in
//! static TLS], `ffi::static_tls::Lent`), made at the thread's first capture, and an ordinary
//! thread-local owns them and frees them at the thread's exit.

use super::python::{self, RawFrame};
use super::recent::RecentStacks;
use crate::ffi::static_tls::{ExitOwner, Lent, static_thread_local};

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

static_thread_local! {
    /// The calling thread's buffers, lent to one capture at a time.
    static BUFFERS: Lent<Scratch>, symbol "cachealloc_tls_stack_buffers";
}

std::thread_local! {
    /// Owns the calling thread's buffers; frees them at the thread's exit.
    static OWNER: ExitOwner<Scratch> = const { ExitOwner::new() };
}

/// `f` of the calling thread's buffers, made at its first capture; `None` once the thread's exit
/// has freed them (a thread-local destructor that frees device memory: that allocation goes
/// without a stack), or while a capture on this thread already has them.
#[inline]
pub(super) fn with<R>(f: impl FnOnce(&mut Scratch) -> R) -> Option<R> {
    BUFFERS.lend(&OWNER, Scratch::default, |buffers| buffers.map(f))
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
