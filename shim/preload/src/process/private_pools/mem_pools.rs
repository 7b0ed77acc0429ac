//! PyTorch's `MemPool`s as private pools: pools a program makes, routes its thread's
//! allocations to, and deletes.
//!
//! # Note [PyTorch MemPools]
//!
//! `torch.cuda.MemPool()` names a private pool (Note [Private pools]); `use_mem_pool(pool)`
//! sends the calling thread's allocations on the pool's device to it until the context ends;
//! a graph captured with `pool=mempool.id` allocates from it too. PyTorch's `cudaMallocAsync`
//! backend has none of this, so the Python integration replaces `torch._C._MemPool` and the
//! routing entry points with calls into the C API (`cachealloc_mem_pool_*`), and the library
//! serves them with PyTorch's semantics:
//!
//! * **References.** A pool's `use_count` is its references: one for the `MemPool` object
//!   ([`Shim::mem_pool_retain`], PyTorch's `createOrIncrefPool`) and one per `use_mem_pool`
//!   under way ([`Shim::mem_pool_begin_thread`] adds one, the integration's
//!   `_cuda_releasePool` takes it back: [`Shim::mem_pool_release`]). With no reference and no
//!   graph left, the pool's memory goes as Note [Private pools] says: tensors that outlive
//!   their `MemPool` keep their blocks until freed.
//! * **Routing.** Each thread has a stack of the pools it allocates to, innermost last
//!   (`use_mem_pool` contexts nest); a stream-ordered allocation on a device (PyTorch's are all
//!   stream-ordered) goes to the innermost pool of that device on the stack, whatever its
//!   stream. Allocations of the synchronous API (`cudaMalloc`: cuBLAS's, cuDNN's and NCCL's own
//!   buffers) are not routed, as PyTorch's pools never see them natively (cuBLAS's handle
//!   buffers in a graph pool made CUDA graph trees see live blocks that no tensor holds).
//!   Other threads (the autograd engine's among them) are not routed, as with PyTorch. A
//!   capturing stream's capture pool comes first.
//! * **The program's allocator.** `MemPool(allocator)`: the pool's segments come from the
//!   `CUDAPluggableAllocator`'s functions ([`ForeignAllocator`](crate::backend::ForeignAllocator)),
//!   which may call CUDA themselves: their calls pass through to CUDA.
//! * **`use_on_oom`.** When the device's ordinary pool is out of memory, an allocation may take
//!   a cached free block of a live `use_on_oom` pool of the device (never one of a deleted
//!   pool); it then belongs to that pool.
//! * **`no_split`.** Blocks are never split: each allocation has its cached block or a segment
//!   to itself.
//! * **Snapshots.** `pool.snapshot()` and `memory_snapshot(pool.id)` read the pool's segments
//!   now, from its allocator ([`Shim::mem_pool_snapshot_json`]).

use std::cell::RefCell;
use std::sync::Arc;

use super::{PoolKey, PoolSettings, PrivatePool, Shim};
use crate::cuda::{self, CudaError};

thread_local! {
    /// The pools the calling thread allocates to, innermost last.
    static ALLOCATING_TO: RefCell<Vec<PoolKey>> = const { RefCell::new(Vec::new()) };
}

impl Shim {
    /// Make the pool `key` with `settings` if it does not exist, and add a reference to it
    /// (PyTorch's `createOrIncrefPool`). Returns its use count.
    pub fn mem_pool_retain(
        &self,
        key: PoolKey,
        settings: PoolSettings,
    ) -> Result<usize, CudaError> {
        let mut book = self.private_book();
        self.private_pool(&mut book, key, settings)
            .ok_or(cuda::ERROR_INITIALIZATION)?;
        let users = book.users(key);
        users.refs += 1;
        Ok(users.refs)
    }

    /// Take a reference back (PyTorch's `releasePool`). Returns the use count left; at zero,
    /// with no graph left either, the pool's memory goes (Note [Private pools]).
    pub fn mem_pool_release(&self, key: PoolKey) -> usize {
        let mut book = self.private_book();
        let Some(users) = book.users.get_mut(&key) else {
            return 0;
        };
        users.refs = users.refs.saturating_sub(1);
        let left = users.refs;
        if left == 0
            && let Some(pool) = self.find_private_pool(key)
        {
            self.release_if_unused(&mut book, &pool);
        }
        left
    }

