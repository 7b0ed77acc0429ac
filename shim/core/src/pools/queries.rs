//! What the pools can say without changing: reserved and cached bytes, the largest free block,
//! where an address lies ([`AddressInfo`]), and a snapshot of every segment with its blocks
//! ([`SegmentSnapshot`], PyTorch's snapshot `segments`).

use super::{BlockId, BlockState, NIL, Pools};
use crate::sizes::PoolKind;

/// Where an address lies in our memory (for IPC handles and error reports).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressInfo {
    /// The block containing the address.
    pub block_address: u64,
    /// Its size.
    pub block_size: u64,
    /// Its state.
    pub state: BlockState,
    /// The segment containing it.
    pub segment_address: u64,
    /// The segment's size.
    pub segment_size: u64,
    /// Which allocation of the pools an active block is (1, 2, …): tells two allocations at
    /// one address apart (0 for a free block).
    pub serial: u64,
    /// Whether the segment is expandable (mapped memory, which CUDA's legacy IPC cannot share).
    pub expandable: bool,
}

/// One block of a [`SegmentSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSnapshot {
    /// Address.
    pub address: u64,
    /// Size.
    pub size: u64,
    /// Requested size (0 for free blocks).
    pub requested_size: u64,
    /// State.
    pub state: BlockState,
    /// The caller's tag at allocation.
    pub tag: u64,
}

/// One segment with its blocks, in address order (PyTorch's snapshot `segments` entries).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentSnapshot {
    /// Address.
    pub address: u64,
    /// Size.
    pub total_size: u64,
    /// Pool.
    pub pool: PoolKind,
    /// Bytes of allocated blocks.
    pub allocated_size: u64,
    /// Bytes of allocated and pending-free blocks.
    pub active_size: u64,
    /// Requested bytes of allocated and pending-free blocks.
    pub requested_size: u64,
    /// The caller's tag when the segment was allocated.
    pub tag: u64,
    /// The stream the segment serves, or [`NO_STREAM`](crate::NO_STREAM).
    pub stream: u64,
    /// An expandable segment: `total_size` is its address range, and its
    /// [`BlockState::Unmapped`] blocks have no memory behind them.
    pub expandable: bool,
    /// The blocks, tiling the segment.
    pub blocks: Vec<BlockSnapshot>,
}

impl<F: Clone> Pools<F> {
    /// Bytes reserved from the device, including allocations in progress.
    pub fn reserved(&self) -> u64 {
        self.stats.reserved_bytes.all.current as u64 + self.growing
    }

    /// The reserved bytes that the memory limit counts against a request on `stream`, or
    /// `None` when the limit does not apply to it: a fraction from PyTorch's variable counts
    /// stream-ordered memory only, and never refuses a synchronous request
    /// ([`AllocatorConfig::fraction_counts_synchronous`](crate::AllocatorConfig::fraction_counts_synchronous)).
    /// Allocations in progress count whatever they are.
    pub fn limited_reserved(&self, stream: u64) -> Option<u64> {
        (self.limit_counts_synchronous || stream != crate::NO_STREAM)
            .then(|| self.counted_reserved())
    }

    /// The reserved bytes the memory limit counts (and the garbage collection threshold,
    /// measured against the limit).
    pub fn counted_reserved(&self) -> u64 {
        if self.limit_counts_synchronous {
            return self.reserved();
        }
        self.stats.reserved_bytes.stream_ordered()[0].current as u64 + self.growing
    }

    /// Count `size` bytes as being allocated on the device outside the lock.
    pub fn begin_growth(&mut self, size: u64) {
        self.growing += size;
    }

    /// The device allocation of `size` bytes started by [`Pools::begin_growth`] has ended.
    pub fn end_growth(&mut self, size: u64) {
        self.growing -= size;
    }

    /// Bytes in free lists (reusable now or after the gate).
    pub fn cached_free_bytes(&self) -> u64 {
        (self.stats.reserved_bytes.all.current - self.stats.active_bytes.all.current) as u64
    }

    /// The largest free block of either pool (0 when none).
    pub fn largest_free_block(&self) -> u64 {
        let rest = match self.unlisted_rest {
            NIL => 0,
            id => self.blocks[id as usize].size,
        };
        self.free
            .iter()
            .flat_map(|l| [l.small.largest(), l.large.largest()])
            .flatten()
            .fold(rest, u64::max)
    }

    /// Where `address` lies in our memory, if anywhere (an unmapped part of an expandable
    /// segment is nowhere).
    pub fn lookup(&self, address: u64) -> Option<AddressInfo> {
        let id = self.find_block(address)?;
        let b = &self.blocks[id as usize];
        if b.state == BlockState::Unmapped {
            return None;
        }
        let seg = self.segment(b.segment);
        Some(AddressInfo {
            block_address: b.address,
            block_size: b.size,
            state: b.state,
            segment_address: seg.address,
            segment_size: seg.size,
            serial: b.serial,
            expandable: seg.expandable,
        })
    }

    pub(super) fn find_block(&self, address: u64) -> Option<BlockId> {
        if let Some(&id) = self.active.get(&address) {
            return Some(id);
        }
        let (_, &segment) = self.segment_index.range(..=address).next_back()?;
        let seg = self.segment(segment);
        if address >= seg.address + seg.size {
            return None;
        }
        let mut id = seg.first;
        while id != NIL {
            let b = &self.blocks[id as usize];
            if address < b.address + b.size {
                return Some(id);
            }
            id = b.next;
        }
        None
    }

    /// Every segment with its blocks, in address order.
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        self.segment_index
            .values()
            .map(|&segment| {
                let seg = self.segment(segment);
                let mut snap = SegmentSnapshot {
                    address: seg.address,
                    total_size: seg.size,
                    pool: seg.pool,
                    allocated_size: 0,
                    active_size: 0,
                    requested_size: 0,
                    tag: seg.tag,
                    stream: seg.stream,
                    expandable: seg.expandable,
                    blocks: Vec::new(),
                };
                let mut id = seg.first;
                while id != NIL {
                    let b = &self.blocks[id as usize];
                    if b.state == BlockState::Active {
                        snap.allocated_size += b.size;
                    }
                    if matches!(b.state, BlockState::Active | BlockState::PendingFree) {
                        snap.active_size += b.size;
                        snap.requested_size += b.requested;
                    }
                    snap.blocks.push(BlockSnapshot {
                        address: b.address,
                        size: b.size,
                        requested_size: b.requested,
                        state: b.state,
                        tag: b.tag,
                    });
                    id = b.next;
                }
                snap
            })
            .collect()
    }
}
