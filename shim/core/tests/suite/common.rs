//! Shared helpers: config presets and an allocator that checks its invariants after every step.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cachealloc_core::sizes::Roundup;
use cachealloc_core::{
    AllocError, Allocation, Allocator, AllocatorConfig, BlockState, Event, Expandable, FenceMode,
    Freed, NO_STREAM, Observer, ReusePolicy, SegmentChanges, SimDevice, Stats,
};

pub(crate) const MIB: u64 = 1 << 20;

/// Fixed segments (`expandable_segments:False`) with the other keys at their defaults: the
/// configuration of the tests of PyTorch's segment rules (the default is expandable segments).
pub(crate) fn fixed() -> AllocatorConfig {
    AllocatorConfig {
        expandable_segments: Expandable::Off,
        ..AllocatorConfig::default()
    }
}

/// The config presets every suite runs over.
pub(crate) fn presets() -> Vec<(&'static str, AllocatorConfig)> {
    let base = fixed();
    vec![
        ("fixed", base.clone()),
        (
            "max_split",
            AllocatorConfig {
                max_split_size: 40 * MIB,
                ..base.clone()
            },
        ),
        (
            "roundup",
            AllocatorConfig {
                roundup: Roundup::Uniform(4),
                ..base.clone()
            },
        ),
        (
            "roundup_list",
            AllocatorConfig {
                roundup: Roundup::PerInterval(vec![1, 2, 4, 8]),
                ..base.clone()
            },
        ),
        (
            "gc",
            AllocatorConfig {
                garbage_collection_threshold: 0.6,
                ..base.clone()
            },
        ),
        (
            "limit",
            AllocatorConfig {
                per_process_memory_fraction: 0.5,
                ..base.clone()
            },
        ),
        (
            "fenced",
            AllocatorConfig {
                reuse: ReusePolicy::Fenced,
                ..base.clone()
            },
        ),
        (
            "expandable",
            AllocatorConfig {
                expandable_segments: Expandable::On,
                ..base.clone()
            },
        ),
        (
            "expandable_all",
            AllocatorConfig {
                expandable_segments: Expandable::On,
                max_split_size: 64 * MIB,
                roundup: Roundup::Uniform(2),
                garbage_collection_threshold: 0.8,
                per_process_memory_fraction: 0.75,
                // PyTorch's fraction: the limit counts stream-ordered memory only.
                fraction_counts_synchronous: false,
                reuse: ReusePolicy::Fenced,
            },
        ),
        (
            "all",
            AllocatorConfig {
                max_split_size: 64 * MIB,
                roundup: Roundup::Uniform(2),
                garbage_collection_threshold: 0.8,
                per_process_memory_fraction: 0.75,
                reuse: ReusePolicy::Fenced,
                ..base
            },
        ),
    ]
}

/// The mapping granularity of the simulated devices of these suites.
pub(crate) const GRANULARITY: u64 = 2 * MIB;

/// The state as told by the allocator's events alone: live blocks `address → (size, pending)`,
/// segments `address → size` and the mapped memory of expandable segments. It must always
/// equal the allocator's own snapshot — the events are complete and in order (what the
/// recorder relies on).
#[derive(Default)]
pub(crate) struct Mirror {
    state: Mutex<(LiveBlocks, Segments, Intervals)>,
}

/// Disjoint, non-adjacent byte intervals `start → end`.
#[derive(Default, Debug, PartialEq, Eq)]
pub(crate) struct Intervals(BTreeMap<u64, u64>);

impl Intervals {
    /// Add `[start, end)`, which must not overlap what is there.
    fn add(&mut self, start: u64, end: u64) {
        let overlaps = self
            .0
            .range(..end)
            .next_back()
            .is_some_and(|(_, &e)| e > start);
        assert!(!overlaps, "map of {start:#x}..{end:#x} over mapped memory");
        let (mut start, mut end) = (start, end);
        if let Some((&s, &e)) = self.0.range(..=start).next_back()
            && e == start
        {
            self.0.remove(&s);
            start = s;
        }
        if let Some(e) = self.0.remove(&end) {
            end = e;
        }
        self.0.insert(start, end);
    }

    /// Remove `[start, end)`, which must be inside one interval.
    fn remove(&mut self, start: u64, end: u64) {
        let (&s, &e) = self
            .0
            .range(..=start)
            .next_back()
            .filter(|&(_, &e)| e >= end)
            .unwrap_or_else(|| panic!("unmap of {start:#x}..{end:#x}, which is not mapped"));
        self.0.remove(&s);
        if s < start {
            self.0.insert(s, start);
        }
        if end < e {
            self.0.insert(end, e);
        }
    }
}

/// `address → (size, pending)`.
type LiveBlocks = BTreeMap<u64, (u64, bool)>;
/// `address → size`.
type Segments = BTreeMap<u64, u64>;

