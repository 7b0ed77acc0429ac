//! [`CudaDevice`]: the real device behind `cachealloc-core`'s [`Device`] trait — segments from
//! libcuda's own `cuMemAlloc_v2`/`cuMemFree_v2` ([`crate::real::driver`]), fences from CUDA events
//! ([`crate::gpu::fences`]).
//!
//! Segments come from the driver, not the runtime: a program whose runtime is linked statically
//! has no runtime we could call, and a shared runtime's `cudaMalloc` would come back to our own
//! driver hooks. Every segment call runs with the device's primary context current
//! ([`Fences::on_own_context`]). A release first synchronizes the context, which `cudaFree` did
//! implicitly: no kernel still running may use a segment's memory when it goes.
//!
//! While a stream captures a CUDA graph (see [`crate::streams`]), every call here runs in the
//! relaxed capture mode ([`capture_mode::relaxed`]), and segment releases are deferred to the end of
//! the last capture: `cudaFree` synchronizes the device, which a capture cannot allow.
//!
//! Every segment and every map counts against the device's budget ([`budget`]): the memory
//! limit that `set_per_process_memory_fraction` sets for all of a device's pools together.
//!
//! With `expandable_segments:True`, the device offers CUDA's virtual memory (`backend/vmm.rs`) when
//! the driver and the GPU have it; the allocator then maps memory into expandable segments. An
//! unmap synchronizes the context first, like a release, and is refused while a capture is
//! under way (the memory then stays cached and mapped; the allocator takes it back).

use std::cell::Cell;
use std::ffi::c_int;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::LocalKey;

use cachealloc_core::{Device, DeviceError, MemInfo, NO_STREAM, SharedLimit};

use crate::cuda;
use crate::cuda::driver::{self as codes, CuResult};
use crate::gpu::LoadedDriver;
use crate::gpu::fences::{Fence, Fences};
use crate::gpu::{capture_mode, captures};
use crate::real::driver as real_driver;
use crate::streams::Stream;
use crate::streams::StreamRegistry;

pub mod budget;
mod foreign;
pub mod trackers;
mod vmm;

pub use foreign::{ForeignAllocator, in_foreign_allocator};

pub use vmm::{Exported, HANDLE_TYPE_POSIX_FD, access_for, access_for_accessors, note_peer_access};

/// Run `f` with the calling thread's `flag` set, then as it was.
fn with_thread_flag<T>(flag: &'static LocalKey<Cell<bool>>, f: impl FnOnce() -> T) -> T {
    let outer = flag.try_with(|c| c.replace(true)).unwrap_or(false);
    let result = f();
    let _ = flag.try_with(|c| c.set(outer));
    result
}

/// One GPU as the allocator core sees it.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: i32,
    fences: Fences,
    streams: Arc<StreamRegistry>,
    /// Virtual memory, once expandable segments were asked for (at start, or by the program at
    /// run time) and the device has it.
    vmm: std::sync::OnceLock<vmm::Vmm>,
    /// Segments (address, size) released while a capture was under way, to free when it ends;
    /// and every segment released by a private pool's allocator, to free when the pool is no
    /// longer used.
    deferred_releases: std::sync::Mutex<Vec<(u64, u64)>>,
    /// A private pool's device: holds every release until [`CudaDevice::release_deferred`].
    holds_releases: bool,
    /// Where segments come from when not from the driver (a private pool's own allocator).
    foreign: Option<ForeignAllocator>,
    /// The pool the segment trackers are told of: 0 for the device's own, else a private
    /// pool's id (Note [Segment trackers]).
    pool_id: u64,
    /// The addresses this device's memory has spanned: see [`CudaDevice::may_contain`].
    lowest: AtomicU64,
    highest: AtomicU64,
}

