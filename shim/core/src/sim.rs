//! [`SimDevice`]: a simulated device for tests, benchmarks and `cachealloc simulate`.
//!
//! It has a fixed capacity, hands out increasing addresses that are never reused (so a stale
//! pointer can never alias a new segment by accident), and completes fences either at once or
//! when the test says so. Failures can be injected. With [`SimDevice::with_map_granularity`] it
//! also offers virtual memory (reserve, map, alias, unmap) and refuses every misuse the CUDA
//! driver refuses: mapping outside a reserved range, mapping twice, unmapping anything but one
//! whole earlier mapping — so the tests catch an allocator that gets its expandable segments
//! wrong. It knows which memory is behind every mapped address ([`SimDevice::memory_of`]), so
//! the tests also catch two live blocks sharing memory through aliases.

use std::collections::{BTreeMap, BTreeSet};

use parking_lot::Mutex;

use crate::device::{Device, DeviceError, MemInfo};

/// First address handed out; arbitrary, but high like a real device's.
const BASE_ADDRESS: u64 = 0x7f00_0000_0000;
/// Alignment of segment addresses (the CUDA driver aligns large allocations to 2 MiB).
const SEGMENT_ALIGNMENT: u64 = 2 << 20;
/// First address of reserved (virtual) ranges: far from the segments.
const RANGE_BASE_ADDRESS: u64 = 0x5000_0000_0000;

/// When fences complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FenceMode {
    /// Every fence is complete as soon as it is recorded (an idle GPU).
    #[default]
    Immediate,
    /// Fences complete only through [`SimDevice::complete_fences`] or a wait.
    Manual,
}

/// A fence of the simulated device: its sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SimFence(pub u64);

/// Counters of what the allocator asked of the simulated device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// Successful segment allocations.
    pub allocs: u64,
    /// Segment releases.
    pub frees: u64,
    /// Allocations refused (capacity or injected).
    pub failed_allocs: u64,
    /// Fences recorded.
    pub fences: u64,
    /// Blocking waits on a fence.
    pub waits: u64,
    /// Stream waits on a fence (device-side dependencies: nothing blocks).
    pub stream_waits: u64,
    /// Successful [`Device::map`] calls (each new memory).
    pub maps: u64,
    /// Successful [`Device::alias`] calls (memory mapped at a second place).
    pub aliases: u64,
    /// [`Device::unmap`] calls.
    pub unmaps: u64,
    /// [`Device::synchronize`] calls (each completes every fence).
    pub synchronizes: u64,
}

#[derive(Debug)]
struct SimState {
    capacity: u64,
    used: u64,
    next_address: u64,
    /// Live segments: address → size.
    segments: BTreeMap<u64, u64>,
    fence_mode: FenceMode,
    next_fence: u64,
    completed_through: u64,
    fail_next_allocs: u32,
    counters: SimCounters,
    /// Addresses to hand out next, with the sizes they are for ([`SimDevice::plan_addresses`]).
    planned: std::collections::VecDeque<(u64, u64)>,
    /// Virtual memory: the granularity, if offered.
    granularity: Option<u64>,
    next_range: u64,
    /// Reserved ranges: address → size.
    ranges: BTreeMap<u64, u64>,
    /// Mapped granules, by address.
    mapped: BTreeSet<u64>,
    /// Live mappings: address → (size, memory); an unmap must name one whole.
    mappings: BTreeMap<u64, (u64, u64)>,
    /// Memory behind mappings: id → (size, how many mappings map it). It is freed with its
    /// last mapping.
    memories: BTreeMap<u64, (u64, u32)>,
    next_memory: u64,
    /// Whether [`Device::alias`] works (on by default).
    aliasing: bool,
    /// See [`SimDevice::set_slow_calls`].
    slow_calls: bool,
    /// Streams the application destroyed ([`SimDevice::destroy_stream`]).
    destroyed_streams: BTreeSet<u64>,
}

/// A capacity-limited simulated device. Cheap to share between threads.
#[derive(Debug)]
pub struct SimDevice {
    state: Mutex<SimState>,
}

