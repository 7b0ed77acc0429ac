//! Tests of the recorder and its rotating writer:
//!
//! * rotation (injected clock, small files): the file count is bounded, each file reads alone,
//!   and its checkpoint equals the live state when it began;
//! * flushing follows the injected clock;
//! * 8 producers through a tiny channel: nothing is lost, the blocking is counted;
//! * an unwritable directory fails at start;
//! * live totals equal a recount; congestion is visible to producers;
//! * records stamped in ticks come out in the monotonic clock's nanoseconds.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use cachealloc_recorder::schema::*;
use cachealloc_recorder::{LiveState, Record, Recorder, TraceWriter, WriterConfig};

use common::*;

#[test]
fn rotation_bounds_files_and_each_file_reads_alone() {
    let dir = temp_dir("rotation");
    let clock = ManualClock::default();
    let mut config = WriterConfig::new(&dir, 64 << 10, 3, false);
    config.flush_bytes = 4 << 10;
    let mut w = TraceWriter::create(config, header(), clock.clone()).unwrap();
    let records = with_program_context(workload(30_000));
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
        let (got, want) = (&from_checkpoint.context, &expected.context);
        assert_eq!(got.blocks, want.blocks, "file {index}");
        assert!(!got.blocks.is_empty(), "file {index}: blocks in scopes");
        assert_eq!(got.thread_scopes, want.thread_scopes, "file {index}");
        assert_eq!(got.phase.phase, want.phase.phase, "file {index}");
        assert_eq!(got.phase.step, want.phase.step, "file {index}");
        for id in got
            .blocks
            .values()
            .map(|b| b.scope)
            .chain(got.thread_scopes.values().copied())
        {
            assert_eq!(
                got.scope_names.get(&id),
                want.scope_names.get(&id),
                "file {index}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `records` with what the Python integration says woven in: every 100th record a phase, a
/// scope for thread 1 (one of 7 names, defined at first use) and a tag of the last allocation.
fn with_program_context(records: Vec<Record>) -> Vec<Record> {
    use cachealloc_recorder::schema::{PhaseEvent, ScopeEvent, ScopeName, TagEvent};
    let mut out = Vec::new();
    let mut last_alloc = None;
    for (i, r) in records.into_iter().enumerate() {
        let t = r.time().unwrap_or(0);
        if let Record::Alloc(a) = &r {
            last_alloc = Some(a.address);
        }
        out.push(r);
        if i % 100 == 99 {
            let n = (i / 100) as u32;
            let scope = n % 7 + 1;
            if n < 7 {
                out.push(Record::ScopeName(Box::new(ScopeName {
                    id: scope,
                    name: format!("Net.layers.{scope}"),
                })));
            }
            out.push(Record::Phase(PhaseEvent {
                t,
                phase: (n % 4) as u8,
                step: u64::from(n / 4),
            }));
            out.push(Record::Scope(ScopeEvent {
                t,
                thread: 1,
                scope: if n.is_multiple_of(5) { 0 } else { scope },
            }));
            if let Some(address) = last_alloc {
                out.push(Record::Tag(TagEvent {
                    t,
                    device: 0,
                    address: address + 8,
                    category: (n % 5 + 1) as u8,
                }));
            }
        }
    }
    out
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
    assert!(recorder.flush(Duration::from_secs(10)));
    let caught_up = (0..1000).any(|_| {
        std::thread::sleep(Duration::from_millis(1));
        !recorder.congested()
    });
    assert!(
        caught_up,
        "once the worker has caught up, the channel is no longer congested"
    );
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

/// A recorder whose worker is stuck: held inside the error callback of a rotation that failed
/// (the trace directory was removed), as a writer stuck in the kernel would be, until the
/// returned sender sends. Small batches are sent, each flushed, until that happens: at most a
/// batch and a flush are queued then, far below `capacity`.
fn stuck_recorder(name: &str, capacity: usize) -> (Arc<Recorder>, std::sync::mpsc::Sender<()>) {
    let dir = temp_dir(name);
    let (blocked_tx, blocked_rx) = std::sync::mpsc::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let release_rx = std::sync::Mutex::new(release_rx);
    let mut config = WriterConfig::new(&dir, 4 << 10, 2, false);
    config.flush_bytes = 1 << 10;
    let recorder = Recorder::start(config, header(), capacity, move |_| {
        let _ = blocked_tx.send(());
        let _ = release_rx.lock().unwrap().recv();
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    for batch in workload(10_000).chunks(16) {
        for record in batch {
            recorder.send(record.clone());
        }
        if !recorder.flush(Duration::from_secs(2)) {
            break;
        }
    }
    blocked_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the writer failed to rotate into the missing directory");
    (Arc::new(recorder), release_tx)
}

/// Exit while the recorder is blocked: `shutdown` gives up after its timeout and says so, rather
/// than hanging the exiting program.
#[test]
fn shutdown_gives_up_on_a_blocked_worker_within_its_timeout() {
    let (recorder, release) = stuck_recorder("blocked", 1024);
    // It returns (a hang would hang this test), and says the worker did not finish.
    assert!(
        !recorder.shutdown(Duration::from_millis(200)),
        "a blocked worker cannot finish"
    );
    release.send(()).unwrap();
}

/// The queue's bound holds while the worker is stuck: a sender gets at most `capacity` records
/// in, then waits; once the worker moves again every send completes; and after `shutdown`
/// sends return at once (nothing drains the queue any more, and nothing waits for it).
#[test]
fn a_stuck_worker_holds_senders_at_the_bound_and_a_stopped_one_holds_none() {
    let capacity = 64;
    let (recorder, release) = stuck_recorder("bound", capacity);
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let records = workload(2_000);
    let total = records.len();
    let producer = {
        let (recorder, sent) = (recorder.clone(), sent.clone());
        std::thread::spawn(move || {
            for record in records {
                recorder.send(record);
                sent.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let while_stuck = sent.load(Ordering::SeqCst);
    assert!(
        while_stuck > 0 && while_stuck <= capacity,
        "{while_stuck} sends completed while the worker was stuck (capacity {capacity})"
    );
    release.send(()).unwrap();
    producer.join().unwrap();
    assert_eq!(sent.load(Ordering::SeqCst), total);
    assert!(recorder.shutdown(Duration::from_secs(10)));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for record in workload(10 * capacity as u64) {
            recorder.send(record);
        }
        let _ = done_tx.send(());
    });
    done_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("sends after shutdown return");
}

/// A counter at 2.5 ticks a nanosecond, from an offset: what a CPU's tick counter looks like
/// to the converter.
fn fake_ticks() -> u64 {
    cachealloc_recorder::monotonic_ns() * 5 / 2 + 1_000_000_007
}

#[test]
fn records_stamped_in_ticks_are_written_in_the_clocks_nanoseconds() {
    let dir = temp_dir("ticks");
    let recorder = Recorder::start_with_ticks(
        WriterConfig::new(&dir, 1 << 30, 2, false),
        header(),
        64,
        fake_ticks,
        |e| panic!("{e}"),
    )
    .unwrap();
    // Senders stamp in ticks; the truth is the monotonic clock read beside each stamp. Some
    // records wait across several of the worker's drains, some are sent right after one.
    let mut truth = vec![];
    for i in 0..300u64 {
        let before = cachealloc_recorder::monotonic_ns();
        let t = fake_ticks();
        truth.push((before, cachealloc_recorder::monotonic_ns()));
        let record = if i % 50 == 7 {
            // A record that goes through the side queue.
            Record::Annotation(Box::new(Annotation {
                t,
                name: format!("mark {i}"),
                thread: 1,
            }))
        } else {
            Record::Scope(ScopeEvent {
                t,
                thread: 1,
                scope: i as u32,
            })
        };
        recorder.send(record);
        if i % 37 == 0 {
            std::thread::sleep(Duration::from_micros(1500));
        }
    }
    assert!(recorder.shutdown(Duration::from_secs(10)));
    let (read, _) = read_all(&dir);
    let times: Vec<u64> = read
        .iter()
        .filter_map(|(_, r)| match r {
            Record::Scope(_) | Record::Annotation(_) => r.time(),
            _ => None,
        })
        .collect();
    assert_eq!(times.len(), truth.len());
    let mut last = 0;
    for (i, (&t, &(before, after))) in times.iter().zip(&truth).enumerate() {
        // Within the clock reads around the stamp, give or take the pairs' own error.
        assert!(
            t + 2_000 >= before && t <= after + 2_000,
            "record {i}: {t} not in [{before}, {after}]"
        );
        assert!(t >= last, "record {i} went back: {t} after {last}");
        last = t;
    }
}
