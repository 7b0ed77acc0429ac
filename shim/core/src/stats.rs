//! Allocator statistics with PyTorch's names and meaning (`torch.cuda.memory_stats()`).
//!
//! Each [`Stat`] has `current`, `peak`, `allocated` (sum of increases) and `freed` (sum of
//! decreases), kept for `all`, `small_pool` and `large_pool`. Definitions, per PyTorch:
//!
//! | stat | counts |
//! |---|---|
//! | `allocation` / `allocated_bytes` | blocks handed to the app and not yet freed by it |
//! | `active` / `active_bytes` | allocated blocks plus freed blocks still waiting for their fence |
//! | `requested_bytes` | the app's unrounded request sizes of active blocks |
//! | `segment` / `reserved_bytes` | device allocations (segments) the allocator holds |
//! | `inactive_split` / `inactive_split_bytes` | free (reusable) blocks in segments that are split |
//!
//! `oversize_allocations` and `oversize_segments` count blocks and segments of at least
//! `max_split_size`. Plain counters: `num_alloc_retries` (device allocations retried after
//! releasing cache), `num_ooms`, `num_device_alloc`, `num_device_free`, `num_fence_waits`.
//!
//! # Note [PyTorch's view of the statistics]
//!
//! Under the shim the pools also serve what libraries allocate for themselves with the
//! synchronous API: cuBLAS's `cuMemAlloc` of 64 MiB for each handle, cuDNN's, NCCL's, a user's
//! `cudaMalloc` through ctypes. PyTorch's own allocator never sees those, and its statistics
//! (`torch.cuda.memory_allocated()`, `memory_reserved()`, `memory_stats()`) leave them out:
//! PyTorch's `test_cublas_workspace_explicit_allocation` measures the workspace of a first
//! matmul by `active_bytes.all.allocated`, which under the shim grew by the handle's memory too.
//! Under the shim every PyTorch allocation is stream-ordered (`cudaMallocAsync`, through
//! PyTorch's backend or cachealloc's allocator for PyTorch), and every block and segment
//! belongs to one stream or to the synchronous API ([`NO_STREAM`](crate::NO_STREAM)). So each
//! [`StatArray`] keeps, besides its `all`/`small_pool`/`large_pool`, the same three for the
//! blocks and segments of stream-ordered requests alone ([`StatAt`] says which a change is),
//! and [`Stats::stream_ordered_view`] is what the Python integration gives PyTorch, and what
//! the default memory pool's attributes answer (a `cudaMallocAsync` pool's memory is
//! stream-ordered by definition). The whole allocator's statistics stay the library's own
//! (`cachealloc_stats_json`, the trace, the exit summary).

use crate::sizes::PoolKind;

/// One statistic: current value, high-water mark, and accumulated increases and decreases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// Value now.
    pub current: i64,
    /// Highest value since the last peak reset.
    pub peak: i64,
    /// Sum of all increases since the last accumulated reset.
    pub allocated: i64,
    /// Sum of all decreases since the last accumulated reset.
    pub freed: i64,
}

impl Stat {
    /// Add `amount`.
    pub fn increase(&mut self, amount: u64) {
        let amount = amount as i64;
        self.current += amount;
        self.peak = self.peak.max(self.current);
        self.allocated += amount;
    }

    /// Subtract `amount`.
    pub fn decrease(&mut self, amount: u64) {
        let amount = amount as i64;
        self.current -= amount;
        self.freed += amount;
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }

    /// Its parts by their `memory_stats()` names.
    fn parts(&self) -> [(&'static str, i64); 4] {
        [
            ("current", self.current),
            ("peak", self.peak),
            ("allocated", self.allocated),
            ("freed", self.freed),
        ]
    }
}

/// Where a change is counted: the pool of the block or segment it concerns, and whether that
/// block or segment serves stream-ordered requests (the view PyTorch is given: Note [PyTorch's
/// view of the statistics]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatAt {
    /// The block's or segment's pool.
    pub pool: PoolKind,
    /// It serves stream-ordered requests (`cudaMallocAsync`), not the synchronous API.
    pub stream_ordered: bool,
}

