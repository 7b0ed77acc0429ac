//! [`Recorder`]: the handle producers send records through, and the worker thread that writes
//! them.
//!
//! The channel is bounded. **Records are never dropped**: a sender that finds it full blocks
//! until there is room, and the time it spent blocked is counted and written into the trace
//! ([`Dropped`] records). Only optional payloads (stacks) may be shed, by the producer, before
//! sending; those are counted too ([`Recorder::note_stack_shed`]).
//!
//! The worker polls: it drains whatever is queued, writes it, and sleeps for a millisecond
//! unless it is behind. It never blocks in `recv`, so a sender never has to wake it — a send is a
//! few atomic operations, no system call. A write error (disk full, directory gone) is reported
//! once; the worker then keeps draining so producers never block on a dead trace.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError, TrySendError, bounded};

use crate::schema::{Dropped, Header, Record, StatsSample};
use crate::writer::{Clock, MonotonicClock, TraceWriter, WriterConfig};

/// How long the worker sleeps when it finds the channel empty.
const POLL: Duration = Duration::from_millis(1);
/// Records written between checks for a due flush.
const BATCH: usize = 8192;
/// Interval between stats samples (computed here from the live state, off the hot path).
const SAMPLE_INTERVAL_NS: u64 = 100_000_000;

enum Message {
    Record(Record),
    Checkpoint,
    Flush(Sender<()>),
    Shutdown,
}

/// Counters shared by producers and the worker. A send touches none of them unless it blocks
/// or a stack is shed: a counter of sends, bumped by every producer thread on every record,
/// was a contended atomic on the allocation path that nothing read.
#[derive(Debug, Default)]
pub struct RecorderStats {
    /// Records written by the worker (added once per batch it drains).
    pub written: AtomicU64,
    /// Sends that found the channel full.
    pub blocked_sends: AtomicU64,
    /// Nanoseconds senders spent blocked.
    pub blocked_ns: AtomicU64,
    /// Stacks shed by producers.
    pub stacks_shed: AtomicU64,
    /// Set once a write failed; nothing is written after.
    pub failed: AtomicBool,
    /// Whether the worker is behind ([`Recorder::congested`]): set by the worker when it
    /// finds the channel more than three quarters full and by a send that finds it full,
    /// cleared by the worker when it finds the backlog below that.
    congested: AtomicBool,
}

impl RecorderStats {
    /// Publish whether the worker is behind; a store only when that changes, so that the
    /// flag's cache line stays shared by the producers that read it on every allocation.
    fn set_congested(&self, congested: bool) {
        if self.congested.load(Ordering::Relaxed) != congested {
            self.congested.store(congested, Ordering::Relaxed);
        }
    }
}

/// The producer side. Cheap to share (`&Recorder` from many threads).
pub struct Recorder {
    tx: Sender<Message>,
    stats: Arc<RecorderStats>,
    worker: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Recorder {
    /// Create the trace (errors surface here: an unwritable directory) and start the worker.
    /// `capacity` bounds the channel; `on_error` is called once if a write fails later.
    pub fn start(
        config: WriterConfig,
        header: Header,
        capacity: usize,
        on_error: impl Fn(&io::Error) + Send + 'static,
    ) -> io::Result<Recorder> {
        Self::start_with_clock(config, header, capacity, MonotonicClock, on_error)
    }

    /// [`Recorder::start`] with an injected clock.
    pub fn start_with_clock<C: Clock + 'static>(
        config: WriterConfig,
        header: Header,
        capacity: usize,
        clock: C,
        on_error: impl Fn(&io::Error) + Send + 'static,
    ) -> io::Result<Recorder> {
        let writer = TraceWriter::create(config, header, clock)?;
        let (tx, rx) = bounded(capacity.max(1));
        let stats = Arc::new(RecorderStats::default());
        let worker_stats = stats.clone();
        let worker = std::thread::Builder::new()
            .name("cachealloc-rec".to_string())
            .spawn(move || run_worker(writer, rx, worker_stats, on_error))?;
        Ok(Recorder {
            tx,
            stats,
            worker: std::sync::Mutex::new(Some(worker)),
        })
    }

