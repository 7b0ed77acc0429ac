//! Fence batches: freed blocks waiting for a fence, closed behind one when needed, completed in
//! order, waited for by the ladder; the gate at the first stream and the barrier at a capture's
//! start. See [Note [Reuse fences]](super#note-reuse-fences).

use super::{Batch, Block, BlockId, FENCE_BATCH_BLOCKS, NO_STREAM, Pools};
use crate::config::ReusePolicy;
use crate::device::Device;
use crate::sizes;

impl<F: Clone> Pools<F> {
    /// Whether freed blocks wait behind fences now.
    pub fn is_fencing(&self) -> bool {
        self.fencing
    }

    /// Whether an open batch is big enough to be closed now ([`FENCE_BATCH_BLOCKS`]).
    #[inline]
    pub fn open_batch_full(&self) -> bool {
        self.open_batch.len() >= FENCE_BATCH_BLOCKS
            || self
                .open_cross
                .iter()
                .any(|(_, b)| b.len() >= FENCE_BATCH_BLOCKS)
    }

    /// Whether any freed block waits for a fence (open or closed batch).
    pub fn has_pending(&self) -> bool {
        !self.open_batch.is_empty()
            || !self.pending.is_empty()
            || !self.open_cross.is_empty()
            || !self.cross.is_empty()
    }

    /// Close every open batch behind a new fence (the cross-stream ones behind fences on their
    /// freeing streams). Returns whether a batch was closed.
    pub fn close_open_batches<D: Device<Fence = F>>(
        &mut self,
        device: &D,
    ) -> Result<bool, crate::DeviceError> {
        let cross = self.close_cross_batches(device)?;
        Ok(self.close_open_batch(device)? || cross)
    }

    /// Close the open batch behind a new fence. Returns whether a batch was closed.
    pub fn close_open_batch<D: Device<Fence = F>>(
        &mut self,
        device: &D,
    ) -> Result<bool, crate::DeviceError> {
        if self.open_batch.is_empty() {
            return Ok(false);
        }
        let blocks = std::mem::take(&mut self.open_batch);
        self.push_fenced(device, blocks, false)?;
        Ok(true)
    }

    /// Put `blocks` (possibly none) behind a new fence over every stream, at the back of the
    /// ordered queue. On failure the blocks go back to the open batch.
    fn push_fenced<D: Device<Fence = F>>(
        &mut self,
        device: &D,
        blocks: Vec<BlockId>,
        gate: bool,
    ) -> Result<(), crate::DeviceError> {
        match device.record_fence() {
            Ok(fence) => {
                self.pending.push_back(Batch {
                    fence,
                    blocks,
                    gate,
                });
                Ok(())
            }
            Err(e) => {
                self.open_batch.extend(blocks);
                Err(e)
            }
        }
    }

    /// Put every block freed from now on behind a fence recorded after all work enqueued so
    /// far: close the open batch, or if it is empty, close an empty batch behind a new fence
    /// (batches complete in order, so every later batch completes after it). Nothing to do
    /// unless frees are fenced. The shim calls this when a stream begins capturing a graph:
    /// later fences leave the capturing stream out, and this one covers its earlier work.
    pub fn close_batch_as_barrier<D: Device<Fence = F>>(
        &mut self,
        device: &D,
    ) -> Result<(), crate::DeviceError> {
        if !self.fencing || self.close_open_batch(device)? {
            return Ok(());
        }
        self.push_fenced(device, Vec::new(), false)
    }

    /// Make the blocks of every completed batch reusable, oldest first, stopping at the first
    /// batch that has not completed. Each block that became free is reported in `completed` as
    /// `(address, size)` as the application knew it (before merging with its neighbours).
    pub fn process_completed<D: Device<Fence = F>>(
        &mut self,
        device: &D,
        completed: &mut Vec<(u64, u64)>,
    ) {
        while let Some(batch) = self.pending.front() {
            if !device.fence_completed(&batch.fence) {
                break;
            }
            let batch = self.pending.pop_front().expect("front exists");
            for id in batch.blocks {
                let b = &self.blocks[id as usize];
                completed.push((b.address, b.size));
                self.release_to_free_list(id);
            }
            if batch.gate {
                self.gated = false;
            }
            device.release_fence(batch.fence);
        }
        self.process_completed_cross(device, completed);
    }

    /// The fence a freed block at `address` waits behind, if it is in a closed batch; closes
    /// the open batch first if the block is still in it. For `cachealloc simulate`, which
    /// completes exactly the fences a recorded run saw complete.
    pub fn fence_of_pending<D: Device<Fence = F>>(
        &mut self,
        device: &D,
        address: u64,
    ) -> Result<Option<F>, crate::DeviceError> {
        let at = |blocks: &[Block], id: &BlockId| blocks[*id as usize].address == address;
        if self.open_batch.iter().any(|id| at(&self.blocks, id)) {
            self.close_open_batch(device)?;
        }
        if self
            .open_cross
            .iter()
            .any(|(_, b)| b.iter().any(|id| at(&self.blocks, id)))
        {
            self.close_cross_batches(device)?;
        }
        Ok(self
            .pending
            .iter()
            .chain(self.cross.iter())
            .find(|b| {
                b.blocks
                    .iter()
                    .any(|id| self.blocks[*id as usize].address == address)
            })
            .map(|b| b.fence.clone()))
    }

    /// Whether waiting for pending batches could serve a rounded request: the pending blocks of
    /// its pool plus its free bytes add up to the request. (A cheap necessary condition; it
    /// keeps a big request from stalling behind many small pending frees.)
    pub fn pending_could_serve(&mut self, rounded: u64, stream: u64) -> bool {
        self.settle();
        let pool = sizes::pool_for(rounded);
        let pending: u64 = self
            .pending
            .iter()
            .flat_map(|b| b.blocks.iter())
            .map(|&id| &self.blocks[id as usize])
            .filter(|b| b.pool == pool && b.stream == stream)
            .map(|b| b.size)
            .sum();
        let free: u64 = self
            .lists(stream)
            .map_or(0, |l| l.list(pool).iter().map(|(size, _, _)| size).sum());
        (self.gated && stream == NO_STREAM) || pending + free >= rounded
    }

    /// The fence of the oldest pending batch, to wait for outside the lock.
    pub fn oldest_pending_fence(&self) -> Option<F> {
        self.pending.front().map(|b| b.fence.clone())
    }

    /// Switch from immediate to fenced reuse (under [`ReusePolicy::Auto`], at the first stream
    /// creation): the free lists stay closed until a gate fence recorded now completes.
    pub fn start_fencing<D: Device<Fence = F>>(
        &mut self,
        device: &D,
    ) -> Result<(), crate::DeviceError> {
        if self.fencing || self.reuse == ReusePolicy::Immediate {
            return Ok(());
        }
        self.fencing = true;
        self.settle();
        let unordered = &self.free[0];
        if unordered.small.is_empty() && unordered.large.is_empty() {
            return Ok(());
        }
        self.push_fenced(device, Vec::new(), true)?;
        self.gated = true;
        Ok(())
    }
}
