//! Criterion benchmark of the allocator core alone (`Allocator` over `SimDevice`, lock
//! included): a cached `malloc` + `free` pair while 10 000 other blocks are live. Target
//! (issue 2): median ≤ 60 ns per pair for small and large sizes. Run with `scripts/bench-core`.
//!
//! Cases, per reuse policy:
//! * `small_exact` / `large_exact` — a free block of exactly the rounded size exists (the
//!   common case of a training loop, which repeats the same shapes): no split, no merge.
//! * `small_split` / `large_split` — only bigger free blocks exist: every pair splits a block
//!   and merges it back on free (the rest lands in the middle of a large free-list bucket).
//!
//! `cold_pair` times the same pairs after evicting the caches (4 MiB or 64 MiB read between
//! pairs): a pair inside a training step, where the work between two allocations pushes the
//! pools' lines out (the route's cost on a host-bound step: BENCHMARKS.md, twelfth session).

// criterion's macros generate undocumented items.
#![allow(missing_docs)]

use std::hint::black_box;

use cachealloc_core::sizes::Roundup;
use cachealloc_core::{Allocator, AllocatorConfig, NO_STREAM, ReusePolicy, SimDevice};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};

const LIVE_BLOCKS: usize = 10_000;
const CASES: [(&str, u64); 4] = [
    ("small_exact", 4096 + 512),
    ("small_split", 4096),
    ("large_exact", 6 * MIB + 2560),
    ("large_split", 16 * MIB),
];
const MIB: u64 = 1 << 20;

/// Request sizes of the set-up: 4.5 KiB, 64 KiB + 1 KiB, …; every size ends in 512 B steps.
const SETUP_SIZES: [u64; 7] = [
    512,
    4096 + 512,
    65_536 + 1024,
    300_000 + 1536,
    2 * MIB + 2048,
    6 * MIB + 2560,
    24 * MIB + 3072,
];

/// An allocator with `LIVE_BLOCKS` live blocks of mixed sizes; every third block of the set-up
/// is freed again, so the free lists are populated and fragmented like a real workload's.
fn populated(reuse: ReusePolicy) -> Allocator<SimDevice> {
    let config = AllocatorConfig {
        reuse,
        ..AllocatorConfig::default()
    };
    let alloc = Allocator::new(SimDevice::new(1 << 40), config);
    let mut to_free = Vec::new();
    let mut live = 0;
    for i in 0..LIVE_BLOCKS + LIVE_BLOCKS / 2 {
        let a = alloc.malloc(SETUP_SIZES[i % SETUP_SIZES.len()], 0).unwrap();
        if i % 3 == 2 {
            to_free.push(a.address)
        } else {
            live += 1;
        }
    }
    for address in to_free {
        alloc.free(address).unwrap();
    }
    alloc.flush_fences().unwrap();
    assert!(live >= LIVE_BLOCKS);
    alloc
}

fn cached_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("cached_pair");
    for reuse in [ReusePolicy::Immediate, ReusePolicy::Fenced] {
        let alloc = populated(reuse);
        for (label, size) in CASES {
            let a = alloc.malloc(size, 0).unwrap();
            alloc.free(a.address).unwrap();
            group.bench_function(BenchmarkId::new(reuse.to_string(), label), |b| {
                b.iter(|| {
                    let a = alloc.malloc(black_box(size), 0).unwrap();
                    alloc.free(black_box(a.address)).unwrap();
                })
            });
        }
        alloc.check_invariants().unwrap();
    }
    group.finish();
}

/// The same pairs with both halves under one lock acquisition: the bookkeeping alone, to tell
/// the data structures' cost from the lock's.
fn bookkeeping_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("bookkeeping_pair");
    let alloc = populated(ReusePolicy::Immediate);
    for (label, size) in CASES {
        let rounded = cachealloc_core::sizes::round_size(size, &Roundup::None);
        group.bench_function(BenchmarkId::new("immediate", label), |b| {
            b.iter(|| {
                alloc.with_pools(|pools| {
                    let a = pools
                        .alloc_cached(black_box(rounded), size, 0, NO_STREAM)
                        .unwrap();
                    pools.free(black_box(a.address), NO_STREAM).unwrap();
                })
            })
        });
    }
    group.finish();
}

/// Bytes read between two timed pairs of `cold_pair`: more than a core's second-level cache
/// (the pair then finds its lines in the last-level cache), and more than the development VM's
/// and the GPU hosts' last-level caches hold (the pair then goes to memory, as a tensor's work
/// between two allocations can make it). Read, not written: evicting dirty lines would leave
/// their write-backs competing with the timed pair (measured: a 4 MiB written eviction cost the
/// pair as much as a 64 MiB one).
const EVICT: [(&str, usize); 2] = [("evict_4mib", 4 << 20), ("evict_64mib", 64 << 20)];

/// The cached pairs with the caches evicted before each one (only the pair is timed; see the
/// module docs).
fn cold_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("cold_pair");
    group.sample_size(20);
    let alloc = populated(ReusePolicy::Immediate);
    for (evict_label, bytes) in EVICT {
        let evict: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
        for (label, size) in CASES {
            let a = alloc.malloc(size, 0).unwrap();
            alloc.free(a.address).unwrap();
            group.bench_function(BenchmarkId::new(evict_label, label), |b| {
                b.iter_custom(|iters| {
                    let mut timed = std::time::Duration::ZERO;
                    for i in 0..iters {
                        let mut sum = i as u8;
                        for line in evict.chunks(64) {
                            sum = sum.wrapping_add(black_box(line[0]));
                        }
                        black_box(sum);
                        let start = std::time::Instant::now();
                        let a = alloc.malloc(black_box(size), 0).unwrap();
                        alloc.free(black_box(a.address)).unwrap();
                        timed += start.elapsed();
                    }
                    timed
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, cached_pair, bookkeeping_pair, cold_pair);
criterion_main!(benches);
