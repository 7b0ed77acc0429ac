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
    FREE_STACKS.swap(on, Ordering::Relaxed)
}

/// Whether frees capture stacks.
pub fn free_stacks() -> bool {
    FREE_STACKS.load(Ordering::Relaxed)
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

/// The stack of the free the calling thread is in (0: none, or free stacks off).
pub fn at_free() -> u32 {
    AT_FREE.try_with(std::cell::Cell::get).unwrap_or(0)
}
