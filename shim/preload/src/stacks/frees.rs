//! Stacks at frees: captured only while the program keeps free context (PyTorch's
//! `_record_memory_history(context="all")`), and handed to the records the free makes through a
//! thread-local (the allocator's observer makes them under the allocator's lock, where no stack
//! is captured). Kept apart from the capture itself so that the trace's observer can read it.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether frees capture the freeing code's stack (`cachealloc_memory_history`: the program
/// asked `_record_memory_history(context="all")`, which keeps free stacks). Off by default: a
/// free's entries then show the block's allocation stack.
static FREE_STACKS: AtomicBool = AtomicBool::new(false);

/// Capture stacks at frees from now on (or stop); returns whether it was on.
pub fn set_free_stacks(on: bool) -> bool {
    if on {
        crate::rare::note(crate::rare::FREE_STACKS);
    }
    FREE_STACKS.swap(on, Ordering::Relaxed)
}

/// Whether frees capture stacks.
#[inline]
pub fn free_stacks() -> bool {
    // Note [Rare conditions in one word]: never asked for, one line for the answer.
    crate::rare::any(crate::rare::FREE_STACKS) && FREE_STACKS.load(Ordering::Relaxed)
}

thread_local! {
    /// The stack of the free (or `empty_cache`) this thread is in, for the records it makes
    /// (0: none).
    static AT_FREE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Set the calling thread's free stack ([`at_free`]); returns the previous one.
pub fn set_at_free(stack: u32) -> u32 {
    AT_FREE.try_with(|s| s.replace(stack)).unwrap_or(0)
}

/// The stack of the free the calling thread is in (0: none, or free stacks off). Until free
/// stacks were first asked for, no thread set one, and no thread-local is read.
#[inline]
pub fn at_free() -> u32 {
    if !crate::rare::any(crate::rare::FREE_STACKS) {
        return 0;
    }
    thread_at_free()
}

/// [`at_free`]'s thread-local, never inlined (Note [Rare conditions in one word]).
#[inline(never)]
fn thread_at_free() -> u32 {
    AT_FREE.try_with(std::cell::Cell::get).unwrap_or(0)
}
