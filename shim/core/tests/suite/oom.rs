//! The out-of-memory ladder: a request fails only when it truly cannot fit after releasing the
//! cache, and the report's figures are right.

use cachealloc_core::{AllocError, AllocatorConfig, Expandable, OomReport, PoolKind};

use crate::common::{Checked, MIB, fixed};

fn expect_oom(c: &Checked, size: u64) -> OomReport {
    match c.try_malloc(size) {
        Err(AllocError::OutOfMemory(report)) => *report,
        other => panic!("expected OOM for {size}, got {other:?}"),
    }
}

/// Three 20 MiB segments on a 64 MiB device, each holding three 6 MiB blocks; the middle block
/// of every segment stays live. 4 MiB of the device stay free.
fn fragmented() -> (Checked, Vec<Vec<u64>>) {
    let c = Checked::new(64 * MIB, fixed());
    let mut segments = Vec::new();
    for _ in 0..3 {
        let blocks: Vec<u64> = (0..3).map(|_| c.malloc(6 * MIB).address).collect();
        segments.push(blocks);
    }
    assert_eq!(c.stats().num_device_alloc, 3);
    for blocks in &segments {
        c.free(blocks[0]);
        c.free(blocks[2]);
    }
    (c, segments)
}

#[test]
fn fragmentation_fails_a_request_that_cannot_fit_and_reports_it() {
    let (c, _segments) = fragmented();
    // 42 MiB are cached free, but in pieces of 6 MiB and 8 MiB (last block + 2 MiB tail).
    let report = expect_oom(&c, 16 * MIB);
    assert_eq!(report.requested, 16 * MIB);
    assert_eq!(report.rounded, 16 * MIB);
    assert_eq!(report.pool, PoolKind::Large);
    assert_eq!(report.segment_size, 16 * MIB);
    assert_eq!(report.allocated, 18 * MIB);
    assert_eq!(report.reserved, 60 * MIB);
    assert_eq!(report.cached_free, 42 * MIB);
    assert_eq!(report.largest_free_block, 8 * MIB);
    assert!((report.fragmentation - (1.0 - 8.0 / 42.0)).abs() < 1e-9);
    assert_eq!(
        (report.device_free, report.device_total, report.limit),
        (4 * MIB, 64 * MIB, 64 * MIB)
    );
    let text = report.to_string();
    assert!(
        text.contains("16.00 MiB") && text.contains("fragmentation"),
        "{text}"
    );
    let s = c.stats();
    assert_eq!(s.num_ooms, 1);
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(
        s.num_device_free, 0,
        "no segment was free as a whole, nothing released"
    );
    // A request that fits in a cached piece still succeeds afterwards.
    c.malloc(8 * MIB);
}

#[test]
fn release_and_retry_serves_a_request_that_fits_after_release() {
    let (c, segments) = fragmented();
    // Free the live block of the first segment: that segment is now one free 20 MiB block.
    c.free(segments[0][1]);
    // 22 MiB fits no cached block and not the 4 MiB left on the device, but it fits once the
    // free segment is released.
    let a = c.malloc(22 * MIB);
    let s = c.stats();
    assert_eq!(a.size, 22 * MIB);
    assert_eq!(s.num_ooms, 0);
    assert_eq!(
        s.num_alloc_retries, 1,
        "served on the retry after emptying the cache"
    );
    assert_eq!(s.num_device_free, 1);
    assert_eq!(s.reserved_bytes.all.current, (62 * MIB) as i64);
}

#[test]
fn memory_fraction_limits_reserved_memory() {
    let config = AllocatorConfig {
        per_process_memory_fraction: 0.5,
        ..fixed()
    };
    let c = Checked::new(100 * MIB, config);
    c.malloc(40 * MIB);
    let report = expect_oom(&c, 12 * MIB);
    assert_eq!(report.limit, 50 * MIB);
    assert_eq!(
        report.device_free,
        60 * MIB,
        "the device had room; the limit refused"
    );
    c.malloc(10 * MIB);
}

