//! [`Recorder`]: the handle producers send records through, and the worker thread that writes
//! them.
//!
//! The queue is a bounded ring (module `queue`, Note [The hand-off's cache lines]). **Records
//! are never dropped**: a sender that finds it full waits until there is room, and the time it
//! spent waiting is counted and written into the trace ([`Dropped`] records). Only optional
//! payloads (stacks) may be shed, by the producer, before sending; those are counted too
//! ([`Recorder::note_stack_shed`]).
//!
//! The worker polls: it drains whatever is queued, writes it, and sleeps for a millisecond
//! unless it is behind. It never blocks, so a sender never has to wake it — a send is one
//! atomic add and a few stores, no system call. A write error (disk full, directory gone) is
//! reported once; the worker then keeps draining so producers never block on a dead trace.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, bounded};

use crate::queue::{Queue, Taken};
use crate::ticks::TickConverter;

use crate::schema::{Dropped, Header, Record, StatsSample};
use crate::writer::{Clock, MonotonicClock, TraceWriter, WriterConfig};

/// How long the worker sleeps when it finds the queue empty.
const POLL: Duration = Duration::from_millis(1);
/// How long a sender that found the queue full sleeps before it looks again.
const WAIT_FOR_ROOM: Duration = Duration::from_micros(50);
/// Records written between checks for a due flush.
const BATCH: usize = 8192;
/// Records read between two releases of their slots to the senders, within a batch.
const RELEASE_EVERY: usize = 1024;
/// Interval between stats samples (computed here from the live state, off the hot path).
const SAMPLE_INTERVAL_NS: u64 = 100_000_000;

/// What the queue's side carries besides the records that do not fit a slot.
enum Message {
    Record(Record),
    Checkpoint,
    Flush(Sender<()>),
    Shutdown,
}

impl From<Record> for Message {
    fn from(record: Record) -> Message {
        Message::Record(record)
    }
}

/// Counters shared by producers and the worker. A send touches none of them unless it blocks
/// or a stack is shed: a counter of sends, bumped by every producer thread on every record,
/// was a contended atomic on the allocation path that nothing read.
#[derive(Debug, Default)]
pub struct RecorderStats {
    /// Records written by the worker (added once per batch it drains).
    pub written: AtomicU64,
    /// Sends that found the queue full.
    pub blocked_sends: AtomicU64,
    /// Nanoseconds senders spent waiting for room.
    pub blocked_ns: AtomicU64,
    /// Stacks shed by producers.
    pub stacks_shed: AtomicU64,
    /// Set once a write failed; nothing is written after.
    pub failed: AtomicBool,
}