impl CudaDevice {
    /// The device `ordinal`; with virtual memory if `expandable` and the device has it (else
    /// says why not, once).
    pub fn new(
        driver: LoadedDriver,
        ordinal: i32,
        streams: Arc<StreamRegistry>,
        expandable: bool,
    ) -> Self {
        let device = CudaDevice {
            ordinal,
            fences: Fences::new(driver, ordinal),
            streams,
            vmm: std::sync::OnceLock::new(),
            deferred_releases: std::sync::Mutex::new(Vec::new()),
            holds_releases: false,
            foreign: None,
            pool_id: 0,
            lowest: AtomicU64::new(u64::MAX),
            highest: AtomicU64::new(0),
        };
        if expandable {
            device.offer_virtual_memory();
        }
        device
    }

    /// The device of the private pool `pool_id` (see Note [Private pools] in the shim's
    /// `process`): fixed segments, from `foreign` when given, and a release is held until the
    /// pool is no longer used ([`CudaDevice::release_deferred`]), since a graph may still write
    /// the memory; with virtual memory if `expandable` (whose maps the pool keeps: Note
    /// [Expandable private pools]).
    pub fn for_private_pool(
        driver: LoadedDriver,
        pool_id: u64,
        ordinal: i32,
        streams: Arc<StreamRegistry>,
        foreign: Option<ForeignAllocator>,
        expandable: bool,
    ) -> Self {
        if foreign.is_some() {
            crate::rare::note(crate::rare::FOREIGN);
        }
        CudaDevice {
            holds_releases: true,
            foreign,
            pool_id,
            ..CudaDevice::new(driver, ordinal, streams, expandable)
        }
    }

    /// Whether `address` may lie in memory of this device's pools: inside the span of every
    /// segment allocated and range reserved so far. The span is widened by the device call
    /// that made the memory, before the allocator can hand any of it out: another thread may
    /// get a block of new memory, and free it, before the call that made it has returned.
    pub fn may_contain(&self, address: u64) -> bool {
        address >= self.lowest.load(Ordering::Acquire)
            && address < self.highest.load(Ordering::Acquire)
    }

    /// Widen the span to include new memory (see [`CudaDevice::may_contain`]).
    fn cover(&self, address: u64, size: u64) {
        self.lowest.fetch_min(address, Ordering::AcqRel);
        self.highest
            .fetch_max(address.saturating_add(size), Ordering::AcqRel);
    }

    /// Tell the segment trackers of `action` on this device's memory (Note [Segment trackers]).
    fn tell(&self, action: c_int, address: u64, size: u64) {
        trackers::tell(action, self.ordinal, address, size, self.pool_id);
    }

    /// Run `f` in the relaxed capture mode while any capture is under way.
    fn capture_safe<T>(&self, f: impl FnOnce() -> T) -> T {
        if self.streams.captures_active() {
            capture_mode::relaxed(f)
        } else {
            f()
        }
    }

