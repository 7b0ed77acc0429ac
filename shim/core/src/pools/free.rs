//! Freeing blocks and keeping the free lists: the application's free (at once, or into a fence
//! batch), merging with free neighbours, and the per-stream free lists with the unlisted rest
//! (see [Note [The unlisted rest]](super#note-the-unlisted-rest)).

use super::free_list::FreeList;
use super::{BlockId, BlockState, FreeError, Freed, NIL, Pools, StreamFreeLists};
use crate::NO_STREAM;
use crate::config::ReusePolicy;
use crate::sizes::{self, PoolKind};

impl<F: Clone> Pools<F> {
    /// The application frees `address`, synchronously ([`NO_STREAM`]) or ordered on `stream`.
    /// The block is free at once when no fence is needed (see
    /// [Note [Stream-ordered reuse]](super#note-stream-ordered-reuse)); otherwise it waits in
    /// the open batch.
    pub fn free(&mut self, address: u64, stream: u64) -> Result<Freed, FreeError> {
        let id = self.take_allocated(address)?;
        let b = &self.blocks[id as usize];
        let (size, requested) = (b.size, b.requested);
        let pending = self.retire(id, stream);
        Ok(Freed {
            address,
            size,
            requested,
            pending,
            stream,
        })
    }

    /// The allocated block at `address`, no longer counted as allocated (it stays active until
    /// it is free: PyTorch's `free_requested`).
    pub(super) fn take_allocated(&mut self, address: u64) -> Result<BlockId, FreeError> {
        let Some(id) = self.active.remove(&address) else {
            return Err(self.explain_bad_free(address));
        };
        let b = &self.blocks[id as usize];
        let (at, size) = (b.stat_at(), b.size);
        self.stats.allocation.decrease(at, 1);
        self.stats.allocated_bytes.decrease(at, size);
        if sizes::is_oversize(size, self.max_split_size) {
            self.stats.oversize_allocations.decrease(1);
        }
        Ok(id)
    }

    /// A block the application freed on `stream` ([`NO_STREAM`]: synchronously) goes where the
    /// free sends it: to its free list at once when no fence is needed (see
    /// [Note [Stream-ordered reuse]](super#note-stream-ordered-reuse)), otherwise into the open
    /// batch. Returns whether it waits for a fence.
    pub(super) fn retire(&mut self, id: BlockId, stream: u64) -> bool {
        let own = self.blocks[id as usize].stream;
        let auto_streams =
            self.reuse == ReusePolicy::Auto && stream != NO_STREAM && own != NO_STREAM;
        let stream_ordered = auto_streams && stream == own;
        let cross_stream = auto_streams && stream != own;
        let pending = self.fencing && !stream_ordered;
        if pending {
            self.blocks[id as usize].state = BlockState::PendingFree;
            if cross_stream {
                self.open_cross_batch(stream).push(id);
            } else {
                self.open_batch.push(id);
            }
        } else {
            self.release_to_free_list(id);
        }
        pending
    }

    pub(super) fn explain_bad_free(&self, address: u64) -> FreeError {
        match self.find_block(address) {
            None => FreeError::NotOurs(address),
            Some(id) if self.blocks[id as usize].state == BlockState::Unmapped => {
                FreeError::NotOurs(address)
            }
            Some(id) => {
                let b = &self.blocks[id as usize];
                if b.address == address {
                    FreeError::DoubleFree {
                        address,
                        size: b.size,
                        state: b.state,
                    }
                } else {
                    FreeError::InteriorPointer {
                        address,
                        block: b.address,
                        size: b.size,
                        offset: address - b.address,
                    }
                }
            }
        }
    }

