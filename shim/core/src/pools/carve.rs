//! Handing out a free block: cutting it to the request (the rest stays free, unlisted; see
//! [Note [The unlisted rest]](super#note-the-unlisted-rest)) and counting it allocated. Shared by
//! the allocation path and by putting a pool back to a checkpoint (`checkpoint`).

use super::{Allocation, Block, BlockId, BlockState, NIL, Pools};
use crate::sizes;
use crate::stats::StatAt;

impl<F: Clone> Pools<F> {
    /// Hand out the (unlisted, free) block `id` for a request, splitting off the rest if the
    /// split rules say so.
    pub(super) fn carve(
        &mut self,
        id: BlockId,
        rounded: u64,
        requested: u64,
        tag: u64,
    ) -> Allocation {
        let (pool, size) = {
            let b = &self.blocks[id as usize];
            (b.pool, b.size)
        };
        let split = if self.in_range(id) {
            size - rounded >= sizes::MIN_BLOCK_SIZE
        } else {
            sizes::should_split(pool, size, rounded, self.max_split_size)
        };
        if split {
            let rest_id = self.split_off_rest(id, rounded);
            self.settle();
            self.count_free(rest_id, true);
            self.unlisted_rest = rest_id;
        }
        self.hand_out(id, requested, tag)
    }

    /// Cut the free block `id` (out of every list) to `size` bytes; the rest becomes a new free
    /// block after it, out of every list and uncounted (the caller lists it, or splits it
    /// further). Returns the rest.
    pub(super) fn split_off_rest(&mut self, id: BlockId, size: u64) -> BlockId {
        let b = &self.blocks[id as usize];
        let rest = Block {
            address: b.address + size,
            size: b.size - size,
            requested: 0,
            segment: b.segment,
            prev: id,
            next: b.next,
            state: BlockState::Free,
            pool: b.pool,
            free_since: b.free_since,
            tag: 0,
            stream: b.stream,
            serial: 0,
            busy: false,
        };
        let rest_id = self.new_block(rest);
        let old_next = self.blocks[id as usize].next;
        if old_next != NIL {
            self.blocks[old_next as usize].prev = rest_id;
        }
        let b = &mut self.blocks[id as usize];
        b.next = rest_id;
        b.size = size;
        rest_id
    }

    /// Hand out the free block `id` (out of every list) whole.
    pub(super) fn hand_out(&mut self, id: BlockId, requested: u64, tag: u64) -> Allocation {
        self.allocations_handed_out += 1;
        let b = &mut self.blocks[id as usize];
        b.state = BlockState::Active;
        b.requested = requested;
        b.tag = tag;
        b.serial = self.allocations_handed_out;
        let (address, size, segment, stream, pool) =
            (b.address, b.size, b.segment, b.stream, b.pool);
        self.active.insert(address, id);
        let at = StatAt::new(pool, stream);
        let s = &mut self.stats;
        s.allocation.increase(at, 1);
        s.allocated_bytes.increase(at, size);
        s.active.increase(at, 1);
        s.active_bytes.increase(at, size);
        s.requested_bytes.increase(at, requested);
        if sizes::is_oversize(size, self.max_split_size) {
            s.oversize_allocations.increase(1);
        }
        Allocation {
            address,
            size,
            requested,
            segment_address: self.segment(segment).address,
            pool,
            tag,
            stream,
        }
    }
}
