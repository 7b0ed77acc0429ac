//! The exported dataset's three tables — their Arrow schemas, the builders that gather rows, and
//! the Parquet files they stream into. The schema is versioned ([`SCHEMA_VERSION`]) and stable:
//! docs/design.md, "The exported dataset", is its reference; a column is never changed or
//! removed, only added.
//!
//! Every integer is a signed 64-bit (or 32-bit) column, so that Spark, which has no unsigned
//! types, reads each as DuckDB and pyarrow do. Times are `t_ns` (ns since the trace's base) and
//! `wall_ns` (ns since the Unix epoch, aligning ranks).

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{
    ArrayBuilder, BooleanBuilder, Int32Builder, Int64Builder, StringBuilder,
};
use arrow_array::types::{Int32Type, Int64Type};
use arrow_array::{ArrayRef, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::basic::Encoding;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use super::column::Column;
use crate::Error;

/// The version of the dataset's schema, in every file's key-value metadata as
/// `cachealloc.schema_version`.
pub const SCHEMA_VERSION: &str = "1";

/// Columns written with delta encoding (where a table has them).
const DELTA_COLUMNS: &[&str] = &["seq", "t_ns", "wall_ns", "allocated", "reserved"];

/// Rows gathered before they are handed to the Parquet writer as one batch.
pub const BATCH_ROWS: usize = 64 * 1024;

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

/// A Parquet file being written from batches of one table.
pub struct TableFile {
    writer: ArrowWriter<File>,
    /// Rows written.
    pub rows: u64,
}

impl TableFile {
    /// Create `path` for `schema`, zstd-compressed, with `metadata` (the job, the rank, the
    /// source trace) added to its key-value metadata.
    pub fn create(
        path: &Path,
        schema: SchemaRef,
        metadata: &[(String, String)],
    ) -> Result<Self, Error> {
        let file = File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
        // zstd's fastest level; statistics per column chunk (what query engines prune with);
        // times, ordinals and running totals delta-encoded (they change little from a row to
        // the next), the rest dictionary-encoded where it repeats.
        let mut props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(
                ZstdLevel::try_new(1).expect("a valid level"),
            ))
            .set_max_row_group_row_count(Some(1 << 20))
            .set_statistics_enabled(EnabledStatistics::Chunk);
        for column in DELTA_COLUMNS {
            if schema.column_with_name(column).is_some() {
                let path = ColumnPath::from(*column);
                props = props
                    .set_column_dictionary_enabled(path.clone(), false)
                    .set_column_encoding(path, Encoding::DELTA_BINARY_PACKED);
            }
        }
        let props = props.build();
        // The schema's own metadata (version, table) also goes into the file's key-value
        // metadata, where readers that do not decode the Arrow schema find it.
        let mut pairs: Vec<(String, String)> = schema
            .metadata()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        pairs.sort();
        pairs.extend(metadata.iter().cloned());
        let mut writer = ArrowWriter::try_new(file, schema, Some(props)).map_err(parquet_error)?;
        for (k, v) in pairs {
            writer.append_key_value_metadata(KeyValue::new(k, v));
        }
        Ok(TableFile { writer, rows: 0 })
    }

    /// Write one batch.
    pub fn write(&mut self, batch: &RecordBatch) -> Result<(), Error> {
        self.rows += batch.num_rows() as u64;
        self.writer.write(batch).map_err(parquet_error)
    }

    /// Add a key-value pair to the file's metadata (before [`TableFile::close`]).
    pub fn note(&mut self, key: &str, value: String) {
        self.writer
            .append_key_value_metadata(KeyValue::new(key.to_string(), value));
    }

    /// Finish the file.
    pub fn close(self) -> Result<u64, Error> {
        self.writer.close().map_err(parquet_error)?;
        Ok(self.rows)
    }
}

fn parquet_error(e: parquet::errors::ParquetError) -> Error {
    Error::Message(format!("writing Parquet: {e}"))
}

fn arrow_error(e: arrow_schema::ArrowError) -> Error {
    Error::Message(format!("building a batch: {e}"))
}

