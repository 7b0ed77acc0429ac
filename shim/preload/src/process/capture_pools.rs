//! Private pools for CUDA graph captures: where allocations made on a capturing stream come from.
//!
//! # Note [Capture pools]
//!
//! A graph captured on a stream replays, later and as often as the program likes, every kernel
//! that the capture recorded, with the addresses they had at capture time. So memory handed out
//! during a capture belongs to the graph: nothing else may be given it while the graph can
//! replay, even after the program has freed it (a temporary freed inside the capture is still
//! written by every replay). PyTorch's native allocator keeps such memory in a *private pool*
//! per capture (or one shared by the graphs captured with the same `pool=`), and so do we:
//!
//! * A capture that begins on a stream gets a [`CapturePool`]: an [`Allocator`] of its own over
//!   segments of its own on the capture's device. Every allocation on that stream until the
//!   capture ends comes from it (never from the driver's graph memory, which PyTorch's
//!   `cudaMallocAsync` backend cannot free outside the graph: the cause of the aborts under
//!   `torch.compile(mode="reduce-overhead")`).
//! * A free of a block of a capture pool, during the capture or after it, returns the block to
//!   that pool, where only allocations of later captures into the same pool can get it (a
//!   shared pool's graphs replay in their capture order, which the program guarantees, as with
//!   PyTorch). Within a capture, a block freed on the capturing stream is reused at once on that
//!   stream: the graph orders the two uses as the stream did.
//! * The pool never releases a segment while it is in use: its device holds every release
//!   ([`CudaDevice::for_capture_pool`]), so neither the out-of-memory ladder nor an
//!   `empty_cache` can give memory a graph writes back to the driver.
//! * The pool is in use while a capture into it is under way or any graph captured into it, or
//!   executable graph instantiated from one, exists (`cudaGraphDestroy`,
//!   `cudaGraphExecDestroy`). When the last goes, its free segments are released; blocks the
//!   program still holds (a graph's static outputs) go back when freed, and the pool goes with
//!   its last segment.
//! * Which pool a capture uses: a new one, unless the Python integration named the pool of the
//!   thread's next capture ([`Shim::use_capture_pool`]: PyTorch's `torch.cuda.graph(pool=…)`,
//!   `graph_pool_handle()`), in which case captures with the same id share it.
//!
//! Not covered: allocations on a stream that joined a capture through an event without the
//! capture beginning on it (they come from the ordinary pool, fenced as before), and graphs
//! made and destroyed only through the driver API.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use cachealloc_core::{Allocator, FreeError, Stats};

use super::Shim;
use crate::backend::CudaDevice;
use crate::cuda::{self, CudaError};
use crate::log;
use crate::trace::DeviceObserver;

/// One private pool.
#[derive(Debug)]
pub struct CapturePool {
    /// The pool's id: the one the Python integration named, or one of ours.
    id: u64,
    device: i32,
    alloc: Allocator<CudaDevice, DeviceObserver>,
}

/// Who uses a pool: captures under way into it, graphs captured into it and executable graphs
/// instantiated from those.
#[derive(Debug, Default)]
struct Users {
    captures: usize,
    graphs: usize,
}

impl Users {
    fn none(&self) -> bool {
        self.captures == 0 && self.graphs == 0
    }
}

/// The book of capture pools, owned by the [`Shim`].
#[derive(Debug, Default)]
pub struct CapturePools {
    /// Whether any pool exists: frees of other memory skip the book while none does.
    any: AtomicBool,
    /// Every pool, in use or released with blocks still allocated.
    pools: RwLock<Vec<Arc<CapturePool>>>,
    book: Mutex<Book>,
}

#[derive(Debug, Default)]
struct Book {
    /// The pool of each stream capturing now.
    capturing: HashMap<usize, Arc<CapturePool>>,
    /// The pool of each graph and executable graph (by handle).
    graphs: HashMap<usize, u64>,
    /// Each pool's users, by id (a pool no longer in use has none here).
    users: HashMap<u64, Users>,
    /// The next id of our own (ids the integration names are PyTorch's, small pairs packed
    /// into the low bits; ours count down from the top, so the two never meet).
    next_own_id: u64,
}

thread_local! {
    /// The pool the calling thread's next capture allocates from (0: a new pool).
    static NEXT_POOL: Cell<u64> = const { Cell::new(0) };
}

impl Shim {
    /// The Python integration's word: the calling thread's next capture allocates from the
    /// pool `id` (shared by every capture given the same id); 0 for a new pool of its own.
    pub fn use_capture_pool(&self, id: u64) {
        let _ = NEXT_POOL.try_with(|next| next.set(id));
    }

