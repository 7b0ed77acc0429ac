//! Checkpoints of graph pools for PyTorch's CUDA graph trees: the pool's layout after a
//! recording, and putting the pool back to it before the next recording (Note [Pool
//! checkpoints] in `cachealloc_core::pools::checkpoint`; Note [Graph trees under the shim] in
//! the Python integration's C++ allocator, `shim/python/cachealloc_torch_allocator.cpp`).

use cachealloc_core::{BlockState, Checkpoint, Restored};

use super::{PoolKey, Shim};
use crate::cuda::{self, CudaError};
use crate::log;

/// A private pool's checkpoint, with the pool it was taken of.
#[derive(Debug)]
pub struct PoolCheckpoint {
    /// The pool.
    pub key: PoolKey,
    /// Its layout.
    pub layout: Checkpoint,
}

impl Shim {
    /// The layout of the private pool `key` now (PyTorch's `getCheckpointState`); `None` for no
    /// such pool, or while one of its blocks waits for a fence.
    pub fn pool_checkpoint(&self, key: PoolKey) -> Option<PoolCheckpoint> {
        let pool = self.find_private_pool(key)?;
        let layout = pool.alloc.checkpoint()?;
        Some(PoolCheckpoint { key, layout })
    }

    /// Put the checkpoint's pool back to it (PyTorch's `setCheckpointPoolState`): every block
    /// it has allocated is freed, and the checkpoint's allocated blocks are allocated again.
    /// Frees that wait for recorded streams are settled first (Inductor synchronizes before
    /// it restores), and what `record_stream` recorded for the freed blocks is forgotten.
    pub fn pool_restore(&self, checkpoint: &PoolCheckpoint) -> Result<Restored, CudaError> {
        let Some(pool) = self.find_private_pool(checkpoint.key) else {
            return Err(cuda::ERROR_INVALID_VALUE);
        };
        self.free_recorded_when_done(true);
        let restored = pool.alloc.restore(&checkpoint.layout).map_err(|e| {
            log::error!("restoring a graph pool's checkpoint: {e}; nothing was changed");
            cuda::ERROR_INVALID_VALUE
        })?;
        for freed in &restored.freed {
            self.forget_recorded_uses(freed.address);
        }
        Ok(restored)
    }

    /// The addresses of the blocks the private pool `key` has allocated now (PyTorch's
    /// `checkPoolLiveAllocations` compares them with the tensors it expects); `None` for no
    /// such pool.
    pub fn pool_live_blocks(&self, key: PoolKey) -> Option<Vec<u64>> {
        let pool = self.find_private_pool(key)?;
        let live = pool
            .alloc
            .snapshot()
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.state == BlockState::Active)
            .map(|b| b.address)
            .collect();
        Some(live)
    }
}
