//! The calling thread's part of the trace — its number in the records and its module scope —
//! in one thread-local.
//!
//! A preloaded library reaches its thread-locals through the loader (`__tls_get_addr`: a call
//! and the thread's vector of modules, cold in a real step), once for each thread-local it
//! reads. An allocation's record needs the thread's number, its scope slot and the scope the
//! trace last heard from it; kept together, that is one trip through the loader a record.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};

/// See the module docs.
pub(super) struct ThreadTrace {
    /// The thread's number in the records (1, 2, …; 0 until first asked).
    number: Cell<u32>,
    /// The thread's scope, as the Python integration last wrote it (0: none); atomic because
    /// the integration writes it through the address `scopes::slot` gives, and `backward()`'s
    /// caller clears the slots of the autograd threads.
    pub(super) slot: AtomicU32,
    /// The scope this thread last sent to the trace, and the phase generation it was sent in.
    pub(super) sent: Cell<(u32, u64)>,
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

thread_local! {
    static THREAD: ThreadTrace = const {
        ThreadTrace {
            number: Cell::new(0),
            slot: AtomicU32::new(0),
            sent: Cell::new((0, 0)),
        }
    };
}

/// `f` of the calling thread's part of the trace; `None` while the thread is being torn down.
pub(super) fn with<R>(f: impl FnOnce(&ThreadTrace) -> R) -> Option<R> {
    THREAD.try_with(f).ok()
}
