//! Tests of staged sends (recorder Note [Staged sends]) through a running recorder:
//!
//! * threads that send under one lock, through their stages and a small ring, some of them
//!   pausing with records staged: the trace holds every record once, in the lock's order;
//! * a thread that blocks with records staged does not block the others, even once the ring is
//!   full behind its records;
//! * a flush writes an idle thread's staged records, in their places.

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::time::Duration;

use cachealloc_recorder::schema::*;
use cachealloc_recorder::{Record, Recorder, WriterConfig};

use common::*;

fn start(dir: &std::path::Path, capacity: usize) -> Arc<Recorder> {
    Arc::new(
        Recorder::start(
            WriterConfig::new(dir, 1 << 30, 2, true),
            header(),
            capacity,
            |e| panic!("{e}"),
        )
        .unwrap(),
    )
}

/// An allocation of `thread` at time `t` (a block of its own).
fn alloc(t: u64, thread: u32) -> Record {
    Record::Alloc(Alloc {
        t,
        device: 0,
        stream: 0,
        address: (1 << 40) + t * 512,
        requested: 512,
        size: 512,
        stack: 0,
        thread,
    })
}

/// `f`'s result, or a failure if it has not returned within a minute (a send that waits for
/// ever fails the test instead of hanging it).
fn within_a_minute<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || done.send(f()));
    result
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{what}: stuck"))
}

/// A thread that sends allocations at `times` through its stage (thread 1), then waits, with
/// them staged, until the returned sender says go on, as a thread waits for the GPU or for the
/// backward pass; returned once they are staged.
fn idle_with_staged(
    recorder: &Arc<Recorder>,
    times: std::ops::Range<u64>,
) -> (std::thread::JoinHandle<()>, mpsc::Sender<()>) {
    let staged = Arc::new(Barrier::new(2));
    let (release, released) = mpsc::channel::<()>();
    let thread = {
        let (recorder, staged) = (recorder.clone(), staged.clone());
        std::thread::spawn(move || {
            let stage = recorder.stage();
            for t in times {
                recorder.send_staged(&stage, alloc(t, 1));
            }
            staged.wait();
            released.recv().unwrap();
        })
    };
    staged.wait();
    (thread, release)
}

/// The times of the trace's allocations, in the trace's order.
fn alloc_times(dir: &std::path::Path) -> Vec<u64> {
    let (read, reader) = read_all(dir);
    assert!(reader.tears().is_empty());
    read.iter()
        .filter_map(|(_, r)| match r {
            Record::Alloc(a) => Some(a.t),
            _ => None,
        })
        .collect()
}

#[test]
fn staged_sends_under_a_lock_keep_its_order_and_lose_nothing() {
    let dir = temp_dir("stages-order");
    let recorder = start(&dir, 64);
    // The lock the allocator's records are sent under; it hands out the times.
    let lock = Arc::new(Mutex::new(0u64));
    let (threads, per_thread) = (4u32, 5_000u64);
    let handles: Vec<_> = (0..threads)
        .map(|thread| {
            let (recorder, lock) = (recorder.clone(), lock.clone());
            std::thread::spawn(move || {
                let stage = recorder.stage();
                for i in 0..per_thread {
                    {
                        let mut next = lock.lock().unwrap();
                        recorder.send_staged(&stage, alloc(*next, thread));
                        *next += 1;
                    }
                    // Now and then a thread pauses with records staged, as a thread waiting
                    // for the GPU does: the others' records queue up behind them.
                    if (i + u64::from(thread)) % 997 == 0 {
                        std::thread::sleep(Duration::from_millis(6));
                    }
                }
            })
        })
        .collect();
    within_a_minute("the senders", move || {
        for h in handles {
            h.join().unwrap();
        }
    });
    assert!(recorder.shutdown(Duration::from_secs(30)));
    let total = u64::from(threads) * per_thread;
    assert_eq!(recorder.stats().written.load(Ordering::SeqCst), total);
    assert_eq!(
        alloc_times(&dir),
        (0..total).collect::<Vec<_>>(),
        "every record once, in the order the lock gave"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_thread_blocked_with_records_staged_does_not_block_the_others() {
    let dir = temp_dir("stages-blocked");
    let recorder = start(&dir, 16);
    let (blocked, release) = idle_with_staged(&recorder, 0..1);
    // Far more than the ring holds, all behind the blocked thread's record.
    let sender = recorder.clone();
    within_a_minute("the other thread's sends", move || {
        for t in 1..200 {
            sender.send(alloc(t, 2));
        }
    });
    release.send(()).unwrap();
    blocked.join().unwrap();
    assert!(recorder.shutdown(Duration::from_secs(30)));
    assert_eq!(alloc_times(&dir), (0..200).collect::<Vec<_>>());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_flush_writes_an_idle_threads_staged_records_in_their_places() {
    let dir = temp_dir("stages-flush");
    let recorder = start(&dir, 1024);
    let (idle, release) = idle_with_staged(&recorder, 0..3);
    recorder.send(alloc(3, 2));
    assert!(
        recorder.flush(Duration::from_secs(10)),
        "the flush waits behind the idle thread's records, and the worker forwards them"
    );
    assert_eq!(alloc_times(&dir), [0, 1, 2, 3], "written by the flush");
    release.send(()).unwrap();
    idle.join().unwrap();
    assert!(recorder.shutdown(Duration::from_secs(30)));
    std::fs::remove_dir_all(&dir).unwrap();
}
