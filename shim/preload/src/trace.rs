//! The shim's side of the trace: where it goes, what its header says, and how allocator events
//! become records.
//!
//! The trace directory is `<trace_dir>/<host>-<pid>[-rank<R>]/`, created at the first CUDA call
//! (never at load: `LD_PRELOAD` is inherited by every child process, most of which never touch
//! CUDA). Each device's allocator reports its events through a [`DeviceObserver`] under its
//! lock, so records reach the channel in the order things happened; the recorder's worker
//! thread writes them. At exit the recorder is flushed and stopped (with a timeout); a forked
//! child records nothing.
//!
//! Traces are private: directories `0700`, files `0600` (`trace_mode` widens them), an existing
//! directory that is another user's, a symbolic link, or writable by others is refused with one
//! message and the program runs on untraced (`cachealloc_recorder::private`).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use std::time::Duration;

use cachealloc_core::{Config, Event, Observer, PoolKind};
use cachealloc_recorder::schema::{self, DeviceInfo, Header, Module};
use cachealloc_recorder::{Record, Recorder, WriterConfig, monotonic_ns};

use crate::log;

pub mod clock;
pub mod pause;
pub mod scopes;
mod thread;

/// Records the channel holds before producers wait (under 5 MB).
const CHANNEL_CAPACITY: usize = 1 << 16;

/// A running trace.
///
/// Every record reads the recorder (its queue), the clock and, at a free, whether any block
/// went unrecorded: laid out in that order on the struct's first cache line, so that a record
/// misses on one line of it, not three (`trace_fields_a_record_reads_share_a_line`).
#[derive(Debug)]
#[repr(C, align(64))]
pub struct Trace {
    recorder: Recorder,
    /// What the records' times are.
    clock: clock::RecordClock,
    /// Bumped at each phase change: every thread's scope in the trace is none after it
    /// (`scopes`; compared for equality only, so wrapping is harmless). Every allocation reads
    /// it, so it sits on this line.
    phase_generation: AtomicU32,
    /// Blocks allocated while the records were paused (Note [A paused trace stays consistent]);
    /// its first field says whether there are any.
    unrecorded: pause::Unrecorded,
    /// Its directory.
    pub dir: PathBuf,
}

impl Trace {
    /// Create the trace directory and start the recorder.
    pub fn start(config: &Config, devices: Vec<DeviceInfo>) -> Result<Trace, String> {
        let pid = std::process::id();
        let host = host_name();
        let rank = env_int("RANK");
        let mut name = format!("{host}-{pid}");
        if rank >= 0 {
            name.push_str(&format!("-rank{rank}"));
        }
        let dir = config.trace_dir.join(name);
        let header = Header {
            version: schema::FORMAT_VERSION,
            file_index: 0,
            pid,
            host,
            rank,
            local_rank: env_int("LOCAL_RANK"),
            world_size: env_int("WORLD_SIZE"),
            cmdline: command_line(),
            wall_clock_base_ns: cachealloc_recorder::wall_clock_at_anchor_ns(),
            monotonic_base_ns: 0,
            config: config.allocator.to_conf_string(),
            devices,
            modules: modules(),
        };
        // SAFETY: geteuid has no preconditions and cannot fail.
        let owner = Some(unsafe { libc::geteuid() });
        // The trace directory (shared by the processes of a job) and then this process's own
        // are checked or created private (`recorder::private`); a refusal is one message.
        let refused = |e: std::io::Error| {
            if cachealloc_recorder::private::is_refusal(&e) {
                e.to_string()
            } else {
                format!("cannot write the trace in {}: {e}", dir.display())
            }
        };
        cachealloc_recorder::private::prepare_dir(&config.trace_dir, config.trace_mode, owner)
            .map_err(refused)?;
        let mut writer = WriterConfig::new(
            &dir,
            config.trace_file_mb << 20,
            config.trace_files,
            config.compress,
        );
        writer.file_mode = config.trace_mode;
        writer.owner = owner;
        // A file-size limit (`ulimit -f`) answers a write beyond it with SIGXFSZ, whose default
        // action kills the process: our trace must never be the reason. The recorder's thread
        // is started with the signal blocked (a new thread inherits the mask), so its writes fail
        // with EFBIG instead, which ends the trace with one message.
        let (clock, why_not) = clock::RecordClock::choose(config.clock);
        if let Some(why_not) = why_not {
            log::info!("{why_not}");
        }
        let on_error = |e: &std::io::Error| {
            log::error!("writing the trace failed: {e}; the trace stops here, the program goes on");
        };
        let recorder = with_sigxfsz_blocked(|| match clock {
            clock::RecordClock::Ticks => Recorder::start_with_ticks(
                writer,
                header,
                CHANNEL_CAPACITY,
                clock::read_ticks,
                on_error,
            ),
            clock::RecordClock::Os => Recorder::start(writer, header, CHANNEL_CAPACITY, on_error),
        })
        .map_err(refused)?;
        Ok(Trace {
            clock,
            phase_generation: AtomicU32::new(0),
            recorder,
            unrecorded: pause::Unrecorded::default(),
            dir,
        })
    }

