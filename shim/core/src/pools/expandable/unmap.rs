//! Giving memory of expandable segments back: taking whole mappings out of free blocks (for
//! `empty_cache`, the out-of-memory ladder, or recycling), and what happens when the driver
//! has unmapped them or refused to. See [Note [Expandable segments]](super#note-expandable-segments).

use super::{MapPlan, Mapping, Pools, Unmapping};
use crate::device::Device;
use crate::pools::{Block, BlockId, BlockState, NIL, SegmentId};
use crate::sizes::PoolKind;
use crate::stats::StatAt;

impl<F: Clone> Pools<F> {
    /// Take the mappings that lie wholly inside free blocks of the expandable segments of
    /// `pools` out of the pools, for unmapping. What shares a mapping with a live block stays.
    pub fn take_unmappable(&mut self, pools: &[PoolKind]) -> Vec<Unmapping> {
        let ranges: Vec<SegmentId> = (self.ranges.iter())
            .filter(|&&(_, pool, _)| pools.contains(&pool))
            .map(|&(_, _, segment)| segment)
            .collect();
        let taken = self.take_free_mappings(&ranges, NIL, u64::MAX);
        self.with_aliases(taken)
    }

    /// Take the expandable segments with nothing mapped, and nothing being mapped, out of the
    /// pools, for their address space to be freed ([`Device::free_range`]): a private pool
    /// emptied for good (Note [Kept maps]). Returns their (address, size).
    pub fn take_empty_ranges<D: Device<Fence = F>>(&mut self, device: &D) -> Vec<(u64, u64)> {
        let mut empty = Vec::new();
        let ranges = std::mem::take(&mut self.ranges);
        for (stream, pool, segment) in ranges {
            let first = self.segment(segment).first;
            let b = &self.blocks[first as usize];
            if b.next != NIL || b.state != BlockState::Unmapped || b.busy {
                self.ranges.push((stream, pool, segment));
                continue;
            }
            let seg = (self.segments[segment as usize].take()).expect("a live range");
            self.spare_segments.push(segment);
            self.spare_blocks.push(first);
            self.segment_index.remove(&seg.address);
            if let Some(fence) = self.forget_idle(segment) {
                device.release_fence(fence);
            }
            empty.push((seg.address, seg.size));
        }
        empty
    }

    /// Take at least `budget` bytes (when there are) of mappings wholly inside free blocks of
    /// the range `planned` memory is in out of the pools for unmapping: from the blocks that
    /// have been free the longest, their last mappings first — never from the free block the
    /// new memory is to join. Mapping `planned` then leaves reserved memory where it was; see
    /// [Note [Expandable segments]](self#note-expandable-segments).
    pub fn take_to_recycle(&mut self, planned: &MapPlan, budget: u64) -> Vec<Unmapping> {
        let b = &self.blocks[planned.block as usize];
        let (segment, joined) = (b.segment, b.prev);
        self.take_free_mappings(&[segment], joined, budget)
    }

    fn take_free_mappings(
        &mut self,
        ranges: &[SegmentId],
        except: BlockId,
        budget: u64,
    ) -> Vec<Unmapping> {
        self.settle();
        // Per free block: its age, id, and the mappings wholly inside it (they are contiguous:
        // a free block is mapped throughout). The free blocks are found in the range's free
        // list, not by walking the range: recycling looks at every map that passes the peak,
        // and a range may hold tens of thousands of live blocks (a model's tensors as it
        // loads: each allocation that grew the range walked all of them). In address order, as
        // a walk would find them.
        let mut found: Vec<(u64, BlockId, Vec<Mapping>)> = Vec::new();
        for &segment in ranges {
            let Some(&(stream, pool, _)) = self.ranges.iter().find(|r| r.2 == segment) else {
                continue;
            };
            let mut free: Vec<BlockId> = (self.lists(stream).into_iter())
                .flat_map(|lists| lists.list(pool).iter())
                .map(|(_, _, id)| id)
                .filter(|&id| id != except && self.blocks[id as usize].segment == segment)
                .collect();
            free.sort_unstable_by_key(|&id| self.blocks[id as usize].address);
            for id in free {
                let b = &self.blocks[id as usize];
                debug_assert_eq!(b.state, BlockState::Free);
                let end = b.address + b.size;
                let inside: Vec<(u64, u64)> = (self.mappings.range(b.address..end))
                    .map(|(&address, &size)| (address, size))
                    .take_while(|&(address, size)| address + size <= end)
                    .collect();
                if !inside.is_empty() {
                    found.push((b.free_since, id, inside));
                }
            }
        }
        if budget != u64::MAX {
            found.sort_unstable_by_key(|&(age, id, _)| (age, id));
        }
        let mut left = budget;
        let mut taken = Vec::new();
        for (_, id, mut inside) in found {
            if left == 0 {
                break;
            }
            // The last mappings of the block, as many as the budget needs.
            let mut keep = inside.len();
            while keep > 0 && left > 0 {
                keep -= 1;
                left = left.saturating_sub(inside[keep].1);
            }
            let inside = inside.split_off(keep);
            taken.extend(self.take_mappings(id, &inside));
        }
        taken
    }