impl StatAt {
    /// A block or segment of `pool` that serves `stream` ([`NO_STREAM`](crate::NO_STREAM): the
    /// synchronous API).
    pub fn new(pool: PoolKind, stream: u64) -> Self {
        StatAt {
            pool,
            stream_ordered: stream != crate::NO_STREAM,
        }
    }
}

/// A statistic kept for all blocks and per pool (PyTorch's `StatArray`), and the same for the
/// blocks and segments of stream-ordered requests alone (Note [PyTorch's view of the
/// statistics]).
///
/// Laid out for the allocator's hot path: a change to a stream-ordered block updates `all`, its
/// pool's stat and their stream-ordered twins, so each twin sits beside its stat and the array
/// starts a cache line — two lines a change instead of three. A pair of an allocation and its
/// free changes five to seven arrays, each out of the caches in a real step (BENCHMARKS.md,
/// fifteenth session).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray {
    /// Both pools together (`all`).
    pub all: Stat,
    stream_ordered_all: Stat,
    /// The small pool (`small_pool`).
    pub small_pool: Stat,
    stream_ordered_small: Stat,
    /// The large pool (`large_pool`).
    pub large_pool: Stat,
    stream_ordered_large: Stat,
}

impl StatArray {
    /// Add `amount` to `all` and to the pool's stat (and to their stream-ordered twins for a
    /// stream-ordered block or segment).
    #[inline]
    pub fn increase(&mut self, at: StatAt, amount: u64) {
        self.all.increase(amount);
        if at.stream_ordered {
            self.stream_ordered_all.increase(amount);
        }
        let (stat, twin) = self.pool_and_twin_mut(at.pool);
        stat.increase(amount);
        if at.stream_ordered {
            twin.increase(amount);
        }
    }

    /// Subtract `amount` from `all` and from the pool's stat (and from their stream-ordered
    /// twins for a stream-ordered block or segment).
    #[inline]
    pub fn decrease(&mut self, at: StatAt, amount: u64) {
        self.all.decrease(amount);
        if at.stream_ordered {
            self.stream_ordered_all.decrease(amount);
        }
        let (stat, twin) = self.pool_and_twin_mut(at.pool);
        stat.decrease(amount);
        if at.stream_ordered {
            twin.decrease(amount);
        }
    }

    fn pool_and_twin_mut(&mut self, pool: PoolKind) -> (&mut Stat, &mut Stat) {
        match pool {
            PoolKind::Small => (&mut self.small_pool, &mut self.stream_ordered_small),
            PoolKind::Large => (&mut self.large_pool, &mut self.stream_ordered_large),
        }
    }

    /// The stream-ordered twins of `all`, `small_pool` and `large_pool`.
    pub(crate) fn stream_ordered(&self) -> [&Stat; 3] {
        [
            &self.stream_ordered_all,
            &self.stream_ordered_small,
            &self.stream_ordered_large,
        ]
    }

    /// The array of stream-ordered blocks and segments only, as the whole array.
    fn stream_ordered_view(&self) -> StatArray {
        StatArray {
            all: self.stream_ordered_all,
            stream_ordered_all: self.stream_ordered_all,
            small_pool: self.stream_ordered_small,
            stream_ordered_small: self.stream_ordered_small,
            large_pool: self.stream_ordered_large,
            stream_ordered_large: self.stream_ordered_large,
        }
    }

    /// The stat of one pool.
    pub fn pool(&self, pool: PoolKind) -> &Stat {
        match pool {
            PoolKind::Small => &self.small_pool,
            PoolKind::Large => &self.large_pool,
        }
    }

    /// Add every stat of `other` to this one's, each part (`current`, `peak`, `allocated`,
    /// `freed`) to its own: a device's arrays with a private pool's added, the peaks as an upper
    /// bound.
    pub fn add(&mut self, other: &StatArray) {
        let theirs = [
            other.all,
            other.stream_ordered_all,
            other.small_pool,
            other.stream_ordered_small,
            other.large_pool,
            other.stream_ordered_large,
        ];
        for (ours, theirs) in self.each_mut().into_iter().zip(theirs) {
            ours.current += theirs.current;
            ours.peak += theirs.peak;
            ours.allocated += theirs.allocated;
            ours.freed += theirs.freed;
        }
    }

