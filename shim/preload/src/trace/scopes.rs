//! Each thread's module scope (issue 23: memory by module), told to the trace only when it
//! matters: before the first allocation a thread makes in a new scope.
//!
//! The Python integration's module hooks run at every `nn.Module` call, a hundred times a step
//! and more; a call into the library at each would cost more than the target allows. So each
//! thread has a *scope slot*, a word in the library that the integration writes directly
//! (`cachealloc_scope_slot` gives its address once per thread; ctypes stores the scope id there,
//! no call). The allocation path reads the slot, and when it differs from what the trace last
//! heard from this thread — or a phase change has since reset every thread's scope (see
//! `schema::PhaseEvent`) — it sends a `Scope` record (and the scope's `ScopeName` the first
//! time) before the allocation's record. The cost on the allocation path is a thread-local load
//! and a compare.
//!
//! A slot is written by its own thread (the integration writes the slot of the thread its hook
//! runs on), and by the thread that called `backward()` when that returns, to clear the slots
//! of the autograd threads (idle by then) that backward's hooks named; it is atomic so that the
//! compiler never assumes it unchanged across the foreign writes.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use cachealloc_recorder::Record;
use cachealloc_recorder::schema::{ScopeEvent, ScopeName};

use super::{Trace, thread};

/// Interned module paths: id `i + 1` is `names[i]`.
#[derive(Default)]
struct ScopeTable {
    ids: HashMap<String, u32>,
    /// Each name, and whether its `ScopeName` record has been sent.
    names: Vec<(String, bool)>,
}

static NAMES: Mutex<Option<ScopeTable>> = Mutex::new(None);

/// The id of the module path `name` (≥ 1), interned for the life of the process.
pub fn define(name: &str) -> u32 {
    let mut guard = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    let table = guard.get_or_insert_with(ScopeTable::default);
    if let Some(&id) = table.ids.get(name) {
        return id;
    }
    table.names.push((name.to_owned(), false));
    let id = table.names.len() as u32;
    table.ids.insert(name.to_owned(), id);
    id
}

/// Whether `scope` is 0 or an id [`define`] returned.
pub fn is_known(scope: u32) -> bool {
    let guard = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    scope == 0
        || guard
            .as_ref()
            .is_some_and(|t| scope as usize <= t.names.len())
}

/// The address of the calling thread's scope slot (valid while the thread lives).
pub fn slot() -> *const AtomicU32 {
    thread::with(|t| &t.slot as *const AtomicU32)
}

/// Set the calling thread's scope (an id of [`define`], or 0).
pub fn set(scope: u32) {
    thread::with(|t| t.slot.store(scope, Ordering::Relaxed));
}

impl Trace {
    /// A phase change: every thread's scope must be said again at its next allocation.
    pub fn phase_changed(&self) {
        self.phase_generation.fetch_add(1, Ordering::Relaxed);
    }

    /// Before the record of an allocation the calling thread makes: tell the trace the
    /// thread's scope if it is not what the trace last heard. Returns the thread's number,
    /// which the allocation's record carries.
    pub fn announce_scope(&self) -> u32 {
        thread::with(|thread| {
            let scope = thread.slot.load(Ordering::Relaxed);
            let generation = self.phase_generation.load(Ordering::Relaxed);
            let (sent, sent_in) = thread.sent.get();
            // After a phase change the trace holds no scope for this thread.
            let in_trace = if sent_in == generation { sent } else { 0 };
            if scope == in_trace {
                if sent_in != generation {
                    thread.sent.set((scope, generation));
                }
            } else if scope == 0 || self.define_in_trace(scope) {
                self.send(Record::Scope(ScopeEvent {
                    t: self.now(),
                    thread: thread.number(),
                    scope,
                }));
                thread.sent.set((scope, generation));
            }
            thread.number()
        })
    }

    /// Send `scope`'s name if the trace does not have it yet; false for an unknown id.
    fn define_in_trace(&self, scope: u32) -> bool {
        let mut guard = NAMES.lock().unwrap_or_else(|e| e.into_inner());
        let Some(entry) = guard
            .as_mut()
            .and_then(|t| t.names.get_mut(scope as usize - 1))
        else {
            return false;
        };
        if !entry.1 {
            // Sent under the lock, so no thread can use the id in the trace before it.
            self.send(Record::ScopeName(Box::new(ScopeName {
                id: scope,
                name: entry.0.clone(),
            })));
            entry.1 = true;
        }
        true
    }
}