    /// Send a record; blocks (counted) while the channel is full. Never drops it.
    pub fn send(&self, record: Record) {
        match self.tx.try_send(Message::Record(record)) {
            Ok(()) => {}
            Err(TrySendError::Full(message)) => {
                self.stats.set_congested(true);
                let start = Instant::now();
                let _ = self.tx.send(message);
                self.stats.blocked_sends.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .blocked_ns
                    .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    /// Write a checkpoint of the live state after everything sent so far, and flush it.
    pub fn checkpoint(&self) {
        let _ = self.tx.send(Message::Checkpoint);
    }

    /// Count a stack the producer chose not to capture or send.
    pub fn note_stack_shed(&self) {
        self.stats.stacks_shed.fetch_add(1, Ordering::Relaxed);
    }

    /// The shared counters.
    pub fn stats(&self) -> &RecorderStats {
        &self.stats
    }

    /// Whether the worker is behind (producers may shed stacks): the channel was more than
    /// three quarters full when the worker last looked, or a send has found it full since.
    /// Producers ask on every allocation, so this reads a flag the worker publishes, not the
    /// channel's length: that would read the channel's head, which the worker writes on every
    /// receive, and so pull a cache line from the worker's core on every allocation.
    pub fn congested(&self) -> bool {
        self.stats.congested.load(Ordering::Relaxed)
    }

    /// Write everything sent so far as a chunk; waits up to `timeout`. Returns whether it did.
    pub fn flush(&self, timeout: Duration) -> bool {
        let (ack_tx, ack_rx) = bounded(1);
        if self
            .tx
            .send_timeout(Message::Flush(ack_tx), timeout)
            .is_err()
        {
            return false;
        }
        ack_rx.recv_timeout(timeout).is_ok()
    }

    /// Flush, finish the current file and stop the worker, waiting up to `timeout`. Returns
    /// whether the worker finished in time. Later sends are ignored.
    pub fn shutdown(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        if self.tx.send_timeout(Message::Shutdown, timeout).is_err() {
            return false;
        }
        let Some(worker) = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return true;
        };
        while !worker.is_finished() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        worker.join().is_ok()
    }
}

/// Fill in the name, file and line of a native frame definition that carries only its address
/// (the hot path captures raw return addresses; resolving them is slow, so it happens here, once
/// per distinct address since the producer interns frames).
fn symbolize(record: &mut Record) {
    let Record::FrameDef(frame) = record else {
        return;
    };
    if frame.kind != crate::schema::FRAME_NATIVE || !frame.name.is_empty() || frame.address == 0 {
        return;
    }
    // A return address points after the call; the call itself is one byte before.
    let call = frame.address - 1;
    backtrace::resolve(call as *mut std::ffi::c_void, |symbol| {
        if frame.name.is_empty()
            && let Some(name) = symbol.name()
        {
            // Demangled (C++ and Rust), without Rust's hash suffix.
            frame.name = format!("{name:#}");
        }
        if frame.file.is_empty()
            && let Some(file) = symbol.filename()
        {
            frame.file = file.display().to_string();
            frame.line = symbol.lineno().unwrap_or(0);
        }
    });
    if frame.name.is_empty() {
        frame.name = format!("{:#x}", frame.address);
    }
}

/// One stats sample per device, from the writer's mirror of the live state.
fn write_samples<C: Clock>(writer: &mut TraceWriter<C>, t: u64) -> io::Result<()> {
    let samples: Vec<Record> = writer
        .state()
        .totals
        .iter()
        .map(|(&device, totals)| {
            Record::StatsSample(StatsSample {
                t,
                device,
                allocated: totals.allocated,
                reserved: totals.reserved,
                active: totals.active,
                requested: totals.requested,
            })
        })
        .collect();
    samples.iter().try_for_each(|r| writer.write(r))
}

fn run_worker<C: Clock>(
    mut writer: TraceWriter<C>,
    rx: Receiver<Message>,
    stats: Arc<RecorderStats>,
    on_error: impl Fn(&io::Error),
) {
    let mut last_dropped = (0, 0, 0);
    let mut last_sample = 0u64;
    let mut since_sample = 0usize;
    let mut ok = true;
    let fail = |e: io::Error, ok: &mut bool| {
        if *ok {
            *ok = false;
            stats.failed.store(true, Ordering::Release);
            on_error(&e);
        }
    };
    let capacity = rx.capacity().unwrap_or(usize::MAX);
    loop {
        stats.set_congested(rx.len().saturating_mul(4) > capacity.saturating_mul(3));
        let mut handled = 0;
        let mut stop = false;
        while handled < BATCH {
            match rx.try_recv() {
                Ok(Message::Record(mut record)) => {
                    handled += 1;
                    symbolize(&mut record);
                    if ok && let Err(e) = writer.write(&record) {
                        fail(e, &mut ok);
                    }
                }
                Ok(Message::Checkpoint) => {
                    if ok && let Err(e) = writer.checkpoint() {
                        fail(e, &mut ok);
                    }
                }
                Ok(Message::Flush(ack)) => {
                    if ok && let Err(e) = writer.flush() {
                        fail(e, &mut ok);
                    }
                    let _ = ack.send(());
                }
                Ok(Message::Shutdown) | Err(TryRecvError::Disconnected) => {
                    stop = true;
                    break;
                }
                Err(TryRecvError::Empty) => break,
            }
        }
        stats.written.fetch_add(handled as u64, Ordering::Relaxed);
        let dropped = (
            stats.stacks_shed.load(Ordering::Relaxed),
            stats.blocked_sends.load(Ordering::Relaxed),
            stats.blocked_ns.load(Ordering::Relaxed),
        );
        if ok && dropped != last_dropped {
            last_dropped = dropped;
            let t = writer.now_ns();
            let record = Record::Dropped(Dropped {
                t,
                stacks_shed: dropped.0,
                blocked_sends: dropped.1,
                blocked_ns: dropped.2,
            });
            if let Err(e) = writer.write(&record) {
                fail(e, &mut ok);
            }
        }
        since_sample += handled;
        let now = writer.now_ns();
        if ok && since_sample > 0 && (stop || now.saturating_sub(last_sample) >= SAMPLE_INTERVAL_NS)
        {
            last_sample = now;
            since_sample = 0;
            if let Err(e) = write_samples(&mut writer, now) {
                fail(e, &mut ok);
            }
        }
        if stop {
            if ok && let Err(e) = writer.finish() {
                fail(e, &mut ok);
            }
            return;
        }
        if ok && let Err(e) = writer.tick() {
            fail(e, &mut ok);
        }
        // Sleep unless behind (a full batch means more is queued): draining while producers
        // send makes both sides fight over the channel's cache lines; a sleeping worker lets
        // sends hit lines nobody else touches. The channel holds far more than one poll's worth.
        if handled < BATCH {
            std::thread::sleep(POLL);
        }
    }
}
