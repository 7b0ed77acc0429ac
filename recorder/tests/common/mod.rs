//! Helpers shared by the recorder's test files: a clock moved by hand, scratch directories, a
//! header, writing and reading a whole trace, and a deterministic workload.
#![allow(dead_code)] // each test file uses some of them

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cachealloc_recorder::schema::*;
use cachealloc_recorder::{Clock, Record, TraceReader, TraceWriter, WriterConfig};

/// A clock the test moves by hand.
#[derive(Clone, Default)]
pub struct ManualClock(pub Arc<AtomicU64>);

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cachealloc-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

pub fn header() -> Header {
    Header {
        version: FORMAT_VERSION,
        file_index: 0,
        pid: 4242,
        host: "testhost".into(),
        rank: 1,
        local_rank: 1,
        world_size: 2,
        cmdline: vec!["python".into(), "train.py".into()],
        wall_clock_base_ns: 1_700_000_000_000_000_000,
        monotonic_base_ns: 0,
        config: "reuse:auto".into(),
        devices: vec![DeviceInfo {
            index: 0,
            name: "Fake GPU".into(),
            total_memory: 1 << 34,
        }],
        modules: vec![Module {
            path: "/lib/x.so".into(),
            start: 0x1000,
            end: 0x2000,
            offset: 0,
        }],
    }
}

/// Write `records` as a trace with `config` (the test header, a clock that never moves) and
/// finish it; returns the last file.
pub fn write_trace(config: WriterConfig, records: &[Record]) -> PathBuf {
    let mut w = TraceWriter::create(config, header(), ManualClock::default()).unwrap();
    for r in records {
        w.write(r).unwrap();
    }
    w.finish().unwrap()
}

pub fn read_all(dir: &Path) -> (Vec<(usize, Record)>, TraceReader) {
    let mut reader = TraceReader::open(dir).unwrap();
    let mut out = Vec::new();
    for item in reader.by_ref() {
        let item = item.unwrap();
        out.push((item.file, item.record));
    }
    (out, reader)
}

/// A deterministic workload: allocations and frees over a few segments.
pub fn workload(n: u64) -> Vec<Record> {
    let mut out = vec![Record::SegmentAlloc(SegmentEvent {
        t: 0,
        device: 0,
        address: 1 << 40,
        size: 1 << 30,
        pool: 1,
        stack: 0,
    })];
    for i in 0..n {
        let address = (1 << 40) + (i % 1000) * 4096;
        if i % 1000 == 0 && i > 0 {
            continue;
        }
        out.push(Record::Alloc(Alloc {
            t: i * 10,
            device: 0,
            stream: 0,
            address,
            requested: 4000,
            size: 4096,
            stack: 0,
            thread: 1,
        }));
        if i % 3 != 0 {
            out.push(Record::FreeRequested(FreeRequested {
                t: i * 10 + 1,
                device: 0,
                stream: 0,
                address,
                size: 4096,
                stack: 0,
                thread: 1,
            }));
            out.push(Record::FreeCompleted(FreeCompleted {
                t: i * 10 + 2,
                device: 0,
                address,
                size: 4096,
            }));
        }
    }
    out
}
