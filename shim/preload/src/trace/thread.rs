//! The calling thread's part of the trace — its number in the records and its module scope —
//! in one thread-local.
//!
//! An allocation's record needs the thread's number, its scope slot and the scope the trace
//! last heard from it; they are kept together in one thread-local in the static TLS block
//! (Note [Thread-locals in static TLS]): two loads, no call into the loader.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::ffi::static_tls::{ZeroInit, static_thread_local};

/// See the module docs.
pub(super) struct ThreadTrace {
    /// The thread's number in the records (1, 2, …; 0 until first asked).
    number: Cell<u32>,
    /// The thread's scope, as the Python integration last wrote it (0: none); atomic because
    /// the integration writes it through the address `scopes::slot` gives, and `backward()`'s
    /// caller clears the slots of the autograd threads.
    pub(super) slot: AtomicU32,
    /// The scope this thread last sent to the trace, and the phase generation it was sent in.
    pub(super) sent: Cell<(u32, u32)>,
}

impl ThreadTrace {
    /// The thread's number, given at its first record.
    pub(super) fn number(&self) -> u32 {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        if self.number.get() == 0 {
            self.number.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        self.number.get()
    }
}

// SAFETY: all-zero bytes are number 0 (not yet given), slot 0 (no scope) and sent (0, 0):
// the initial values; the fields need no drop.
unsafe impl ZeroInit for ThreadTrace {
    const ZERO: Self = ThreadTrace {
        number: Cell::new(0),
        slot: AtomicU32::new(0),
        sent: Cell::new((0, 0)),
    };
}

static_thread_local! {
    static THREAD: ThreadTrace, symbol "cachealloc_tls_thread_trace";
}

/// `f` of the calling thread's part of the trace (there at every point of the thread's life,
/// its teardown included: it lives in the thread's static TLS block).
#[inline]
pub(super) fn with<R>(f: impl FnOnce(&ThreadTrace) -> R) -> R {
    THREAD.with(f)
}
