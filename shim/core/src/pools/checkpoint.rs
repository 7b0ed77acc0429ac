//! Checkpoints of a pool's layout, and putting a pool back to one: what PyTorch's CUDA graph
//! trees need from the allocator of a graph pool (`getCheckpointState`,
//! `setCheckpointPoolState`).
//!
//! # Note [Pool checkpoints]
//!
//! `torch.compile(mode="reduce-overhead")` records a tree of CUDA graphs into one private pool.
//! Replaying a graph makes no allocation, so after replays the pool's books no longer say
//! which of its blocks hold live tensors. Before recording a new graph at some point of the
//! tree, Inductor puts the pool back to the layout it had right after recording the graph it
//! branches from (a [`Checkpoint`], taken then), so that the new recording does not allocate
//! over tensors that the replays made live:
//!
//! 1. every block the pool has allocated now is freed (the caller learns which, to forget
//!    their storages), and so each segment of the checkpoint becomes one free block;
//! 2. each segment of the checkpoint is split again into its blocks, at the same addresses,
//!    and the blocks the checkpoint had allocated are allocated again (the caller learns
//!    which, to give their storages a deleter).
//!
//! Segments the pool gained after the checkpoint stay, free. This is PyTorch's
//! `setCheckpointPoolState`. It needs every block of the pool to be allocated or free (no block
//! waiting for a fence, as a pool that is never fenced has none) and fixed segments (a graph
//! pool has no expandable ones); it refuses, changing nothing, when the pool lost a segment of
//! the checkpoint.

use super::{Allocation, BlockId, BlockState, Freed, NIL, Pools};
use crate::NO_STREAM;
use crate::config::ReusePolicy;

/// One block of a [`CheckpointSegment`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointBlock {
    /// Its address.
    pub address: u64,
    /// Its size.
    pub size: u64,
    /// Whether it was allocated (else free).
    pub allocated: bool,
    /// The application's request, when allocated.
    pub requested: u64,
    /// The caller's tag at its allocation.
    pub tag: u64,
}

/// One segment of a [`Checkpoint`]: its blocks in address order, tiling it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointSegment {
    /// The segment's address.
    pub address: u64,
    /// Its size.
    pub size: u64,
    /// Its blocks.
    pub blocks: Vec<CheckpointBlock>,
}

/// A pool's layout at one moment (PyTorch's `PrivatePoolState`); see
/// [Note [Pool checkpoints]](self#note-pool-checkpoints).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Checkpoint {
    /// Its segments, in address order.
    pub segments: Vec<CheckpointSegment>,
}

/// What putting a pool back to a checkpoint did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Restored {
    /// The blocks that were allocated and were freed.
    pub freed: Vec<Freed>,
    /// The blocks of the checkpoint allocated again.
    pub allocated: Vec<Allocation>,
}

/// Why a pool could not be put back to a checkpoint. Nothing was changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RestoreError {
    /// A segment of the checkpoint is no longer in the pool, or has another size.
    #[error("the pool no longer has the checkpoint's segment at {0:#x} of the same size")]
    SegmentGone(u64),
    /// The checkpoint's blocks do not tile their segment.
    #[error("the checkpoint's blocks do not tile the segment at {0:#x}")]
    BadLayout(u64),
    /// A block of the pool waits for a fence or has no memory (an expandable segment).
    #[error("the pool has a block at {0:#x} that is neither allocated nor free")]
    NotSettled(u64),
}

impl<F: Clone> Pools<F> {
    /// The pools' layout now: every segment with its blocks. `None` when a block is neither
    /// allocated nor free, which a checkpoint cannot describe.
    pub fn checkpoint(&self) -> Option<Checkpoint> {
        let mut segments = Vec::new();
        for &seg in self.segment_index.values() {
            let segment = self.segment(seg);
            let mut blocks = Vec::new();
            let mut id = segment.first;
            while id != NIL {
                let b = &self.blocks[id as usize];
                let allocated = match b.state {
                    BlockState::Active => true,
                    BlockState::Free => false,
                    BlockState::PendingFree | BlockState::Unmapped => return None,
                };
                blocks.push(CheckpointBlock {
                    address: b.address,
                    size: b.size,
                    allocated,
                    requested: if allocated { b.requested } else { 0 },
                    tag: if allocated { b.tag } else { 0 },
                });
                id = b.next;
            }
            segments.push(CheckpointSegment {
                address: segment.address,
                size: segment.size,
                blocks,
            });
        }
        Some(Checkpoint { segments })
    }

    /// Put the pools back to `checkpoint`; see [Note [Pool checkpoints]](self#note-pool-checkpoints).
    pub fn restore(&mut self, checkpoint: &Checkpoint) -> Result<Restored, RestoreError> {
        self.check_restorable(checkpoint)?;
        let mut restored = Restored::default();
        let active: Vec<(u64, u64)> = self
            .live_blocks()
            .filter(|b| b.state == BlockState::Active)
            .map(|b| (b.address, b.stream))
            .collect();
        for (address, stream) in active {
            let freed = self.free(address, stream).expect("an active block frees");
            debug_assert!(!freed.pending, "checked: the pools are never fenced");
            restored.freed.push(freed);
        }
        self.settle();
        for segment in &checkpoint.segments {
            let seg = self.segment_index[&segment.address];
            let first = self.segment(seg).first;
            self.remove_free(first);
            self.rebuild_segment(first, &segment.blocks, &mut restored.allocated);
        }
        Ok(restored)
    }

    /// Refuse, before changing anything, a checkpoint that cannot be restored.
    fn check_restorable(&self, checkpoint: &Checkpoint) -> Result<(), RestoreError> {
        // A free on the block's own stream is reusable at once unless every free is fenced.
        let stream_ordered = |stream| self.reuse == ReusePolicy::Auto && stream != NO_STREAM;
        if self.fencing
            && let Some(b) = self
                .live_blocks()
                .find(|b| b.state == BlockState::Active && !stream_ordered(b.stream))
        {
            return Err(RestoreError::NotSettled(b.address));
        }
        if let Some(b) = self
            .live_blocks()
            .find(|b| matches!(b.state, BlockState::PendingFree | BlockState::Unmapped))
        {
            return Err(RestoreError::NotSettled(b.address));
        }
        for segment in &checkpoint.segments {
            let live = self.segment_index.get(&segment.address);
            let same = live.is_some_and(|&seg| {
                let s = self.segment(seg);
                s.size == segment.size && !s.expandable
            });
            if !same {
                return Err(RestoreError::SegmentGone(segment.address));
            }
            let mut at = segment.address;
            for b in &segment.blocks {
                if b.address != at || b.size == 0 {
                    return Err(RestoreError::BadLayout(segment.address));
                }
                at += b.size;
            }
            if at != segment.address + segment.size {
                return Err(RestoreError::BadLayout(segment.address));
            }
        }
        Ok(())
    }

    /// Split the free block `id` (a whole segment, out of every list) into `blocks`, allocating
    /// those the checkpoint had allocated and listing the others as free.
    fn rebuild_segment(
        &mut self,
        mut id: BlockId,
        blocks: &[CheckpointBlock],
        allocated: &mut Vec<Allocation>,
    ) {
        for (i, spec) in blocks.iter().enumerate() {
            if i + 1 < blocks.len() {
                self.split_off_rest(id, spec.size);
            }
            let next = self.blocks[id as usize].next;
            if spec.allocated {
                allocated.push(self.hand_out(id, spec.requested, spec.tag));
            } else {
                let b = &mut self.blocks[id as usize];
                b.free_since = self.lookups;
                self.add_free(id);
            }
            id = next;
        }
    }
}
