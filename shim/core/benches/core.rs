//! Criterion benchmark of the allocator core alone: a cached `malloc` + `free` pair while 10 000
//! other blocks are live, for a small-pool and a large-pool size, with immediate and with fenced
//! reuse. Target (issue 2): median ≤ 60 ns per pair. Run with `scripts/bench-core`.

// criterion's macros generate undocumented items.
#![allow(missing_docs)]

use std::hint::black_box;

use cachealloc_core::{Allocator, AllocatorConfig, ReusePolicy, SimDevice};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};

const LIVE_BLOCKS: usize = 10_000;

/// An allocator with `LIVE_BLOCKS` live blocks of mixed sizes, every third one freed again so
/// the free lists are populated and fragmented like a real workload's.
fn populated(reuse: ReusePolicy) -> (Allocator<SimDevice>, Vec<u64>) {
    let config = AllocatorConfig {
        reuse,
        ..AllocatorConfig::default()
    };
    let alloc = Allocator::new(SimDevice::new(1 << 40), config);
    let sizes = [512u64, 4096, 65_536, 300_000, 2 << 20, 6 << 20, 24 << 20];
    let mut live = Vec::new();
    let mut to_free = Vec::new();
    for i in 0..LIVE_BLOCKS + LIVE_BLOCKS / 2 {
        let a = alloc
            .malloc(sizes[i % sizes.len()] + (i as u64 % 7) * 512, 0)
            .unwrap();
        if i % 3 == 2 {
            to_free.push(a.address)
        } else {
            live.push(a.address)
        }
    }
    for address in to_free {
        alloc.free(address).unwrap();
    }
    alloc.flush_fences().unwrap();
    (alloc, live)
}

fn cached_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("cached_malloc_free_pair");
    for reuse in [ReusePolicy::Immediate, ReusePolicy::Fenced] {
        let (alloc, live) = populated(reuse);
        for (label, size) in [("small_4KiB", 4096u64), ("large_8MiB", 8 << 20)] {
            // Warm: make sure the size is cached.
            let a = alloc.malloc(size, 0).unwrap();
            alloc.free(a.address).unwrap();
            group.bench_function(BenchmarkId::new(format!("{reuse}"), label), |b| {
                b.iter(|| {
                    let a = alloc.malloc(black_box(size), 0).unwrap();
                    alloc.free(black_box(a.address)).unwrap();
                })
            });
        }
        assert!(live.len() >= LIVE_BLOCKS);
        alloc.check_invariants().unwrap();
    }
    group.finish();
}

criterion_group!(benches, cached_pair);
criterion_main!(benches);