    fn each_mut(&mut self) -> [&mut Stat; 6] {
        [
            &mut self.all,
            &mut self.stream_ordered_all,
            &mut self.small_pool,
            &mut self.stream_ordered_small,
            &mut self.large_pool,
            &mut self.stream_ordered_large,
        ]
    }

    fn named(&self) -> [(&'static str, &Stat); 3] {
        [
            ("all", &self.all),
            (PoolKind::Small.stat_name(), &self.small_pool),
            (PoolKind::Large.stat_name(), &self.large_pool),
        ]
    }
}

/// The statistics kept for all blocks and per pool ([`StatArray`]s), by their
/// `memory_stats()` names: the one table of those names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatKind {
    /// `allocation`.
    Allocation,
    /// `segment`.
    Segment,
    /// `active`.
    Active,
    /// `inactive_split`.
    InactiveSplit,
    /// `allocated_bytes`.
    AllocatedBytes,
    /// `reserved_bytes`.
    ReservedBytes,
    /// `active_bytes`.
    ActiveBytes,
    /// `inactive_split_bytes`.
    InactiveSplitBytes,
    /// `requested_bytes`.
    RequestedBytes,
}

impl StatKind {
    /// Every kind.
    pub const ALL: [StatKind; 9] = [
        StatKind::Allocation,
        StatKind::Segment,
        StatKind::Active,
        StatKind::InactiveSplit,
        StatKind::AllocatedBytes,
        StatKind::ReservedBytes,
        StatKind::ActiveBytes,
        StatKind::InactiveSplitBytes,
        StatKind::RequestedBytes,
    ];

    /// Its `memory_stats()` name, the first part of its keys.
    pub fn name(self) -> &'static str {
        match self {
            StatKind::Allocation => "allocation",
            StatKind::Segment => "segment",
            StatKind::Active => "active",
            StatKind::InactiveSplit => "inactive_split",
            StatKind::AllocatedBytes => "allocated_bytes",
            StatKind::ReservedBytes => "reserved_bytes",
            StatKind::ActiveBytes => "active_bytes",
            StatKind::InactiveSplitBytes => "inactive_split_bytes",
            StatKind::RequestedBytes => "requested_bytes",
        }
    }
}

/// The plain counters of [`Stats`], by their `memory_stats()` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// `num_alloc_retries`.
    AllocRetries,
    /// `num_ooms`.
    Ooms,
    /// `num_device_alloc`.
    DeviceAlloc,
    /// `num_device_free`.
    DeviceFree,
    /// `num_fence_waits`.
    FenceWaits,
    /// `num_cache_hits`.
    CacheHits,
    /// `max_split_size` (-1 when unlimited).
    MaxSplitSize,
}

impl Counter {
    /// Every counter.
    pub const ALL: [Counter; 7] = [
        Counter::AllocRetries,
        Counter::Ooms,
        Counter::DeviceAlloc,
        Counter::DeviceFree,
        Counter::FenceWaits,
        Counter::CacheHits,
        Counter::MaxSplitSize,
    ];

    /// Its `memory_stats()` key.
    pub fn name(self) -> &'static str {
        match self {
            Counter::AllocRetries => "num_alloc_retries",
            Counter::Ooms => "num_ooms",
            Counter::DeviceAlloc => "num_device_alloc",
            Counter::DeviceFree => "num_device_free",
            Counter::FenceWaits => "num_fence_waits",
            Counter::CacheHits => "num_cache_hits",
            Counter::MaxSplitSize => "max_split_size",
        }
    }
}