    /// The memory of `unmapping` is unmapped: it is address space again.
    pub fn unmap_done(&mut self, unmapping: Unmapping) {
        if unmapping.is_parked_place() {
            self.release_place(unmapping.block);
            return;
        }
        for alias in &unmapping.aliases {
            self.release_place(alias.block);
        }
        self.stats.num_device_free += 1;
        self.mappings.remove(&unmapping.address);
        self.make_unmapped(unmapping.block);
    }

    /// Unmapping failed: the memory is still there, free again, and still mapped at those of
    /// its parked places from `aliases_left` on (a parked place stays parked).
    pub fn unmap_failed_after(&mut self, unmapping: Unmapping, aliases_left: usize) {
        if unmapping.is_parked_place() {
            self.restore_parked(&unmapping);
            self.release_place(unmapping.block);
            return;
        }
        let left = aliases_left.min(unmapping.aliases.len());
        for (i, alias) in unmapping.aliases.iter().enumerate() {
            if i >= left {
                self.restore_alias(alias, &unmapping);
            }
            self.release_place(alias.block);
        }
        self.unmap_failed(unmapping);
    }

    /// Unmapping failed: the memory is still there, free again.
    pub fn unmap_failed(&mut self, unmapping: Unmapping) {
        let now = self.lookups;
        self.back_to_free(unmapping, now);
    }

    /// Memory taken for unmapping is not unmapped after all: it goes back to the pools as it
    /// was (free since the same moment), its parked places parked again.
    pub(in crate::pools) fn keep_mapped(&mut self, unmapping: Unmapping) {
        for alias in &unmapping.aliases {
            self.restore_alias(alias, &unmapping);
            self.release_place(alias.block);
        }
        let since = unmapping.free_since;
        self.back_to_free(unmapping, since);
    }

    /// The memory of `unmapping` is free again in its pool, freed at the stamp `since`.
    fn back_to_free(&mut self, unmapping: Unmapping, since: u64) {
        let at = StatAt::new(unmapping.pool, self.blocks[unmapping.block as usize].stream);
        self.stats.reserved_bytes.increase(at, unmapping.size);
        let b = &mut self.blocks[unmapping.block as usize];
        b.busy = false;
        b.state = BlockState::Free;
        b.free_since = since;
        self.make_free(unmapping.block);
    }

    /// Take the contiguous `mappings` (wholly inside the free block `id`) out of it as busy
    /// unmapped blocks, one per mapping; the block's ends stay free.
    fn take_mappings(&mut self, id: BlockId, mappings: &[(u64, u64)]) -> Vec<Unmapping> {
        let (Some(&(low, _)), Some(&(last, last_size))) = (mappings.first(), mappings.last())
        else {
            return Vec::new();
        };
        let (range, free_since) = {
            let b = &self.blocks[id as usize];
            (b.segment, b.free_since)
        };
        let mut block = self.take_range(id, low, last + last_size);
        let pool = self.blocks[block as usize].pool;
        let mut out = Vec::with_capacity(mappings.len());
        for (i, &(address, size)) in mappings.iter().enumerate() {
            // Every mapping but the last is split off the front of what is left.
            let next = if i + 1 < mappings.len() {
                let b = &self.blocks[block as usize];
                let rest = Block {
                    address: address + size,
                    size: b.address + b.size - address - size,
                    prev: block,
                    ..b.clone()
                };
                let rest = self.new_block(rest);
                self.link_after(block, rest);
                self.blocks[block as usize].size = size;
                rest
            } else {
                NIL
            };
            out.push(Unmapping {
                address,
                size,
                pool,
                block,
                range,
                free_since,
                parked: false,
                holder: 0,
                aliases: Vec::new(),
            });
            block = next;
        }
        out
    }

    /// Split `[low, high)` out of the free block `id` as a busy unmapped block (returned); the
    /// ends stay free.
    pub(in crate::pools) fn take_range(&mut self, id: BlockId, low: u64, high: u64) -> BlockId {
        self.remove_free(id);
        let b = self.blocks[id as usize].clone();
        if low > b.address {
            let head = self.new_block(Block {
                size: low - b.address,
                next: id,
                ..b.clone()
            });
            self.link_before(id, head);
            self.add_free(head);
        }
        if high < b.address + b.size {
            let tail = self.new_block(Block {
                address: high,
                size: b.address + b.size - high,
                prev: id,
                ..b.clone()
            });
            self.link_after(id, tail);
            self.add_free(tail);
        }
        let b = &mut self.blocks[id as usize];
        b.address = low;
        b.size = high - low;
        b.state = BlockState::Unmapped;
        b.busy = true;
        let at = b.stat_at();
        self.stats.reserved_bytes.decrease(at, high - low);
        id
    }
}
