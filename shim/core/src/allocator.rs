//! [`Allocator`]: one device's caching allocator — [`Pools`] behind a lock, plus the
//! out-of-memory ladder that calls the [`Device`].
//!
//! # Note [The allocation ladder and the lock]
//!
//! `malloc` climbs these rungs until one serves the request (PyTorch's order, with our fences):
//!
//! 1. a cached block (after making completed fence batches reusable);
//! 2. close the open fence batches and look again (they may complete at once on an idle GPU);
//!    then adopt the stream's blocks freed on other streams, behind a device-side wait on their
//!    fences (see [Note [Stream-ordered reuse]](crate::pools#note-stream-ordered-reuse));
//! 3. garbage collection, when `garbage_collection_threshold` is set and reserved memory is above
//!    that fraction of the limit: release old free segments;
//! 4. wait for pending fence batches, oldest first, looking again after each — only while the
//!    pending blocks of the request's pool, with its free blocks, add up to the request;
//! 5. a new segment from the device;
//! 6. release free oversize segments (with `max_split_size`) and try the device again;
//! 7. release every free segment (empty the cache) and try the device once more;
//! 8. fail with an [`OomReport`].
//!
//! **When the host waits.** Only rung 4 waits on the host, and only for blocks freed
//! synchronously (`cudaFree`) or under `reuse:fenced`: a block freed in a stream's order is
//! reusable at once (rung 1) or adopted behind a device-side wait (rung 2). The ladder prefers that
//! wait to growing, as PyTorch does: memory that is about to be free is not reserved twice, so the
//! policy's memory budget for waiting instead of growing is zero extra bytes; a request that the
//! pending blocks cannot serve does not wait at all.
//!
//! The lock is never held across a device allocation, a device release or a fence wait: a real
//! `cudaFree` synchronizes the whole device, and `cudaMalloc` can take milliseconds, and other
//! threads must keep allocating from the cache meanwhile. So each of those rungs takes what it
//! needs out of the pools under the lock (segments to release are removed from the books first,
//! bytes about to be allocated are counted against the limit first), unlocks, talks to the
//! device, and relocks. Another thread may change the pools in between; every rung re-reads the
//! state after relocking, so the worst outcome is one segment more than strictly needed, exactly
//! as with PyTorch's `release_lock_on_cudamalloc`. Fence recording and querying (CUDA events) are
//! cheap and happen under the lock.

use std::fmt;

use spin::mutex::{SpinMutex, SpinMutexGuard};
use spin::relax::Yield;

use crate::config::{AllocatorConfig, Expandable};
use crate::device::{Device, DeviceError};
use crate::events::{Event, Observer};
use crate::oom::OomReport;
use crate::pools::expandable::Geometry;
use crate::pools::{
    AddressInfo, Allocation, FreeError, Freed, NO_STREAM, Pools, ReleasedSegment, SegmentSnapshot,
};
use crate::sizes::{self, PoolKind};
use crate::stats::Stats;

mod checkpoint;
mod expandable;
mod held;
mod maintenance;
mod oom_report;
mod request;
mod settings;

use request::Request;

/// Why `malloc` failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum AllocError {
    /// Every rung of the ladder failed.
    #[error("{0}")]
    OutOfMemory(Box<OomReport>),
    /// The device failed in some other way.
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// What happened to device segments and pending frees during an operation, for the caller to
/// trace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SegmentChanges {
    /// Segments allocated on the device: (address, size).
    pub allocated: Vec<(u64, u64)>,
    /// Segments released on the device.
    pub released: Vec<ReleasedSegment>,
    /// Releases the device refused (the memory is lost to us; reported, not fatal).
    pub release_errors: Vec<(ReleasedSegment, DeviceError)>,
    /// Freed blocks whose fence completed, now reusable: (address, size) (PyTorch's
    /// `free_completed`).
    pub completed_frees: Vec<(u64, u64)>,
    /// Memory mapped into expandable segments: (address, size).
    pub mapped: Vec<(u64, u64)>,
    /// Memory of expandable segments unmapped: (address, size).
    pub unmapped: Vec<(u64, u64)>,
    /// Unmaps the device refused (the memory stays in the pools): (address, size), error.
    pub unmap_errors: Vec<((u64, u64), DeviceError)>,
}