    /// Free the segments whose release waited for the end of a capture. Returns how many
    /// could not be freed.
    pub fn release_deferred(&self) -> usize {
        let segments = std::mem::take(
            &mut *self
                .deferred_releases
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        segments
            .into_iter()
            .filter(|&(address, size)| self.free_now(address, size).is_err())
            .count()
    }

    /// A new segment of `size` bytes: from the pool's own allocator, else from the driver.
    fn allocate_segment_now(&self, size: u64) -> Result<u64, DeviceError> {
        if let Some(foreign) = self.foreign {
            let ptr = foreign.alloc(size, self.ordinal);
            if ptr == 0 {
                return Err(DeviceError::OutOfMemory);
            }
            self.cover(ptr, size);
            return Ok(ptr);
        }
        let malloc = real_driver::cuMemAlloc_v2().ok_or_else(|| missing("cuMemAlloc_v2"))?;
        let mut ptr: u64 = 0;
        let code = self.capture_safe(|| {
            // SAFETY: valid out-pointer; `size` fits in usize on the 64-bit platforms we build
            // for; this device's context is current.
            self.fences
                .on_own_context(|| unsafe { malloc(&mut ptr, size as usize) })
        })?;
        match code {
            codes::SUCCESS if ptr != 0 => {
                self.cover(ptr, size);
                Ok(ptr)
            }
            // The driver keeps no sticky error for a failed allocation (the runtime did, which
            // is why this once cleared it).
            codes::ERROR_OUT_OF_MEMORY => Err(DeviceError::OutOfMemory),
            other => Err(driver_error(other, "cuMemAlloc_v2")),
        }
    }

    /// Run `make`, which maps the new device memory `mappings`, if the device's budget has
    /// room for them (else out of memory); they count as held if it succeeds.
    fn within_budget(
        &self,
        mappings: &[(u64, u64)],
        make: impl FnOnce() -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        let budget = budget::of(self.ordinal);
        let bytes = mappings.iter().map(|&(_, size)| size).sum();
        let taken = budget.take(bytes).ok_or(DeviceError::OutOfMemory)?;
        match make() {
            Ok(()) => {
                budget.made(taken, mappings.iter().map(|&(address, _)| address));
                Ok(())
            }
            Err(e) => {
                budget.not_made(taken);
                Err(e)
            }
        }
    }

    /// Free a segment now, and give its bytes back to the device's budget.
    fn free_now(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        let result = self.free_now_uncounted(address, size);
        if result.is_ok() {
            budget::of(self.ordinal).give_back(address, size);
        }
        result
    }

    fn free_now_uncounted(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        let sync = real_driver::cuCtxSynchronize().ok_or_else(|| missing("cuCtxSynchronize"))?;
        if let Some(foreign) = self.foreign {
            self.fences.on_own_context(|| {
                // SAFETY: no arguments; this device's context is current.
                unsafe { sync() };
            })?;
            foreign.free(address, size, self.ordinal);
            return Ok(());
        }
        let free = real_driver::cuMemFree_v2().ok_or_else(|| missing("cuMemFree_v2"))?;
        let code = self.fences.on_own_context(|| {
            // SAFETY: no arguments; this device's context is current. An error here is a
            // broken context, which cuMemFree below reports again.
            unsafe { sync() };
            // SAFETY: `address` is a segment cuMemAlloc_v2 returned and we still own.
            unsafe { free(address) }
        })?;
        match code {
            codes::SUCCESS | codes::ERROR_DEINITIALIZED => Ok(()),
            other => Err(driver_error(other, "cuMemFree_v2")),
        }
    }
}

fn missing(name: &str) -> DeviceError {
    DeviceError::Other {
        code: codes::ERROR_NOT_FOUND.0,
        message: format!("the CUDA driver lacks {name}"),
    }
}

fn driver_error(code: CuResult, what: &str) -> DeviceError {
    DeviceError::Other {
        code: code.0,
        message: format!("{what} returned {code}"),
    }
}

impl Device for CudaDevice {
    type Fence = Fence;

    fn mem_info(&self) -> MemInfo {
        let Some(get) = real_driver::cuMemGetInfo_v2() else {
            return MemInfo::default();
        };
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers for the duration of the call; this device's context is
        // current.
        let code = self
            .fences
            .on_own_context(|| unsafe { get(&mut free, &mut total) });
        if code != Ok(codes::SUCCESS) {
            return MemInfo::default();
        }
        MemInfo {
            free: free as u64,
            total: total as u64,
        }
    }

    fn shared_limit(&self) -> Option<SharedLimit> {
        let budget = budget::of(self.ordinal);
        let limit = budget.limit();
        (limit != u64::MAX).then(|| SharedLimit {
            limit,
            held: budget.held(),
            counts_synchronous: budget.scope() == budget::Scope::Everything,
        })
    }

    fn allocate_segment(&self, size: u64) -> Result<u64, DeviceError> {
        let budget = budget::of(self.ordinal);
        let taken = budget.take(size).ok_or(DeviceError::OutOfMemory)?;
        let result = self.allocate_segment_now(size);
        match result {
            Ok(address) => {
                budget.made(taken, [address]);
                self.tell(trackers::SEGMENT_ALLOC, address, size);
            }
            Err(_) => budget.not_made(taken),
        }
        result
    }

