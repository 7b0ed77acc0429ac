//! What an allocation that grows an expandable segment costs the core as the segment fills with
//! live blocks (a model's tensors as it loads): `N` (20 000) live 1 MiB blocks, one range, each
//! allocation mapping new memory over `SimDevice` (2 MiB granules); prints the mean time of an
//! allocation for each fifth of them. Flat when a map's recycling looks at the free blocks only;
//! it grew with the live blocks when recycling walked the whole range (BENCHMARKS.md, thirtieth
//! session).
//!
//!     cargo run --release -p cachealloc-core --example growth [N]

use std::time::Instant;

use cachealloc_core::config::Expandable;
use cachealloc_core::{Allocator, AllocatorConfig, SimDevice};

fn main() {
    let n: usize = (std::env::args().nth(1))
        .map(|s| s.parse().expect("N: a number of allocations"))
        .unwrap_or(20_000)
        .max(5);
    let config = AllocatorConfig {
        expandable_segments: Expandable::On,
        ..AllocatorConfig::default()
    };
    let alloc = Allocator::new(
        SimDevice::new(1 << 45).with_map_granularity(2 << 20),
        config,
    );
    let mut live = Vec::with_capacity(n);
    let fifth = n / 5;
    let mut start = Instant::now();
    for i in 0..fifth * 5 {
        live.push(
            alloc
                .malloc(1 << 20, 0)
                .expect("the simulated device has room"),
        );
        if (i + 1) % fifth == 0 {
            let per = start.elapsed().as_secs_f64() * 1e6 / fifth as f64;
            println!(
                "live blocks {:>6}..{:<6} {per:8.2} µs an allocation",
                i + 1 - fifth,
                i + 1
            );
            start = Instant::now();
        }
    }
}
