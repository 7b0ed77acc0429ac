//! Blocks freed on another stream than their own: their batches, fences on the freeing stream,
//! completion in any order, and adoption by their own stream through a device-side wait. See
//! [Note [Stream-ordered reuse]](super#note-stream-ordered-reuse).

use super::{Batch, BlockId, BlockState, Pools};
use crate::device::{Device, DeviceError};

impl<F: Clone> Pools<F> {
    /// The open cross-stream batch of blocks freed on `stream`.
    pub(super) fn open_cross_batch(&mut self, stream: u64) -> &mut Vec<BlockId> {
        let at = match self.open_cross.iter().position(|(s, _)| *s == stream) {
            Some(at) => at,
            None => {
                self.open_cross.push((stream, Vec::new()));
                self.open_cross.len() - 1
            }
        };
        &mut self.open_cross[at].1
    }

    /// Close every open cross-stream batch behind a fence on its freeing stream. Returns
    /// whether one was closed.
    pub(super) fn close_cross_batches<D: Device<Fence = F>>(
        &mut self,
        device: &D,
    ) -> Result<bool, DeviceError> {
        let mut closed = false;
        while let Some((stream, blocks)) = self.open_cross.pop() {
            let fence = match device.record_stream_fence(stream) {
                Ok(fence) => fence,
                Err(e) => {
                    self.open_cross.push((stream, blocks));
                    return Err(e);
                }
            };
            self.cross.push(Batch {
                fence,
                blocks,
                gate: false,
            });
            closed = true;
        }
        Ok(closed)
    }

    /// `stream` is about to be destroyed: close the open batch of blocks freed on it behind a
    /// fence recorded on it now, while it exists. Later, another thread would record that fence
    /// on a dangling handle (regression: a segmentation fault inside `cuStreamQuery` on an
    /// H100, when one thread's allocation closed the batch of a stream another thread had just
    /// destroyed). If the driver refuses the stream's own fence, a fence on every stream (which
    /// includes `stream` until it is destroyed) stands in; if that fails too, the batch stays
    /// open and the error is returned.
    pub fn close_cross_batch_before_destroy<D: Device<Fence = F>>(
        &mut self,
        stream: u64,
        device: &D,
    ) -> Result<(), DeviceError> {
        let Some(at) = self.open_cross.iter().position(|(s, _)| *s == stream) else {
            return Ok(());
        };
        let fence = device
            .record_stream_fence(stream)
            .or_else(|_| device.record_fence())?;
        let (_, blocks) = self.open_cross.swap_remove(at);
        self.cross.push(Batch {
            fence,
            blocks,
            gate: false,
        });
        Ok(())
    }

    /// Make the blocks of every completed cross-stream batch reusable, reporting each in
    /// `completed` as `(address, size)`.
    pub(super) fn process_completed_cross<D: Device<Fence = F>>(
        &mut self,
        device: &D,
        completed: &mut Vec<(u64, u64)>,
    ) {
        let mut i = 0;
        while i < self.cross.len() {
            if !device.fence_completed(&self.cross[i].fence) {
                i += 1;
                continue;
            }
            let batch = self.cross.swap_remove(i);
            for id in batch.blocks {
                self.release_pending(id, completed);
            }
            device.release_fence(batch.fence);
        }
    }

    /// Adopt for `stream` its blocks that were freed on other streams: close the open
    /// cross-stream batches, make `stream` wait on the device for each fence behind which one
    /// of its blocks waits, and free those blocks at once (reported in `completed`). Returns
    /// whether any block was adopted.
    pub fn adopt_cross_stream<D: Device<Fence = F>>(
        &mut self,
        stream: u64,
        device: &D,
        completed: &mut Vec<(u64, u64)>,
    ) -> Result<bool, DeviceError> {
        if self.open_cross.is_empty() && self.cross.is_empty() {
            return Ok(false);
        }
        self.close_cross_batches(device)?;
        let mut adopted = false;
        let mut i = 0;
        while i < self.cross.len() {
            let ours = |id: &BlockId| self.blocks[*id as usize].stream == stream;
            if !self.cross[i].blocks.iter().any(ours) {
                i += 1;
                continue;
            }
            device.stream_wait(stream, &self.cross[i].fence)?;
            let (mine, others): (Vec<BlockId>, Vec<BlockId>) =
                std::mem::take(&mut self.cross[i].blocks)
                    .into_iter()
                    .partition(|&id| self.blocks[id as usize].stream == stream);
            for id in mine {
                self.release_pending(id, completed);
            }
            adopted = true;
            if others.is_empty() {
                let batch = self.cross.swap_remove(i);
                device.release_fence(batch.fence);
            } else {
                self.cross[i].blocks = others;
                i += 1;
            }
        }
        Ok(adopted)
    }

    /// A fence of a cross-stream batch, to wait for outside the lock (`empty_cache`).
    pub fn any_cross_fence(&self) -> Option<F> {
        self.cross.first().map(|b| b.fence.clone())
    }

    /// A pending block becomes free, reported in `completed`.
    fn release_pending(&mut self, id: BlockId, completed: &mut Vec<(u64, u64)>) {
        let b = &self.blocks[id as usize];
        debug_assert_eq!(b.state, BlockState::PendingFree);
        completed.push((b.address, b.size));
        self.release_to_free_list(id);
    }
}
