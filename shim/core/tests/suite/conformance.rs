//! One scenario suite, instantiated for every preset of `common::presets()` (as rmm runs one
//! conformance suite over every memory resource).

use cachealloc_core::{AllocError, AllocatorConfig, FenceMode, ReusePolicy};

use crate::common::{Checked, MIB, presets};

/// Run `scenario` once per preset, with fences completing immediately and manually.
fn for_every_preset(scenario: impl Fn(&str, &Checked)) {
    for (name, config) in presets() {
        for mode in [FenceMode::Immediate, FenceMode::Manual] {
            let c = match mode {
                FenceMode::Immediate => Checked::new(1 << 32, config.clone()),
                FenceMode::Manual => Checked::manual(1 << 32, config.clone()),
            };
            scenario(&format!("{name}/{mode:?}"), &c);
        }
    }
}

fn sizes() -> Vec<u64> {
    vec![
        0,
        1,
        511,
        512,
        513,
        4096,
        100_000,
        MIB - 1,
        MIB,
        MIB + 1,
        3 * MIB,
        10 * MIB - 1,
        10 * MIB,
        10 * MIB + 1,
        25 * MIB,
        70 * MIB,
    ]
}

#[test]
fn every_size_allocates_and_frees_back_to_zero() {
    for_every_preset(|name, c| {
        let blocks: Vec<_> = sizes().into_iter().map(|s| c.malloc(s)).collect();
        let total: u64 = blocks.iter().map(|b| b.size).sum();
        assert_eq!(
            c.stats().allocated_bytes.all.current as u64,
            total,
            "{name}"
        );
        for b in &blocks {
            c.free(b.address);
        }
        assert_eq!(c.stats().allocated_bytes.all.current, 0, "{name}");
        c.empty_cache();
        assert_eq!(
            c.stats().reserved_bytes.all.current,
            0,
            "{name}: empty_cache releases all"
        );
        assert_eq!(c.stats().active_bytes.all.current, 0, "{name}");
        assert_eq!(c.device().used(), 0, "{name}");
    });
}

#[test]
fn live_blocks_never_overlap() {
    for_every_preset(|name, c| {
        let mut live: Vec<(u64, u64)> = Vec::new();
        for round in 0..4u64 {
            for (i, s) in sizes().into_iter().enumerate() {
                let a = c.malloc(s + round * 1000);
                live.push((a.address, a.size));
                if i % 3 == 0 {
                    let (addr, _) = live.remove(live.len() / 2);
                    c.free(addr);
                }
            }
        }
        live.sort();
        for w in live.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{name}: {w:x?} overlap");
        }
    });
}

#[test]
fn repeated_pairs_reuse_the_cache() {
    for_every_preset(|name, c| {
        for s in sizes() {
            let a = c.malloc(s);
            c.free(a.address);
        }
        let before = c.stats().num_device_alloc;
        for _ in 0..50 {
            for s in sizes() {
                let a = c.malloc(s);
                c.free(a.address);
            }
        }
        assert_eq!(
            c.stats().num_device_alloc,
            before,
            "{name}: the steady state needs no device allocation"
        );
    });
}

#[test]
fn stats_peaks_bound_currents_and_snapshot_tiles_segments() {
    for_every_preset(|name, c| {
        let blocks: Vec<_> = sizes().into_iter().map(|s| c.malloc(s)).collect();
        for b in blocks.iter().step_by(2) {
            c.free(b.address);
        }
        let s = c.stats();
        assert!(
            s.reserved_bytes.all.current >= s.active_bytes.all.current,
            "{name}"
        );
        assert!(
            s.active_bytes.all.current >= s.allocated_bytes.all.current,
            "{name}"
        );
        assert!(
            s.allocated_bytes.all.peak >= s.allocated_bytes.all.current,
            "{name}"
        );
        for seg in c.alloc.snapshot() {
            assert_eq!(
                seg.blocks.iter().map(|b| b.size).sum::<u64>(),
                seg.total_size,
                "{name}"
            );
            assert!(
                seg.allocated_size <= seg.active_size && seg.active_size <= seg.total_size,
                "{name}"
            );
        }
        let flat = s.to_flat();
        assert!(
            flat.iter()
                .any(|(k, _)| k == "reserved_bytes.large_pool.peak"),
            "{name}"
        );
    });
}

#[test]
fn oom_is_reported_and_recoverable() {
    for (name, config) in presets() {
        let c = Checked::new(64 * MIB, config.clone());
        let limit = c.alloc.limit();
        let mut held = Vec::new();
        loop {
            match c.try_malloc(6 * MIB) {
                Ok(a) => held.push(a.address),
                Err(AllocError::OutOfMemory(report)) => {
                    let over_limit = report.reserved + report.segment_size > limit;
                    let device_full = report.device_free < report.segment_size;
                    assert!(
                        over_limit || device_full,
                        "{name}: failed although it fits: {report}"
                    );
                    break;
                }
                Err(e) => panic!("{name}: {e}"),
            }
            assert!(held.len() < 100, "{name}: the limit was never reached");
        }
        assert!(c.stats().num_ooms == 1, "{name}");
        for a in held.drain(..) {
            c.free(a);
        }
        c.malloc(6 * MIB);
    }
}

#[test]
fn fenced_presets_never_reuse_before_the_fence() {
    for (name, config) in presets() {
        let config = AllocatorConfig {
            reuse: ReusePolicy::Fenced,
            ..config
        };
        let c = Checked::manual(1 << 32, config);
        let a = c.malloc(4096);
        let filler = c.malloc(2 * MIB - 4096);
        c.free(a.address);
        c.free(filler.address);
        // Requests that other memory can serve must not take the pending blocks.
        let b = c.malloc(12 * MIB);
        assert_ne!(b.segment_address, a.segment_address, "{name}");
        assert_eq!(c.device().counters().waits, 0, "{name}");
    }
}