impl SimDevice {
    /// A device with `capacity` bytes whose fences complete immediately.
    pub fn new(capacity: u64) -> Self {
        Self::with_fence_mode(capacity, FenceMode::Immediate)
    }

    /// A device with `capacity` bytes and the given fence behaviour.
    pub fn with_fence_mode(capacity: u64, fence_mode: FenceMode) -> Self {
        SimDevice {
            state: Mutex::new(SimState {
                capacity,
                used: 0,
                next_address: BASE_ADDRESS,
                segments: BTreeMap::new(),
                fence_mode,
                next_fence: 1,
                completed_through: 0,
                fail_next_allocs: 0,
                counters: SimCounters::default(),
                planned: std::collections::VecDeque::new(),
                granularity: None,
                next_range: RANGE_BASE_ADDRESS,
                ranges: BTreeMap::new(),
                mapped: BTreeSet::new(),
                mappings: BTreeMap::new(),
                memories: BTreeMap::new(),
                next_memory: 1,
                aliasing: true,
                slow_calls: false,
                destroyed_streams: BTreeSet::new(),
            }),
        }
    }

    /// Offer virtual memory in units of `granularity` bytes (a positive multiple of 512).
    pub fn with_map_granularity(self, granularity: u64) -> Self {
        assert!(granularity > 0 && granularity.is_multiple_of(512));
        self.state.lock().granularity = Some(granularity);
        self
    }

    /// Whether every byte of `[address, address + size)` is backed by memory: inside a live
    /// segment, or in mapped granules.
    pub fn is_backed(&self, address: u64, size: u64) -> bool {
        let s = self.state.lock();
        if let Some((&start, &len)) = s.segments.range(..=address).next_back()
            && address + size <= start + len
        {
            return true;
        }
        let Some(g) = s.granularity else {
            return false;
        };
        let first = address / g * g;
        (first..address + size)
            .step_by(g as usize)
            .all(|granule| s.mapped.contains(&granule))
    }

    /// Bytes of memory behind mappings (memory mapped at several places counts once).
    pub fn mapped_bytes(&self) -> u64 {
        self.state
            .lock()
            .memories
            .values()
            .map(|&(size, _)| size)
            .sum()
    }

    /// The memory behind `[address, address + size)`, in pieces `(memory, start, end)` of
    /// offsets into each memory, or `None` where some of it has none. A live segment is its own
    /// memory, named by its address; mapped memory is named by an id of its own, the same at
    /// every place it is mapped. Two ranges whose pieces overlap share bytes.
    pub fn memory_of(&self, address: u64, size: u64) -> Option<Vec<(u64, u64, u64)>> {
        let s = self.state.lock();
        if let Some((&start, &len)) = s.segments.range(..=address).next_back()
            && address + size <= start + len
        {
            return Some(vec![(start, address - start, address - start + size)]);
        }
        let mut pieces = Vec::new();
        let (mut at, end) = (address, address + size);
        while at < end {
            let (&start, &(len, memory)) = s.mappings.range(..=at).next_back()?;
            if at >= start + len {
                return None;
            }
            let upto = end.min(start + len);
            pieces.push((memory, at - start, upto - start));
            at = upto;
        }
        Some(pieces)
    }

    /// Make every map, alias and unmap give up the CPU first, as a real driver's slow calls do,
    /// so that tests of threads racing around them see the races.
    pub fn set_slow_calls(&self, on: bool) {
        self.state.lock().slow_calls = on;
    }

    /// Give up the CPU if calls are slow ([`SimDevice::set_slow_calls`]).
    fn maybe_yield(&self) {
        if self.state.lock().slow_calls {
            std::thread::yield_now();
        }
    }

    /// How many mappings map memory that is mapped elsewhere too: mappings beyond one per
    /// memory.
    pub fn second_mappings(&self) -> usize {
        let s = self.state.lock();
        s.mappings.len() - s.memories.len()
    }

    /// Turn [`Device::alias`] off (or on again), as on a driver without it.
    pub fn set_aliasing(&self, on: bool) {
        self.state.lock().aliasing = on;
    }

