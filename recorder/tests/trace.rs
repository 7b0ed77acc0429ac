//! Tests of the trace format, writer, reader and recorder:
//!
//! * every record kind round-trips;
//! * rotation (injected clock, small files): the file count is bounded, each file reads alone,
//!   and its checkpoint equals the live state when it began;
//! * a torn tail or flipped bytes: the reader stops at the tear and keeps everything before;
//! * unknown record kinds are skipped;
//! * 8 producers through a tiny channel: nothing is lost, the blocking is counted;
//! * golden files of format version 1 still read exactly.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cachealloc_recorder::schema::*;
use cachealloc_recorder::{
    Clock, LiveState, Record, Recorder, TraceReader, TraceWriter, WriterConfig,
};

/// A clock the test moves by hand.
#[derive(Clone, Default)]
struct ManualClock(Arc<AtomicU64>);

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cachealloc-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn header() -> Header {
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

/// One record of every kind (but Header, which the writer adds itself).
fn one_of_each() -> Vec<Record> {
    let seg = SegmentEvent {
        t: 5,
        device: 0,
        address: 0x7f00_0000_0000,
        size: 2 << 20,
        pool: 0,
        stack: 1,
    };
    vec![
        Record::FrameDef(Box::new(FrameDef {
            id: 1,
            kind: 1,
            name: "forward".into(),
            file: "model.py".into(),
            line: 42,
            address: 0,
        })),
        Record::StackDef(Box::new(StackDef {
            id: 1,
            frames: vec![1],
        })),
        Record::SegmentAlloc(seg),
        Record::Alloc(Alloc {
            t: 6,
            device: 0,
            stream: 0,
            address: 0x7f00_0000_0000,
            requested: 1000,
            size: 1024,
            stack: 1,
            thread: 1,
        }),
        Record::FreeRequested(FreeRequested {
            t: 7,
            device: 0,
            stream: 0,
            address: 0x7f00_0000_0000,
            size: 1024,
            stack: 0,
            thread: 1,
        }),
        Record::FreeCompleted(FreeCompleted {
            t: 8,
            device: 0,
            address: 0x7f00_0000_0000,
            size: 1024,
        }),
        Record::SegmentMap(SegmentEvent { t: 9, ..seg }),
        Record::SegmentUnmap(SegmentEvent { t: 10, ..seg }),
        Record::SegmentFree(SegmentEvent { t: 11, ..seg }),
        Record::Oom(Box::new(Oom {
            t: 12,
            device: 0,
            requested: 1 << 40,
            rounded: 1 << 40,
            allocated: 3,
            reserved: 4,
            cached_free: 1,
            largest_free_block: 1,
            device_free: 5,
            device_total: 6,
            limit: 6,
            stack: 1,
            thread: 2,
        })),
        Record::StreamCreated(StreamEvent {
            t: 13,
            device: 0,
            stream: 0x55,
            flags: 1,
        }),
        Record::StreamDestroyed(StreamEvent {
            t: 14,
            device: 0,
            stream: 0x55,
            flags: 0,
        }),
        Record::Annotation(Box::new(Annotation {
            t: 15,
            name: "epoch 1 ✓".into(),
            thread: 1,
        })),
        Record::StatsSample(StatsSample {
            t: 16,
            device: 0,
            allocated: 1,
            reserved: 2,
            active: 1,
            requested: 1,
        }),
        Record::Dropped(Dropped {
            t: 17,
            stacks_shed: 1,
            blocked_sends: 2,
            blocked_ns: 3,
        }),
        Record::CheckpointSegment(SegmentState {
            device: 0,
            address: 1 << 30,
            size: 2 << 20,
            pool: 0,
            stack: 0,
        }),
        Record::CheckpointBlock(BlockState {
            device: 0,
            address: 1 << 30,
            size: 512,
            requested: 1,
            stack: 0,
            pending: 1,
        }),
        Record::CheckpointEnd(CheckpointEnd { t: 18 }),
        Record::Free(FreeRequested {
            t: 19,
            device: 0,
            stream: 0,
            address: 0x7f00_0000_1000,
            size: 512,
            stack: 0,
            thread: 3,
        }),
    ]
}

/// The records of the golden files: every kind that existed when they were written (kind 23,
/// `Free`, came later; the files must still read exactly).
fn golden_records() -> Vec<Record> {
    one_of_each()
        .into_iter()
        .filter(|r| r.kind() <= 22)
        .collect()
}

fn read_all(dir: &Path) -> (Vec<(usize, Record)>, TraceReader) {
    let mut reader = TraceReader::open(dir).unwrap();
    let mut out = Vec::new();
    for item in reader.by_ref() {
        let item = item.unwrap();
        out.push((item.file, item.record));
    }
    (out, reader)
}

/// The records of one file after its header and checkpoint.
fn events_of(records: &[(usize, Record)], file: usize) -> Vec<Record> {
    let in_file: Vec<&Record> = records
        .iter()
        .filter(|(f, _)| *f == file)
        .map(|(_, r)| r)
        .collect();
    let end = in_file
        .iter()
        .position(|r| matches!(r, Record::CheckpointEnd(_)))
        .expect("checkpoint end");
    in_file[end + 1..].iter().map(|r| (*r).clone()).collect()
}

#[test]
fn every_record_kind_round_trips() {
    for compress in [false, true] {
        let dir = temp_dir(&format!("roundtrip-{compress}"));
        let mut w = TraceWriter::create(
            WriterConfig::new(&dir, 1 << 30, 4, compress),
            header(),
            ManualClock::default(),
        )
        .unwrap();
        for r in one_of_each() {
            w.write(&r).unwrap();
        }
        w.finish().unwrap();
        let (records, reader) = read_all(&dir);
        assert!(reader.tears().is_empty());
        assert!(matches!(&records[0].1, Record::Header(h) if **h == header()));
        assert_eq!(events_of(&records, 0), one_of_each());
        assert!(
            dir.join("trace-000000.cat").exists(),
            "finished file renamed from .part"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn unknown_kinds_are_passed_over() {
    let dir = temp_dir("unknown");
    let mut w = TraceWriter::create(
        WriterConfig::new(&dir, 1 << 30, 4, false),
        header(),
        ManualClock::default(),
    )
    .unwrap();
    w.write(&Record::Unknown {
        kind: 200,
        body: vec![1, 2, 3],
    })
    .unwrap();
    w.write(&Record::Annotation(Box::new(Annotation {
        t: 1,
        name: "after".into(),
        thread: 0,
    })))
    .unwrap();
    w.finish().unwrap();
    let (records, _) = read_all(&dir);
    let events = events_of(&records, 0);
    assert_eq!(
        events[0],
        Record::Unknown {
            kind: 200,
            body: vec![1, 2, 3]
        }
    );
    assert!(matches!(&events[1], Record::Annotation(a) if a.name == "after"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A deterministic workload: allocations and frees over a few segments.
fn workload(n: u64) -> Vec<Record> {
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

#[test]
fn rotation_bounds_files_and_each_file_reads_alone() {
    let dir = temp_dir("rotation");
    let clock = ManualClock::default();
    let mut config = WriterConfig::new(&dir, 64 << 10, 3, false);
    config.flush_bytes = 4 << 10;
    let mut w = TraceWriter::create(config, header(), clock.clone()).unwrap();
    let records = workload(30_000);
    // The live state when each file began, to compare with its checkpoint.
    let mut expected_at_file_start = vec![LiveState::default()];
    let mut mirror = LiveState::default();
    for r in &records {
        clock.0.fetch_add(1000, Ordering::SeqCst);
        mirror.apply(r);
        let before = w.file_index();
        w.write(r).unwrap();
        if w.file_index() != before {
            // The chunk that triggered the rotation held everything up to this record.
            expected_at_file_start.push(mirror.clone());
        }
    }
    let last = w.file_index();
    w.finish().unwrap();
    assert!(last >= 5, "the workload spans several files ({last})");
    let files = cachealloc_recorder::reader::trace_files(&dir).unwrap();
    assert_eq!(files.len(), 3, "only max_files are kept");
    for (i, path) in files.iter().enumerate() {
        let index = last as usize - 2 + i;
        let bytes = std::fs::read(path).unwrap();
        assert!(
            bytes.len() as u64 <= (64 << 10) + (8 << 10),
            "file size bounded: {}",
            bytes.len()
        );
        let (file_records, tear) = cachealloc_recorder::reader::read_file(path, &bytes).unwrap();
        assert!(tear.is_none());
        let Record::Header(h) = &file_records[0] else {
            panic!("header first")
        };
        assert_eq!(h.file_index as usize, index);
        let mut from_checkpoint = LiveState::default();
        for r in file_records
            .iter()
            .take_while(|r| !matches!(r, Record::CheckpointEnd(_)))
        {
            from_checkpoint.apply(r);
        }
        let expected = &expected_at_file_start[index];
        assert_eq!(from_checkpoint.segments, expected.segments, "file {index}");
        assert_eq!(from_checkpoint.blocks, expected.blocks, "file {index}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn flushing_follows_the_injected_clock() {
    let dir = temp_dir("clock");
    let clock = ManualClock::default();
    let mut w = TraceWriter::create(
        WriterConfig::new(&dir, 1 << 30, 2, false),
        header(),
        clock.clone(),
    )
    .unwrap();
    let path = dir.join("trace-000000.cat.part");
    let size = || std::fs::metadata(&path).unwrap().len();
    let initial = size();
    w.write(&Record::Annotation(Box::new(Annotation {
        t: 1,
        name: "a".into(),
        thread: 0,
    })))
    .unwrap();
    w.tick().unwrap();
    assert_eq!(size(), initial, "not flushed before 100 ms");
    clock.0.store(100_000_000, Ordering::SeqCst);
    w.tick().unwrap();
    assert!(size() > initial, "flushed after 100 ms");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A finished single-file trace of the workload; returns its path and records.
fn small_trace(name: &str, compress: bool) -> (PathBuf, PathBuf, Vec<Record>) {
    let dir = temp_dir(name);
    let mut config = WriterConfig::new(&dir, 1 << 30, 2, compress);
    config.flush_bytes = 2 << 10;
    let mut w = TraceWriter::create(config, header(), ManualClock::default()).unwrap();
    let records = workload(3000);
    for r in &records {
        w.write(r).unwrap();
    }
    let path = w.finish().unwrap();
    (dir, path, records)
}

#[test]
fn a_torn_tail_keeps_everything_before_it() {
    for compress in [false, true] {
        let (dir, path, records) = small_trace(&format!("torn-{compress}"), compress);
        let full = std::fs::read(&path).unwrap();
        // Cut in the middle of the last chunk, as kill -9 during a write could.
        std::fs::write(&path, &full[..full.len() - 100]).unwrap();
        let (read, reader) = read_all(&dir);
        assert_eq!(reader.tears().len(), 1);
        let tear = &reader.tears()[0];
        assert!(
            matches!(
                tear.error,
                cachealloc_recorder::chunk::ChunkError::Truncated { .. }
            ),
            "{tear:?}"
        );
        let events = events_of(&read, 0);
        assert!(!events.is_empty() && events.len() < records.len());
        assert_eq!(events[..], records[..events.len()], "a prefix, intact");
        assert!(
            records.len() - events.len() < 400,
            "only the last chunk is lost"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn flipped_bytes_stop_the_file_at_the_corrupt_chunk() {
    let (dir, path, records) = small_trace("flip", true);
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let (read, reader) = read_all(&dir);
    assert_eq!(reader.tears().len(), 1);
    let tear = &reader.tears()[0];
    assert_eq!(tear.error, cachealloc_recorder::chunk::ChunkError::Checksum);
    assert!(tear.offset <= middle as u64);
    let events = events_of(&read, 0);
    assert_eq!(events[..], records[..events.len()]);
    assert!(events.len() < records.len());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eight_producers_through_a_tiny_channel_lose_nothing() {
    let dir = temp_dir("backpressure");
    let recorder = Arc::new(
        Recorder::start(
            WriterConfig::new(&dir, 1 << 30, 2, true),
            header(),
            16,
            |e| panic!("{e}"),
        )
        .unwrap(),
    );
    let per_thread = 20_000u64;
    let threads: Vec<_> = (0..8u32)
        .map(|thread| {
            let recorder = recorder.clone();
            std::thread::spawn(move || {
                for i in 0..per_thread {
                    let address = (u64::from(thread) << 32) + i * 512;
                    recorder.send(Record::Alloc(Alloc {
                        t: i,
                        device: 0,
                        stream: 0,
                        address,
                        requested: 512,
                        size: 512,
                        stack: 0,
                        thread,
                    }));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(recorder.shutdown(Duration::from_secs(30)));
    let stats = recorder.stats();
    assert_eq!(stats.written.load(Ordering::SeqCst), 8 * per_thread);
    assert!(
        stats.blocked_sends.load(Ordering::SeqCst) > 0,
        "a 16-slot channel must have pushed back"
    );
    let (read, reader) = read_all(&dir);
    assert!(reader.tears().is_empty());
    let mut per = [0u64; 8];
    let mut last = [None::<u64>; 8];
    let mut dropped = None;
    for (_, r) in &read {
        match r {
            Record::Alloc(a) => {
                let th = a.thread as usize;
                per[th] += 1;
                assert!(
                    last[th].is_none_or(|l| a.t == l + 1),
                    "each thread's records in order"
                );
                last[th] = Some(a.t);
            }
            Record::Dropped(d) => dropped = Some(*d),
            _ => {}
        }
    }
    assert_eq!(per, [per_thread; 8]);
    let dropped = dropped.expect("the blocking is written into the trace");
    assert!(dropped.blocked_sends > 0 && dropped.blocked_ns > 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_unwritable_directory_fails_at_start() {
    let err = Recorder::start(
        WriterConfig::new("/proc/cachealloc-cannot-be-here", 1 << 20, 2, false),
        header(),
        16,
        |_| {},
    );
    assert!(err.is_err());
}

// ----- golden files ------------------------------------------------------------------------

fn golden_dir(compress: bool) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/v1")
        .join(if compress { "zstd" } else { "plain" })
}

/// Regenerate the golden files (only when the format version changes):
/// `cargo test -p cachealloc-recorder --test trace -- --ignored write_golden_files`
#[test]
#[ignore]
fn write_golden_files() {
    for compress in [false, true] {
        let dir = golden_dir(compress);
        let _ = std::fs::remove_dir_all(&dir);
        let mut w = TraceWriter::create(
            WriterConfig::new(&dir, 1 << 30, 2, compress),
            header(),
            ManualClock::default(),
        )
        .unwrap();
        for r in golden_records() {
            w.write(&r).unwrap();
        }
        w.finish().unwrap();
    }
}

#[test]
fn golden_files_of_format_1_read_exactly() {
    for compress in [false, true] {
        let (records, reader) = read_all(&golden_dir(compress));
        assert!(reader.tears().is_empty());
        assert!(
            matches!(&records[0].1, Record::Header(h) if **h == header()),
            "{compress}"
        );
        assert_eq!(events_of(&records, 0), golden_records(), "{compress}");
    }
}

#[test]
fn live_totals_equal_a_recount_even_when_checkpoints_repeat_the_state() {
    let mut state = LiveState::default();
    let recount = |s: &LiveState| {
        let mut t = cachealloc_recorder::state::DeviceTotals::default();
        for b in s.blocks.values() {
            if b.pending == 0 {
                t.allocated += b.size;
            }
            t.active += b.size;
            t.requested += b.requested;
        }
        t.reserved = s.segments.values().map(|s| s.size).sum();
        t
    };
    let mut records = workload(5000);
    // A block freed but pending, then a mid-stream checkpoint that repeats everything live.
    records.push(Record::Alloc(Alloc {
        t: 1,
        device: 0,
        stream: 0,
        address: 7 << 40,
        requested: 100,
        size: 512,
        stack: 0,
        thread: 1,
    }));
    records.push(Record::FreeRequested(FreeRequested {
        t: 2,
        device: 0,
        stream: 0,
        address: 7 << 40,
        size: 512,
        stack: 0,
        thread: 1,
    }));
    for (i, r) in records.iter().enumerate() {
        state.apply(r);
        if i % 997 == 0 {
            assert_eq!(
                state.totals.get(&0).copied().unwrap_or_default(),
                recount(&state),
                "after record {i}"
            );
        }
    }
    for r in state.clone().checkpoint(3) {
        state.apply(&r);
    }
    assert_eq!(
        state.totals[&0],
        recount(&state),
        "a repeated checkpoint does not double count"
    );
    assert!(
        state.totals[&0].active > state.totals[&0].allocated,
        "the pending block is active, not allocated"
    );
}

#[test]
fn congestion_is_visible_to_producers_and_shed_stacks_are_recorded() {
    let dir = temp_dir("congestion");
    let recorder = Recorder::start(
        WriterConfig::new(&dir, 1 << 30, 2, false),
        header(),
        8,
        |e| panic!("{e}"),
    )
    .unwrap();
    let mut seen_congested = false;
    for i in 0..2000u64 {
        if recorder.congested() {
            seen_congested = true;
            recorder.note_stack_shed();
        }
        recorder.send(Record::Alloc(Alloc {
            t: i,
            device: 0,
            stream: 0,
            address: i * 512,
            requested: 512,
            size: 512,
            stack: 0,
            thread: 1,
        }));
    }
    assert!(seen_congested, "an 8-slot channel fed in a burst fills up");
    let shed = recorder.stats().stacks_shed.load(Ordering::SeqCst);
    assert!(recorder.shutdown(Duration::from_secs(10)));
    let (read, _) = read_all(&dir);
    let last_dropped = read.iter().rev().find_map(|(_, r)| {
        if let Record::Dropped(d) = r {
            Some(*d)
        } else {
            None
        }
    });
    assert_eq!(
        last_dropped.map(|d| d.stacks_shed),
        Some(shed),
        "the shed count is in the trace"
    );
    assert_eq!(
        read.iter().filter(|(_, r)| r.kind() == 10).count(),
        2000,
        "no event was shed"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
