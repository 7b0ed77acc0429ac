//! PyTorch's `torch.cuda.memory_stats()` over a replay: every `current`/`peak`/`allocated`/
//! `freed` counter, for `all`, `small_pool` and `large_pool`, with PyTorch's meanings:
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

use cachealloc_core::stats::Stat;

use crate::replay::Step;

/// The metrics with `all`/`small_pool`/`large_pool` variants, in PyTorch's key order.
pub const METRICS: [&str; 8] = [
    "active",
    "active_bytes",
    "allocated_bytes",
    "allocation",
    "requested_bytes",
    "reserved_bytes",
    "segment",
    "inactive_split_bytes",
];

/// Pools: `all`, `small_pool`, `large_pool`.
pub const POOLS: [&str; 3] = ["all", "small_pool", "large_pool"];

#[derive(Debug, Clone, Copy)]
struct Block {
    size: u64,
    requested: u64,
    pool: usize,
    pending: bool,
}

/// Counters of one device.
#[derive(Debug, Clone, Default)]
pub struct DeviceStats {
    /// `[metric][pool]`, indexed as [`METRICS`] and [`POOLS`] (`inactive_split_bytes` is filled
    /// by [`StatsTracker::finish`]).
    pub stats: [[Stat; 3]; 8],
    /// `num_ooms`.
    pub num_ooms: u64,
    /// `num_device_alloc`.
    pub num_device_alloc: u64,
    /// `num_device_free`.
    pub num_device_free: u64,
    segments: BTreeMap<u64, SegmentState>,
    blocks: HashMap<u64, Block>,
}

/// A pool byte's index in the stats arrays (1 small, 2 large).
fn pool_index(pool: u8) -> usize {
    if pool == schema::POOL_SMALL { 1 } else { 2 }
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

impl DeviceStats {
    fn pool_of(&self, address: u64) -> usize {
        self.segments
            .range(..=address)
            .next_back()
            .filter(|(start, seg)| address < *start + seg.size)
            .map_or(2, |(_, seg)| pool_index(seg.pool))
    }

    fn bump(&mut self, metric: usize, pool: usize, n: i64) {
        for p in [0, pool] {
            if n >= 0 {
                self.stats[metric][p].increase(n.unsigned_abs());
            } else {
                self.stats[metric][p].decrease(n.unsigned_abs());
            }
        }
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
        self.bump(0, pool, 1);
        self.bump(1, pool, size as i64);
        self.bump(4, pool, requested as i64);
        if !pending {
            self.bump(2, pool, size as i64);
            self.bump(3, pool, 1);
        }
    }

    fn free_requested(&mut self, address: u64) {
        if let Some(b) = self.blocks.get_mut(&address)
            && !b.pending
        {
            b.pending = true;
            let (pool, size) = (b.pool, b.size);
            self.bump(2, pool, -(size as i64));
            self.bump(3, pool, -1);
        }
    }

    fn free_completed(&mut self, address: u64) {
        self.free_requested(address);
        if let Some(b) = self.blocks.remove(&address) {
            self.bump(0, b.pool, -1);
            self.bump(1, b.pool, -(b.size as i64));
            self.bump(4, b.pool, -(b.requested as i64));
        }
    }

    fn segment(&mut self, address: u64, size: u64, pool: u8) {
        let seg = segment(address, size, pool);
        self.segments.insert(address, seg);
        self.bump(5, pool_index(seg.pool), size as i64);
        self.bump(6, pool_index(seg.pool), 1);
    }

    fn segment_free(&mut self, address: u64) {
        if let Some(seg) = self.segments.remove(&address) {
            self.bump(5, pool_index(seg.pool), -(seg.size as i64));
            self.bump(6, pool_index(seg.pool), -1);
        }
    }

    /// Memory mapped into an expandable segment: reserved, but not a segment of its own (as
    /// PyTorch counts expandable segments).
    fn segment_map(&mut self, address: u64, size: u64, pool: u8) {
        let seg = segment(address, size, pool);
        spans::map(&mut self.segments, |a| a, seg);
        self.bump(5, pool_index(seg.pool), size as i64);
    }

    fn segment_unmap(&mut self, address: u64, size: u64) {
        if let Some(run) = spans::unmap(&mut self.segments, |a| a, address, size) {
            self.bump(5, pool_index(run.pool), -(size as i64));
        }
    }

    /// Free bytes inside segments that still hold an active block, per pool.
    fn inactive_split(&self) -> [u64; 3] {
        let mut used: HashMap<u64, u64> = HashMap::new();
        for (&address, b) in &self.blocks {
            if let Some((&start, _)) = self.segments.range(..=address).next_back() {
                *used.entry(start).or_default() += b.size;
            }
        }
        let mut out = [0u64; 3];
        for (start, used) in used {
            let seg = self.segments[&start];
            let free = seg.size.saturating_sub(used);
            out[0] += free;
            out[pool_index(seg.pool)] += free;
        }
        out
    }

    /// `memory_stats()`'s dictionary, keys sorted as PyTorch returns them.
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut map = BTreeMap::new();
        for (m, metric) in METRICS.iter().enumerate() {
            for (p, pool) in POOLS.iter().enumerate() {
                let s = self.stats[m][p];
                for (field, value) in [
                    ("current", s.current),
                    ("peak", s.peak),
                    ("allocated", s.allocated),
                    ("freed", s.freed),
                ] {
                    map.insert(format!("{metric}.{pool}.{field}"), value);
                }
            }
        }
        map.insert("num_ooms".into(), self.num_ooms as i64);
        map.insert("num_device_alloc".into(), self.num_device_alloc as i64);
        map.insert("num_device_free".into(), self.num_device_free as i64);
        map
    }
}

/// Keeps [`DeviceStats`] for every device while a replay runs.
#[derive(Debug, Default)]
pub struct StatsTracker {
    /// Per device.
    pub devices: BTreeMap<u32, DeviceStats>,
    checkpoint: Option<Vec<Record>>,
    files_seen: usize,
}

impl StatsTracker {
    /// Account for one replayed record.
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
                d.num_device_alloc += 1;
                d.segment(s.address, s.size, s.pool);
            }
            Record::SegmentFree(s) => {
                let d = self.devices.entry(s.device).or_default();
                d.num_device_free += 1;
                d.segment_free(s.address);
            }
            Record::SegmentMap(s) => {
                let d = self.devices.entry(s.device).or_default();
                d.num_device_alloc += 1;
                d.segment_map(s.address, s.size, s.pool);
            }
            Record::SegmentUnmap(s) => {
                let d = self.devices.entry(s.device).or_default();
                d.num_device_free += 1;
                d.segment_unmap(s.address, s.size);
            }
            Record::Oom(o) => self.devices.entry(o.device).or_default().num_ooms += 1,
            _ => {}
        }
    }

    /// Fill the counters only known at the end (`inactive_split_bytes`, current only).
    pub fn finish(&mut self) {
        for d in self.devices.values_mut() {
            let split = d.inactive_split();
            for (p, bytes) in split.into_iter().enumerate() {
                d.stats[7][p].current = bytes as i64;
            }
        }
    }
}