    /// Mark every fence recorded so far as complete (the GPU caught up).
    pub fn complete_fences(&self) {
        let mut s = self.state.lock();
        s.completed_through = s.next_fence - 1;
    }

    /// Mark `fence` and every fence recorded before it as complete.
    pub fn complete_through(&self, fence: &SimFence) {
        let mut s = self.state.lock();
        s.completed_through = s.completed_through.max(fence.0);
    }

    /// Hand out these addresses, in order, for the next segment allocations: `(size, address)`.
    /// An allocation of another size than the next planned one, or one whose planned address
    /// would overlap a live segment, gets a fresh address instead. `cachealloc simulate` replays
    /// a run's segment addresses this way, so that best-fit ties between equal blocks break as
    /// they did in the run.
    pub fn plan_addresses(&self, plan: impl IntoIterator<Item = (u64, u64)>) {
        self.state.lock().planned.extend(plan);
    }

    /// Make the next `n` segment allocations fail with out-of-memory.
    pub fn fail_next_allocs(&self, n: u32) {
        self.state.lock().fail_next_allocs = n;
    }

    /// Bytes of live segments.
    pub fn used(&self) -> u64 {
        self.state.lock().used
    }

    /// Number of live segments.
    pub fn live_segments(&self) -> usize {
        self.state.lock().segments.len()
    }

    /// The application destroyed `stream`: from now on a fence recorded on it, or a wait made
    /// on it, panics — the driver's undefined behaviour (a use of a dangling handle), made loud.
    pub fn destroy_stream(&self, stream: u64) {
        self.state.lock().destroyed_streams.insert(stream);
    }

    fn check_stream_alive(&self, stream: u64, what: &str) {
        assert!(
            !self.state.lock().destroyed_streams.contains(&stream),
            "{what} on stream {stream:#x}, which the application destroyed"
        );
    }

    /// Number of fences recorded so far (fences are numbered from 1).
    pub fn fences_recorded(&self) -> u64 {
        self.state.lock().next_fence - 1
    }

    /// Every fence numbered up to this one has completed.
    pub fn completed_through(&self) -> u64 {
        self.state.lock().completed_through
    }

    /// What the allocator asked so far.
    pub fn counters(&self) -> SimCounters {
        self.state.lock().counters
    }
}

impl Device for SimDevice {
    type Fence = SimFence;

    fn mem_info(&self) -> MemInfo {
        let s = self.state.lock();
        MemInfo {
            free: s.capacity - s.used,
            total: s.capacity,
        }
    }

    fn allocate_segment(&self, size: u64) -> Result<u64, DeviceError> {
        let mut s = self.state.lock();
        if s.fail_next_allocs > 0 {
            s.fail_next_allocs -= 1;
            s.counters.failed_allocs += 1;
            return Err(DeviceError::OutOfMemory);
        }
        if size == 0 || size > s.capacity - s.used {
            s.counters.failed_allocs += 1;
            return Err(DeviceError::OutOfMemory);
        }
        let planned = match s.planned.front() {
            Some(&(planned_size, address)) if planned_size == size => {
                s.planned.pop_front();
                let overlaps = s
                    .segments
                    .range(..address + size)
                    .next_back()
                    .is_some_and(|(&start, &len)| start + len > address);
                (!overlaps).then_some(address)
            }
            _ => None,
        };
        let address = match planned {
            Some(address) => address,
            None => {
                let address = s.next_address;
                s.next_address += crate::sizes::round_up(size, SEGMENT_ALIGNMENT);
                address
            }
        };
        s.used += size;
        s.segments.insert(address, size);
        s.counters.allocs += 1;
        Ok(address)
    }

    fn free_segment(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        let mut s = self.state.lock();
        match s.segments.remove(&address) {
            Some(recorded) if recorded == size => {
                s.used -= size;
                s.counters.frees += 1;
                Ok(())
            }
            Some(recorded) => {
                s.segments.insert(address, recorded);
                Err(DeviceError::Other {
                    code: 1,
                    message: format!("segment {address:#x} has {recorded} bytes, not {size}"),
                })
            }
            None => Err(DeviceError::Other {
                code: 1,
                message: format!("{address:#x} is not a live segment"),
            }),
        }
    }

