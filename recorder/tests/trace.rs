//! Tests of the trace format, its writer and reader:
//!
//! * every record kind round-trips;
//! * a torn tail or flipped bytes: the reader stops at the tear and keeps everything before;
//! * records borrowed (`next_ref`) are the records taken (the iterator);
//! * unknown record kinds are skipped;
//! * golden files of format version 1 still read exactly.
//!
//! The recorder's behaviour (rotation, flushing, producers, congestion) is in `recorder.rs`.

mod common;

use std::path::{Path, PathBuf};

use cachealloc_recorder::schema::*;
use cachealloc_recorder::{Record, WriterConfig};

use common::*;

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
        Record::ScopeName(Box::new(ScopeName {
            id: 1,
            name: "Net.layers.0".into(),
        })),
        Record::Scope(ScopeEvent {
            t: 20,
            thread: 1,
            scope: 1,
        }),
        Record::Phase(PhaseEvent {
            t: 21,
            phase: PHASE_BACKWARD,
            step: 3,
        }),
        Record::Tag(TagEvent {
            t: 22,
            device: 0,
            address: 0x7f00_0000_0010,
            category: TAG_GRADIENT,
        }),
        Record::CheckpointBlockContext(BlockContext {
            device: 0,
            address: 1 << 30,
            scope: 1,
            phase: PHASE_FORWARD,
            category: TAG_ACTIVATION,
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
        write_trace(
            WriterConfig::new(&dir, 1 << 30, 4, compress),
            &one_of_each(),
        );
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
    write_trace(
        WriterConfig::new(&dir, 1 << 30, 4, false),
        &[
            Record::Unknown {
                kind: 200,
                body: vec![1, 2, 3],
            },
            Record::Annotation(Box::new(Annotation {
                t: 1,
                name: "after".into(),
                thread: 0,
            })),
        ],
    );
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

/// A finished single-file trace of the workload; returns its path and records.
fn small_trace(name: &str, compress: bool) -> (PathBuf, PathBuf, Vec<Record>) {
    let dir = temp_dir(name);
    let mut config = WriterConfig::new(&dir, 1 << 30, 2, compress);
    config.flush_bytes = 2 << 10;
    let records = workload(3000);
    let path = write_trace(config, &records);
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

/// Borrowing the records (`next_ref`, the export's walk) reads what taking them (the iterator)
/// reads, tears included, also when the two are mixed.
#[test]
fn borrowed_records_are_the_records() {
    let dir = temp_dir("borrowed");
    let mut config = WriterConfig::new(&dir, 40 << 10, 16, false);
    config.flush_bytes = 2 << 10;
    write_trace(config, &workload(6000));
    let files = cachealloc_recorder::reader::trace_files(&dir).unwrap();
    assert!(files.len() >= 3, "{} files", files.len());
    let full = std::fs::read(&files[1]).unwrap();
    std::fs::write(&files[1], &full[..full.len() - 100]).unwrap();
    let (taken, reader) = read_all(&dir);
    let mut borrowing = cachealloc_recorder::TraceReader::open(&dir).unwrap();
    let mut borrowed = vec![];
    while let Some(item) = borrowing.next_ref() {
        let (file, record) = item.unwrap();
        borrowed.push((file, record.clone()));
        // Every third record taken instead, between two borrowed ones.
        if borrowed.len() % 3 == 0
            && let Some(item) = borrowing.next()
        {
            let item = item.unwrap();
            borrowed.push((item.file, item.record));
        }
    }
    assert_eq!(borrowed, taken);
    assert_eq!(borrowing.tears(), reader.tears());
    assert_eq!(reader.tears().len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
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
        write_trace(
            WriterConfig::new(&dir, 1 << 30, 2, compress),
            &golden_records(),
        );
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

/// A writer keeps one zstd context for all its chunks: each chunk is the same as one framed on
/// its own, and reads back as the records it holds.
#[test]
fn a_reused_chunk_encoder_frames_each_chunk_as_a_fresh_one_would() {
    use cachealloc_recorder::chunk::{ChunkEncoder, decode_payload, encode_chunk, split_chunk};
    let mut encoder = ChunkEncoder::default();
    for n in [1u64, 700, 3, 2000, 50] {
        let records: Vec<Record> = (0..n)
            .map(|i| {
                Record::FreeCompleted(FreeCompleted {
                    t: i * 1000 + n,
                    device: (i % 3) as u32,
                    address: 0x7f00_0000_0000 + i * 4096 * n,
                    size: 512 * (i % 7 + 1),
                })
            })
            .collect();
        let mut bytes = Vec::new();
        for r in &records {
            r.encode(&mut bytes);
        }
        for compress in [true, false] {
            let (mut reused, mut fresh) = (Vec::new(), Vec::new());
            encoder.encode(&bytes, compress, &mut reused);
            encode_chunk(&bytes, compress, &mut fresh);
            assert_eq!(reused, fresh, "{n} records, compress {compress}");
            let (payload, flags, used) = split_chunk(&reused).unwrap();
            assert_eq!(used, reused.len());
            assert_eq!(decode_payload(payload, flags).unwrap(), records);
        }
    }
}
