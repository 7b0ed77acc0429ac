//! A trace read while its program still writes it ([`TraceReader::follow`]): each read after a
//! flush returns every record flushed so far and nothing twice, across rotations; a chunk not
//! yet written whole is read once it is, not reported as a tear; a file listed while it was
//! being written and finished before the reader reached it is read by its final name.

mod common;

use std::io::Write;
use std::sync::atomic::Ordering;

use cachealloc_recorder::{Record, TraceReader, TraceWriter, WriterConfig};

use common::*;

/// A writer of 16 KiB files flushed every 2 KiB into `dir`, keeping `max_files`.
fn small_files(
    dir: &std::path::Path,
    max_files: u32,
    clock: &ManualClock,
) -> TraceWriter<ManualClock> {
    let mut config = WriterConfig::new(dir, 16 << 10, max_files, true);
    config.flush_bytes = 2 << 10;
    TraceWriter::create(config, header(), clock.clone()).unwrap()
}

/// Write `records` (each a microsecond after the last) until the writer is in file `file`,
/// then flush.
fn write_until_file(
    w: &mut TraceWriter<ManualClock>,
    clock: &ManualClock,
    records: &mut impl Iterator<Item = Record>,
    file: u32,
) {
    while w.file_index() < file {
        clock.0.fetch_add(1000, Ordering::SeqCst);
        w.write(&records.next().expect("records enough")).unwrap();
    }
    w.flush().unwrap();
}

/// Every record of `dir`, read by a reader opened now.
fn all(dir: &std::path::Path) -> Vec<Record> {
    TraceReader::open(dir)
        .unwrap()
        .map(|item| item.unwrap().record)
        .collect()
}

/// Every record the reader has now.
fn drain(reader: &mut TraceReader) -> Vec<Record> {
    reader.refresh().unwrap();
    reader.by_ref().map(|item| item.unwrap().record).collect()
}

#[test]
fn a_followed_trace_gives_each_flushed_record_once_across_rotations() {
    let dir = temp_dir("follow-rotation");
    let clock = ManualClock::default();
    let mut w = small_files(&dir, 1000, &clock);
    let records = workload(20_000);
    let mut reader = TraceReader::follow(&dir).unwrap();
    let mut followed = drain(&mut reader);
    for batch in records.chunks(1_500) {
        for r in batch {
            clock.0.fetch_add(1000, Ordering::SeqCst);
            w.write(r).unwrap();
        }
        w.flush().unwrap();
        followed.extend(drain(&mut reader));
        // What a reader opened now reads, the followed one has read.
        let now: Vec<Record> = TraceReader::open(&dir)
            .unwrap()
            .map(|item| item.unwrap().record)
            .collect();
        assert_eq!(
            followed.len(),
            now.len(),
            "after {} records",
            followed.len()
        );
    }
    let files = w.file_index();
    w.finish().unwrap();
    followed.extend(drain(&mut reader));
    assert!(files >= 4, "the workload spans several files ({files})");
    assert!(
        followed == all(&dir),
        "the followed records are the trace's"
    );
    assert!(reader.tears().is_empty());
}

#[test]
fn a_chunk_written_in_part_is_read_when_whole() {
    let source = temp_dir("follow-part-source");
    let mut config = WriterConfig::new(&source, 1 << 30, 2, true);
    config.flush_bytes = 1 << 10;
    let mut w = TraceWriter::create(config, header(), ManualClock::default()).unwrap();
    for r in workload(2_000) {
        w.write(&r).unwrap();
    }
    w.finish().unwrap();
    let file = &cachealloc_recorder::reader::trace_files(&source).unwrap()[0];
    let bytes = std::fs::read(file).unwrap();
    let whole = all(&source);

    // The same file, as a program that has written all but the last 100 bytes leaves it.
    let dir = temp_dir("follow-part");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("trace-000000.cat.part");
    let cut = bytes.len() - 100;
    std::fs::write(&path, &bytes[..cut]).unwrap();
    let mut reader = TraceReader::follow(&dir).unwrap();
    let mut followed = drain(&mut reader);
    assert!(!followed.is_empty() && followed.len() < whole.len());
    assert!(
        reader.tears().is_empty(),
        "a chunk being written is no tear"
    );
    // The rest, in two writes: the header of the last chunk may itself have been cut.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(&bytes[cut..cut + 50]).unwrap();
    followed.extend(drain(&mut reader));
    f.write_all(&bytes[cut + 50..]).unwrap();
    followed.extend(drain(&mut reader));
    assert!(
        followed == whole,
        "{} of {} records",
        followed.len(),
        whole.len()
    );
    assert!(reader.tears().is_empty());

    // Opened (not followed), the cut file has a tear where the chunk was cut.
    std::fs::write(&path, &bytes[..cut]).unwrap();
    let mut once = TraceReader::open(&dir).unwrap();
    drain(&mut once);
    assert_eq!(once.tears().len(), 1);
}

#[test]
fn files_rotated_away_before_they_are_read_are_passed_over() {
    let dir = temp_dir("follow-rotated-away");
    let clock = ManualClock::default();
    let mut w = small_files(&dir, 3, &clock);
    let mut reader = TraceReader::follow(&dir).unwrap();
    drain(&mut reader);
    let mut records = workload(40_000).into_iter();
    let mut write_until = |w: &mut TraceWriter<ManualClock>, file: u32| {
        write_until_file(w, &clock, &mut records, file)
    };
    // The reader learns of files 1 and 2, then the program rotates them away before it reads.
    write_until(&mut w, 2);
    reader.refresh().unwrap();
    write_until(&mut w, 6);
    let mut followed: Vec<Record> = reader.by_ref().map(|item| item.unwrap().record).collect();
    followed.extend(drain(&mut reader));
    let kept = all(&dir);
    assert!(followed.len() > kept.len());
    assert!(
        followed.ends_with(&kept),
        "after the file it had begun, the files still there"
    );
}

#[test]
fn a_file_finished_after_it_was_listed_is_read() {
    let dir = temp_dir("follow-finished");
    let clock = ManualClock::default();
    let mut w = small_files(&dir, 1000, &clock);
    let mut records = workload(40_000).into_iter();
    let mut write_until = |w: &mut TraceWriter<ManualClock>, file: u32| {
        write_until_file(w, &clock, &mut records, file)
    };
    // The reader lists file 1 as it is being written (`.part`) while it is still in file 0;
    // the program finishes file 1 (renamed) before the reader gets there.
    write_until(&mut w, 1);
    let mut reader = TraceReader::follow(&dir).unwrap();
    assert!(reader.files()[1].to_str().unwrap().ends_with(".part"));
    let mut followed: Vec<Record> = reader.by_ref().take(3).map(|i| i.unwrap().record).collect();
    write_until(&mut w, 3);
    followed.extend(drain(&mut reader));
    w.finish().unwrap();
    followed.extend(drain(&mut reader));
    assert!(followed == all(&dir), "every record, file 1's too");
    assert!(reader.tears().is_empty());
}