    /// A raw allocation that passed through (`pool:off`, or degraded): a segment holding one
    /// block, both recorded.
    pub fn raw_allocation(&self, device: u32, address: u64, size: u64, stack: u32) {
        let thread = self.announce_scope();
        let t = self.now();
        let pool = pool_byte(cachealloc_core::sizes::pool_for(size));
        self.send(Record::SegmentAlloc(schema::SegmentEvent {
            t,
            device,
            address,
            size,
            pool,
            stack,
        }));
        self.send(Record::Alloc(schema::Alloc {
            t,
            device,
            stream: 0,
            address,
            requested: size,
            size,
            stack,
            thread,
        }));
    }

    /// The free of a raw allocation ([`Trace::raw_allocation`]): the block and its segment.
    pub fn raw_free(&self, device: u32, address: u64, size: u64) {
        let t = self.now();
        self.send(Record::Free(schema::FreeRequested {
            t,
            device,
            stream: 0,
            address,
            size,
            stack: 0,
            thread: thread_number(),
        }));
        self.send(Record::SegmentFree(schema::SegmentEvent {
            t,
            device,
            address,
            size,
            pool: pool_byte(cachealloc_core::sizes::pool_for(size)),
            stack: 0,
        }));
    }

    /// A named marker of the application's (`cachealloc_annotate`).
    pub fn annotation(&self, name: &str) {
        self.send(Record::Annotation(Box::new(schema::Annotation {
            t: self.now(),
            name: name.to_string(),
            thread: thread_number(),
        })));
    }

    /// The application created `stream` on `device`.
    pub fn stream_created(&self, device: u32, stream: u64, flags: u32) {
        self.send(Record::StreamCreated(schema::StreamEvent {
            t: self.now(),
            device,
            stream,
            flags,
        }));
    }

    /// The application destroyed `stream`.
    pub fn stream_destroyed(&self, stream: u64) {
        self.send(Record::StreamDestroyed(schema::StreamEvent {
            t: self.now(),
            device: 0,
            stream,
            flags: 0,
        }));
    }

    /// Send one record.
    pub fn send(&self, record: Record) {
        self.recorder.send(record);
    }

    /// Whether producers should shed optional payloads (stacks) now: the channel is filling.
    pub fn congested(&self) -> bool {
        self.recorder.congested()
    }

    /// Count a stack that was not captured because of congestion.
    pub fn note_stack_shed(&self) {
        self.recorder.note_stack_shed();
    }

    /// Write every record sent so far to the trace files; whether that happened within
    /// `timeout`.
    pub fn flush(&self, timeout: Duration) -> bool {
        self.recorder.flush(timeout)
    }

    /// Write a checkpoint of the live state now (after an OOM).
    pub fn checkpoint(&self) {
        self.recorder.checkpoint();
    }

    /// Flush and stop at exit; returns whether everything was written in time.
    pub fn shutdown(&self) -> bool {
        self.recorder.shutdown(Duration::from_secs(5))
    }
}

impl Trace {
    /// Time for a record: ticks or nanoseconds, as the recorder expects them ([`clock`]).
    #[inline]
    pub fn now(&self) -> u64 {
        match self.clock {
            clock::RecordClock::Ticks => clock::read_ticks(),
            clock::RecordClock::Os => monotonic_ns(),
        }
    }
}

/// A small per-process number for the calling thread (1, 2, …), for records.
pub fn thread_number() -> u32 {
    thread::with(thread::ThreadTrace::number)
}

/// Turns one device's allocator events into records.
#[derive(Debug)]
pub struct DeviceObserver {
    /// The device.
    pub device: u32,
    /// The trace, if any.
    pub trace: Option<Arc<Trace>>,
    /// Write a checkpoint after an OOM record (`oom_checkpoint`).
    pub oom_checkpoint: bool,
}

fn pool_byte(pool: PoolKind) -> u8 {
    match pool {
        PoolKind::Small => schema::POOL_SMALL,
        PoolKind::Large => schema::POOL_LARGE,
    }
}