/// The producer side. Cheap to share (`&Recorder` from many threads).
pub struct Recorder {
    queue: Arc<Queue<Message>>,
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
    /// `capacity` bounds the queue (rounded up to a power of two); `on_error` is called once if
    /// a write fails later.
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
        Self::spawn(config, header, capacity, clock, None, on_error)
    }

    /// [`Recorder::start`] for senders that stamp their records with `read_ticks` — a tick
    /// counter that runs at a constant rate, in step on every CPU — instead of
    /// [`crate::monotonic_ns`]: the worker turns the ticks into nanoseconds (Note [Record times
    /// in ticks]). Only the records sent are converted; the recorder's own (stats samples,
    /// checkpoints) are in nanoseconds already.
    pub fn start_with_ticks(
        config: WriterConfig,
        header: Header,
        capacity: usize,
        read_ticks: fn() -> u64,
        on_error: impl Fn(&io::Error) + Send + 'static,
    ) -> io::Result<Recorder> {
        let ticks = TickConverter::new(read_ticks);
        Self::spawn(
            config,
            header,
            capacity,
            MonotonicClock,
            Some(ticks),
            on_error,
        )
    }

    fn spawn<C: Clock + 'static>(
        config: WriterConfig,
        header: Header,
        capacity: usize,
        clock: C,
        ticks: Option<TickConverter>,
        on_error: impl Fn(&io::Error) + Send + 'static,
    ) -> io::Result<Recorder> {
        let writer = TraceWriter::create(config, header, clock)?;
        let queue = Arc::new(Queue::new(capacity));
        let stats = Arc::new(RecorderStats::default());
        let (worker_queue, worker_stats) = (queue.clone(), stats.clone());
        let worker = std::thread::Builder::new()
            .name("cachealloc-rec".to_string())
            .spawn(move || run_worker(writer, &worker_queue, worker_stats, ticks, on_error))?;
        Ok(Recorder {
            queue,
            stats,
            worker: std::sync::Mutex::new(Some(worker)),
        })
    }

    /// Send a record; waits (counted) while the queue is full. Never drops it, unless the
    /// worker has stopped ([`Recorder::shutdown`]).
    pub fn send(&self, record: Record) {
        self.queue.send(record, |room| self.wait_for_room(room));
    }

    #[cold]
    fn wait_for_room(&self, room: &dyn Fn() -> bool) {
        self.queue.set_congested(true);
        let start = Instant::now();
        while !room() {
            std::thread::sleep(WAIT_FOR_ROOM);
        }
        self.stats.blocked_sends.fetch_add(1, Ordering::Relaxed);
        self.stats
            .blocked_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// A control message, in order with the records.
    fn send_message(&self, message: Message) {
        self.queue
            .send_side(message, |room| self.wait_for_room(room));
    }

    /// Write a checkpoint of the live state after everything sent so far, and flush it.
    pub fn checkpoint(&self) {
        self.send_message(Message::Checkpoint);
    }

    /// Count a stack the producer chose not to capture or send.
    pub fn note_stack_shed(&self) {
        self.stats.stacks_shed.fetch_add(1, Ordering::Relaxed);
    }

    /// The shared counters.
    pub fn stats(&self) -> &RecorderStats {
        &self.stats
    }

    /// Whether the worker is behind (producers may shed stacks): the queue was more than
    /// three quarters full when the worker last looked, or a send has found it full since.
    /// Producers ask on every allocation, so this reads a flag the worker publishes, not the
    /// queue's backlog; the flag sits on the line the allocation's send writes next.
    pub fn congested(&self) -> bool {
        self.queue.congested()
    }

    /// Write everything sent so far as a chunk; waits up to `timeout`. Returns whether it did.
    pub fn flush(&self, timeout: Duration) -> bool {
        let (ack_tx, ack_rx) = bounded(1);
        if !self.send_message_within(Message::Flush(ack_tx), Instant::now() + timeout) {
            return false;
        }
        ack_rx.recv_timeout(timeout).is_ok()
    }

    /// [`Recorder::send_message`], unless the worker has stopped or the queue stays full until
    /// `deadline` (a stuck worker): then nothing is sent. Returns whether it was sent.
    fn send_message_within(&self, message: Message, deadline: Instant) -> bool {
        while self.queue.backlog() >= self.queue.capacity() {
            if self.queue.stopped() || Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(WAIT_FOR_ROOM);
        }
        if self.queue.stopped() {
            return false;
        }
        self.send_message(message);
        true
    }

    /// Flush, finish the current file and stop the worker, waiting up to `timeout`. Returns
    /// whether the worker finished in time. Later sends are ignored.
    pub fn shutdown(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        if !self.send_message_within(Message::Shutdown, deadline) {
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

impl Drop for Recorder {
    /// A recorder dropped without [`Recorder::shutdown`]: the worker writes what is queued,
    /// finishes the trace and stops (it holds the queue too, so it would poll for ever).
    fn drop(&mut self) {
        self.queue.close();
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

/// Sets the queue's `stopped` when the worker returns or unwinds: senders then never wait.
struct StopOnExit<'a>(&'a Queue<Message>);

impl Drop for StopOnExit<'_> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

fn run_worker<C: Clock>(
    mut writer: TraceWriter<C>,
    queue: &Queue<Message>,
    stats: Arc<RecorderStats>,
    mut ticks: Option<TickConverter>,
    on_error: impl Fn(&io::Error),
) {
    let _stop = StopOnExit(queue);
    // The next index to read; published to the senders (`release`) as slots are read.
    let mut head = 0usize;
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
    let capacity = queue.capacity();
    loop {
        queue.set_congested(queue.backlog().saturating_mul(4) > capacity.saturating_mul(3));
        if let Some(ticks) = &mut ticks {
            ticks.observe();
        }
        let mut handled = 0;
        let mut stop = false;
        while handled < BATCH {
            // Whether the queue was closed before this look: then an empty queue is the end.
            let closed = queue.closed();
            let record = match queue.take(&mut head) {
                Some(Taken::Record(record) | Taken::Side(Message::Record(record))) => record,
                Some(Taken::Side(Message::Checkpoint)) => {
                    if ok && let Err(e) = writer.checkpoint() {
                        fail(e, &mut ok);
                    }
                    continue;
                }
                Some(Taken::Side(Message::Flush(ack))) => {
                    if ok && let Err(e) = writer.flush() {
                        fail(e, &mut ok);
                    }
                    let _ = ack.send(());
                    continue;
                }
                Some(Taken::Side(Message::Shutdown)) => {
                    stop = true;
                    break;
                }
                None => {
                    stop = closed;
                    break;
                }
            };
            handled += 1;
            if handled % RELEASE_EVERY == 0 {
                queue.release(head);
            }
            let mut record = record;
            if let Some(ticks) = &mut ticks
                && let Some(t) = record.time_mut()
            {
                *t = ticks.nanoseconds(*t);
            }
            symbolize(&mut record);
            if ok && let Err(e) = writer.write(&record) {
                fail(e, &mut ok);
            }
        }
        queue.release(head);
        // Written only when something was taken: the line is read by the senders.
        if handled > 0 {
            stats.written.fetch_add(handled as u64, Ordering::Relaxed);
        }
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
        // send makes both sides fight over the queue's cache lines; a sleeping worker lets
        // sends hit lines nobody else touches. The queue holds far more than one poll's worth.
        if handled < BATCH {
            std::thread::sleep(POLL);
        }
    }
}