/// One event of the `events` table (see [`Events`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct EventRow<'a> {
    /// Ordinal of the record in the trace.
    pub seq: u64,
    /// Time, ns since the trace's base.
    pub t_ns: u64,
    /// What happened: `alloc`, `free`, `free_requested`, `free_completed`, `segment_alloc`,
    /// `segment_free`, `segment_map`, `segment_unmap`, `oom`, `stream_created`,
    /// `stream_destroyed`, `annotation`.
    pub kind: &'a str,
    /// Device.
    pub device: Option<u32>,
    /// Stream.
    pub stream: Option<u64>,
    /// Pool of a segment event: `small` or `large`.
    pub pool: Option<&'a str>,
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
    seq: Vec<i64>,
    t_ns: Vec<i64>,
    wall_ns: Vec<i64>,
    kind: StringBuilder,
    device: Column<Int32Type>,
    stream: Column<Int64Type>,
    pool: StringBuilder,
    size: Column<Int64Type>,
    requested: Column<Int64Type>,
    address: Column<Int64Type>,
    stack_id: Column<Int64Type>,
    thread: Column<Int32Type>,
    allocated: Column<Int64Type>,
    reserved: Column<Int64Type>,
    name: StringBuilder,
    category: StringBuilder,
    module: StringBuilder,
}

impl Events {
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

    /// Empty builders; `wall_base` is the trace's wall clock at its base (ns since the epoch).
    pub fn new(wall_base: u64) -> Self {
        let n = BATCH_ROWS;
        Events {
            wall_base: wall_base as i64,
            seq: Vec::with_capacity(n),
            t_ns: Vec::with_capacity(n),
            wall_ns: Vec::with_capacity(n),
            kind: StringBuilder::with_capacity(n, n * 8),
            device: Column::with_capacity(n),
            stream: Column::with_capacity(n),
            pool: StringBuilder::new(),
            size: Column::with_capacity(n),
            requested: Column::with_capacity(n),
            address: Column::with_capacity(n),
            stack_id: Column::with_capacity(n),
            thread: Column::with_capacity(n),
            allocated: Column::with_capacity(n),
            reserved: Column::with_capacity(n),
            name: StringBuilder::new(),
            category: StringBuilder::new(),
            module: StringBuilder::new(),
        }
    }

    /// Rows gathered since the last batch.
    pub fn len(&self) -> usize {
        self.seq.len()
    }

    /// Whether no rows are gathered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Add a row (inlined into the export's loop, with its `event_row`).
    #[inline(always)]
    pub fn push(&mut self, e: &EventRow<'_>) {
        self.seq.push(e.seq as i64);
        self.t_ns.push(e.t_ns as i64);
        self.wall_ns
            .push(self.wall_base.wrapping_add(e.t_ns as i64));
        self.kind.append_value(e.kind);
        self.device.push(e.device.map(|d| d as i32));
        self.stream.push(opt_i64(e.stream));
        self.pool.append_option(e.pool);
        self.size.push(opt_i64(e.size));
        self.requested.push(opt_i64(e.requested));
        self.address.push(opt_i64(e.address));
        self.stack_id
            .push(e.stack_id.filter(|&s| s != 0).map(i64::from));
        self.thread.push(e.thread.map(|t| t as i32));
        self.allocated.push(opt_i64(e.allocated));
        self.reserved.push(opt_i64(e.reserved));
        self.name.append_option(e.name);
        self.category.append_option(e.category);
        self.module.append_option(e.module);
    }

    /// The rows gathered as one batch (the builders start again empty).
    pub fn batch(&mut self) -> Result<RecordBatch, Error> {
        let columns: Vec<ArrayRef> = vec![
            plain(&mut self.seq),
            plain(&mut self.t_ns),
            plain(&mut self.wall_ns),
            Arc::new(self.kind.finish()),
            self.device.finish(),
            self.stream.finish(),
            Arc::new(self.pool.finish()),
            self.size.finish(),
            self.requested.finish(),
            self.address.finish(),
            self.stack_id.finish(),
            self.thread.finish(),
            self.allocated.finish(),
            self.reserved.finish(),
            Arc::new(self.name.finish()),
            Arc::new(self.category.finish()),
            Arc::new(self.module.finish()),
        ];
        RecordBatch::try_new(Self::schema(), columns).map_err(arrow_error)
    }
}

