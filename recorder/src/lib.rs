//! `cachealloc-recorder`: cachealloc's trace — the event schema, the queue and worker thread
//! that take events off the hot path, the rotating chunked writer, and the streaming reader the
//! offline tools use.
//!
//! ```
//! use cachealloc_recorder::{Recorder, Record, TraceReader, WriterConfig, schema};
//! # let dir = std::env::temp_dir().join(format!("cachealloc-doc-{}", std::process::id()));
//! let header = schema::Header::new(1, "h");
//! let recorder = Recorder::start(WriterConfig::new(&dir, 64 << 20, 8, true), header, 1024, |_| {}).unwrap();
//! recorder.send(Record::Annotation(Box::new(schema::Annotation { t: 1, name: "epoch 1".into(), thread: 1 })));
//! assert!(recorder.shutdown(std::time::Duration::from_secs(5)));
//! let names: Vec<String> = TraceReader::open(&dir).unwrap()
//!     .filter_map(|item| match item.unwrap().record { Record::Annotation(a) => Some(a.name), _ => None })
//!     .collect();
//! assert_eq!(names, ["epoch 1"]);
//! # std::fs::remove_dir_all(&dir).unwrap();
//! ```
//!
//! # Note [Trace files and framing]
//!
//! A trace is a directory per process of files `trace-NNNNNN.cat` (the one being written ends
//! in `.part`). Each file is:
//!
//! ```text
//! "CATRACE\0"  format version (u32 LE)
//! chunk: Header, then a checkpoint (frames, stacks, live segments, live blocks, CheckpointEnd)
//! chunk: records …
//! chunk: records …
//! ```
//!
//! and a chunk is `len (u32 LE) | crc32 (u32 LE) | flags (u8) | payload`, the payload being
//! records back to back, zstd-compressed when flag bit 0 is set ([`chunk`]). A record is
//! `kind (u8) | length (LEB128) | MessagePack body` ([`schema`]).
//!
//! Why this shape:
//!
//! * **Crash safety.** A chunk is written whole with one `write`; after `kill -9` the kernel still
//!   holds everything written, and at most the chunk being assembled (≤ 64 KiB or 100 ms of
//!   events) is lost. A torn or corrupt chunk fails its CRC and the reader stops there.
//! * **Any file alone.** Rotation deletes old files to bound disk use; since every file starts
//!   with a checkpoint of the live state, the remaining ones are still complete: the tools know
//!   what was live when the file began.
//! * **Evolution.** The length prefix of every record lets an old reader skip a kind it does not
//!   know; kinds are never changed, only added.
//! * **Compression per chunk** keeps random access at chunk granularity and bounds the memory a
//!   reader needs.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod chunk;
mod decode;
mod encode;
pub mod private;
mod queue;
pub mod reader;
pub mod recorder;
pub mod schema;
pub mod spans;
pub mod state;
mod ticks;
pub mod writer;

pub use reader::{Item, ReadError, Tear, TraceReader};
pub use recorder::{Recorder, RecorderStats};
pub use schema::Record;
pub use state::LiveState;
pub use writer::{Clock, MonotonicClock, TraceWriter, WriterConfig};

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

static ANCHOR: OnceLock<(Instant, u64)> = OnceLock::new();

fn anchor() -> &'static (Instant, u64) {
    ANCHOR.get_or_init(|| {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        (Instant::now(), wall)
    })
}

/// Monotonic nanoseconds since the process's trace anchor (the first call).
pub fn monotonic_ns() -> u64 {
    anchor().0.elapsed().as_nanos() as u64
}

/// Wall-clock time (ns since the Unix epoch) at the anchor: record times plus this give wall
/// time, which aligns the traces of several ranks.
pub fn wall_clock_at_anchor_ns() -> u64 {
    anchor().1
}
