//! Private pools: device memory that belongs to one user and is never handed to ordinary
//! allocations — CUDA graph captures ([`captures`], Note [Capture pools]) and PyTorch's
//! `MemPool`s ([`mem_pools`], Note [PyTorch MemPools]).
//!
//! # Note [Private pools]
//!
//! PyTorch's native allocator keeps graph pools and `MemPool`s as one kind, a *private pool*
//! named by a pool id, and so do we: a graph captured with `pool=mempool.id` allocates from
//! that `MemPool`, and graphs captured with the same `graph_pool_handle()` share one pool.
//!
//! * A [`PrivatePool`] is an [`Allocator`] of its own over segments of its own on one device
//!   (from the driver, or from the program's allocator for `MemPool(allocator)`).
//! * Its *users*: captures under way into it, graphs captured into it and executable graphs
//!   instantiated from those, and references (a `MemPool` object, each `use_mem_pool` context
//!   under way; PyTorch's `use_count`).
//! * The pool never releases a segment while it has a user: its device holds every release
//!   ([`CudaDevice::for_private_pool`]), so neither the out-of-memory ladder nor an
//!   `empty_cache` can give memory a graph writes back to the driver, and a `MemPool` keeps its
//!   memory until it is deleted (PyTorch: `empty_cache` does nothing to a live pool).
//! * When the last user of a `MemPool`'s pool goes, its free segments are released (PyTorch's
//!   `MemPool` destructor empties it); blocks the program still holds (tensors that outlive
//!   their `MemPool`) go back when freed, each segment as soon as it is free, and the pool is
//!   forgotten with its last segment.
//! * A pool made for graphs keeps its memory after its last graph is destroyed, until
//!   `empty_cache` or an allocation that runs out of memory releases its free segments, as
//!   PyTorch frees a released graph pool's segments only then. Releasing at once would be
//!   wrong: a later capture may use the pool's blocks that the program still holds (a graph's
//!   output that a new capture reads, or writes in place, after `graph.reset()`), and when the
//!   program frees them later their memory still belongs to that new graph. (`empty_cache`
//!   can free such memory under a live graph, natively as under the shim.)
//! * A free finds a private pool's block by the address span of the pool's memory, after the
//!   device pools (so ordinary frees never look here while no private pool exists).
//! * A pool is named by its id and its device: PyTorch's pool ids are small pairs packed into
//!   the low bits of a `u64` (the Python integration's `pool_key`); ours count down from the
//!   top, so the two never meet.

//!
//! # Note [Expandable private pools]
//!
//! PyTorch's private pools grow by expandable segments when the program asked for them
//! (`expandable_segments:True`), and ours do then too: a graph pool's memory is a run of
//! mapped memory per stream, as PyTorch's snapshots show it and its tests count it. The
//! shim's own default (`stream_ordered`: PyTorch's ordinary tensors in expandable segments)
//! is not a request PyTorch knows of, so private pools keep fixed segments under it, as
//! PyTorch's do by default; so do pools that never split (`MemPool(no_split=True)`) and pools
//! whose memory comes from the program's allocator. The program may switch at run time
//! (`_set_allocator_settings`), for private pools as for the ordinary ones.
//!
//! An expandable private pool *keeps its maps* (Note [Kept maps] in `cachealloc_core`): a
//! graph replays into blocks freed after its capture, so no memory is recycled, moved or
//! unmapped while the pool has a user, and maps come in PyTorch's pages. When the pool is
//! released its free memory is unmapped like any pool's, and once nothing is mapped its
//! address space is freed too (a pool per capture would otherwise leave a device-sized range
//! of address space behind each time).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use cachealloc_core::{Allocator, Expandable, FreeError, SegmentSnapshot, Stats};

use super::Shim;
use crate::backend::{CudaDevice, ForeignAllocator};
use crate::cuda::{self, CudaError};
use crate::log;
use crate::trace::DeviceObserver;

pub mod captures;
pub mod checkpoints;
pub mod mem_pools;

/// A private pool's name: its id and its device.
pub type PoolKey = (u64, i32);

