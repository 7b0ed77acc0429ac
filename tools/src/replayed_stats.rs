//! PyTorch's `torch.cuda.memory_stats()` recomputed from a trace's records, as a
//! [`TraceWalk`](crate::walk::TraceWalk) meets them: every `current`/`peak`/`allocated`/`freed` counter, for `all`, `small_pool` and
//! `large_pool`, kept in the allocator's own [`Stats`] (whose key names are the only ones), with
//! PyTorch's meanings:
//!
//! * `allocation`, `allocated_bytes` fall when the application frees a block;
//! * `active`, `active_bytes`, `requested_bytes` fall when the block becomes reusable (after its
//!   reuse fence), so pending frees still count as active;
//! * `segment`, `reserved_bytes` follow device allocations and releases.
//!
//! A block's pool is its segment's. Counters cover what the trace covers: a trace that starts
//! mid-run (rotation dropped its first files) counts the blocks of its first checkpoint as
//! allocated then.

use std::collections::{BTreeMap, HashMap};

use cachealloc_recorder::schema::SegmentState;
use cachealloc_recorder::{Record, schema, spans};

use cachealloc_core::sizes::PoolKind;
use cachealloc_core::stats::{Counter, StatAt, StatKind, Stats};

use crate::walk::Step;

/// The `memory_stats()` arrays a trace determines: all but `inactive_split` (the count; its
/// bytes are known, `current` only, at the end).
const ARRAYS: [StatKind; 8] = [
    StatKind::Active,
    StatKind::ActiveBytes,
    StatKind::AllocatedBytes,
    StatKind::Allocation,
    StatKind::RequestedBytes,
    StatKind::ReservedBytes,
    StatKind::Segment,
    StatKind::InactiveSplitBytes,
];

/// The `memory_stats()` counters a trace determines (not retries, fence waits, cache hits nor
/// `max_split_size`).
const COUNTERS: [Counter; 3] = [Counter::Ooms, Counter::DeviceAlloc, Counter::DeviceFree];

#[derive(Debug, Clone, Copy)]
struct Block {
    size: u64,
    requested: u64,
    pool: PoolKind,
    pending: bool,
}

/// Counters of one device.
#[derive(Debug, Clone, Default)]
pub struct DeviceStats {
    /// The counters, as the allocator keeps them; only those a trace determines are filled
    /// (`inactive_split_bytes` by [`StatsTracker::finish`]).
    pub stats: Stats,
    segments: BTreeMap<u64, SegmentState>,
    blocks: HashMap<u64, Block>,
}