    fn record_fence(&self) -> Result<SimFence, DeviceError> {
        let mut s = self.state.lock();
        let fence = SimFence(s.next_fence);
        s.next_fence += 1;
        s.counters.fences += 1;
        if s.fence_mode == FenceMode::Immediate {
            s.completed_through = fence.0;
        }
        Ok(fence)
    }

    fn fence_completed(&self, fence: &SimFence) -> bool {
        fence.0 <= self.state.lock().completed_through
    }

    fn record_stream_fence(&self, stream: u64) -> Result<SimFence, DeviceError> {
        self.check_stream_alive(stream, "a fence recorded");
        self.record_fence()
    }

    fn stream_wait(&self, stream: u64, _fence: &SimFence) -> Result<(), DeviceError> {
        self.check_stream_alive(stream, "a wait made");
        self.state.lock().counters.stream_waits += 1;
        Ok(())
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        let mut s = self.state.lock();
        s.counters.synchronizes += 1;
        s.completed_through = s.next_fence - 1;
        Ok(())
    }

    fn wait_fence(&self, fence: &SimFence) -> Result<(), DeviceError> {
        let mut s = self.state.lock();
        s.counters.waits += 1;
        s.completed_through = s.completed_through.max(fence.0);
        Ok(())
    }

    fn map_granularity(&self) -> Option<u64> {
        self.state.lock().granularity
    }

    fn reserve_range(&self, size: u64) -> Result<u64, DeviceError> {
        let mut s = self.state.lock();
        let g = s
            .granularity
            .ok_or(DeviceError::unsupported("reserve_range"))?;
        if size == 0 || !size.is_multiple_of(g) {
            return Err(misuse(format!(
                "reserve of {size} bytes: not a multiple of {g}"
            )));
        }
        let address = crate::sizes::round_up(s.next_range, g);
        s.next_range = address + size;
        s.ranges.insert(address, size);
        Ok(address)
    }

    fn free_range(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        let mut s = self.state.lock();
        if s.ranges.get(&address) != Some(&size) {
            return Err(misuse(format!(
                "{address:#x}+{size} is not a reserved range"
            )));
        }
        if s.mapped.range(address..address + size).next().is_some() {
            return Err(misuse(format!(
                "range {address:#x} still has mapped memory"
            )));
        }
        s.ranges.remove(&address);
        Ok(())
    }

    fn map(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.maybe_yield();
        let mut s = self.state.lock();
        let granules = s.granules(address, size)?;
        if let Some(g) = granules.clone().find(|g| s.mapped.contains(g)) {
            return Err(misuse(format!("granule {g:#x} is mapped already")));
        }
        if s.fail_next_allocs > 0 {
            s.fail_next_allocs -= 1;
            s.counters.failed_allocs += 1;
            return Err(DeviceError::OutOfMemory);
        }
        if size > s.capacity - s.used {
            s.counters.failed_allocs += 1;
            return Err(DeviceError::OutOfMemory);
        }
        s.mapped.extend(granules);
        let memory = s.next_memory;
        s.next_memory += 1;
        s.memories.insert(memory, (size, 1));
        s.mappings.insert(address, (size, memory));
        s.used += size;
        s.counters.maps += 1;
        Ok(())
    }

    fn can_alias(&self) -> bool {
        let s = self.state.lock();
        s.granularity.is_some() && s.aliasing
    }

    fn alias(&self, from: u64, to: u64, size: u64) -> Result<(), DeviceError> {
        self.maybe_yield();
        let mut s = self.state.lock();
        if !s.aliasing {
            return Err(DeviceError::unsupported("alias"));
        }
        let granules = s.granules(to, size)?;
        let Some(&(mapped_size, memory)) = s.mappings.get(&from) else {
            return Err(misuse(format!("alias of {from:#x}: not a mapping")));
        };
        if mapped_size != size {
            return Err(misuse(format!(
                "alias of {from:#x}+{mapped_size} as {size} bytes (the driver maps whole memory)"
            )));
        }
        if let Some(g) = granules.clone().find(|g| s.mapped.contains(g)) {
            return Err(misuse(format!("granule {g:#x} is mapped already")));
        }
        s.mapped.extend(granules);
        s.mappings.insert(to, (size, memory));
        s.memories.get_mut(&memory).expect("mapped memory").1 += 1;
        s.counters.aliases += 1;
        Ok(())
    }

