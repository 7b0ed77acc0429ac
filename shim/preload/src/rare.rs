//! What an allocation or a free must look out for, in one word.
//!
//! # Note [Rare conditions in one word]
//!
//! The hot path of every interposed allocation and free asks whether anything unusual is going
//! on: a forked child (pass everything through), a program's own allocator running for one of
//! our pools, a thread allocating to a `MemPool`, a stream capturing a CUDA graph, blocks
//! `record_stream` named streams for, blocks shared with other processes, PyTorch's profiler,
//! stacks at frees.
//! Each has its own flag where it is kept, and each flag is its own cache line: in a real
//! training step the program's work between two allocations evicts them, and a call missed on
//! one line per question (`scripts/bench-cold-lines`, BENCHMARKS.md, fifteenth session). So each
//! condition also sets a bit here when it first becomes possible, and the hot path reads this
//! one word first, asking its own flag only when the bit is set. The bits are never cleared
//! (a flag's own truth can come and go under other threads; a bit that stays set only sends the
//! check to that flag, as before), so a program that never uses these features pays one line
//! for all of them, and one that does pays what it paid before. A bit is set *before* the
//! condition it announces is made true, so whoever can see the condition sees the bit.
//!
//! Two bits are not conditions but switches: the benchmarks' pauses of the trace's records
//! and of stack capture (`cachealloc_trace_pause`, `cachealloc_stacks_pause`). The hot path asks
//! them at every allocation, so the word is their only home; they are set and cleared by their
//! calls ([`switch`]), not sticky, and a program that never pauses reads nothing more for them.
//!
//! Where the check guards a thread-local, the thread-local's read is a function that is never
//! inlined: a preloaded library reaches its thread-locals through the loader (a call and two
//! cold lines), and the compiler computes a thread-local's address ahead of the test that
//! guards its use, so inlined, the read cost every call even while the bit said no.

use std::sync::atomic::{AtomicU32, Ordering};

/// The process is the child of a `fork` ([`crate::process::after_fork_in_child`]).
pub const FORKED: u32 = 1;
/// A private pool has a program's own allocator ([`crate::backend::ForeignAllocator`]).
pub const FOREIGN: u32 = 1 << 1;
/// A thread has allocated to a `MemPool`.
pub const MEM_POOL: u32 = 1 << 2;
/// A stream has begun capturing a CUDA graph.
pub const CAPTURE: u32 = 1 << 3;
/// `record_stream` named a stream for a block.
pub const RECORDED: u32 = 1 << 4;
/// A block was shared with another process (IPC).
pub const IPC: u32 = 1 << 5;
/// PyTorch's profiler functions are known.
pub const PROFILER: u32 = 1 << 6;
/// Frees capture their own stacks (`_record_memory_history(context="all")`).
pub const FREE_STACKS: u32 = 1 << 7;

/// Switch: allocation records are paused (`trace::pause`).
pub const TRACE_PAUSED: u32 = 1 << 8;
/// Switch: stack capture is paused (`stacks::pause`).
pub const STACKS_PAUSED: u32 = 1 << 9;

/// The word, alone on its cache line (it is read by every call and written a few times a run).
#[repr(align(64))]
struct Word(AtomicU32);

static RARE: Word = Word(AtomicU32::new(0));

/// Announce `bits`: call before making the condition true.
pub fn note(bits: u32) {
    RARE.0.fetch_or(bits, Ordering::SeqCst);
}

/// Turn the switch `bit` on or off; returns whether it was on.
pub fn switch(bit: u32, on: bool) -> bool {
    let before = if on {
        RARE.0.fetch_or(bit, Ordering::SeqCst)
    } else {
        RARE.0.fetch_and(!bit, Ordering::SeqCst)
    };
    before & bit != 0
}

/// Whether any of `bits` was ever announced (a switch: is on): if not, none of their
/// conditions holds.
#[inline]
pub fn any(bits: u32) -> bool {
    RARE.0.load(Ordering::Acquire) & bits != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_noted_bit_stays_and_others_stay_clear() {
        // The word is the process's: use a bit no other code sets in this test binary.
        const TEST_BIT: u32 = 1 << 31;
        assert!(!any(TEST_BIT));
        note(TEST_BIT);
        assert!(any(TEST_BIT));
        assert!(any(TEST_BIT | FORKED));
        note(TEST_BIT);
        assert!(any(TEST_BIT), "noting twice keeps it");
    }

    #[test]
    fn a_switch_goes_on_and_off_and_leaves_the_other_bits() {
        const SWITCH: u32 = 1 << 30;
        note(1 << 29);
        assert!(!switch(SWITCH, true), "it was off");
        assert!(any(SWITCH));
        assert!(switch(SWITCH, true), "it was on");
        assert!(switch(SWITCH, false), "it was on");
        assert!(!any(SWITCH));
        assert!(!switch(SWITCH, false), "it was off");
        assert!(any(1 << 29), "other bits stay");
    }
}