/// A column without nulls as an array; the vector starts again empty, with the same room.
fn plain(values: &mut Vec<i64>) -> ArrayRef {
    let rows = values.len();
    Arc::new(Int64Array::from(std::mem::replace(
        values,
        Vec::with_capacity(rows),
    )))
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
    pub kind: &'a str,
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
pub struct Stacks {
    stack_id: Int64Builder,
    site: StringBuilder,
    depth: Int32Builder,
    frame_id: Int64Builder,
    kind: StringBuilder,
    name: StringBuilder,
    file: StringBuilder,
    line: Int32Builder,
    address: Int64Builder,
}

impl Stacks {
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

    /// Empty builders.
    pub fn new() -> Self {
        Stacks {
            stack_id: Int64Builder::new(),
            site: StringBuilder::new(),
            depth: Int32Builder::new(),
            frame_id: Int64Builder::new(),
            kind: StringBuilder::new(),
            name: StringBuilder::new(),
            file: StringBuilder::new(),
            line: Int32Builder::new(),
            address: Int64Builder::new(),
        }
    }

    /// Rows gathered since the last batch.
    pub fn len(&self) -> usize {
        self.stack_id.len()
    }

    /// Whether no rows are gathered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Add a row.
    pub fn push(&mut self, f: &FrameRow<'_>) {
        self.stack_id.append_value(i64::from(f.stack_id));
        self.site.append_value(f.site);
        self.depth.append_value(f.depth as i32);
        self.frame_id.append_value(i64::from(f.frame_id));
        self.kind.append_value(f.kind);
        self.name.append_value(f.name);
        self.file.append_value(f.file);
        self.line.append_value(f.line as i32);
        self.address.append_value(f.address as i64);
    }

    /// The rows gathered as one batch.
    pub fn batch(&mut self) -> Result<RecordBatch, Error> {
        let columns: Vec<ArrayRef> = vec![
            Arc::new(self.stack_id.finish()),
            Arc::new(self.site.finish()),
            Arc::new(self.depth.finish()),
            Arc::new(self.frame_id.finish()),
            Arc::new(self.kind.finish()),
            Arc::new(self.name.finish()),
            Arc::new(self.file.finish()),
            Arc::new(self.line.finish()),
            Arc::new(self.address.finish()),
        ];
        RecordBatch::try_new(Self::schema(), columns).map_err(arrow_error)
    }
}

impl Default for Stacks {
    fn default() -> Self {
        Self::new()
    }
}

/// The `samples` table: allocated and reserved bytes of a device over time — the trace's own
/// stats samples, or, for a trace without them, the walked state every 100 ms of trace time
/// (`derived` says which).
pub struct Samples {
    wall_base: i64,
    t_ns: Int64Builder,
    wall_ns: Int64Builder,
    device: Int32Builder,
    allocated: Int64Builder,
    reserved: Int64Builder,
    active: Int64Builder,
    requested: Int64Builder,
    derived: BooleanBuilder,
}

impl Samples {
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

    /// Empty builders (see [`Events::new`] for `wall_base`).
    pub fn new(wall_base: u64) -> Self {
        Samples {
            wall_base: wall_base as i64,
            t_ns: Int64Builder::new(),
            wall_ns: Int64Builder::new(),
            device: Int32Builder::new(),
            allocated: Int64Builder::new(),
            reserved: Int64Builder::new(),
            active: Int64Builder::new(),
            requested: Int64Builder::new(),
            derived: BooleanBuilder::new(),
        }
    }

    /// Rows gathered.
    pub fn len(&self) -> usize {
        self.t_ns.len()
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
        self.t_ns.append_value(t_ns as i64);
        self.wall_ns
            .append_value(self.wall_base.wrapping_add(t_ns as i64));
        self.device.append_value(device as i32);
        self.allocated.append_value(allocated as i64);
        self.reserved.append_value(reserved as i64);
        self.active.append_option(recorded.map(|r| r.0 as i64));
        self.requested.append_option(recorded.map(|r| r.1 as i64));
        self.derived.append_value(recorded.is_none());
    }

    /// The rows gathered as one batch.
    pub fn batch(&mut self) -> Result<RecordBatch, Error> {
        let columns: Vec<ArrayRef> = vec![
            Arc::new(self.t_ns.finish()),
            Arc::new(self.wall_ns.finish()),
            Arc::new(self.device.finish()),
            Arc::new(self.allocated.finish()),
            Arc::new(self.reserved.finish()),
            Arc::new(self.active.finish()),
            Arc::new(self.requested.finish()),
            Arc::new(self.derived.finish()),
        ];
        RecordBatch::try_new(Self::schema(), columns).map_err(arrow_error)
    }
}