    /// A pending or active block becomes free: it merges with free neighbours and joins its free
    /// list (PyTorch's `free_block`).
    pub(super) fn release_to_free_list(&mut self, id: BlockId) {
        let (at, size, requested) = {
            let b = &self.blocks[id as usize];
            (b.stat_at(), b.size, b.requested)
        };
        self.stats.active.decrease(at, 1);
        self.stats.active_bytes.decrease(at, size);
        self.stats.requested_bytes.decrease(at, requested);
        let prev = self.blocks[id as usize].prev;
        if prev != NIL && self.blocks[prev as usize].state == BlockState::Free {
            self.merge_into(id, prev);
        }
        let next = self.blocks[id as usize].next;
        if next != NIL && self.blocks[next as usize].state == BlockState::Free {
            self.merge_into(id, next);
        }
        let b = &mut self.blocks[id as usize];
        b.state = BlockState::Free;
        b.requested = 0;
        b.tag = 0;
        b.free_since = self.lookups;
        self.add_free(id);
    }

    /// Absorb the free neighbour `other` into `id`.
    pub(super) fn merge_into(&mut self, id: BlockId, other: BlockId) {
        self.remove_free(other);
        self.absorb(id, other);
    }

    /// Absorb the neighbour `other` (already out of every list) into `id`.
    pub(super) fn absorb(&mut self, id: BlockId, other: BlockId) {
        let o = self.blocks[other as usize].clone();
        let b = &mut self.blocks[id as usize];
        if o.next == id {
            b.address = o.address;
            b.prev = o.prev;
            if o.prev != NIL {
                self.blocks[o.prev as usize].next = id;
            } else {
                let segment = self.blocks[id as usize].segment;
                self.segment_mut(segment).first = id;
            }
        } else {
            b.next = o.next;
            if o.next != NIL {
                self.blocks[o.next as usize].prev = id;
            }
        }
        self.blocks[id as usize].size += o.size;
        self.spare_blocks.push(other);
    }

    /// The free lists of `stream`, if it has any.
    #[inline]
    pub(super) fn lists(&self, stream: u64) -> Option<&StreamFreeLists> {
        self.free.iter().find(|l| l.stream == stream)
    }

    /// The free list of `pool` on `stream`, created at the stream's first free block.
    #[inline]
    pub(super) fn free_list_mut(&mut self, stream: u64, pool: PoolKind) -> &mut FreeList {
        let at = match self.free.iter().position(|l| l.stream == stream) {
            Some(at) => at,
            None => {
                self.free.push(StreamFreeLists::new(stream));
                self.free.len() - 1
            }
        };
        self.free[at].list_mut(pool)
    }

    /// A block became free: count it and put it into its free list.
    pub(super) fn add_free(&mut self, id: BlockId) {
        self.count_free(id, true);
        self.list(id);
    }

    /// A free block stops being free (allocated, merged away or released): take it out of its
    /// free list (or the unlisted-rest slot) and uncount it.
    pub(super) fn remove_free(&mut self, id: BlockId) {
        if self.unlisted_rest == id {
            self.unlisted_rest = NIL;
        } else {
            let b = &self.blocks[id as usize];
            let (pool, size, address, stream) = (b.pool, b.size, b.address, b.stream);
            let removed = self.free_list_mut(stream, pool).remove(size, address);
            debug_assert_eq!(removed, Some(id));
        }
        self.count_free(id, false);
    }

    /// Put the unlisted rest, if any, into its free list.
    #[inline]
    pub(super) fn settle(&mut self) {
        if self.unlisted_rest != NIL {
            let id = std::mem::replace(&mut self.unlisted_rest, NIL);
            self.list(id);
        }
    }

    pub(super) fn list(&mut self, id: BlockId) {
        let b = &self.blocks[id as usize];
        let (pool, size, address, stream) = (b.pool, b.size, b.address, b.stream);
        self.free_list_mut(stream, pool).insert(size, address, id);
    }

    /// Count a free block in (or out of) `inactive_split` if its segment is split. (A free
    /// block's split-ness cannot change while it stays free: neighbours change only by splitting
    /// or merging, which take it out first.)
    pub(super) fn count_free(&mut self, id: BlockId, added: bool) {
        let b = &self.blocks[id as usize];
        if b.is_split() {
            let (at, size) = (b.stat_at(), b.size);
            if added {
                self.stats.inactive_split.increase(at, 1);
                self.stats.inactive_split_bytes.increase(at, size);
            } else {
                self.stats.inactive_split.decrease(at, 1);
                self.stats.inactive_split_bytes.decrease(at, size);
            }
        }
    }
}