impl Observer for DeviceObserver {
    fn on_event(&self, event: Event<'_>) {
        let Some(trace) = &self.trace else { return };
        let device = self.device;
        // Note [A paused trace stays consistent]. An allocation's scope goes before its record
        // (and gives the thread's number with it).
        let allocating_thread = match &event {
            Event::Alloc(a) if pause::paused() => {
                trace.unrecorded.add(device, a.address);
                return;
            }
            Event::Alloc(_) => trace.announce_scope(),
            Event::FreeRequested(f) if trace.unrecorded.contains(device, f.address, !f.pending) => {
                return;
            }
            Event::FreeCompleted { address, .. }
                if trace.unrecorded.contains(device, *address, true) =>
            {
                return;
            }
            _ => 0,
        };
        let t = trace.now();
        let record = match event {
            Event::Alloc(a) => Record::Alloc(schema::Alloc {
                t,
                device,
                stream: a.stream,
                address: a.address,
                requested: a.requested,
                size: a.size,
                stack: a.tag as u32,
                thread: allocating_thread,
            }),
            Event::FreeRequested(f) => {
                let body = schema::FreeRequested {
                    t,
                    device,
                    stream: f.stream,
                    address: f.address,
                    size: f.size,
                    stack: crate::stacks::frees::at_free(),
                    thread: thread_number(),
                };
                if f.pending {
                    Record::FreeRequested(body)
                } else {
                    Record::Free(body)
                }
            }
            Event::FreeCompleted { address, size } => {
                Record::FreeCompleted(schema::FreeCompleted {
                    t,
                    device,
                    address,
                    size,
                })
            }
            Event::SegmentAlloc {
                address,
                size,
                pool,
                tag,
            } => Record::SegmentAlloc(schema::SegmentEvent {
                t,
                device,
                address,
                size,
                pool: pool_byte(pool),
                stack: tag as u32,
            }),
            Event::SegmentFree(s) => Record::SegmentFree(schema::SegmentEvent {
                t,
                device,
                address: s.address,
                size: s.size,
                pool: pool_byte(s.pool),
                stack: crate::stacks::frees::at_free(),
            }),
            Event::SegmentMap {
                address,
                size,
                pool,
                tag,
            } => Record::SegmentMap(schema::SegmentEvent {
                t,
                device,
                address,
                size,
                pool: pool_byte(pool),
                stack: tag as u32,
            }),
            Event::SegmentUnmap {
                address,
                size,
                pool,
            } => Record::SegmentUnmap(schema::SegmentEvent {
                t,
                device,
                address,
                size,
                pool: pool_byte(pool),
                stack: crate::stacks::frees::at_free(),
            }),
            Event::Oom(r) => Record::Oom(Box::new(schema::Oom {
                t,
                device,
                requested: r.requested,
                rounded: r.rounded,
                allocated: r.allocated,
                reserved: r.reserved,
                cached_free: r.cached_free,
                largest_free_block: r.largest_free_block,
                device_free: r.device_free,
                device_total: r.device_total,
                limit: r.limit,
                stack: r.tag as u32,
                thread: thread_number(),
            })),
        };
        let is_oom = matches!(record, Record::Oom(_));
        trace.send(record);
        if is_oom && self.oom_checkpoint {
            trace.checkpoint();
        }
    }
}

fn env_int(key: &str) -> i32 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(-1)
}

fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it (the last
    // byte stays 0 since we pass one less).
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    if r != 0 {
        return "unknown".to_string();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn command_line() -> Vec<String> {
    std::fs::read("/proc/self/cmdline")
        .map(|bytes| {
            bytes
                .split(|&b| b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Executable file mappings, for symbolizing native frames offline.
fn modules() -> Vec<Module> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Vec::new();
    };
    maps.lines()
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            let range = parts.next()?;
            let perms = parts.next()?;
            let offset = parts.next()?;
            let path = parts.nth(2)?;
            if !perms.contains('x') || !path.starts_with('/') {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            Some(Module {
                path: path.to_string(),
                start: u64::from_str_radix(start, 16).ok()?,
                end: u64::from_str_radix(end, 16).ok()?,
                offset: u64::from_str_radix(offset, 16).ok()?,
            })
        })
        .collect()
}

/// Run `f` with SIGXFSZ blocked on the calling thread (and so on the threads it starts), then
/// restore the thread's mask.
fn with_sigxfsz_blocked<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialize it before it is read.
    let mut block: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; a zeroed sigset_t is valid storage for these calls.
    let mut previous: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers to the local sets; SIGXFSZ is a valid signal number;
    // pthread_sigmask only changes the calling thread's mask.
    let blocked = unsafe {
        libc::sigemptyset(&mut block);
        libc::sigaddset(&mut block, libc::SIGXFSZ);
        libc::pthread_sigmask(libc::SIG_BLOCK, &block, &mut previous) == 0
    };
    let result = f();
    if blocked {
        // SAFETY: restores the mask saved above on this same thread.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut()) };
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_fields_a_record_reads_share_a_line() {
        // The struct starts a line; the whole recorder handle, the clock, the phase generation
        // and the unrecorded blocks' flag (Unrecorded's first field) end within it.
        assert_eq!(std::mem::align_of::<Trace>(), 64);
        assert_eq!(std::mem::offset_of!(Trace, recorder), 0);
        assert!(std::mem::size_of::<Recorder>() <= std::mem::offset_of!(Trace, clock));
        assert!(std::mem::offset_of!(Trace, clock) < 64);
        assert!(std::mem::offset_of!(Trace, phase_generation) + 4 <= 64);
        assert!(std::mem::offset_of!(Trace, unrecorded) < 64);
    }
}