/// The allocator's lock: a spin lock whose waiters yield the CPU. It is held only for
/// bookkeeping and for recording or querying fences (never across a device allocation, release
/// or wait), so waits are short, and its release is a plain store: one atomic operation per
/// `malloc` or `free` instead of two (measured in BENCHMARKS.md).
type Lock<F> = SpinMutex<Pools<F>, Yield>;
/// The pools, locked.
type Locked<'a, F> = SpinMutexGuard<'a, Pools<F>>;
/// What a rung that grows (releasing the lock meanwhile) gives back: the allocation that
/// served the request, `None` when out of memory, and the lock, taken again.
type Served<'a, F> = (Result<Option<Allocation>, DeviceError>, Locked<'a, F>);

/// One device's caching allocator. Thread-safe; see the module docs for the locking rules.
pub struct Allocator<D: Device, O: Observer = ()> {
    device: D,
    observer: O,
    pools: Lock<D::Fence>,
    config: AllocatorConfig,
    /// Bytes this process may reserve on the device.
    limit: u64,
}

impl<D: Device + fmt::Debug, O: Observer> fmt::Debug for Allocator<D, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocator")
            .field("device", &self.device)
            .field("config", &self.config)
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl<D: Device> Allocator<D> {
    /// An allocator over `device` with the given policy. Reads the device's total memory once,
    /// for the memory limit.
    pub fn new(device: D, config: AllocatorConfig) -> Self {
        Self::with_observer(device, config, ())
    }
}

impl<D: Device, O: Observer> Allocator<D, O> {
    /// An allocator that reports its events to `observer`.
    pub fn with_observer(device: D, config: AllocatorConfig, observer: O) -> Self {
        let total = device.mem_info().total;
        let limit = crate::sizes::limit_for_fraction(total, config.per_process_memory_fraction);
        let mut pools = Pools::new(&config);
        if config.expandable_segments.any()
            && let Some(granularity) = device.map_granularity()
        {
            pools.enable_expandable(Geometry {
                moves: device.can_alias(),
                ..Geometry::for_device(granularity, total)
            });
            pools.set_synchronous_fixed(config.expandable_segments == Expandable::StreamOrdered);
        }
        Allocator {
            pools: Lock::new(pools),
            device,
            observer,
            config,
            limit,
        }
    }

    /// The observer.
    pub fn observer(&self) -> &O {
        &self.observer
    }

    /// Make completed fence batches reusable, reporting each completed free.
    fn collect_completed(&self, pools: &mut Pools<D::Fence>, changes: &mut SegmentChanges) {
        let from = changes.completed_frees.len();
        pools.process_completed(&self.device, &mut changes.completed_frees);
        for &(address, size) in &changes.completed_frees[from..] {
            self.observer
                .on_event(Event::FreeCompleted { address, size });
        }
    }

    /// Adopt `stream`'s blocks freed on other streams ([`Pools::adopt_cross_stream`]),
    /// reporting each as a completed free.
    fn adopt_cross_stream(
        &self,
        pools: &mut Pools<D::Fence>,
        stream: u64,
        changes: &mut SegmentChanges,
    ) -> Result<bool, DeviceError> {
        let from = changes.completed_frees.len();
        let adopted =
            pools.adopt_cross_stream(stream, &self.device, &mut changes.completed_frees)?;
        for &(address, size) in &changes.completed_frees[from..] {
            self.observer
                .on_event(Event::FreeCompleted { address, size });
        }
        Ok(adopted)
    }

    /// Report a block handed out.
    #[inline(always)]
    fn served(&self, allocation: Allocation) -> Allocation {
        self.observer.on_event(Event::Alloc(&allocation));
        allocation
    }

    /// Take a new segment into the pools and serve the request from it.
    fn new_segment(
        &self,
        pools: &mut Pools<D::Fence>,
        changes: &mut SegmentChanges,
        address: u64,
        request: &Request,
    ) -> Allocation {
        let Request {
            size,
            rounded,
            segment_size,
            tag,
            stream,
        } = *request;
        changes.allocated.push((address, segment_size));
        self.observer.on_event(Event::SegmentAlloc {
            address,
            size: segment_size,
            pool: sizes::pool_for(rounded),
            tag,
        });
        let allocation =
            pools.add_segment_and_alloc(address, segment_size, rounded, size, tag, stream);
        self.served(allocation)
    }

