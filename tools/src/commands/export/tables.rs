//! The exported dataset's three tables — their Arrow schemas, the columns that gather rows
//! ([`Col`]), and the Parquet files they stream into ([`TableFile`]). The schema is versioned ([`SCHEMA_VERSION`]) and stable:
//! docs/design.md, "The exported dataset", is its reference; a column is never changed or
//! removed, only added.
//!
//! Every integer is a signed 64-bit (or 32-bit) column, so that Spark, which has no unsigned
//! types, reads each as DuckDB and pyarrow do. Times are `t_ns` (ns since the trace's base) and
//! `wall_ns` (ns since the Unix epoch, aligning ranks).

use std::collections::HashMap;
use std::sync::Arc;

use arrow_schema::{DataType, Field, Schema, SchemaRef};
use bytes::Bytes;
use parquet::data_type::ByteArray;

use super::column::{Col, ColRef};

pub use super::table_file::{Layout, TableFile};

/// The version of the dataset's schema, in every file's key-value metadata as
/// `cachealloc.schema_version`.
pub const SCHEMA_VERSION: &str = "1";

/// Rows gathered before they are handed to the Parquet writer as one batch.
pub const BATCH_ROWS: usize = 16 * 1024;

fn field(name: &str, data_type: DataType, nullable: bool) -> Field {
    Field::new(name, data_type, nullable)
}

fn schema(table: &str, fields: Vec<Field>) -> SchemaRef {
    let metadata = [
        ("cachealloc.schema_version", SCHEMA_VERSION),
        ("cachealloc.table", table),
    ];
    Arc::new(Schema::new_with_metadata(fields, metadata))
}

/// A string known for the whole run (a kind, a pool, a category) as a Parquet value: no copy.
fn static_str(s: &'static str) -> ByteArray {
    ByteArray::from(Bytes::from_static(s.as_bytes()))
}

/// A string of the trace as a Parquet value (a copy).
fn copied_str(s: &str) -> ByteArray {
    ByteArray::from(Bytes::copy_from_slice(s.as_bytes()))
}

/// A block's event — `alloc`, `free` or `free_requested`, nearly every row of a trace — which
/// [`Events::push_block`] pushes straight into the columns: the optional fields of an
/// [`EventRow`] cost a tenth of the export's rows.
#[derive(Debug, Clone, Copy)]
pub struct BlockEvent {
    /// `alloc`, `free` or `free_requested`.
    pub kind: &'static str,
    /// Time, ns since the trace's base.
    pub t_ns: u64,
    /// Device.
    pub device: u32,
    /// Stream.
    pub stream: u64,
    /// The block's size.
    pub size: u64,
    /// The application's request (an `alloc`).
    pub requested: Option<u64>,
    /// The block's address.
    pub address: u64,
    /// Stack id (0: none).
    pub stack: u32,
    /// Thread number.
    pub thread: u32,
}

/// One event of the `events` table other than a [`BlockEvent`] (see [`Events`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct EventRow<'a> {
    /// Ordinal of the record in the trace.
    pub seq: u64,
    /// Time, ns since the trace's base.
    pub t_ns: u64,
    /// What happened: `alloc`, `free`, `free_requested`, `free_completed`, `segment_alloc`,
    /// `segment_free`, `segment_map`, `segment_unmap`, `oom`, `stream_created`,
    /// `stream_destroyed`, `annotation`.
    pub kind: &'static str,
    /// Device.
    pub device: Option<u32>,
    /// Stream.
    pub stream: Option<u64>,
    /// Pool of a segment event: `small` or `large`.
    pub pool: Option<&'static str>,
    /// Size of the block or segment (an OOM: the rounded request).
    pub size: Option<u64>,
    /// The application's request (alloc, OOM).
    pub requested: Option<u64>,
    /// Address.
    pub address: Option<u64>,
    /// Stack id (`stacks.stack_id`); null for none.
    pub stack_id: Option<u32>,
    /// Thread number.
    pub thread: Option<u32>,
    /// Bytes allocated on the device after the event.
    pub allocated: Option<u64>,
    /// Bytes reserved on the device after the event.
    pub reserved: Option<u64>,
    /// An annotation's name.
    pub name: Option<&'a str>,
    /// The block's category (alloc and free rows of a trace with the program's context).
    pub category: Option<&'static str>,
    /// The module the block was made in (the same rows).
    pub module: Option<&'a str>,
}

fn opt_i64(v: Option<u64>) -> Option<i64> {
    v.map(|v| v as i64)
}

