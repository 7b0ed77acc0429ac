//! The trace's record kinds. **The schema only grows**: a kind, once released, is never changed;
//! new information gets a new kind. Readers skip kinds they do not know ([`Record::Unknown`]).
//!
//! A record is encoded as `kind: u8`, `body length: LEB128`, `body: MessagePack` (a struct as
//! an array of its fields, in declaration order). The length prefix is what lets an old reader
//! step over a new kind.
//!
//! Rare kinds with large bodies are boxed in [`Record`], so that a record on the channel is about
//! the size of an [`Alloc`].
//!
//! Times are nanoseconds since the trace's monotonic base ([`Header::monotonic_base_ns`]).
//! Stack ids refer to [`StackDef`] records written earlier in the same file; 0 means "no stack".

use serde::{Deserialize, Serialize};

/// First bytes of every trace file.
pub const MAGIC: &[u8; 8] = b"CATRACE\0";
/// The pool byte of segment and block records: PyTorch's small pool (blocks of at most 1 MiB,
/// in 2 MiB segments).
pub const POOL_SMALL: u8 = 0;
/// The pool byte of the large pool.
pub const POOL_LARGE: u8 = 1;

/// The name of a pool byte, as PyTorch's snapshots spell segment types: `small` or `large`.
pub fn pool_name(pool: u8) -> &'static str {
    if pool == POOL_SMALL { "small" } else { "large" }
}

/// Format version written after the magic. A reader refuses files of a newer major version.
pub const FORMAT_VERSION: u32 = 1;

/// A GPU, as the header describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// CUDA ordinal.
    pub index: u32,
    /// Product name.
    pub name: String,
    /// Total memory in bytes.
    pub total_memory: u64,
}

/// A loaded module (shared object) for offline symbolization of native frames.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Module {
    /// Path of the file.
    pub path: String,
    /// Start of the mapping.
    pub start: u64,
    /// End of the mapping.
    pub end: u64,
    /// File offset of the mapping.
    pub offset: u64,
}

/// First record of every file: who wrote it and how to read it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    /// Schema version ([`FORMAT_VERSION`]).
    pub version: u32,
    /// Index of this file in the process's sequence (0, 1, …; older files may be rotated away).
    pub file_index: u32,
    /// Process id.
    pub pid: u32,
    /// Host name.
    pub host: String,
    /// `RANK`, `LOCAL_RANK`, `WORLD_SIZE` from the environment (-1 when unset).
    pub rank: i32,
    /// See `rank`.
    pub local_rank: i32,
    /// See `rank`.
    pub world_size: i32,
    /// The process's command line.
    pub cmdline: Vec<String>,
    /// Wall-clock time (ns since the Unix epoch) at the monotonic base.
    pub wall_clock_base_ns: u64,
    /// Monotonic clock reading that record times count from.
    pub monotonic_base_ns: u64,
    /// The configuration in force (`key:value,…`).
    pub config: String,
    /// The devices.
    pub devices: Vec<DeviceInfo>,
    /// Loaded modules, for native symbolization.
    pub modules: Vec<Module>,
}

impl Header {
    /// The header of file 0 of process `pid` on `host`, in this format's version, with nothing
    /// else known (no rank, command line, clock base, configuration, devices or modules): what
    /// tools and tests that write traces start from, filling in what they know.
    pub fn new(pid: u32, host: &str) -> Self {
        Self {
            version: FORMAT_VERSION,
            file_index: 0,
            pid,
            host: host.into(),
            rank: -1,
            local_rank: -1,
            world_size: -1,
            cmdline: vec![],
            wall_clock_base_ns: 0,
            monotonic_base_ns: 0,
            config: String::new(),
            devices: vec![],
            modules: vec![],
        }
    }
}

/// A block handed to the application.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Alloc {
    /// Time.
    pub t: u64,
    /// Device ordinal.
    pub device: u32,
    /// Stream handle, 0 when unknown.
    pub stream: u64,
    /// Address of the block.
    pub address: u64,
    /// The application's request.
    pub requested: u64,
    /// Size of the block.
    pub size: u64,
    /// Stack id (0: none).
    pub stack: u32,
    /// Thread number (small, per process).
    pub thread: u32,
}