    fn unmap(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.maybe_yield();
        let mut s = self.state.lock();
        let granules = s.granules(address, size)?;
        let Some(&(mapped_size, memory)) = s.mappings.get(&address).filter(|m| m.0 == size) else {
            return Err(misuse(format!(
                "{address:#x}+{size} is not one whole mapping (the driver unmaps only those)"
            )));
        };
        s.mappings.remove(&address);
        for g in granules {
            s.mapped.remove(&g);
        }
        let left = {
            let m = s.memories.get_mut(&memory).expect("mapped memory");
            m.1 -= 1;
            m.1
        };
        if left == 0 {
            s.memories.remove(&memory);
            s.used -= mapped_size;
        }
        s.counters.unmaps += 1;
        Ok(())
    }
}

impl SimState {
    /// The granules of `[address, address + size)`, which must be whole granules inside one
    /// reserved range.
    fn granules(
        &self,
        address: u64,
        size: u64,
    ) -> Result<std::iter::StepBy<std::ops::Range<u64>>, DeviceError> {
        let g = self.granularity.ok_or(DeviceError::unsupported("map"))?;
        if size == 0 || !size.is_multiple_of(g) || !address.is_multiple_of(g) {
            return Err(misuse(format!(
                "{address:#x}+{size} is not whole granules of {g}"
            )));
        }
        let inside = self
            .ranges
            .range(..=address)
            .next_back()
            .is_some_and(|(&start, &len)| address + size <= start + len);
        if !inside {
            return Err(misuse(format!(
                "{address:#x}+{size} is outside every reserved range"
            )));
        }
        Ok((address..address + size).step_by(g as usize))
    }
}

/// A call the CUDA driver would refuse (`CUDA_ERROR_INVALID_VALUE`).
fn misuse(message: String) -> DeviceError {
    DeviceError::Other { code: 1, message }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_increase_and_capacity_is_enforced() {
        let dev = SimDevice::new(8 << 20);
        let a = dev.allocate_segment(2 << 20).unwrap();
        let b = dev.allocate_segment(4 << 20).unwrap();
        assert!(b > a);
        assert_eq!(dev.allocate_segment(4 << 20), Err(DeviceError::OutOfMemory));
        dev.free_segment(a, 2 << 20).unwrap();
        let c = dev.allocate_segment(4 << 20).unwrap();
        assert!(c > b, "addresses are never reused");
        assert_eq!(
            dev.mem_info(),
            MemInfo {
                free: 0,
                total: 8 << 20
            }
        );
        assert!(
            dev.free_segment(a, 2 << 20).is_err(),
            "double release is refused"
        );
    }

    #[test]
    fn manual_fences_complete_on_demand() {
        let dev = SimDevice::with_fence_mode(1 << 30, FenceMode::Manual);
        let f1 = dev.record_fence().unwrap();
        assert!(!dev.fence_completed(&f1));
        dev.complete_fences();
        assert!(dev.fence_completed(&f1));
        let f2 = dev.record_fence().unwrap();
        assert!(!dev.fence_completed(&f2));
        dev.wait_fence(&f2).unwrap();
        assert!(dev.fence_completed(&f2));
        assert_eq!(dev.counters().waits, 1);
    }

    #[test]
    fn injected_failures_are_counted() {
        let dev = SimDevice::new(1 << 30);
        dev.fail_next_allocs(1);
        assert!(dev.allocate_segment(2 << 20).is_err());
        assert!(dev.allocate_segment(2 << 20).is_ok());
        assert_eq!(dev.counters().failed_allocs, 1);
    }
}