    fn free_segment(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.tell(trackers::SEGMENT_FREE, address, size);
        if self.holds_releases || self.streams.captures_active() {
            self.deferred_releases
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((address, size));
            return Ok(());
        }
        self.free_now(address, size)
    }

    fn record_fence(&self) -> Result<Fence, DeviceError> {
        self.capture_safe(|| {
            self.streams
                .with_fence_targets(self.ordinal, captures::is_capturing, |targets| {
                    self.fences.record(targets)
                })
        })
    }

    fn record_stream_fence(&self, stream: u64) -> Result<Fence, DeviceError> {
        let stream = Stream(stream as usize);
        let capturing = self.streams.is_capturing(stream)
            || (self.streams.captures_active() && captures::is_capturing(stream));
        if capturing {
            // An event recorded now would join the capture: a full fence instead (it leaves the
            // capturing stream out, and the barrier at the capture's start covers its earlier
            // work).
            return self.record_fence();
        }
        self.capture_safe(|| self.fences.record(&[stream]))
    }

    fn stream_wait(&self, stream: u64, fence: &Fence) -> Result<(), DeviceError> {
        self.capture_safe(|| self.fences.make_wait(Stream(stream as usize), fence))
    }

    fn fence_completed(&self, fence: &Fence) -> bool {
        self.capture_safe(|| self.fences.completed(fence))
    }

    fn wait_fence(&self, fence: &Fence) -> Result<(), DeviceError> {
        self.capture_safe(|| self.fences.wait(fence))
    }

    fn release_fence(&self, fence: Fence) {
        self.fences.release(fence);
    }

    fn map_granularity(&self) -> Option<u64> {
        self.vmm.get().map(vmm::Vmm::granularity)
    }

    fn offer_mapping(&self) -> Option<u64> {
        self.offer_virtual_memory()
    }

    fn reserve_range(&self, size: u64) -> Result<u64, DeviceError> {
        let vmm = self.vmm()?;
        let address = self.capture_safe(|| self.fences.on_own_context(|| vmm.reserve(size)))??;
        self.cover(address, size);
        Ok(address)
    }

    fn free_range(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        let vmm = self.vmm()?;
        self.capture_safe(|| self.fences.on_own_context(|| vmm.free_range(address, size)))?
    }

    fn map(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        let vmm = self.vmm()?;
        self.within_budget(&[(address, size)], || {
            self.capture_safe(|| self.fences.on_own_context(|| vmm.map(address, size)))?
        })?;
        self.tell(trackers::SEGMENT_MAP, address, size);
        Ok(())
    }

    fn map_run(&self, mappings: &[(u64, u64)]) -> Result<(), DeviceError> {
        let vmm = self.vmm()?;
        self.within_budget(mappings, || {
            self.capture_safe(|| self.fences.on_own_context(|| vmm.map_run(mappings)))?
        })?;
        for &(address, size) in mappings {
            self.tell(trackers::SEGMENT_MAP, address, size);
        }
        Ok(())
    }

    fn can_alias(&self) -> bool {
        self.vmm.get().is_some_and(vmm::Vmm::can_alias)
    }

    fn alias(&self, from: u64, to: u64, size: u64) -> Result<(), DeviceError> {
        self.map_with_moves(&[(from, to, size)], &[])
    }

    fn map_with_moves(
        &self,
        moves: &[(u64, u64, u64)],
        mappings: &[(u64, u64)],
    ) -> Result<(), DeviceError> {
        let vmm = self.vmm()?;
        // Moved memory is memory held already (its new place is the old one's for the budget's
        // counts); only the new mappings are more.
        self.within_budget(mappings, || {
            self.capture_safe(|| {
                (self.fences).on_own_context(|| vmm.map_with_moves(moves, mappings))
            })?
        })?;
        let moved = moves.iter().map(|&(from, to, _)| (from, to));
        budget::of(self.ordinal).moved(moved);
        let made = moves.iter().map(|&(_, to, size)| (to, size));
        for (address, size) in made.chain(mappings.iter().copied()) {
            self.tell(trackers::SEGMENT_MAP, address, size);
        }
        Ok(())
    }

