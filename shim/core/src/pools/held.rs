//! Frees held for work the pools cannot see: blocks the application freed while work on other
//! streams, which only the caller knows of, may still use them.
//!
//! # Note [Held frees]
//!
//! PyTorch's `record_stream` lends a block to other streams: when the program frees it, the
//! memory must not be handed out again before the work queued on those streams has run. The
//! shim's preload layer keeps the streams and records a fence on each at the free (Note
//! [Recorded streams] in the shim); the pools know nothing of those fences. A *held* free
//! splits the free in two, as PyTorch's native allocator does (`free_requested`, then
//! `free_completed` when the block's stream-use events complete):
//!
//! * [`Pools::free_held`] at the program's free: the block stops counting as allocated (it is
//!   no longer the program's) but stays active, as pending frees do, and is not reusable. It is
//!   in no fence batch; only the caller can let it go.
//! * [`Pools::release_held`] once the caller knows the other streams' work is done: the block
//!   goes where the program's free would have sent it at that moment — its free list, or the
//!   open batch when the free needs a fence ([`Pools::free`]'s rule).
//!
//! Without the split the block would stay *allocated* until the other streams' work ran, and
//! PyTorch's `memory_allocated()` would count memory the program no longer holds: about twice
//! native's on a workload of two streams (BENCHMARKS.md, issue 25).
//!
//! Held blocks keep their segments (a held block is `PendingFree`, which `empty_cache` and
//! checkpoints leave alone), and the invariants count them beside the batches' blocks.

use super::{BlockId, BlockState, FreeError, Freed, Pools};

impl<F: Clone> Pools<F> {
    /// The program freed `address` on `stream` ([`crate::NO_STREAM`]: synchronously), but the
    /// caller holds it back from reuse until [`Pools::release_held`]. The block is no longer
    /// allocated; it stays active. A pointer that is not ours, a double free and an interior
    /// pointer are refused with nothing changed.
    pub fn free_held(&mut self, address: u64, stream: u64) -> Result<Freed, FreeError> {
        let id = self.take_allocated(address)?;
        let b = &mut self.blocks[id as usize];
        b.state = BlockState::PendingFree;
        let (size, requested) = (b.size, b.requested);
        self.held.insert(address, (id, stream));
        Ok(Freed {
            address,
            size,
            requested,
            pending: true,
            stream,
        })
    }

    /// Let the held block at `address` go, as its free would have at this moment: to its free
    /// list (reported in `completed`, as a completed free), or behind a fence. Returns false if
    /// no block is held there.
    pub fn release_held(&mut self, address: u64, completed: &mut Vec<(u64, u64)>) -> bool {
        let Some((id, stream)) = self.held.remove(&address) else {
            return false;
        };
        let size = self.blocks[id as usize].size;
        if !self.retire(id, stream) {
            completed.push((address, size));
        }
        true
    }

    /// Whether a block is held at `address`.
    pub fn is_held(&self, address: u64) -> bool {
        self.held.contains_key(&address)
    }

    /// The held blocks' ids (for the invariants).
    pub(super) fn held_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.held.values().map(|&(id, _)| id)
    }
}
