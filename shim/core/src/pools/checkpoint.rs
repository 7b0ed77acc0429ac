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
//!    their storages), and so the memory of each segment of the checkpoint is free;
//! 2. the blocks the checkpoint had allocated are carved out of that free memory again, at
//!    the same addresses (the caller learns which, to give their storages a deleter); what lies
//!    between them stays free.
//!
//! Segments the pool gained after the checkpoint stay, free. This is PyTorch's
//! `setCheckpointPoolState`. It needs every block of the pool to be allocated or free (no block
//! waiting for a fence, as a pool that is never fenced has none); it refuses, changing nothing,
//! when the pool lost memory of the checkpoint.
//!
//! An expandable segment's "segments" are its runs of mapped memory, as PyTorch's snapshots
//! show them. A private pool keeps its maps ([Note [Kept maps]](super::expandable#note-kept-maps)),
//! so a run can only have grown since the checkpoint: its blocks are carved out of the larger
//! free run, and the memory mapped after the checkpoint stays free around them (PyTorch's
//! expandable private pools behave so; its `test_expandable_segment_checkpoint_growth`).

use super::{Allocation, BlockState, Freed, NIL, Pools};
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
    /// Memory of the checkpoint is no longer in the pool: a fixed segment gone or of another
    /// size, or a run of an expandable segment no longer mapped throughout.
    #[error("the pool no longer has the checkpoint's memory at {0:#x}")]
    SegmentGone(u64),
    /// The checkpoint's blocks do not tile their segment.
    #[error("the checkpoint's blocks do not tile the segment at {0:#x}")]
    BadLayout(u64),
    /// A block of the pool waits for a fence, or is being mapped or unmapped.
    #[error("the pool has a block at {0:#x} that is neither allocated nor free")]
    NotSettled(u64),
}

impl<F: Clone> Pools<F> {
    /// The pools' layout now: every fixed segment, and every run of mapped memory of an
    /// expandable one, with its blocks. `None` when a block is neither allocated nor free (nor
    /// unmapped and idle), which a checkpoint cannot describe.
    pub fn checkpoint(&self) -> Option<Checkpoint> {
        let mut segments = Vec::new();
        for &seg in self.segment_index.values() {
            let mut run: Option<CheckpointSegment> = None;
            let mut id = self.segment(seg).first;
            while id != NIL {
                let b = &self.blocks[id as usize];
                id = b.next;
                let allocated = match b.state {
                    BlockState::Active => true,
                    BlockState::Free => false,
                    BlockState::Unmapped if !b.busy => {
                        segments.extend(run.take());
                        continue;
                    }
                    BlockState::PendingFree | BlockState::Unmapped => return None,
                };
                let run = run.get_or_insert_with(|| CheckpointSegment {
                    address: b.address,
                    size: 0,
                    blocks: Vec::new(),
                });
                run.size += b.size;
                run.blocks.push(CheckpointBlock {
                    address: b.address,
                    size: b.size,
                    allocated,
                    requested: if allocated { b.requested } else { 0 },
                    tag: if allocated { b.tag } else { 0 },
                });
            }
            segments.extend(run);
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
        for block in checkpoint.segments.iter().flat_map(|s| &s.blocks) {
            if block.allocated {
                restored.allocated.push(self.carve_at(block));
            }
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
        if let Some(b) = self.live_blocks().find(|b| {
            b.state == BlockState::PendingFree || (b.state == BlockState::Unmapped && b.busy)
        }) {
            return Err(RestoreError::NotSettled(b.address));
        }
        for segment in &checkpoint.segments {
            if !self.still_has(segment) {
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

    /// Whether the pools still have the memory of `segment`, allocated or free: the same fixed
    /// segment, or memory mapped throughout it in an expandable one.
    fn still_has(&self, segment: &CheckpointSegment) -> bool {
        let Some((_, &seg)) = self.segment_index.range(..=segment.address).next_back() else {
            return false;
        };
        let live = self.segment(seg);
        if !live.expandable {
            return live.address == segment.address && live.size == segment.size;
        }
        let end = segment.address + segment.size;
        if end > live.address + live.size {
            return false;
        }
        let mut id = live.first;
        while id != NIL {
            let b = &self.blocks[id as usize];
            if b.address >= end {
                break;
            }
            if b.address + b.size > segment.address && b.state == BlockState::Unmapped {
                return false;
            }
            id = b.next;
        }
        true
    }

    /// Allocate the checkpoint's `block` again, out of the free block that holds its memory
    /// (every block is free now): what lies before and after it in that block stays free.
    fn carve_at(&mut self, block: &CheckpointBlock) -> Allocation {
        let mut id = self
            .find_block(block.address)
            .expect("checked: the memory is there");
        debug_assert_eq!(self.blocks[id as usize].state, BlockState::Free);
        self.remove_free(id);
        let start = self.blocks[id as usize].address;
        if start < block.address {
            let rest = self.split_off_rest(id, block.address - start);
            self.add_free(id);
            id = rest;
        }
        if self.blocks[id as usize].size > block.size {
            let rest = self.split_off_rest(id, block.size);
            self.add_free(rest);
        }
        self.hand_out(id, block.requested, block.tag)
    }
}