    /// A capture begins on `stream` of `device`: give it its pool.
    pub(super) fn capture_pool_begin(&self, stream: usize, device: i32) {
        let named = NEXT_POOL.try_with(|next| next.replace(0)).unwrap_or(0);
        let pools = &self.capture_pools;
        let mut book = pools.book.lock().unwrap_or_else(|p| p.into_inner());
        let id = if named != 0 {
            named
        } else {
            book.next_own_id += 1;
            u64::MAX - book.next_own_id
        };
        let existing = pools
            .pools
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|p| p.id == id && p.device == device)
            .cloned();
        let pool = match existing {
            Some(pool) => pool,
            None => match self.new_capture_pool(id, device) {
                Some(pool) => {
                    pools
                        .pools
                        .write()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(pool.clone());
                    pools.any.store(true, Ordering::Release);
                    pool
                }
                None => return,
            },
        };
        book.users.entry(id).or_default().captures += 1;
        book.capturing.insert(stream, pool);
    }

    fn new_capture_pool(&self, id: u64, device: i32) -> Option<Arc<CapturePool>> {
        let driver = self.driver?;
        let mut config = crate::settings::get().config.allocator.clone();
        // A private pool keeps its memory: no collection, and fixed segments (an unmap would
        // give memory back).
        config.garbage_collection_threshold = 0.0;
        config.expandable_segments = false;
        let observer = DeviceObserver {
            device: device as u32,
            trace: self.trace.as_ref().ok().cloned(),
            oom_checkpoint: false,
        };
        let device_handle = CudaDevice::for_capture_pool(driver, device, self.streams.clone());
        log::debug!("device {device}: capture pool {id:#x} created");
        Some(Arc::new(CapturePool {
            id,
            device,
            alloc: Allocator::with_observer(device_handle, config, observer),
        }))
    }

    /// The capture on `stream` ended, making `graph` (none if it failed): the graph holds the
    /// pool from now on, instead of the capture.
    pub(super) fn capture_pool_end(&self, stream: usize, graph: Option<usize>) {
        let pools = &self.capture_pools;
        let mut book = pools.book.lock().unwrap_or_else(|p| p.into_inner());
        let Some(pool) = book.capturing.remove(&stream) else {
            return;
        };
        let users = book.users.entry(pool.id).or_default();
        users.captures = users.captures.saturating_sub(1);
        if let Some(graph) = graph.filter(|&g| g != 0) {
            users.graphs += 1;
            book.graphs.insert(graph, pool.id);
        }
        self.release_if_unused(&mut book, &pool);
    }

    /// `exec` was instantiated from `graph`: it holds `graph`'s pool too.
    pub fn graph_instantiated(&self, graph: usize, exec: usize) {
        if !self.capture_pools.any.load(Ordering::Acquire) || exec == 0 {
            return;
        }
        let mut book = self
            .capture_pools
            .book
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let Some(&id) = book.graphs.get(&graph) else {
            return;
        };
        book.graphs.insert(exec, id);
        book.users.entry(id).or_default().graphs += 1;
    }

    /// The graph or executable graph `handle` was destroyed: it no longer holds its pool.
    pub fn graph_destroyed(&self, handle: usize) {
        if !self.capture_pools.any.load(Ordering::Acquire) {
            return;
        }
        let pools = &self.capture_pools;
        let mut book = pools.book.lock().unwrap_or_else(|p| p.into_inner());
        let Some(id) = book.graphs.remove(&handle) else {
            return;
        };
        if let Some(users) = book.users.get_mut(&id) {
            users.graphs = users.graphs.saturating_sub(1);
        }
        let pool = pools
            .pools
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|p| p.id == id)
            .cloned();
        if let Some(pool) = pool {
            self.release_if_unused(&mut book, &pool);
        }
    }

    /// With no capture and no graph left on it, release the pool's free segments, and forget
    /// it once it has none left.
    fn release_if_unused(&self, book: &mut Book, pool: &Arc<CapturePool>) {
        if !book.users.get(&pool.id).is_none_or(Users::none) {
            return;
        }
        book.users.remove(&pool.id);
        if let Err(e) = pool.alloc.empty_cache() {
            log::error!("device {}: releasing a capture pool: {e}", pool.device);
        }
        self.release_held(pool);
    }

    /// Free the segments a pool no longer in use held, now if no capture is under way (a
    /// device synchronization would break it), else when the last one ends; forget the pool
    /// once it has no segment left.
    fn release_held(&self, pool: &CapturePool) {
        if self.streams.captures_active() {
            return;
        }
        let failed = pool.alloc.device().release_deferred();
        if failed > 0 {
            log::error!(
                "device {}: {failed} segments of a capture pool could not be freed",
                pool.device
            );
        }
        if pool.alloc.stats().reserved_bytes.all.current <= 0 {
            let mut all = self
                .capture_pools
                .pools
                .write()
                .unwrap_or_else(|p| p.into_inner());
            all.retain(|p| !std::ptr::eq(&**p, pool));
            self.capture_pools
                .any
                .store(!all.is_empty(), Ordering::Release);
        }
    }

    /// After the last capture of the process ended: release what pools no longer in use hold.
    pub(super) fn release_unused_capture_pools(&self) {
        if !self.capture_pools.any.load(Ordering::Acquire) {
            return;
        }
        let book = self
            .capture_pools
            .book
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let unused: Vec<Arc<CapturePool>> = self
            .capture_pools
            .pools
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|p| book.users.get(&p.id).is_none_or(Users::none))
            .cloned()
            .collect();
        drop(book);
        for pool in unused {
            self.release_held(&pool);
        }
    }

    /// The pool `stream` is capturing into, if it is capturing.
    fn capturing_pool(&self, stream: usize) -> Option<Arc<CapturePool>> {
        if !self.capture_pools.any.load(Ordering::Acquire) {
            return None;
        }
        let book = self
            .capture_pools
            .book
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        book.capturing.get(&stream).cloned()
    }

    /// Serve an allocation on the capturing `stream` from its capture's pool; `None` when the
    /// capture has no pool of ours (the shim began without a driver, or the capture began
    /// through a door we do not see).
    pub fn capture_malloc(&self, stream: usize, size: u64) -> Option<Result<u64, CudaError>> {
        let pool = self.capturing_pool(stream)?;
        Some(self.serve(&pool.alloc, pool.device, size, stream as u64))
    }

    /// Free `address` if a capture pool holds it; `None` if none does.
    pub(super) fn capture_free(&self, address: u64, stream: u64) -> Option<CudaError> {
        if !self.capture_pools.any.load(Ordering::Acquire) {
            return None;
        }
        let candidates: Vec<Arc<CapturePool>> = self
            .capture_pools
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
                    let mut book = self
                        .capture_pools
                        .book
                        .lock()
                        .unwrap_or_else(|p| p.into_inner());
                    if book.users.get(&pool.id).is_none_or(Users::none) {
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

    /// Add the capture pools of `device` to its stats (PyTorch counts private pools in a
    /// device's allocated and reserved memory): current values and, as an upper bound, peaks.
    pub(super) fn add_capture_pools(&self, device: i32, stats: &mut Stats) {
        self.for_each_capture_pool(device, |alloc| {
            let theirs = alloc.stats();
            for (ours, theirs) in [
                (&mut stats.allocated_bytes.all, &theirs.allocated_bytes.all),
                (&mut stats.reserved_bytes.all, &theirs.reserved_bytes.all),
                (&mut stats.active_bytes.all, &theirs.active_bytes.all),
                (&mut stats.requested_bytes.all, &theirs.requested_bytes.all),
                (&mut stats.allocation.all, &theirs.allocation.all),
                (&mut stats.segment.all, &theirs.segment.all),
            ] {
                ours.current += theirs.current;
                ours.peak += theirs.peak;
                ours.allocated += theirs.allocated;
                ours.freed += theirs.freed;
            }
        });
    }

    /// Run `f` on the allocator of each capture pool of `device`.
    pub(super) fn for_each_capture_pool(
        &self,
        device: i32,
        mut f: impl FnMut(&Allocator<CudaDevice, DeviceObserver>),
    ) {
        if !self.capture_pools.any.load(Ordering::Acquire) {
            return;
        }
        for pool in self
            .capture_pools
            .pools
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|p| p.device == device)
        {
            f(&pool.alloc);
        }
    }

    /// How many capture pools exist, and their reserved bytes (for the exit summary and tests).
    pub fn capture_pool_count(&self) -> (usize, i64) {
        let pools = self
            .capture_pools
            .pools
            .read()
            .unwrap_or_else(|p| p.into_inner());
        let reserved = pools
            .iter()
            .map(|p| p.alloc.stats().reserved_bytes.all.current)
            .sum();
        (pools.len(), reserved)
    }
}
