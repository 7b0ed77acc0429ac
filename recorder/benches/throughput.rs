//! Recorder throughput and trace size (issue 4 targets: the worker sustains ≥ 2 M alloc/free
//! events/s on one core with zero loss; ≤ 16 bytes per event on disk with zstd, ≤ 40 without).
//!
//! A training-like stream of events (alloc, free requested, free completed over a few thousand
//! live addresses, sizes from a small set, monotonically increasing times) is pushed through a
//! `Recorder` by one producer thread; the worker (another core) writes it. Reported: events/s
//! from the first send to the end of `shutdown` (everything on disk), bytes per event, and how
//! often the producer had to wait. Run with `scripts/bench-recorder`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cachealloc_recorder::schema::*;
use cachealloc_recorder::{Record, Recorder, WriterConfig};
use common::header;

mod common;

/// Event `i` of the stream: thirds of allocs, free requests and free completions.
fn event(i: u64) -> Record {
    const SIZES: [u64; 8] = [512, 1024, 4096, 65536, 1 << 20, 4 << 20, 16 << 20, 3 << 20];
    let slot = (i / 3) % 4096;
    let address = 0x7f00_0000_0000 + slot * (32 << 20);
    let size = SIZES[(slot % 8) as usize];
    let t = i * 700; // ~1.4 M allocations per second of process time
    match i % 3 {
        0 => Record::Alloc(Alloc {
            t,
            device: 0,
            stream: 0,
            address,
            requested: size - 100,
            size,
            stack: (slot % 50) as u32 + 1,
            thread: 1,
        }),
        1 => Record::FreeRequested(FreeRequested {
            t,
            device: 0,
            stream: 0,
            address,
            size,
            stack: 0,
            thread: 1,
        }),
        _ => Record::FreeCompleted(FreeCompleted {
            t,
            device: 0,
            address,
            size,
        }),
    }
}

fn run(compress: bool, events: u64) {
    let dir = std::env::temp_dir().join(format!(
        "cachealloc-bench-{}-{compress}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let config = WriterConfig::new(&dir, 1 << 30, 4, compress);
    let recorder = Recorder::start(config, header(), 1 << 16, |e| panic!("{e}")).unwrap();
    let start = Instant::now();
    for i in 0..events {
        recorder.send(event(i));
    }
    assert!(recorder.shutdown(Duration::from_secs(120)));
    let elapsed = start.elapsed().as_secs_f64();
    let written = recorder.stats().written.load(Ordering::SeqCst);
    assert_eq!(written, events, "no event lost");
    let bytes: u64 = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    println!(
        "compress={compress} events={events} events_per_s={:.0} bytes_per_event={:.2} blocked_sends={} blocked_ms={:.1}",
        events as f64 / elapsed,
        bytes as f64 / events as f64,
        recorder.stats().blocked_sends.load(Ordering::SeqCst),
        recorder.stats().blocked_ns.load(Ordering::SeqCst) as f64 / 1e6,
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn main() {
    let events: u64 = std::env::var("EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6_000_000);
    for compress in [false, true] {
        for _ in 0..3 {
            run(compress, events);
        }
    }
}