    /// The pool's use count (its references).
    pub fn mem_pool_use_count(&self, key: PoolKey) -> usize {
        self.private_book().users.get(&key).map_or(0, |u| u.refs)
    }

    /// The calling thread allocates to the pool `key` on its device until
    /// [`Shim::mem_pool_end_thread`] (PyTorch's `beginAllocateCurrentThreadToPool`, which
    /// adds a reference too).
    pub fn mem_pool_begin_thread(&self, key: PoolKey) -> Result<(), CudaError> {
        self.mem_pool_retain(key, PoolSettings::default())?;
        crate::rare::note(crate::rare::MEM_POOL);
        let _ = ALLOCATING_TO.try_with(|stack| stack.borrow_mut().push(key));
        Ok(())
    }

    /// The calling thread stops allocating to `key` (its innermost entry; PyTorch's
    /// `endAllocateToPool`). The reference goes with [`Shim::mem_pool_release`].
    pub fn mem_pool_end_thread(&self, key: PoolKey) {
        let _ = ALLOCATING_TO.try_with(|stack| {
            let mut stack = stack.borrow_mut();
            if let Some(at) = stack.iter().rposition(|&k| k == key) {
                stack.remove(at);
            }
        });
    }

    /// The pool the calling thread allocates to on `device`, if any.
    #[inline]
    fn thread_mem_pool(&self, device: i32) -> Option<Arc<PrivatePool>> {
        // Until a thread has allocated to a MemPool, no allocation reads [`ALLOCATING_TO`]
        // (Note [Rare conditions in one word]).
        if !crate::rare::any(crate::rare::MEM_POOL) {
            return None;
        }
        self.find_private_pool(thread_pool_key(device)?)
    }

    /// Serve an allocation from the pool the calling thread allocates to on `device`; `None`
    /// when it allocates to none.
    pub(in crate::process) fn thread_pool_malloc(
        &self,
        device: i32,
        size: u64,
        stream: u64,
    ) -> Option<Result<u64, CudaError>> {
        let pool = self.thread_mem_pool(device)?;
        let served = self.serve(&pool.alloc, device, size, stream);
        Some(self.after_releasing_unused(served, &pool.alloc, device, size, stream))
    }

    /// After `device`'s ordinary pool ran out of memory: a cached block of a live `use_on_oom`
    /// pool of the device, if one fits.
    pub(in crate::process) fn oom_fallback(
        &self,
        device: i32,
        size: u64,
        stream: u64,
    ) -> Option<u64> {
        if !self
            .private_pools
            .any
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return None;
        }
        let candidates: Vec<Arc<PrivatePool>> = {
            let book = self.private_book();
            let pools = self.private_pools.pools.read();
            let pools = pools.unwrap_or_else(|p| p.into_inner());
            pools
                .iter()
                .filter(|p| p.use_on_oom && p.device == device && !book.unused(p.key()))
                .cloned()
                .collect()
        };
        let tag = u64::from(self.capture_stack());
        candidates
            .iter()
            .find_map(|p| p.alloc.malloc_from_cache(size, stream, tag))
            .map(|a| a.address)
    }

    /// The segments of the pool `key` now, as the JSON list of PyTorch's snapshot `segments`
    /// (`pool_snapshot`); `[]` for no such pool.
    pub fn mem_pool_snapshot_json(&self, key: PoolKey) -> String {
        if self.find_private_pool(key).is_none() {
            return "[]".to_string();
        }
        self.pool_segments_json(key.1, Some(key.0))
    }
}

/// The innermost pool the calling thread allocates to on `device`; never inlined (Note [Rare
/// conditions in one word]).
#[inline(never)]
fn thread_pool_key(device: i32) -> Option<PoolKey> {
    ALLOCATING_TO
        .try_with(|stack| {
            let stack = stack.borrow();
            stack.iter().rev().find(|k| k.1 == device).copied()
        })
        .ok()
        .flatten()
}
