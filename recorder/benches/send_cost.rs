//! What one `Recorder::send` costs the program when records come the way a training step makes
//! them: microseconds apart, with the program's own work in between churning the caches, and the
//! worker on another core draining the queue every millisecond. (The throughput bench sends back
//! to back, where the worker is always behind and this cost does not show.) It is the cost the
//! design's "Where a traced allocation's time goes" names: the cache lines a send pulls from the
//! worker's core (recorder Note [The hand-off's cache lines]).
//!
//! Reported, as `key=value` on one line: mean, median, p90 and p99 nanoseconds per `send`, each
//! timed alone, less the cost of the timer itself. `GAP_NS` (default 3 000) sets the spacing, `EVENTS` (default 400 000) the
//! records. Run with `cargo bench -p cachealloc-recorder --bench send_cost`; to compare builds,
//! alternate their binaries (`target/release/deps/send_cost-*`) with `scripts/bench-alternate`.
//! The machine matters: on the development VM the worker's lines come back cheaply, on the GPU
//! machine's Xeon each miss cost ~100 ns.

use std::hint::black_box;
use std::time::{Duration, Instant};

use cachealloc_recorder::schema::*;
use cachealloc_recorder::{Record, Recorder, WriterConfig};
use common::header;

mod common;

/// Record `i`: allocations and frees in turn over 4 096 addresses.
fn record(i: u64) -> Record {
    let address = 0x7f00_0000_0000 + (i / 2 % 4096) * (32 << 20);
    if i.is_multiple_of(2) {
        Record::Alloc(Alloc {
            t: i * 3000,
            device: 0,
            stream: 7,
            address,
            requested: 1000,
            size: 1024,
            stack: (i % 50) as u32 + 1,
            thread: 1,
        })
    } else {
        Record::FreeRequested(FreeRequested {
            t: i * 3000,
            device: 0,
            stream: 7,
            address,
            size: 1024,
            stack: 0,
            thread: 1,
        })
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A recorder writing to a fresh directory of its own, with the default queue.
fn start() -> (Recorder, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("cachealloc-send-cost-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = WriterConfig::new(&dir, 1 << 30, 4, true);
    let recorder = Recorder::start(config, header(), 1 << 16, |e| panic!("{e}")).unwrap();
    (recorder, dir)
}

fn stop(recorder: Recorder, dir: &std::path::Path) {
    recorder.shutdown(Duration::from_secs(60));
    let _ = std::fs::remove_dir_all(dir);
}

fn main() {
    if env("PROGRAM", 0) == 1 {
        return program();
    }
    let gap = Duration::from_nanos(env("GAP_NS", 3000));
    let events = env("EVENTS", 400_000);
    let (recorder, dir) = start();
    // The program's own memory, walked a little between records (16 KiB of 32 MiB each time).
    let mut work = vec![0u64; 4 << 20];
    let mut cursor = 0usize;
    let timer = (0..10_000)
        .map(|_| {
            let a = Instant::now();
            (Instant::now() - a).as_nanos() as u64
        })
        .min()
        .unwrap_or(0);
    let mut costs = Vec::with_capacity(events as usize);
    for i in 0..events {
        let until = Instant::now() + gap;
        while Instant::now() < until {
            for _ in 0..256 {
                work[cursor] = work[cursor].wrapping_add(i);
                cursor = (cursor + 8) % work.len();
            }
        }
        let r = record(i);
        let start = Instant::now();
        recorder.send(black_box(r));
        costs.push((start.elapsed().as_nanos() as u64).saturating_sub(timer));
    }
    black_box(&work);
    stop(recorder, &dir);
    let mean = costs.iter().sum::<u64>() as f64 / costs.len() as f64;
    costs.sort_unstable();
    let at = |q: f64| costs[((costs.len() - 1) as f64 * q) as usize];
    println!(
        "send: records={events} gap_ns={} timer_ns={timer} mean_ns={mean:.1} median_ns={} p90_ns={} p99_ns={}",
        gap.as_nanos(),
        at(0.5),
        at(0.9),
        at(0.99)
    );
}

/// `PROGRAM=1`: what the sends cost the program's own work, not the send alone. A store to a
/// line another core read waits in the store buffer, and is paid at the program's next locked
/// instruction (PyTorch's reference counts) or when the buffer fills, so timing `send` alone
/// misses it. Each iteration does fixed work (`WORK_LINES` lines of 32 MiB walked, an atomic
/// add every 64 lines), then sends a record or not: blocks of `BLOCK` iterations with sends and
/// without alternate, `ROUNDS` pairs; printed: the median over pairs of the added ns per
/// iteration, and the iteration's ns without sends. `RANDOM=1` and `LOCKED=1`: below.
fn program() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let lines = env("WORK_LINES", 256) as usize;
    let block = env("BLOCK", 2000);
    let rounds = env("ROUNDS", 200);
    // RANDOM=1: the work's lines in a scattered order, as a program's heap is touched, not a
    // stream the hardware prefetcher follows; LOCKED=1: each iteration takes a mutex, and a
    // send happens under it, as the allocator's do (the unlock is a locked instruction).
    let (random, locked) = (env("RANDOM", 0) == 1, env("LOCKED", 0) == 1);
    let (recorder, dir) = start();
    let mutex = std::sync::Mutex::new(0u64);
    let mut work = vec![0u64; 4 << 20];
    let counts: Vec<AtomicU64> = (0..64).map(|_| AtomicU64::new(0)).collect();
    let mut cursor = 0usize;
    let mut i = 0u64;
    let mut run = |send: bool| {
        let start = Instant::now();
        for _ in 0..block {
            for l in 0..lines {
                work[cursor] = work[cursor].wrapping_add(i);
                cursor = if random {
                    // A walk of all 2^19 lines in a scattered order: line x, then 5x + 1.
                    ((cursor / 8 * 5 + 1) % (work.len() / 8)) * 8
                } else {
                    (cursor + 8) % work.len()
                };
                if l % 64 == 63 {
                    counts[(l / 64) % 64].fetch_add(1, Ordering::AcqRel);
                }
            }
            let _guard = locked.then(|| {
                let mut guard = mutex.lock().unwrap();
                *guard += 1;
                guard
            });
            if send {
                recorder.send(black_box(record(i)));
            }
            i += 1;
        }
        start.elapsed().as_nanos() as f64 / block as f64
    };
    let (mut added, mut base) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        let (with, without) = if r % 2 == 0 {
            let w = run(true);
            (w, run(false))
        } else {
            let wo = run(false);
            (run(true), wo)
        };
        added.push(with - without);
        base.push(without);
    }
    black_box(&work);
    stop(recorder, &dir);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "program: lines={lines} block={block} rounds={rounds} added_ns={:.1} iteration_ns={:.1}",
        median(&mut added),
        median(&mut base)
    );
}