/// The application freed a block (it may still be in use on the device: PyTorch's
/// `free_requested`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreeRequested {
    /// Time.
    pub t: u64,
    /// Device.
    pub device: u32,
    /// Stream, 0 when unknown.
    pub stream: u64,
    /// Address.
    pub address: u64,
    /// Size of the block.
    pub size: u64,
    /// Stack id of the free.
    pub stack: u32,
    /// Thread number.
    pub thread: u32,
}

/// A freed block became reusable (its fence completed: PyTorch's `free_completed`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreeCompleted {
    /// Time.
    pub t: u64,
    /// Device.
    pub device: u32,
    /// Address.
    pub address: u64,
    /// Size.
    pub size: u64,
}

/// A segment was allocated, released, mapped or unmapped (the kind says which).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentEvent {
    /// Time.
    pub t: u64,
    /// Device.
    pub device: u32,
    /// Address.
    pub address: u64,
    /// Size.
    pub size: u64,
    /// Pool: [`POOL_SMALL`] or [`POOL_LARGE`].
    pub pool: u8,
    /// Stack id.
    pub stack: u32,
}

/// A request failed with out-of-memory: the allocator's report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Oom {
    /// Time.
    pub t: u64,
    /// Device.
    pub device: u32,
    /// The request.
    pub requested: u64,
    /// Rounded request.
    pub rounded: u64,
    /// Allocated bytes.
    pub allocated: u64,
    /// Reserved bytes.
    pub reserved: u64,
    /// Cached free bytes.
    pub cached_free: u64,
    /// Largest free block.
    pub largest_free_block: u64,
    /// Device free memory.
    pub device_free: u64,
    /// Device total memory.
    pub device_total: u64,
    /// The process's limit.
    pub limit: u64,
    /// Stack id.
    pub stack: u32,
    /// Thread number.
    pub thread: u32,
}

/// A stream was created or destroyed (the kind says which).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamEvent {
    /// Time.
    pub t: u64,
    /// Device.
    pub device: u32,
    /// Stream handle.
    pub stream: u64,
    /// Creation flags (0 for a destruction).
    pub flags: u32,
}

/// A named marker set by the application.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Annotation {
    /// Time.
    pub t: u64,
    /// The name.
    pub name: String,
    /// Thread number.
    pub thread: u32,
}

/// Periodic allocator statistics of one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsSample {
    /// Time.
    pub t: u64,
    /// Device.
    pub device: u32,
    /// Allocated bytes.
    pub allocated: u64,
    /// Reserved bytes.
    pub reserved: u64,
    /// Active bytes.
    pub active: u64,
    /// Requested bytes.
    pub requested: u64,
}

/// What the recorder could not keep, cumulative since the start of the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dropped {
    /// Time.
    pub t: u64,
    /// Stacks shed under overload (their events kept, with stack 0).
    pub stacks_shed: u64,
    /// Sends that found the channel full and blocked.
    pub blocked_sends: u64,
    /// Total time senders spent blocked, ns.
    pub blocked_ns: u64,
}

/// A stack: frame ids, innermost first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StackDef {
    /// Stack id (≥ 1).
    pub id: u32,
    /// Frame ids, innermost first.
    pub frames: Vec<u32>,
}

/// [`FrameDef::kind`] of a native frame.
pub const FRAME_NATIVE: u8 = 0;
/// [`FrameDef::kind`] of a Python frame.
pub const FRAME_PYTHON: u8 = 1;

/// A frame: a Python function at a line, or a native return address (symbolized by the
/// recorder's worker when possible).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrameDef {
    /// Frame id (≥ 1).
    pub id: u32,
    /// 0 native, 1 Python.
    pub kind: u8,
    /// Function name (empty when unknown).
    pub name: String,
    /// File name (empty when unknown).
    pub file: String,
    /// Line (0 when unknown).
    pub line: u32,
    /// Instruction address (native) or 0.
    pub address: u64,
}

/// A segment live at a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentState {
    /// Device.
    pub device: u32,
    /// Address.
    pub address: u64,
    /// Size.
    pub size: u64,
    /// Pool: [`POOL_SMALL`] or [`POOL_LARGE`].
    pub pool: u8,
    /// Stack id of its allocation.
    pub stack: u32,
}

/// A block allocated (or freed but pending) at a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    /// Device.
    pub device: u32,
    /// Address.
    pub address: u64,
    /// Size.
    pub size: u64,
    /// Requested size.
    pub requested: u64,
    /// Stack id of its allocation.
    pub stack: u32,
    /// 0 allocated, 1 freed and pending.
    pub pending: u8,
}

