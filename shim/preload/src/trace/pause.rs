//! A pause of the trace's allocation records (`cachealloc_trace_pause`), for measuring what the
//! trace costs within one process, step by step (issue 25's method: the two sides alternated
//! in one process, without the noise between processes).
//!
//! # Note [A paused trace stays consistent]
//!
//! While paused, allocations are not recorded and no stack is captured for them. Each block
//! allocated meanwhile is remembered (per device, by address) and its free is not recorded
//! either, whenever it comes; a block allocated before the pause has its free recorded as
//! usual. So every recorded free has its recorded allocation, and the tools' live state stays
//! right for the blocks they know of; blocks made during a pause and still live after it are
//! missing from allocated bytes (segments, always recorded, still count them as reserved). The
//! pause and the resumption are annotations in the trace (`cachealloc: recording paused`,
//! `… resumed`), so a reader sees the gap. Segment events, OOMs and the program's context
//! records are recorded throughout.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use rustc_hash::FxHashSet;

/// Pause (or resume) allocation records; returns whether they were paused. The switch is a bit
/// of the rare conditions' word, which every allocation reads anyway (Note [Rare conditions in
/// one word]).
pub fn set_paused(paused: bool) -> bool {
    crate::rare::switch(crate::rare::TRACE_PAUSED, paused)
}

/// Whether allocation records are paused now.
#[inline]
pub fn paused() -> bool {
    crate::rare::any(crate::rare::TRACE_PAUSED)
}

/// The blocks allocated while paused and not freed yet, whose frees go unrecorded.
///
/// The paused side of an in-process measurement pays for this set on every allocation and free
/// where the trace turned off pays nothing, so it is kept cheap (`FxHashSet`: the standard
/// library's SipHash showed in a profile of the CPU proxy's paused steps). What remains (the
/// lock, the set) still makes in-process trace costs read a little low, never high
/// (BENCHMARKS.md, tenth session).
#[derive(Debug, Default)]
#[repr(C)]
pub struct Unrecorded {
    /// Whether `blocks` holds any (frees skip the lock until then). First: every free reads it,
    /// beside the trace's other hot fields.
    any: AtomicBool,
    blocks: Mutex<FxHashSet<(u32, u64)>>,
}

impl Unrecorded {
    /// A block allocated while paused.
    pub fn add(&self, device: u32, address: u64) {
        let mut blocks = self.blocks.lock().unwrap_or_else(|p| p.into_inner());
        blocks.insert((device, address));
        self.any.store(true, Ordering::Release);
    }

    /// Whether the block at `address` was allocated while paused (its free goes unrecorded);
    /// with `forget`, it is forgotten (its last record: the free's completion, or an immediate
    /// free).
    pub fn contains(&self, device: u32, address: u64, forget: bool) -> bool {
        if !self.any.load(Ordering::Acquire) {
            return false;
        }
        let mut blocks = self.blocks.lock().unwrap_or_else(|p| p.into_inner());
        let found = if forget {
            blocks.remove(&(device, address))
        } else {
            blocks.contains(&(device, address))
        };
        if blocks.is_empty() {
            self.any.store(false, Ordering::Release);
        }
        found
    }
}