    fn unmap(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        let vmm = self.vmm()?;
        if self.streams.captures_active() {
            return Err(DeviceError::Other {
                code: codes::ERROR_STREAM_CAPTURE_UNSUPPORTED.0,
                message: "unmapping waits for the end of the graph capture".to_string(),
            });
        }
        // The caller made sure nothing uses the memory (Device::unmap's contract).
        self.fences.on_own_context(|| vmm.unmap(address, size))??;
        budget::of(self.ordinal).give_back(address, size);
        self.tell(trackers::SEGMENT_UNMAP, address, size);
        Ok(())
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        if self.streams.captures_active() {
            return Err(DeviceError::Other {
                code: codes::ERROR_STREAM_CAPTURE_UNSUPPORTED.0,
                message: "a device synchronization waits for the end of the graph capture"
                    .to_string(),
            });
        }
        let sync = real_driver::cuCtxSynchronize().ok_or_else(|| missing("cuCtxSynchronize"))?;
        self.fences.on_own_context(|| {
            // SAFETY: no arguments; this device's context is current.
            match unsafe { sync() } {
                codes::SUCCESS => Ok(()),
                other => Err(driver_error(other, "cuCtxSynchronize")),
            }
        })?
    }

    fn record_idle_fence(&self, stream: u64) -> Result<Option<Fence>, DeviceError> {
        if self.streams.captures_active() {
            return Ok(None); // an event on a capturing stream would join the graph
        }
        // The legacy and per-thread handles (and synchronous allocations) mean no one stream:
        // an event on the legacy stream orders after every blocking stream, per-thread
        // default streams among them, and a full fence adds the non-blocking ones.
        if stream == NO_STREAM || stream <= cuda::STREAM_PER_THREAD as u64 {
            return self.record_fence().map(Some);
        }
        self.record_stream_fence(stream).map(Some)
    }
}

impl CudaDevice {
    /// Offer CUDA's virtual memory for expandable segments, if the device has it (else say why
    /// not, once). Returns the granularity.
    fn offer_virtual_memory(&self) -> Option<u64> {
        if let Some(vmm) = self.vmm.get() {
            return Some(vmm.granularity());
        }
        static SAID: AtomicBool = AtomicBool::new(false);
        match vmm::Vmm::probe(self.ordinal) {
            Ok(vmm) => Some(self.vmm.get_or_init(|| vmm).granularity()),
            Err(why) => {
                if !SAID.swap(true, Ordering::Relaxed) {
                    crate::log::info!(
                        "expandable segments unavailable on device {}: {why}; using fixed \
                         segments",
                        self.ordinal
                    );
                }
                None
            }
        }
    }

    /// The device was reset: the memory mapped for expandable segments went with its context,
    /// so no peer is to be granted it any more.
    pub fn forget_mappings(&self) {
        if let Some(vmm) = self.vmm.get() {
            vmm.forget_mappings();
        }
    }

    /// Give `peer`, which may now use this device's memory, access to the memory mapped for
    /// expandable segments. Returns how many mappings could not be granted.
    pub fn grant_peer(&self, peer: i32) -> Result<usize, DeviceError> {
        match self.vmm.get() {
            Some(vmm) => self.capture_safe(|| self.fences.on_own_context(|| vmm.grant(peer))),
            None => Ok(0),
        }
    }

    /// Export the memory mapped over the block `[address, address + size)` of an expandable
    /// segment, for another process (see Note [IPC of pooled memory] in the shim's
    /// `process::ipc`).
    pub fn export_mapped(&self, address: u64, size: u64) -> Result<Exported, String> {
        let vmm = self.vmm().map_err(|e| e.to_string())?;
        self.capture_safe(|| self.fences.on_own_context(|| vmm.export(address, size)))
            .map_err(|e| e.to_string())?
    }

    fn vmm(&self) -> Result<&vmm::Vmm, DeviceError> {
        self.vmm
            .get()
            .ok_or_else(|| DeviceError::unsupported("virtual memory"))
    }
}