/// End of a checkpoint: the state above is complete as of `t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointEnd {
    /// Time.
    pub t: u64,
}

mod program;
pub use program::*;

macro_rules! records {
    ($($(#[$doc:meta])* $kind:literal => $variant:ident($ty:ty) as $name:ident,)*) => {
        /// The kind byte of each record, by name (what [`Record::kind`] returns).
        pub mod kinds {
            $(
                #[doc = concat!("[`Record::", stringify!($variant), "`](super::Record::", stringify!($variant), ").")]
                pub const $name: u8 = $kind;
            )*
        }

        /// One trace record.
        #[derive(Clone, Debug, PartialEq)]
        pub enum Record {
            $($(#[$doc])* $variant($ty),)*
            /// A kind this reader does not know (written by a newer version): skipped.
            Unknown {
                /// Its kind byte.
                kind: u8,
                /// Its undecoded body.
                body: Vec<u8>,
            },
        }

        impl Record {
            /// The kind byte.
            pub fn kind(&self) -> u8 {
                match self {
                    $(Record::$variant(_) => $kind,)*
                    Record::Unknown { kind, .. } => *kind,
                }
            }

            /// Append `kind, length, body` to `out`, through rmp-serde. (The writer takes the
            /// hot kinds by a fast path first, module `encode`: the same bytes, faster.)
            pub fn encode(&self, out: &mut Vec<u8>) {
                let body = match self {
                    $(Record::$variant(r) => rmp_serde::to_vec(r).expect("plain structs always encode"),)*
                    Record::Unknown { body, .. } => body.clone(),
                };
                out.push(self.kind());
                write_leb128(out, body.len() as u64);
                out.extend_from_slice(&body);
            }

            /// Decode a body of `kind` through rmp-serde. (The reader takes the hot kinds by a
            /// fast path first, module `decode`: the same result, faster.)
            pub fn decode(kind: u8, body: &[u8]) -> Result<Record, rmp_serde::decode::Error> {
                Ok(match kind {
                    $($kind => Record::$variant(rmp_serde::from_slice(body)?),)*
                    _ => Record::Unknown { kind, body: body.to_vec() },
                })
            }
        }
    };
}

records! {
    /// The file header.
    1 => Header(Box<Header>) as HEADER,
    /// A live segment (checkpoint).
    2 => CheckpointSegment(SegmentState) as CHECKPOINT_SEGMENT,
    /// A live block (checkpoint).
    3 => CheckpointBlock(BlockState) as CHECKPOINT_BLOCK,
    /// End of a checkpoint.
    4 => CheckpointEnd(CheckpointEnd) as CHECKPOINT_END,
    /// A stack definition.
    5 => StackDef(Box<StackDef>) as STACK_DEF,
    /// A frame definition.
    6 => FrameDef(Box<FrameDef>) as FRAME_DEF,
    /// An allocation.
    10 => Alloc(Alloc) as ALLOC,
    /// A free by the application.
    11 => FreeRequested(FreeRequested) as FREE_REQUESTED,
    /// A freed block became reusable.
    12 => FreeCompleted(FreeCompleted) as FREE_COMPLETED,
    /// A segment was allocated on the device.
    13 => SegmentAlloc(SegmentEvent) as SEGMENT_ALLOC,
    /// A segment was released to the device.
    14 => SegmentFree(SegmentEvent) as SEGMENT_FREE,
    /// Pages of an expandable segment were mapped.
    15 => SegmentMap(SegmentEvent) as SEGMENT_MAP,
    /// Pages of an expandable segment were unmapped.
    16 => SegmentUnmap(SegmentEvent) as SEGMENT_UNMAP,
    /// Out of memory.
    17 => Oom(Box<Oom>) as OOM,
    /// A stream was created.
    18 => StreamCreated(StreamEvent) as STREAM_CREATED,
    /// A stream was destroyed.
    19 => StreamDestroyed(StreamEvent) as STREAM_DESTROYED,
    /// An application marker.
    20 => Annotation(Box<Annotation>) as ANNOTATION,
    /// Allocator statistics.
    21 => StatsSample(StatsSample) as STATS_SAMPLE,
    /// What the recorder could not keep.
    22 => Dropped(Dropped) as DROPPED,
    /// A free that was reusable at once (free requested and completed together: no fence was
    /// needed). One record instead of two on the hottest path.
    23 => Free(FreeRequested) as FREE,
    /// A module path's name.
    24 => ScopeName(Box<ScopeName>) as SCOPE_NAME,
    /// A thread's innermost module changed.
    25 => Scope(ScopeEvent) as SCOPE,
    /// The program's phase changed.
    26 => Phase(PhaseEvent) as PHASE,
    /// A block's category.
    27 => Tag(TagEvent) as TAG,
    /// A live block's scope, phase and tag (checkpoint).
    28 => CheckpointBlockContext(BlockContext) as CHECKPOINT_BLOCK_CONTEXT,
}

impl Record {
    /// When the event happened (ns since the trace's monotonic base), for kinds that carry a
    /// time (not the header, checkpoint state or definitions).
    pub fn time(&self) -> Option<u64> {
        Some(match self {
            Record::Alloc(a) => a.t,
            Record::FreeRequested(f) | Record::Free(f) => f.t,
            Record::FreeCompleted(f) => f.t,
            Record::SegmentAlloc(s)
            | Record::SegmentFree(s)
            | Record::SegmentMap(s)
            | Record::SegmentUnmap(s) => s.t,
            Record::Oom(o) => o.t,
            Record::StreamCreated(s) | Record::StreamDestroyed(s) => s.t,
            Record::Annotation(a) => a.t,
            Record::StatsSample(s) => s.t,
            Record::Dropped(d) => d.t,
            Record::CheckpointEnd(c) => c.t,
            Record::Scope(s) => s.t,
            Record::Phase(p) => p.t,
            Record::Tag(g) => g.t,
            _ => return None,
        })
    }

    /// [`Record::time`], to change (the worker turns a sender's ticks into nanoseconds: Note
    /// [Record times in ticks]).
    pub(crate) fn time_mut(&mut self) -> Option<&mut u64> {
        Some(match self {
            Record::Alloc(a) => &mut a.t,
            Record::FreeRequested(f) | Record::Free(f) => &mut f.t,
            Record::FreeCompleted(f) => &mut f.t,
            Record::SegmentAlloc(s)
            | Record::SegmentFree(s)
            | Record::SegmentMap(s)
            | Record::SegmentUnmap(s) => &mut s.t,
            Record::Oom(o) => &mut o.t,
            Record::StreamCreated(s) | Record::StreamDestroyed(s) => &mut s.t,
            Record::Annotation(a) => &mut a.t,
            Record::StatsSample(s) => &mut s.t,
            Record::Dropped(d) => &mut d.t,
            Record::CheckpointEnd(c) => &mut c.t,
            Record::Scope(s) => &mut s.t,
            Record::Phase(p) => &mut p.t,
            Record::Tag(g) => &mut g.t,
            _ => return None,
        })
    }

    /// Whether this is one of the program's context records (phase, scope, tag, a live
    /// block's context): what a trace of a program that says nothing of itself lacks.
    pub fn is_context(&self) -> bool {
        matches!(
            self,
            Record::Phase(_)
                | Record::Scope(_)
                | Record::Tag(_)
                | Record::CheckpointBlockContext(_)
        )
    }

    /// The device the event concerns, for kinds that have one.
    pub fn device(&self) -> Option<u32> {
        Some(match self {
            Record::Alloc(a) => a.device,
            Record::FreeRequested(f) | Record::Free(f) => f.device,
            Record::FreeCompleted(f) => f.device,
            Record::SegmentAlloc(s)
            | Record::SegmentFree(s)
            | Record::SegmentMap(s)
            | Record::SegmentUnmap(s) => s.device,
            Record::Oom(o) => o.device,
            Record::StreamCreated(s) | Record::StreamDestroyed(s) => s.device,
            Record::StatsSample(s) => s.device,
            Record::Tag(g) => g.device,
            _ => return None,
        })
    }
}

/// Append `value` as unsigned LEB128.
pub fn write_leb128(out: &mut Vec<u8>, mut value: u64) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// Read unsigned LEB128 from the front of `bytes`: `(value, bytes used)`.
pub fn read_leb128(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut value = 0u64;
    for (i, &b) in bytes.iter().enumerate().take(10) {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}