/// The `events` table: one row per event of the trace.
pub struct Events {
    wall_base: i64,
    seq: Col<i64>,
    t_ns: Col<i64>,
    wall_ns: Col<i64>,
    kind: Col<ByteArray>,
    device: Col<i32>,
    stream: Col<i64>,
    pool: Col<ByteArray>,
    size: Col<i64>,
    requested: Col<i64>,
    address: Col<i64>,
    stack_id: Col<i64>,
    thread: Col<i32>,
    allocated: Col<i64>,
    reserved: Col<i64>,
    name: Col<ByteArray>,
    category: Col<ByteArray>,
    module: Col<ByteArray>,
    /// The module names met so far, each copied once (every alloc and free row of a trace with
    /// context names one).
    modules: HashMap<String, ByteArray>,
}

impl Events {
    /// How the table's columns are encoded.
    pub const LAYOUT: Layout = Layout {
        delta: &[
            "seq",
            "t_ns",
            "wall_ns",
            "allocated",
            "reserved",
            "device",
            "stream",
            "thread",
            "stack_id",
            "requested",
        ],
        statistics: &["seq", "t_ns", "wall_ns", "device", "allocated", "reserved"],
    };

    /// The table's schema.
    pub fn schema() -> SchemaRef {
        use DataType::{Int32, Int64, Utf8};
        schema(
            "events",
            vec![
                field("seq", Int64, false),
                field("t_ns", Int64, false),
                field("wall_ns", Int64, false),
                field("kind", Utf8, false),
                field("device", Int32, true),
                field("stream", Int64, true),
                field("pool", Utf8, true),
                field("size", Int64, true),
                field("requested", Int64, true),
                field("address", Int64, true),
                field("stack_id", Int64, true),
                field("thread", Int32, true),
                field("allocated", Int64, true),
                field("reserved", Int64, true),
                field("name", Utf8, true),
                field("category", Utf8, true),
                field("module", Utf8, true),
            ],
        )
    }

    /// Empty columns; `wall_base` is the trace's wall clock at its base (ns since the epoch).
    pub fn new(wall_base: u64) -> Self {
        let n = BATCH_ROWS;
        Events {
            wall_base: wall_base as i64,
            seq: Col::with_capacity(n, false),
            t_ns: Col::with_capacity(n, false),
            wall_ns: Col::with_capacity(n, false),
            kind: Col::with_capacity(n, false),
            device: Col::with_capacity(n, true),
            stream: Col::with_capacity(n, true),
            pool: Col::with_capacity(n, true),
            size: Col::with_capacity(n, true),
            requested: Col::with_capacity(n, true),
            address: Col::with_capacity(n, true),
            stack_id: Col::with_capacity(n, true),
            thread: Col::with_capacity(n, true),
            allocated: Col::with_capacity(n, true),
            reserved: Col::with_capacity(n, true),
            name: Col::with_capacity(n, true),
            category: Col::with_capacity(n, true),
            module: Col::with_capacity(n, true),
            modules: HashMap::new(),
        }
    }

    /// Rows gathered since the last batch.
    pub fn len(&self) -> usize {
        self.seq.values.len()
    }

    /// Whether no rows are gathered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Add a row.
    pub fn push(&mut self, e: &EventRow<'_>) {
        self.seq.push(e.seq as i64);
        self.t_ns.push(e.t_ns as i64);
        self.wall_ns
            .push(self.wall_base.wrapping_add(e.t_ns as i64));
        self.kind.push(static_str(e.kind));
        self.device.push_opt(e.device.map(|d| d as i32));
        self.stream.push_opt(opt_i64(e.stream));
        self.pool.push_opt(e.pool.map(static_str));
        self.size.push_opt(opt_i64(e.size));
        self.requested.push_opt(opt_i64(e.requested));
        self.address.push_opt(opt_i64(e.address));
        self.stack_id
            .push_opt(e.stack_id.filter(|&s| s != 0).map(i64::from));
        self.thread.push_opt(e.thread.map(|t| t as i32));
        self.allocated.push_opt(opt_i64(e.allocated));
        self.reserved.push_opt(opt_i64(e.reserved));
        self.name.push_opt(e.name.map(copied_str));
        self.push_context(e.category, e.module);
    }