/// One private pool.
#[derive(Debug)]
pub struct PrivatePool {
    /// The pool's id: the one the Python integration named, or one of ours.
    id: u64,
    device: i32,
    /// Whether allocations of the device's ordinary pool that run out of memory may take this
    /// pool's free blocks (`MemPool(use_on_oom=True)`).
    use_on_oom: bool,
    /// Made for graphs (not a `MemPool`): its memory is released only by `empty_cache` or an
    /// allocation out of memory, once it is not in use (see Note [Private pools]).
    for_graphs: bool,
    /// Fixed segments whatever the program asks (`no_split`, or memory from the program's
    /// allocator): Note [Expandable private pools].
    fixed_only: bool,
    alloc: Allocator<CudaDevice, DeviceObserver>,
}

impl PrivatePool {
    fn key(&self) -> PoolKey {
        (self.id, self.device)
    }
}

/// How a new private pool is made.
#[derive(Clone, Copy, Debug, Default)]
pub struct PoolSettings {
    /// Whether allocations of the device's ordinary pool that run out of memory may take this
    /// pool's free blocks (`MemPool(use_on_oom=True)`).
    pub use_on_oom: bool,
    /// Never split a block: each allocation has a segment (or a cached block) to itself
    /// (`MemPool(no_split=True)`).
    pub no_split: bool,
    /// Where segments come from, when not from the driver.
    pub foreign: Option<ForeignAllocator>,
    /// Made by a capture, not by a `MemPool`: kept until `empty_cache` or an allocation out of
    /// memory once unused (Note [Private pools]).
    pub for_graphs: bool,
}

/// Who uses a pool (see Note [Private pools]).
#[derive(Debug, Default)]
struct Users {
    /// Captures under way into it.
    captures: usize,
    /// Graphs (`cudaGraph_t`) its captures made, not yet destroyed.
    graphs: usize,
    /// Executable graphs instantiated from them, not yet destroyed.
    execs: usize,
    /// References of `MemPool`s and of threads allocating to it.
    refs: usize,
    /// The program's own count of the graphs holding it, where the program keeps one
    /// (PyTorch's `CUDAGraph`): then that count, not the graph objects, says when the graphs
    /// let go (Note [The program's graph references] in `private_pools::captures`).
    program_graphs: Option<usize>,
}

impl Users {
    fn none(&self) -> bool {
        let graphs = self.program_graphs.unwrap_or(self.graphs);
        self.captures == 0 && graphs == 0 && self.execs == 0 && self.refs == 0
    }
}

/// The book of private pools, owned by the [`Shim`].
#[derive(Debug, Default)]
pub struct PrivatePools {
    /// Whether any pool exists: frees of other memory skip the book while none does.
    any: AtomicBool,
    /// Every pool, in use or released with blocks still allocated.
    pools: RwLock<Vec<Arc<PrivatePool>>>,
    book: Mutex<Book>,
}

#[derive(Debug, Default)]
struct Book {
    /// The pool of each stream capturing now, those that joined a capture too.
    capturing: HashMap<usize, Arc<PrivatePool>>,
    /// The stream each capture under way began on, by the driver's capture id.
    capture_ids: HashMap<u64, usize>,
    /// The streams that joined a capture, and the stream it began on.
    joined: HashMap<usize, usize>,
    /// The pool of each graph and executable graph (by handle), and whether it is executable.
    graphs: HashMap<usize, (PoolKey, bool)>,
    /// Each pool's users (a pool no longer in use has none here).
    users: HashMap<PoolKey, Users>,
    /// The next id of our own (counting down from the top).
    next_own_id: u64,
}

impl Book {
    fn users(&mut self, key: PoolKey) -> &mut Users {
        self.users.entry(key).or_default()
    }

    fn unused(&self, key: PoolKey) -> bool {
        self.users.get(&key).is_none_or(Users::none)
    }
}