/// All statistics of one device's allocator.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Number of allocated blocks.
    pub allocation: StatArray,
    /// Number of segments.
    pub segment: StatArray,
    /// Number of active blocks.
    pub active: StatArray,
    /// Number of free blocks in split segments.
    pub inactive_split: StatArray,
    /// Bytes of allocated blocks.
    pub allocated_bytes: StatArray,
    /// Bytes of segments.
    pub reserved_bytes: StatArray,
    /// Bytes of active blocks.
    pub active_bytes: StatArray,
    /// Bytes of free blocks in split segments.
    pub inactive_split_bytes: StatArray,
    /// Requested (unrounded) bytes of active blocks.
    pub requested_bytes: StatArray,
    /// Allocated blocks of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// Device allocations retried after releasing cached memory.
    pub num_alloc_retries: u64,
    /// Requests that failed with out-of-memory.
    pub num_ooms: u64,
    /// Segment allocations made on the device.
    pub num_device_alloc: u64,
    /// Segment releases made on the device.
    pub num_device_free: u64,
    /// Times an allocation blocked waiting for a reuse fence.
    pub num_fence_waits: u64,
    /// Requests served from cached blocks (no device allocation).
    pub num_cache_hits: u64,
    /// `max_split_size` in force (`u64::MAX` when unlimited), as PyTorch reports it.
    pub max_split_size: u64,
}