/// The pool a trace's pool byte names.
fn pool_kind(pool: u8) -> PoolKind {
    if pool == schema::POOL_SMALL {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// A live segment, or a mapped run of an expandable segment (see `recorder::spans`).
fn segment(address: u64, size: u64, pool: u8) -> SegmentState {
    SegmentState {
        device: 0,
        address,
        size,
        pool,
        stack: 0,
    }
}

/// Where a change is counted: the whole allocator's statistics (what `cachealloc stats`
/// shows); the stream-ordered view PyTorch is given is not replayed here.
fn whole(pool: PoolKind) -> StatAt {
    StatAt {
        pool,
        stream_ordered: false,
    }
}

impl DeviceStats {
    fn pool_of(&self, address: u64) -> PoolKind {
        self.segments
            .range(..=address)
            .next_back()
            .filter(|(start, seg)| address < *start + seg.size)
            .map_or(PoolKind::Large, |(_, seg)| pool_kind(seg.pool))
    }

    fn alloc(&mut self, address: u64, size: u64, requested: u64, pending: bool) {
        let pool = self.pool_of(address);
        self.blocks.insert(
            address,
            Block {
                size,
                requested,
                pool,
                pending,
            },
        );
        let s = &mut self.stats;
        s.active.increase(whole(pool), 1);
        s.active_bytes.increase(whole(pool), size);
        s.requested_bytes.increase(whole(pool), requested);
        if !pending {
            s.allocated_bytes.increase(whole(pool), size);
            s.allocation.increase(whole(pool), 1);
        }
    }

    fn free_requested(&mut self, address: u64) {
        if let Some(b) = self.blocks.get_mut(&address)
            && !b.pending
        {
            b.pending = true;
            self.stats.allocated_bytes.decrease(whole(b.pool), b.size);
            self.stats.allocation.decrease(whole(b.pool), 1);
        }
    }

    fn free_completed(&mut self, address: u64) {
        self.free_requested(address);
        if let Some(b) = self.blocks.remove(&address) {
            self.stats.active.decrease(whole(b.pool), 1);
            self.stats.active_bytes.decrease(whole(b.pool), b.size);
            self.stats
                .requested_bytes
                .decrease(whole(b.pool), b.requested);
        }
    }

    fn segment(&mut self, address: u64, size: u64, pool: u8) {
        let seg = segment(address, size, pool);
        self.segments.insert(address, seg);
        self.stats
            .reserved_bytes
            .increase(whole(pool_kind(pool)), size);
        self.stats.segment.increase(whole(pool_kind(pool)), 1);
    }

    fn segment_free(&mut self, address: u64) {
        if let Some(seg) = self.segments.remove(&address) {
            self.stats
                .reserved_bytes
                .decrease(whole(pool_kind(seg.pool)), seg.size);
            self.stats.segment.decrease(whole(pool_kind(seg.pool)), 1);
        }
    }

    /// Memory mapped into an expandable segment: reserved, but not a segment of its own (as
    /// PyTorch counts expandable segments).
    fn segment_map(&mut self, address: u64, size: u64, pool: u8) {
        spans::map(&mut self.segments, |a| a, segment(address, size, pool));
        self.stats
            .reserved_bytes
            .increase(whole(pool_kind(pool)), size);
    }

    fn segment_unmap(&mut self, address: u64, size: u64) {
        if let Some(run) = spans::unmap(&mut self.segments, |a| a, address, size) {
            self.stats
                .reserved_bytes
                .decrease(whole(pool_kind(run.pool)), size);
        }
    }

    /// Free bytes inside segments that still hold an active block, per pool: (small, large).
    fn inactive_split(&self) -> (u64, u64) {
        let mut used: HashMap<u64, u64> = HashMap::new();
        for (&address, b) in &self.blocks {
            if let Some((&start, _)) = self.segments.range(..=address).next_back() {
                *used.entry(start).or_default() += b.size;
            }
        }
        let (mut small, mut large) = (0, 0);
        for (start, used) in used {
            let seg = self.segments[&start];
            let free = seg.size.saturating_sub(used);
            match pool_kind(seg.pool) {
                PoolKind::Small => small += free,
                PoolKind::Large => large += free,
            }
        }
        (small, large)
    }

    /// `memory_stats()`'s dictionary (the keys a trace determines), keys sorted as PyTorch
    /// returns them.
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut map: BTreeMap<String, i64> = ARRAYS
            .into_iter()
            .flat_map(|kind| self.stats.flat_entries(kind))
            .collect();
        for counter in COUNTERS {
            map.insert(counter.name().into(), self.stats.counter(counter));
        }
        map
    }
}

/// Keeps [`DeviceStats`] for every device while a trace is walked.
#[derive(Debug, Default)]
pub struct StatsTracker {
    /// Per device.
    pub devices: BTreeMap<u32, DeviceStats>,
    checkpoint: Option<Vec<Record>>,
    files_seen: usize,
}

impl StatsTracker {
    /// Account for one record of the walk.
    pub fn apply(&mut self, step: &Step) {
        match &step.record {
            Record::Header(_) => {
                self.files_seen += 1;
                self.checkpoint = Some(vec![]);
                return;
            }
            Record::CheckpointSegment(_) | Record::CheckpointBlock(_) => {
                if let Some(c) = &mut self.checkpoint {
                    c.push(step.record.clone());
                }
                return;
            }
            Record::CheckpointEnd(_) => {
                let records = self.checkpoint.take().unwrap_or_default();
                self.load_checkpoint(&records);
                return;
            }
            _ => {}
        }
        self.event(&step.record);
    }

    /// The first file's checkpoint is counted as events; a later one (the same state unless a
    /// tear came before) replaces the live maps and leaves the counters alone.
    fn load_checkpoint(&mut self, records: &[Record]) {
        let first = self.files_seen <= 1;
        if !first {
            for d in self.devices.values_mut() {
                d.segments.clear();
                d.blocks.clear();
            }
        }
        for r in records {
            match r {
                Record::CheckpointSegment(s) => {
                    let d = self.devices.entry(s.device).or_default();
                    if first {
                        d.segment(s.address, s.size, s.pool);
                    } else {
                        d.segments
                            .insert(s.address, segment(s.address, s.size, s.pool));
                    }
                }
                Record::CheckpointBlock(b) => {
                    let d = self.devices.entry(b.device).or_default();
                    if first {
                        d.alloc(b.address, b.size, b.requested, b.pending != 0);
                    } else {
                        let pool = d.pool_of(b.address);
                        d.blocks.insert(
                            b.address,
                            Block {
                                size: b.size,
                                requested: b.requested,
                                pool,
                                pending: b.pending != 0,
                            },
                        );
                    }
                }
                _ => {}
            }
        }
    }

    fn event(&mut self, record: &Record) {
        match record {
            Record::Alloc(a) => self.devices.entry(a.device).or_default().alloc(
                a.address,
                a.size,
                a.requested,
                false,
            ),
            Record::FreeRequested(f) => self
                .devices
                .entry(f.device)
                .or_default()
                .free_requested(f.address),
            Record::Free(f) => self
                .devices
                .entry(f.device)
                .or_default()
                .free_completed(f.address),
            Record::FreeCompleted(f) => self
                .devices
                .entry(f.device)
                .or_default()
                .free_completed(f.address),
            Record::SegmentAlloc(s) => {
                let d = self.devices.entry(s.device).or_default();
                d.stats.num_device_alloc += 1;
                d.segment(s.address, s.size, s.pool);
            }
            Record::SegmentFree(s) => {
                let d = self.devices.entry(s.device).or_default();
                d.stats.num_device_free += 1;
                d.segment_free(s.address);
            }
            Record::SegmentMap(s) => {
                let d = self.devices.entry(s.device).or_default();
                d.stats.num_device_alloc += 1;
                d.segment_map(s.address, s.size, s.pool);
            }
            Record::SegmentUnmap(s) => {
                let d = self.devices.entry(s.device).or_default();
                d.stats.num_device_free += 1;
                d.segment_unmap(s.address, s.size);
            }
            Record::Oom(o) => self.devices.entry(o.device).or_default().stats.num_ooms += 1,
            _ => {}
        }
    }

    /// Fill the counters only known at the end (`inactive_split_bytes`, current only).
    pub fn finish(&mut self) {
        for d in self.devices.values_mut() {
            let (small, large) = d.inactive_split();
            let split = &mut d.stats.inactive_split_bytes;
            split.all.current = (small + large) as i64;
            split.small_pool.current = small as i64;
            split.large_pool.current = large as i64;
        }
    }
}