impl Observer for Mirror {
    fn on_event(&self, event: Event<'_>) {
        let mut state = self.state.lock().unwrap();
        let (blocks, segments, mapped) = &mut *state;
        match event {
            Event::Alloc(a) => assert!(
                blocks.insert(a.address, (a.size, false)).is_none(),
                "alloc of a live block"
            ),
            Event::FreeRequested(f) => {
                let b = blocks
                    .get_mut(&f.address)
                    .expect("free of a block never allocated");
                assert!(!b.1, "second free request");
                if f.pending {
                    b.1 = true;
                } else {
                    blocks.remove(&f.address);
                }
            }
            Event::FreeCompleted { address, .. } => assert!(
                blocks.remove(&address).is_some(),
                "completion of an unknown block"
            ),
            Event::SegmentAlloc { address, size, .. } => {
                assert!(segments.insert(address, size).is_none())
            }
            Event::SegmentFree(s) => assert!(
                segments.remove(&s.address).is_some(),
                "release of an unknown segment"
            ),
            Event::SegmentMap { address, size, .. } => mapped.add(address, address + size),
            Event::SegmentUnmap { address, size, .. } => mapped.remove(address, address + size),
            Event::Oom(_) => {}
        }
    }
}

/// An allocator over a `SimDevice` that checks its invariants, and that its events tell its
/// state, after every operation.
pub(crate) struct Checked {
    pub(crate) alloc: Allocator<SimDevice, Mirror>,
}

impl Checked {
    pub(crate) fn new(capacity: u64, config: AllocatorConfig) -> Self {
        Checked {
            alloc: Allocator::with_observer(
                SimDevice::new(capacity).with_map_granularity(GRANULARITY),
                config,
                Mirror::default(),
            ),
        }
    }

    pub(crate) fn manual(capacity: u64, config: AllocatorConfig) -> Self {
        Self::on(
            SimDevice::with_fence_mode(capacity, FenceMode::Manual)
                .with_map_granularity(GRANULARITY),
            config,
        )
    }

    /// Over `device`, as set up by the test.
    pub(crate) fn on(device: SimDevice, config: AllocatorConfig) -> Self {
        Checked {
            alloc: Allocator::with_observer(device, config, Mirror::default()),
        }
    }

    pub(crate) fn check(&self) {
        if let Err(e) = self.alloc.check_invariants() {
            panic!("invariant violated: {e}");
        }
        let mut blocks = BTreeMap::new();
        let mut segments = BTreeMap::new();
        let mut mapped = Intervals::default();
        let mut memory_in_use = Vec::new();
        for seg in self.alloc.snapshot() {
            if seg.expandable {
                for b in seg
                    .blocks
                    .iter()
                    .filter(|b| b.state != BlockState::Unmapped)
                {
                    mapped.add(b.address, b.address + b.size);
                }
            } else {
                segments.insert(seg.address, seg.total_size);
            }
            for b in seg
                .blocks
                .iter()
                .filter(|b| matches!(b.state, BlockState::Active | BlockState::PendingFree))
            {
                blocks.insert(b.address, (b.size, b.state == BlockState::PendingFree));
                assert!(
                    self.device().is_backed(b.address, b.size),
                    "live block {:#x}+{} has no memory behind it",
                    b.address,
                    b.size
                );
                let pieces = self.device().memory_of(b.address, b.size);
                for (memory, start, end) in pieces.expect("backed") {
                    memory_in_use.push((memory, start, end, b.address));
                }
            }
        }
        // No two live blocks share memory (moved memory is mapped at several places).
        memory_in_use.sort_unstable();
        for pair in memory_in_use.windows(2) {
            let ((m1, _, end1, b1), (m2, start2, _, b2)) = (pair[0], pair[1]);
            assert!(
                m1 != m2 || end1 <= start2,
                "live blocks {b1:#x} and {b2:#x} share the memory {m1} at offset {start2}"
            );
        }
        let mirror = self.alloc.observer().state.lock().unwrap();
        assert_eq!(mirror.0, blocks, "the events do not tell the live blocks");
        assert_eq!(mirror.1, segments, "the events do not tell the segments");
        assert_eq!(mirror.2, mapped, "the events do not tell the mapped memory");
    }

    pub(crate) fn malloc(&self, size: u64) -> Allocation {
        let a = self
            .try_malloc(size)
            .unwrap_or_else(|e| panic!("malloc({size}) failed: {e}"));
        assert!(a.size >= size, "block smaller than the request");
        a
    }

    pub(crate) fn try_malloc(&self, size: u64) -> Result<Allocation, AllocError> {
        self.try_malloc_on(size, NO_STREAM)
    }

    pub(crate) fn try_malloc_on(&self, size: u64, stream: u64) -> Result<Allocation, AllocError> {
        let r = self
            .alloc
            .malloc_on_stream(size, stream, 0, &mut SegmentChanges::default());
        self.check();
        r
    }

    pub(crate) fn malloc_on(&self, size: u64, stream: u64) -> Allocation {
        self.try_malloc_on(size, stream)
            .unwrap_or_else(|e| panic!("malloc({size}) on {stream:#x} failed: {e}"))
    }

    pub(crate) fn free(&self, address: u64) -> Freed {
        self.free_on(address, NO_STREAM)
    }

    pub(crate) fn free_on(&self, address: u64, stream: u64) -> Freed {
        let f = self
            .alloc
            .free_on_stream(address, stream)
            .unwrap_or_else(|e| panic!("free failed: {e}"));
        self.check();
        f
    }

    pub(crate) fn empty_cache(&self) {
        self.alloc.empty_cache().unwrap();
        self.check();
    }

    pub(crate) fn stats(&self) -> Stats {
        self.alloc.stats()
    }

    pub(crate) fn device(&self) -> &SimDevice {
        self.alloc.device()
    }
}