impl Stats {
    /// Set every peak to its current value (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peaks(&mut self) {
        self.for_each_stat(Stat::reset_peak);
    }

    /// Zero the accumulated counters (`torch.cuda.reset_accumulated_memory_stats`).
    pub fn reset_accumulated(&mut self) {
        self.for_each_stat(Stat::reset_accumulated);
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.num_fence_waits = 0;
        self.num_cache_hits = 0;
    }

    /// Apply `f` to every [`Stat`]: the three of each array, then the two oversize stats.
    fn for_each_stat(&mut self, f: impl Fn(&mut Stat)) {
        for array in self.arrays_mut() {
            array.each_mut().into_iter().for_each(&f);
        }
        f(&mut self.oversize_allocations);
        f(&mut self.oversize_segments);
    }

    /// PyTorch's view: these statistics with every array counting only the blocks and segments
    /// of stream-ordered requests (Note [PyTorch's view of the statistics]); the plain counters
    /// and the oversize statistics are the whole allocator's.
    pub fn stream_ordered_view(&self) -> Stats {
        let mut view = self.clone();
        for array in view.arrays_mut() {
            *array = array.stream_ordered_view();
        }
        view
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// The [`StatArray`] of `kind`.
    pub fn array(&self, kind: StatKind) -> &StatArray {
        match kind {
            StatKind::Allocation => &self.allocation,
            StatKind::Segment => &self.segment,
            StatKind::Active => &self.active,
            StatKind::InactiveSplit => &self.inactive_split,
            StatKind::AllocatedBytes => &self.allocated_bytes,
            StatKind::ReservedBytes => &self.reserved_bytes,
            StatKind::ActiveBytes => &self.active_bytes,
            StatKind::InactiveSplitBytes => &self.inactive_split_bytes,
            StatKind::RequestedBytes => &self.requested_bytes,
        }
    }

    /// The value `memory_stats()` gives `counter`.
    pub fn counter(&self, counter: Counter) -> i64 {
        let value = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        match counter {
            Counter::AllocRetries => value(self.num_alloc_retries),
            Counter::Ooms => value(self.num_ooms),
            Counter::DeviceAlloc => value(self.num_device_alloc),
            Counter::DeviceFree => value(self.num_device_free),
            Counter::FenceWaits => value(self.num_fence_waits),
            Counter::CacheHits => value(self.num_cache_hits),
            Counter::MaxSplitSize if self.max_split_size == u64::MAX => -1,
            Counter::MaxSplitSize => value(self.max_split_size),
        }
    }

    /// The twelve `memory_stats()` entries of `kind`'s array: `{kind}.{pool}.{part}` for the
    /// pools `all`, `small_pool`, `large_pool` and the parts `current`, `peak`, `allocated`,
    /// `freed`.
    pub fn flat_entries(&self, kind: StatKind) -> impl Iterator<Item = (String, i64)> + '_ {
        self.array(kind)
            .named()
            .into_iter()
            .flat_map(move |(pool, stat)| {
                stat.parts()
                    .into_iter()
                    .map(move |(part, value)| (format!("{}.{pool}.{part}", kind.name()), value))
            })
    }

    /// The flat `name → value` list of `torch.cuda.memory_stats()`, in its key order
    /// (`allocated_bytes.all.current`, …, `num_ooms`, …), sorted by key as PyTorch returns it.
    pub fn to_flat(&self) -> Vec<(String, i64)> {
        let mut out = Vec::with_capacity(120);
        for kind in StatKind::ALL {
            out.extend(self.flat_entries(kind));
        }
        for (name, stat) in [
            ("oversize_allocations", &self.oversize_allocations),
            ("oversize_segments", &self.oversize_segments),
        ] {
            for (part, value) in stat.parts() {
                out.push((format!("{name}.{part}"), value));
            }
        }
        for counter in Counter::ALL {
            out.push((counter.name().into(), self.counter(counter)));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.increase(10);
        s.increase(5);
        s.decrease(12);
        s.increase(1);
        assert_eq!(
            s,
            Stat {
                current: 4,
                peak: 15,
                allocated: 16,
                freed: 12
            }
        );
        s.reset_peak();
        assert_eq!(s.peak, 4);
        s.reset_accumulated();
        assert_eq!((s.allocated, s.freed, s.current), (0, 0, 4));
    }

    #[test]
    fn a_change_touches_two_lines_of_its_array() {
        use std::mem::offset_of;
        assert_eq!(std::mem::align_of::<StatArray>(), 64);
        let line = |offset: usize| offset / 64;
        for (stat, twin) in [
            (
                offset_of!(StatArray, all),
                offset_of!(StatArray, stream_ordered_all),
            ),
            (
                offset_of!(StatArray, small_pool),
                offset_of!(StatArray, stream_ordered_small),
            ),
            (
                offset_of!(StatArray, large_pool),
                offset_of!(StatArray, stream_ordered_large),
            ),
        ] {
            assert_eq!(line(stat), line(twin + size_of::<Stat>() - 1));
        }
        // What each change reaches: the stat, its pool's, and their twins when stream-ordered.
        let mut a = StatArray::default();
        a.increase(StatAt::new(PoolKind::Small, 7), 10);
        a.increase(StatAt::new(PoolKind::Large, crate::NO_STREAM), 3);
        a.decrease(StatAt::new(PoolKind::Small, 7), 4);
        assert_eq!((a.all.current, a.all.peak), (9, 13));
        assert_eq!((a.small_pool.current, a.large_pool.current), (6, 3));
        let [o_all, o_small, o_large] = a.stream_ordered();
        assert_eq!((o_all.current, o_all.peak, o_all.freed), (6, 10, 4));
        assert_eq!((o_small.current, o_large.current), (6, 0));
        let view = a.stream_ordered_view();
        assert_eq!(
            (view.all, view.small_pool, view.large_pool),
            (*o_all, *o_small, *o_large)
        );
        let mut sum = a;
        sum.add(&a);
        assert_eq!((sum.all.current, sum.all.peak), (18, 26));
        assert_eq!(sum.stream_ordered()[1].allocated, 20);
    }

    #[test]
    fn flat_names_follow_pytorch() {
        let mut stats = Stats {
            max_split_size: u64::MAX,
            ..Stats::default()
        };
        stats
            .allocated_bytes
            .increase(StatAt::new(PoolKind::Large, crate::NO_STREAM), 4096);
        let flat = stats.to_flat();
        let get = |k: &str| flat.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
        assert_eq!(get("allocated_bytes.all.current"), Some(4096));
        assert_eq!(get("allocated_bytes.large_pool.peak"), Some(4096));
        assert_eq!(get("allocated_bytes.small_pool.current"), Some(0));
        assert_eq!(get("max_split_size"), Some(-1));
        assert_eq!(get("oversize_segments.current"), Some(0));
        assert!(
            flat.windows(2).all(|w| w[0].0 < w[1].0),
            "sorted and unique"
        );
        // Nine arrays of twelve, two oversize stats of four, seven counters.
        assert_eq!(flat.len(), 9 * 12 + 2 * 4 + 7);
    }
}