#[test]
fn oversize_segments_are_released_before_emptying_the_cache() {
    let config = AllocatorConfig {
        max_split_size: 40 * MIB,
        ..fixed()
    };
    let c = Checked::new(128 * MIB, config);
    let small = c.malloc(4096);
    c.free(small.address); // a cached small segment that a full empty would release
    let big = c.malloc(64 * MIB);
    c.free(big.address);
    let huge = c.malloc(100 * MIB);
    assert_eq!(huge.size, 100 * MIB);
    let s = c.stats();
    assert_eq!(
        s.num_device_free, 1,
        "only the oversize segment was released"
    );
    assert_eq!(s.num_alloc_retries, 0, "no full cache release was needed");
    assert_eq!(s.segment.small_pool.current, 1);
}

#[test]
fn garbage_collection_releases_old_cached_segments_before_growing() {
    let config = AllocatorConfig {
        garbage_collection_threshold: 0.5,
        ..fixed()
    };
    let c = Checked::new(100 * MIB, config);
    let a = c.malloc(30 * MIB);
    let b = c.malloc(24 * MIB);
    c.free(a.address);
    // Reserved 54 MiB > 50 MiB: the next growth first collects the free 30 MiB segment.
    let d = c.malloc(36 * MIB);
    let s = c.stats();
    assert_eq!(s.num_device_free, 1);
    assert_eq!(s.num_alloc_retries, 0);
    assert_eq!(s.reserved_bytes.all.current, (60 * MIB) as i64);
    c.free(b.address);
    c.free(d.address);
}

#[test]
fn injected_device_failure_takes_the_retry_path() {
    let c = Checked::new(1 << 30, fixed());
    let a = c.malloc(12 * MIB);
    c.free(a.address);
    c.device().fail_next_allocs(1);
    let b = c.malloc(30 * MIB);
    assert_eq!(b.size, 30 * MIB);
    let s = c.stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(
        s.num_device_free, 1,
        "the cached 12 MiB segment was released for the retry"
    );
}

#[test]
fn a_request_larger_than_the_device_fails_cleanly() {
    let c = Checked::new(1 << 30, fixed());
    let report = expect_oom(&c, u64::MAX - 1);
    assert!(report.rounded >= u64::MAX - 512);
    assert_eq!(c.stats().reserved_bytes.all.current, 0);
}

/// A fraction from `PYTORCH_CUDA_ALLOC_CONF` counts stream-ordered memory only, as PyTorch's
/// counts its own, and never refuses a synchronous request (the libraries' own `cudaMalloc`);
/// cachealloc's own fraction counts both. Fixed segments and expandable ones.
#[test]
fn pytorchs_fraction_counts_stream_ordered_memory_only() {
    for expandable in [Expandable::Off, Expandable::On] {
        let pytorchs = AllocatorConfig {
            per_process_memory_fraction: 0.25,
            fraction_counts_synchronous: false,
            expandable_segments: expandable,
            ..fixed()
        };
        let c = Checked::new(200 * MIB, pytorchs.clone());
        c.malloc(60 * MIB); // a library's, past the 50 MiB limit
        c.malloc_on(40 * MIB, 7);
        match c.try_malloc_on(12 * MIB, 7) {
            Err(AllocError::OutOfMemory(report)) => assert_eq!(report.limit, 50 * MIB),
            other => panic!("{expandable:?}: 40 + 12 MiB of tensors passed 50 MiB: {other:?}"),
        }
        c.malloc_on(10 * MIB, 7);
        c.malloc(30 * MIB);
        let own = AllocatorConfig {
            fraction_counts_synchronous: true,
            ..pytorchs
        };
        let c = Checked::new(200 * MIB, own);
        let report = expect_oom(&c, 60 * MIB);
        assert_eq!(report.limit, 50 * MIB, "{expandable:?}");
    }
}