    /// Add a block's event, the `seq`-th record, after which the device held `allocated` and
    /// `reserved` bytes; `category` and `module` as for [`EventRow`].
    #[inline(always)]
    pub fn push_block(
        &mut self,
        seq: u64,
        e: &BlockEvent,
        (allocated, reserved): (u64, u64),
        category: Option<&'static str>,
        module: Option<&str>,
    ) {
        self.seq.push(seq as i64);
        self.t_ns.push(e.t_ns as i64);
        self.wall_ns
            .push(self.wall_base.wrapping_add(e.t_ns as i64));
        self.kind.push(static_str(e.kind));
        self.device.push_opt(Some(e.device as i32));
        self.stream.push_opt(Some(e.stream as i64));
        self.pool.push_opt(None);
        self.size.push_opt(Some(e.size as i64));
        self.requested.push_opt(opt_i64(e.requested));
        self.address.push_opt(Some(e.address as i64));
        self.stack_id
            .push_opt((e.stack != 0).then_some(i64::from(e.stack)));
        self.thread.push_opt(Some(e.thread as i32));
        self.allocated.push_opt(Some(allocated as i64));
        self.reserved.push_opt(Some(reserved as i64));
        self.name.push_opt(None);
        self.push_context(category, module);
    }

    /// The `category` and `module` of a row.
    #[inline(always)]
    fn push_context(&mut self, category: Option<&'static str>, module: Option<&str>) {
        self.category.push_opt(category.map(static_str));
        let module = module.map(|m| match self.modules.get(m) {
            Some(v) => v.clone(),
            None => {
                let v = copied_str(m);
                self.modules.insert(m.to_string(), v.clone());
                v
            }
        });
        self.module.push_opt(module);
    }

    /// Write the rows gathered to `file` (the columns start again empty).
    pub fn write_to(&mut self, file: &mut TableFile) -> Result<(), crate::Error> {
        let rows = self.len();
        file.write(
            rows,
            vec![
                ColRef::Int64(&mut self.seq),
                ColRef::Int64(&mut self.t_ns),
                ColRef::Int64(&mut self.wall_ns),
                ColRef::Str(&mut self.kind),
                ColRef::Int32(&mut self.device),
                ColRef::Int64(&mut self.stream),
                ColRef::Str(&mut self.pool),
                ColRef::Int64(&mut self.size),
                ColRef::Int64(&mut self.requested),
                ColRef::Int64(&mut self.address),
                ColRef::Int64(&mut self.stack_id),
                ColRef::Int32(&mut self.thread),
                ColRef::Int64(&mut self.allocated),
                ColRef::Int64(&mut self.reserved),
                ColRef::Str(&mut self.name),
                ColRef::Str(&mut self.category),
                ColRef::Str(&mut self.module),
            ],
        )
    }
}

/// One frame of a stack, for the `stacks` table.
#[derive(Debug, Clone, Copy)]
pub struct FrameRow<'a> {
    /// The stack.
    pub stack_id: u32,
    /// The stack's allocation site (the innermost Python frame, else the innermost frame): the
    /// same on every row of the stack.
    pub site: &'a str,
    /// Position in the stack, 0 innermost.
    pub depth: u32,
    /// The frame's id.
    pub frame_id: u32,
    /// `python` or `native`.
    pub kind: &'static str,
    /// Function name (empty when unknown).
    pub name: &'a str,
    /// File (empty when unknown).
    pub file: &'a str,
    /// Line (0 when unknown).
    pub line: u32,
    /// A native frame's address (0 for Python).
    pub address: u64,
}

/// The `stacks` table: one row per frame of each stack the trace defines.
#[derive(Default)]
pub struct Stacks {
    stack_id: Col<i64>,
    site: Col<ByteArray>,
    depth: Col<i32>,
    frame_id: Col<i64>,
    kind: Col<ByteArray>,
    name: Col<ByteArray>,
    file: Col<ByteArray>,
    line: Col<i32>,
    address: Col<i64>,
}

impl Stacks {
    /// How the table's columns are encoded (stack ids grow through the table).
    pub const LAYOUT: Layout = Layout {
        delta: &[],
        statistics: &["stack_id"],
    };

    /// The table's schema.
    pub fn schema() -> SchemaRef {
        use DataType::{Int32, Int64, Utf8};
        schema(
            "stacks",
            vec![
                field("stack_id", Int64, false),
                field("site", Utf8, false),
                field("depth", Int32, false),
                field("frame_id", Int64, false),
                field("kind", Utf8, false),
                field("name", Utf8, false),
                field("file", Utf8, false),
                field("line", Int32, false),
                field("address", Int64, false),
            ],
        )
    }