    /// Rungs 5–7: ask the device for a segment and, if it gives one, serve the request from it.
    fn grow_and_serve<'a>(
        &'a self,
        pools: Locked<'a, D::Fence>,
        request: &Request,
        changes: &mut SegmentChanges,
        is_retry: bool,
    ) -> Served<'a, D::Fence> {
        if pools.grows_expandable_for(request.stream) {
            return self.map_and_serve(pools, request, changes, is_retry);
        }
        let (grown, mut pools) = self.grow(pools, request, is_retry);
        let served =
            grown.map(|address| address.map(|a| self.new_segment(&mut pools, changes, a, request)));
        (served, pools)
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The policy the allocator was made with (the program may since have changed
    /// `max_split_size`, `roundup_power2_divisions` and `garbage_collection_threshold`:
    /// [`Allocator::set_policy`]).
    pub fn config(&self) -> &AllocatorConfig {
        &self.config
    }

    /// Bytes this process may reserve.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Whether the allocator grows expandable segments (asked for, and the device can map), for
    /// stream-ordered requests at least (see [`Expandable`]).
    pub fn expandable(&self) -> bool {
        self.pools.lock().grows_expandable()
    }

    /// Allocate `size` bytes for the synchronous API ([`NO_STREAM`]). `tag` is kept with the
    /// block (a stack id for the recorder).
    pub fn malloc(&self, size: u64, tag: u64) -> Result<Allocation, AllocError> {
        self.malloc_traced(size, tag, &mut SegmentChanges::default())
    }

    /// [`Allocator::malloc`], also reporting the segments it allocated or released.
    pub fn malloc_traced(
        &self,
        size: u64,
        tag: u64,
        changes: &mut SegmentChanges,
    ) -> Result<Allocation, AllocError> {
        self.malloc_on_stream(size, NO_STREAM, tag, changes)
    }

    /// Allocate `size` bytes for use on `stream` (or [`NO_STREAM`]), reporting the segments it
    /// allocated or released; see [Note [Stream-ordered reuse]](crate::pools#note-stream-ordered-reuse).
    pub fn malloc_on_stream(
        &self,
        size: u64,
        stream: u64,
        tag: u64,
        changes: &mut SegmentChanges,
    ) -> Result<Allocation, AllocError> {
        let mut pools = self.pools.lock();
        let rounded = pools.round(size);

        // 1. The cache, after closing a full open batch and collecting completed ones.
        if pools.has_pending() {
            if pools.open_batch_full() {
                pools.close_open_batches(&self.device)?;
            }
            self.collect_completed(&mut pools, changes);
        }
        if let Some(a) = pools.alloc_cached(rounded, size, tag, stream) {
            return Ok(self.served(a));
        }
        self.malloc_slow(pools, &Request::new(size, rounded, stream, tag), changes)
    }

    /// Serve `size` bytes for `stream` from cached blocks alone (those whose fences completed):
    /// no wait, no new segment, `None` when none fits. A pool lends its free memory so when
    /// another pool of the device is out of memory (PyTorch's `MemPool(use_on_oom=True)`).
    pub fn malloc_from_cache(&self, size: u64, stream: u64, tag: u64) -> Option<Allocation> {
        let mut pools = self.pools.lock();
        let rounded = pools.round(size);
        if pools.has_pending() {
            self.collect_completed(&mut pools, &mut SegmentChanges::default());
        }
        let served = pools.alloc_cached(rounded, size, tag, stream);
        served.map(|a| self.served(a))
    }

    /// Allocate `size` bytes from a new segment without looking in the cache first (falling
    /// back to the whole ladder if the device refuses).
    ///
    /// This is what a concurrent run does when another thread frees a fitting block while this
    /// one is growing with the lock released: the trace then shows the free before this
    /// allocation, yet the allocation came from a new segment. `cachealloc simulate` replays a
    /// run's requests one at a time, and follows the recorded growth with this to make the run's
    /// decisions again.
    pub fn malloc_from_new_segment(
        &self,
        size: u64,
        stream: u64,
        tag: u64,
    ) -> Result<Allocation, AllocError> {
        let mut changes = SegmentChanges::default();
        let mut pools = self.pools.lock();
        let request = Request::new(size, pools.round(size), stream, tag);
        // What the ladder did before growing, less the cache lookups: fences and GC.
        if pools.has_pending() {
            if pools.open_batch_full() {
                pools.close_open_batches(&self.device)?;
            }
            self.collect_completed(&mut pools, &mut changes);
        }
        if pools.close_open_batches(&self.device)? {
            self.collect_completed(&mut pools, &mut changes);
        }
        if stream != NO_STREAM {
            self.adopt_cross_stream(&mut pools, stream, &mut changes)?;
        }
        let threshold = pools.garbage_collection_threshold();
        if threshold > 0.0 {
            let garbage = pools.take_garbage(threshold, self.limit);
            pools = self.release_unlocked(pools, garbage, &mut changes);
        }
        let (served, pools) = self.grow_and_serve(pools, &request, &mut changes, false);
        if let Some(a) = served? {
            return Ok(a);
        }
        self.malloc_slow(pools, &request, &mut changes)
    }

    #[cold]
    fn malloc_slow<'a>(
        &'a self,
        mut pools: Locked<'a, D::Fence>,
        request: &Request,
        changes: &mut SegmentChanges,
    ) -> Result<Allocation, AllocError> {
        let &Request {
            size,
            rounded,
            segment_size,
            tag,
            stream,
        } = request;

        // 2. Close the open batches; on an idle device they may complete at once.
        if pools.close_open_batches(&self.device)? {
            self.collect_completed(&mut pools, changes);
            if let Some(a) = pools.alloc_cached(rounded, size, tag, stream) {
                return Ok(self.served(a));
            }
        }

        // 2b. The stream's blocks freed on other streams, behind a device-side wait.
        if stream != NO_STREAM
            && self.adopt_cross_stream(&mut pools, stream, changes)?
            && let Some(a) = pools.alloc_cached(rounded, size, tag, stream)
        {
            return Ok(self.served(a));
        }

        // 3. Garbage collection of old cached segments.
        let threshold = pools.garbage_collection_threshold();
        if threshold > 0.0 {
            let garbage = pools.take_garbage(threshold, self.limit);
            pools = self.release_unlocked(pools, garbage, changes);
        }

        // 4. Wait for pending fences, oldest first, while they could serve the request.
        while pools.pending_could_serve(rounded, stream)
            && let Some(fence) = pools.oldest_pending_fence()
        {
            pools.stats.num_fence_waits += 1;
            let (waited, relocked) = self.unlocked(pools, || self.device.wait_fence(&fence));
            pools = relocked;
            waited?;
            self.collect_completed(&mut pools, changes);
            if let Some(a) = pools.alloc_cached(rounded, size, tag, stream) {
                return Ok(self.served(a));
            }
        }

        // 5. A new segment.
        let (served, relocked) = self.grow_and_serve(pools, request, changes, false);
        pools = relocked;
        if let Some(a) = served? {
            return Ok(a);
        }

        // 6. Release free oversize segments, then try again.
        let oversize = pools.take_oversize_segments(rounded, stream);
        if !oversize.is_empty() {
            pools = self.release_unlocked(pools, oversize, changes);
            let (served, relocked) = self.grow_and_serve(pools, request, changes, false);
            pools = relocked;
            if let Some(a) = served? {
                return Ok(a);
            }
        }

        // 7. Empty the cache, then try once more (pools that keep their maps unmap nothing:
        // Note [Kept maps]).
        let all = pools.take_free_segments(&[PoolKind::Large, PoolKind::Small]);
        pools = self.release_unlocked(pools, all, changes);
        if !pools.keeps_maps() {
            pools = self.unmap_unlocked(pools, changes);
        }
        let (served, relocked) = self.grow_and_serve(pools, request, changes, true);
        pools = relocked;
        if let Some(a) = served? {
            return Ok(a);
        }

        // 8. Out of memory.
        pools.stats.num_ooms += 1;
        // With expandable segments, what the device could not give is the request's granules
        // (or pages: Note [Kept maps]).
        let segment_size = match pools.map_size_for(rounded) {
            Some(map) if pools.grows_expandable_for(request.stream) => map,
            _ => segment_size,
        };
        let request = Request {
            segment_size,
            ..*request
        };
        let report = self.oom_report(&pools, &request);
        self.observer.on_event(Event::Oom(&report));
        Err(AllocError::OutOfMemory(Box::new(report)))
    }

    /// Run `f` with the lock released, then take it again.
    fn unlocked<'a, R>(
        &'a self,
        pools: Locked<'a, D::Fence>,
        f: impl FnOnce() -> R,
    ) -> (R, Locked<'a, D::Fence>) {
        drop(pools);
        let result = f();
        (result, self.pools.lock())
    }

    /// Ask the device for a segment without holding the lock. `Ok(None)` means out of memory
    /// (by the limit or the device).
    fn grow<'a>(
        &'a self,
        mut pools: Locked<'a, D::Fence>,
        request: &Request,
        is_retry: bool,
    ) -> (Result<Option<u64>, DeviceError>, Locked<'a, D::Fence>) {
        if is_retry {
            pools.stats.num_alloc_retries += 1;
        }
        let segment_size = request.segment_size;
        if let Some(counted) = pools.limited_reserved(request.stream)
            && counted.saturating_add(segment_size) > self.limit
        {
            return (Ok(None), pools);
        }
        pools.begin_growth(segment_size);
        let (result, mut pools) =
            self.unlocked(pools, || self.device.allocate_segment(segment_size));
        pools.end_growth(segment_size);
        let result = match result {
            Ok(address) => Ok(Some(address)),
            Err(DeviceError::OutOfMemory) => Ok(None),
            Err(other) => Err(other),
        };
        (result, pools)
    }

    /// Release segments (already out of the books) on the device without holding the lock.
    fn release_unlocked<'a>(
        &'a self,
        pools: Locked<'a, D::Fence>,
        segments: Vec<ReleasedSegment>,
        changes: &mut SegmentChanges,
    ) -> Locked<'a, D::Fence> {
        if segments.is_empty() {
            return pools;
        }
        for segment in &segments {
            self.observer.on_event(Event::SegmentFree(segment));
        }
        self.unlocked(pools, || self.release_segments(segments, changes))
            .1
    }

    fn release_segments(&self, segments: Vec<ReleasedSegment>, changes: &mut SegmentChanges) {
        for seg in segments {
            match self.device.free_segment(seg.address, seg.size) {
                Ok(()) => changes.released.push(seg),
                Err(e) => changes.release_errors.push((seg, e)),
            }
        }
    }

    /// Free a block synchronously (`cudaFree`). A pointer that is not ours, a double free and an
    /// interior pointer are refused with nothing changed.
    #[inline]
    pub fn free(&self, address: u64) -> Result<Freed, FreeError> {
        self.free_on_stream(address, NO_STREAM)
    }

    /// Free a block ordered on `stream` (`cudaFreeAsync`; [`NO_STREAM`] for a synchronous
    /// free): on the block's own stream it is reusable at once, otherwise it waits for a fence
    /// (see [Note [Stream-ordered reuse]](crate::pools#note-stream-ordered-reuse)).
    #[inline]
    pub fn free_on_stream(&self, address: u64, stream: u64) -> Result<Freed, FreeError> {
        let mut pools = self.pools.lock();
        let freed = pools.free(address, stream)?;
        self.observer.on_event(Event::FreeRequested(&freed));
        Ok(freed)
    }

    /// A copy of the stats.
    pub fn stats(&self) -> Stats {
        self.pools.lock().stats.clone()
    }

    /// Reset peak stats.
    pub fn reset_peak_stats(&self) {
        self.pools.lock().stats.reset_peaks();
    }

    /// Reset accumulated stats.
    pub fn reset_accumulated_stats(&self) {
        self.pools.lock().stats.reset_accumulated();
    }

    /// Reserved bytes not allocated to the application (what `cudaMemGetInfo` may add to
    /// `free`).
    pub fn cached_free_bytes(&self) -> u64 {
        self.pools.lock().cached_free_bytes()
    }

    /// Where `address` lies in our memory.
    pub fn lookup(&self, address: u64) -> Option<AddressInfo> {
        self.pools.lock().lookup(address)
    }

    /// Every segment with its blocks.
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        self.pools.lock().snapshot()
    }

    /// Run [`Pools::check_invariants`].
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pools.lock().check_invariants()
    }

    /// Run `f` on the pools under the lock (for callers that need several queries at once).
    pub fn with_pools<R>(&self, f: impl FnOnce(&mut Pools<D::Fence>) -> R) -> R {
        f(&mut self.pools.lock())
    }
}