impl Shim {
    fn private_book(&self) -> MutexGuard<'_, Book> {
        (self.private_pools.book.lock()).unwrap_or_else(|p| p.into_inner())
    }

    /// The pool `key`, if it exists.
    fn find_private_pool(&self, key: PoolKey) -> Option<Arc<PrivatePool>> {
        if !self.private_pools.any.load(Ordering::Acquire) {
            return None;
        }
        let pools = self.private_pools.pools.read();
        let pools = pools.unwrap_or_else(|p| p.into_inner());
        pools.iter().find(|p| p.key() == key).cloned()
    }

    /// The pool `key`, made with `settings` if it does not exist (the caller holds the book,
    /// so that two threads cannot make it twice). `None` without a driver.
    fn private_pool(
        &self,
        _book: &mut Book,
        key: PoolKey,
        settings: PoolSettings,
    ) -> Option<Arc<PrivatePool>> {
        if let Some(pool) = self.find_private_pool(key) {
            return Some(pool);
        }
        let driver = self.driver?;
        let (id, device) = key;
        let mut config = self.allocator_config_now();
        // A private pool keeps its memory while it is used: no collection, and expandable
        // segments keep their maps (Note [Expandable private pools]).
        config.garbage_collection_threshold = 0.0;
        let fixed_only = settings.no_split || settings.foreign.is_some();
        config.expandable_segments = private_mode(config.expandable_segments, fixed_only);
        if settings.no_split {
            config.max_split_size = 0; // every block is oversize: never split
        }
        let observer = DeviceObserver {
            device: device as u32,
            trace: self.trace.as_ref().ok().cloned(),
            oom_checkpoint: false,
        };
        let device_handle = CudaDevice::for_private_pool(
            driver,
            id,
            device,
            self.streams.clone(),
            settings.foreign,
            config.expandable_segments.any(),
        );
        // Never fenced (unlike the device's ordinary pool once streams exist): a capture into
        // the pool frees synchronously, and a fence is an event, which a capture cannot take.
        // Frees in a stream's order (PyTorch's) are reused in that order, as everywhere.
        let alloc = Allocator::with_observer(device_handle, config, observer);
        alloc.keep_maps();
        log::debug!("device {device}: private pool {id:#x} created");
        let pool = Arc::new(PrivatePool {
            id,
            device,
            use_on_oom: settings.use_on_oom,
            for_graphs: settings.for_graphs,
            fixed_only,
            alloc,
        });
        let mut pools = self.private_pools.pools.write();
        pools
            .as_mut()
            .unwrap_or_else(|p| p.get_mut())
            .push(pool.clone());
        self.private_pools.any.store(true, Ordering::Release);
        Some(pool)
    }

    /// What a private pool knows of `address`.
    pub(super) fn private_lookup(&self, address: u64) -> Option<cachealloc_core::AddressInfo> {
        self.with_private_pool_holding(address, |alloc| alloc.lookup(address))
            .flatten()
    }

    /// Run `f` on the allocator of the private pool that holds `address`, if one does.
    pub(super) fn with_private_pool_holding<R>(
        &self,
        address: u64,
        f: impl FnOnce(&Allocator<CudaDevice, DeviceObserver>) -> R,
    ) -> Option<R> {
        if !self.private_pools.any.load(Ordering::Acquire) {
            return None;
        }
        let pools = self.private_pools.pools.read();
        let pools = pools.unwrap_or_else(|p| p.into_inner());
        let pool = pools.iter().find(|p| p.alloc.lookup(address).is_some())?;
        Some(f(&pool.alloc))
    }

    /// A new id of our own, for a capture given no pool.
    fn own_pool_id(book: &mut Book) -> u64 {
        book.next_own_id += 1;
        u64::MAX - book.next_own_id
    }

    /// With no user left, release the pool's free segments, and forget it once it has none
    /// left; a pool made for graphs keeps them until `empty_cache` or an allocation out of
    /// memory (Note [Private pools]).
    fn release_if_unused(&self, book: &mut Book, pool: &PrivatePool) {
        if !book.unused(pool.key()) {
            return;
        }
        book.users.remove(&pool.key());
        if pool.for_graphs {
            return;
        }
        if let Err(e) = pool.alloc.empty_cache() {
            log::error!("device {}: releasing a private pool: {e}", pool.device);
        }
        self.release_held(pool);
    }

    /// Free the segments a pool no longer in use held, now if no capture is under way (a
    /// device synchronization would break it), else when the last one ends; forget the pool
    /// once it has no segment left.
    fn release_held(&self, pool: &PrivatePool) {
        if self.streams.captures_active() {
            return;
        }
        let failed = pool.alloc.device().release_deferred();
        if failed > 0 {
            log::error!(
                "device {}: {failed} segments of a private pool could not be freed",
                pool.device
            );
        }
        if pool.alloc.stats().reserved_bytes.all.current <= 0 {
            let lost = pool.alloc.free_empty_ranges();
            if lost > 0 {
                log::error!(
                    "device {}: the address space of {lost} expandable segments of a private \
                     pool could not be freed",
                    pool.device
                );
            }
            let mut all = self.private_pools.pools.write();
            let all = all.as_mut().unwrap_or_else(|p| p.get_mut());
            all.retain(|p| !std::ptr::eq(&**p, pool));
            (self.private_pools.any).store(!all.is_empty(), Ordering::Release);
        }
    }

    /// Release what pools no longer in use hold, those of `device` or of every device: at
    /// `empty_cache` and when an allocation runs out of memory (`graphs`: the pools made for
    /// graphs too), and after the last capture of the process ended (the `MemPool`s' releases it
    /// deferred). Returns the bytes released.
    pub(super) fn release_unused_private_pools(&self, graphs: bool, device: Option<i32>) -> u64 {
        if !self.private_pools.any.load(Ordering::Acquire) {
            return 0;
        }
        let book = self.private_book();
        let unused: Vec<Arc<PrivatePool>> = self
            .private_pools
            .pools
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|p| book.unused(p.key()) && (graphs || !p.for_graphs))
            .filter(|p| device.is_none_or(|d| d == p.device))
            .cloned()
            .collect();
        drop(book);
        let mut released = 0;
        for pool in unused {
            let before = pool.alloc.stats().reserved_bytes.all.current;
            let _ = pool.alloc.empty_cache();
            self.release_held(&pool);
            let after = pool.alloc.stats().reserved_bytes.all.current;
            released += before.saturating_sub(after).max(0) as u64;
        }
        released
    }

    /// Free `address` if a private pool holds it; `None` if none does.
    pub(super) fn private_free(&self, address: u64, stream: u64) -> Option<CudaError> {
        if !self.private_pools.any.load(Ordering::Acquire) {
            return None;
        }
        let candidates: Vec<Arc<PrivatePool>> = self
            .private_pools
            .pools
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|p| p.alloc.device().may_contain(address))
            .cloned()
            .collect();
        for pool in candidates {
            match pool.alloc.free_on_stream(address, stream) {
                Ok(_) => {
                    let mut book = self.private_book();
                    if book.unused(pool.key()) {
                        self.release_if_unused(&mut book, &pool);
                    }
                    return Some(cuda::SUCCESS);
                }
                Err(FreeError::NotOurs(_)) => continue,
                Err(bad) => {
                    log::error!("free refused: {bad}; nothing was changed");
                    return Some(cuda::ERROR_INVALID_VALUE);
                }
            }
        }
        None
    }

    /// Add the private pools of `device` to its stats (PyTorch counts private pools in a
    /// device's allocated and reserved memory): current values and, as an upper bound, peaks.
    pub(super) fn add_private_pools(&self, device: i32, stats: &mut Stats) {
        self.for_each_private_pool(device, |alloc| {
            let theirs = alloc.stats();
            for (ours, theirs) in [
                (&mut stats.allocation, &theirs.allocation),
                (&mut stats.segment, &theirs.segment),
                (&mut stats.active, &theirs.active),
                (&mut stats.inactive_split, &theirs.inactive_split),
                (&mut stats.allocated_bytes, &theirs.allocated_bytes),
                (&mut stats.reserved_bytes, &theirs.reserved_bytes),
                (&mut stats.active_bytes, &theirs.active_bytes),
                (
                    &mut stats.inactive_split_bytes,
                    &theirs.inactive_split_bytes,
                ),
                (&mut stats.requested_bytes, &theirs.requested_bytes),
            ] {
                ours.add(theirs);
            }
        });
    }

    /// Whether `device` has a private pool.
    pub(super) fn has_private_pool_on(&self, device: i32) -> bool {
        let mut any = false;
        self.for_each_private_pool(device, |_| any = true);
        any
    }

    /// Run `f` on every private pool's allocator, with its device.
    pub(super) fn for_each_private_pool_anywhere(
        &self,
        mut f: impl FnMut(i32, &Allocator<CudaDevice, DeviceObserver>),
    ) {
        self.for_each_private_pool_of_any_kind(|pool| f(pool.device, &pool.alloc));
    }

    /// Run `f` on the allocator of each private pool of `device`.
    pub(super) fn for_each_private_pool(
        &self,
        device: i32,
        mut f: impl FnMut(&Allocator<CudaDevice, DeviceObserver>),
    ) {
        self.for_each_private_pool_anywhere(|d, alloc| {
            if d == device {
                f(alloc)
            }
        });
    }

    /// The segments of `device`'s pools — the ordinary pool's and every private pool's — each
    /// with its pool's id as the library keys it (0 for the ordinary pool; PyTorch's pair is
    /// `(id >> 32, id & 0xFFFF_FFFF)`: Note [Private pools]), with their blocks.
    pub fn segment_snapshots(&self, device: i32) -> Vec<(u64, SegmentSnapshot)> {
        let mut segments = Vec::new();
        if let Some(alloc) = self.allocator_of(device) {
            segments.extend(alloc.snapshot().into_iter().map(|s| (0, s)));
        }
        if self.private_pools.any.load(Ordering::Acquire) {
            let pools = self.private_pools.pools.read();
            let pools = pools.unwrap_or_else(|p| p.into_inner());
            for pool in pools.iter().filter(|p| p.device == device) {
                segments.extend(pool.alloc.snapshot().into_iter().map(|s| (pool.id, s)));
            }
        }
        segments
    }

    /// [`Shim::segment_snapshots`] as a JSON list of `[address, size, first, second,
    /// expandable]`: each segment's span (an expandable segment's whole address range), its
    /// pool's id as PyTorch's pair ((0, 0) for the ordinary pool) and whether it is expandable
    /// (0 or 1). What the trace does not say of a segment, for the snapshot's
    /// `segment_pool_id` and `is_expandable`.
    pub fn segments_json(&self, device: i32) -> String {
        let rows: Vec<String> = self
            .segment_snapshots(device)
            .iter()
            .map(|(id, segment)| {
                format!(
                    "[{},{},{},{},{}]",
                    segment.address,
                    segment.total_size,
                    id >> 32,
                    id & 0xFFFF_FFFF,
                    segment.expandable as u8
                )
            })
            .collect();
        format!("[{}]", rows.join(","))
    }

    /// How many private pools exist, and their reserved bytes (for the exit summary and tests).
    pub fn private_pool_count(&self) -> (usize, i64) {
        let pools = self.private_pools.pools.read();
        let pools = pools.unwrap_or_else(|p| p.into_inner());
        let reserved = pools
            .iter()
            .map(|p| p.alloc.stats().reserved_bytes.all.current)
            .sum();
        (pools.len(), reserved)
    }
}

/// How a private pool grows when the program's setting is `asked` (Note [Expandable private
/// pools]): expandable segments only where the program asked PyTorch for them.
fn private_mode(asked: Expandable, fixed_only: bool) -> Expandable {
    match asked {
        Expandable::On if !fixed_only => Expandable::On,
        _ => Expandable::Off,
    }
}

impl Shim {
    /// The program switched expandable segments at run time (`_set_allocator_settings`): the
    /// private pools grow so from now on too (Note [Expandable private pools]).
    pub(super) fn set_private_pools_expandable(&self, asked: Expandable) {
        self.for_each_private_pool_of_any_kind(|pool| {
            pool.alloc
                .set_expandable(private_mode(asked, pool.fixed_only));
        });
    }

    /// Run `f` on every private pool.
    fn for_each_private_pool_of_any_kind(&self, mut f: impl FnMut(&PrivatePool)) {
        if !self.private_pools.any.load(Ordering::Acquire) {
            return;
        }
        let pools = self.private_pools.pools.read();
        for pool in pools.unwrap_or_else(|p| p.into_inner()).iter() {
            f(pool);
        }
    }
}