    /// Empty columns.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rows gathered since the last batch.
    pub fn len(&self) -> usize {
        self.stack_id.values.len()
    }

    /// Whether no rows are gathered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Add a row.
    pub fn push(&mut self, f: &FrameRow<'_>) {
        self.stack_id.push(i64::from(f.stack_id));
        self.site.push(copied_str(f.site));
        self.depth.push(f.depth as i32);
        self.frame_id.push(i64::from(f.frame_id));
        self.kind.push(static_str(f.kind));
        self.name.push(copied_str(f.name));
        self.file.push(copied_str(f.file));
        self.line.push(f.line as i32);
        self.address.push(f.address as i64);
    }

    /// Write the rows gathered to `file` (the columns start again empty).
    pub fn write_to(&mut self, file: &mut TableFile) -> Result<(), crate::Error> {
        let rows = self.len();
        file.write(
            rows,
            vec![
                ColRef::Int64(&mut self.stack_id),
                ColRef::Str(&mut self.site),
                ColRef::Int32(&mut self.depth),
                ColRef::Int64(&mut self.frame_id),
                ColRef::Str(&mut self.kind),
                ColRef::Str(&mut self.name),
                ColRef::Str(&mut self.file),
                ColRef::Int32(&mut self.line),
                ColRef::Int64(&mut self.address),
            ],
        )
    }
}

/// The `samples` table: allocated and reserved bytes of a device over time — the trace's own
/// stats samples, or, for a trace without them, the walked state every 100 ms of trace time
/// (`derived` says which).
pub struct Samples {
    wall_base: i64,
    t_ns: Col<i64>,
    wall_ns: Col<i64>,
    device: Col<i32>,
    allocated: Col<i64>,
    reserved: Col<i64>,
    active: Col<i64>,
    requested: Col<i64>,
    derived: Col<bool>,
}

impl Samples {
    /// How the table's columns are encoded.
    pub const LAYOUT: Layout = Layout {
        delta: &["t_ns", "wall_ns", "allocated", "reserved"],
        statistics: &["t_ns", "wall_ns", "device", "allocated", "reserved"],
    };

    /// The table's schema.
    pub fn schema() -> SchemaRef {
        use DataType::{Boolean, Int32, Int64};
        schema(
            "samples",
            vec![
                field("t_ns", Int64, false),
                field("wall_ns", Int64, false),
                field("device", Int32, false),
                field("allocated", Int64, false),
                field("reserved", Int64, false),
                field("active", Int64, true),
                field("requested", Int64, true),
                field("derived", Boolean, false),
            ],
        )
    }

    /// Empty columns (see [`Events::new`] for `wall_base`).
    pub fn new(wall_base: u64) -> Self {
        Samples {
            wall_base: wall_base as i64,
            t_ns: Col::default(),
            wall_ns: Col::default(),
            device: Col::default(),
            allocated: Col::default(),
            reserved: Col::default(),
            active: Col::default(),
            requested: Col::default(),
            derived: Col::default(),
        }
    }

    /// Rows gathered.
    pub fn len(&self) -> usize {
        self.t_ns.values.len()
    }

    /// Whether no rows are gathered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Add a sample; `active` and `requested` are known for recorded samples only.
    pub fn push(
        &mut self,
        t_ns: u64,
        device: u32,
        allocated: u64,
        reserved: u64,
        recorded: Option<(u64, u64)>,
    ) {
        self.t_ns.push(t_ns as i64);
        self.wall_ns.push(self.wall_base.wrapping_add(t_ns as i64));
        self.device.push(device as i32);
        self.allocated.push(allocated as i64);
        self.reserved.push(reserved as i64);
        self.active.push_opt(recorded.map(|r| r.0 as i64));
        self.requested.push_opt(recorded.map(|r| r.1 as i64));
        self.derived.push(recorded.is_none());
    }

    /// Write the rows gathered to `file` (the columns start again empty).
    pub fn write_to(&mut self, file: &mut TableFile) -> Result<(), crate::Error> {
        let rows = self.len();
        file.write(
            rows,
            vec![
                ColRef::Int64(&mut self.t_ns),
                ColRef::Int64(&mut self.wall_ns),
                ColRef::Int32(&mut self.device),
                ColRef::Int64(&mut self.allocated),
                ColRef::Int64(&mut self.reserved),
                ColRef::Int64(&mut self.active),
                ColRef::Int64(&mut self.requested),
                ColRef::Bool(&mut self.derived),
            ],
        )
    }
}
