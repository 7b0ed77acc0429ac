//! [`TableFile`]: one table's Parquet file, written column by column through Parquet's own
//! column writers (the `parquet` crate's low-level API), fed the columns a table gathered
//! ([`super::column::Col`]) without building Arrow arrays.
//!
//! The file is still what Arrow's writer would make of the table's Arrow schema: the Parquet
//! schema is converted from it, and the Arrow schema is stored in the file's key-value metadata
//! (`ARROW:schema`), so pyarrow reads the same types and schema metadata back.
//!
//! Row groups hold up to [`ROW_GROUP_ROWS`] rows. Parquet writes a row group's columns one after
//! the other, so each column's pages are kept in memory (`MemoryPages`) until the row group is
//! full, then spliced into the file in column order: memory is bounded by one row group's
//! encoded pages, whatever the trace's length.

use std::fs::File;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use arrow_schema::SchemaRef;
use bytes::Bytes;
use parquet::arrow::{ArrowSchemaConverter, add_encoded_arrow_schema_to_metadata};
use parquet::basic::{Compression, Encoding, Type as PhysicalType, ZstdLevel};
use parquet::column::page::{CompressedPage, PageWriteSpec, PageWriter};
use parquet::column::writer::{ColumnCloseResult, ColumnWriter, get_column_writer};
use parquet::errors::ParquetError;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::{EnabledStatistics, WriterProperties, WriterPropertiesPtr};
use parquet::file::writer::{SerializedFileWriter, SerializedPageWriter, TrackedWrite};
use parquet::schema::types::{ColumnDescPtr, ColumnPath};

use super::column::{ColRef, Levels};
use super::delta::DeltaChunk;
use crate::Error;

/// zstd's fastest positive level, for every column.
fn zstd_level() -> ZstdLevel {
    ZstdLevel::try_new(1).expect("a valid level")
}

/// Rows of a row group (at most).
pub const ROW_GROUP_ROWS: usize = 1 << 20;

/// How a table's columns are encoded, beyond the defaults (zstd, dictionaries where values
/// repeat, no statistics).
pub struct Layout {
    /// Columns written with delta encoding (`delta::DeltaChunk`): times, ordinals and running
    /// totals, which change little from a row to the next, and integers that hardly change at
    /// all (a device, a stream, a thread): for those deltas take the bytes of a dictionary's
    /// run-length indices at a third of the work (interning each value in the dictionary costs
    /// more than computing its delta). And `requested`, whose values are too many for a
    /// dictionary to pay: about 110 000 distinct in a row group of a long trace, where each
    /// value's search of the dictionary missed the caches (an eighth of the export's time), for
    /// files 2 % larger on a long trace and 2 % smaller for a job of short ranks.
    pub delta: &'static [&'static str],
    /// Columns with statistics (each column chunk's minimum, maximum and nulls): those a query
    /// engine can prune row groups with — times and ordinals (which only grow), running totals
    /// (a query for moments above a threshold), the device. Elsewhere (addresses, sizes, stack
    /// ids, strings) every row group spans nearly the whole range, and the statistics cost
    /// about 5 % of the export for nothing.
    pub statistics: &'static [&'static str],
}

/// A Parquet file being written from batches of one table's columns.
pub struct TableFile {
    file: SerializedFileWriter<File>,
    props: WriterPropertiesPtr,
    layout: &'static Layout,
    /// Each leaf column's writer for the row group being gathered.
    columns: Vec<ColumnChunk>,
    /// Rows in the row group being gathered.
    group_rows: usize,
    /// Levels all null and all present, for the crate's writers, which take one per row.
    uniform: [Vec<i16>; 2],
    /// Rows written.
    pub rows: u64,
}

/// One column of the row group being gathered: the crate's column writer and the pages it
/// wrote so far, or, for an integer column of [`Layout::delta`], a [`DeltaChunk`].
enum ColumnChunk {
    Crate {
        descr: ColumnDescPtr,
        writer: Box<ColumnWriter<'static>>,
        pages: MemoryPages,
    },
    Delta(Box<DeltaChunk>),
}

impl TableFile {
    /// Create `path` for the table of `schema`, zstd-compressed, encoded as `layout` says, with
    /// `metadata` (the job, the rank, the source trace) added to its key-value metadata.
    pub fn create(
        path: &Path,
        schema: SchemaRef,
        layout: &'static Layout,
        metadata: &[(String, String)],
    ) -> Result<Self, Error> {
        let file = File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(zstd_level()))
            .set_statistics_enabled(EnabledStatistics::None);
        for column in layout.delta {
            let path = ColumnPath::from(*column);
            props = props
                .set_column_dictionary_enabled(path.clone(), false)
                .set_column_encoding(path, Encoding::DELTA_BINARY_PACKED);
        }
        for column in layout.statistics {
            props = props
                .set_column_statistics_enabled(ColumnPath::from(*column), EnabledStatistics::Chunk);
        }
        // The schema's own metadata (version, table) also goes into the file's key-value
        // metadata, where readers that do not decode the Arrow schema find it.
        let mut pairs: Vec<(String, String)> = schema
            .metadata()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        pairs.sort();
        pairs.extend(metadata.iter().cloned());
        let mut props = props
            .set_key_value_metadata(Some(
                pairs
                    .into_iter()
                    .map(|(k, v)| KeyValue::new(k, v))
                    .collect(),
            ))
            .build();
        add_encoded_arrow_schema_to_metadata(&schema, &mut props);
        let parquet_schema = ArrowSchemaConverter::new()
            .with_coerce_types(props.coerce_types())
            .convert(&schema)
            .map_err(parquet_error)?;
        let props = Arc::new(props);
        let file = SerializedFileWriter::new(file, parquet_schema.root_schema_ptr(), props.clone())
            .map_err(parquet_error)?;
        let columns = file
            .schema_descr()
            .columns()
            .iter()
            .map(|descr| ColumnChunk::new(descr.clone(), &props, layout))
            .collect::<Result<_, _>>()?;
        Ok(TableFile {
            file,
            props,
            layout,
            columns,
            group_rows: 0,
            uniform: [Vec::new(), Vec::new()],
            rows: 0,
        })
    }

    /// Write a batch of `rows` rows, one [`ColRef`] per column in the schema's order; the
    /// columns are cleared.
    pub fn write(&mut self, rows: usize, mut batch: Vec<ColRef<'_>>) -> Result<(), Error> {
        if batch.len() != self.columns.len() {
            return Err(Error::Message(format!(
                "writing Parquet: a batch of {} columns for a table of {}",
                batch.len(),
                self.columns.len()
            )));
        }
        for (chunk, column) in self.columns.iter_mut().zip(batch.iter_mut()) {
            chunk.write(rows, column, &mut self.uniform)?;
            column.clear();
        }
        self.rows += rows as u64;
        self.group_rows += rows;
        if self.group_rows >= ROW_GROUP_ROWS {
            self.flush_row_group()?;
        }
        Ok(())
    }

    /// Add a key-value pair to the file's metadata (before [`TableFile::close`]).
    pub fn note(&mut self, key: &str, value: String) {
        self.file
            .append_key_value_metadata(KeyValue::new(key.to_string(), value));
    }

    /// Finish the file; the rows written.
    pub fn close(mut self) -> Result<u64, Error> {
        if self.group_rows > 0 {
            self.flush_row_group()?;
        }
        self.file.close().map_err(parquet_error)?;
        Ok(self.rows)
    }

    /// Close each column's writer and splice its pages into a new row group, in column order.
    fn flush_row_group(&mut self) -> Result<(), Error> {
        let mut group = self.file.next_row_group().map_err(parquet_error)?;
        for chunk in &mut self.columns {
            let fresh = ColumnChunk::new(chunk.descr().clone(), &self.props, self.layout)?;
            let (bytes, close) = std::mem::replace(chunk, fresh).close()?;
            group.append_column(&bytes, close).map_err(parquet_error)?;
        }
        group.close().map_err(parquet_error)?;
        self.group_rows = 0;
        Ok(())
    }
}

impl ColumnChunk {
    fn new(
        descr: ColumnDescPtr,
        props: &WriterPropertiesPtr,
        layout: &Layout,
    ) -> Result<Self, Error> {
        let delta = layout.delta.contains(&descr.name())
            && matches!(
                descr.physical_type(),
                PhysicalType::INT32 | PhysicalType::INT64
            );
        if delta {
            let statistics = layout.statistics.contains(&descr.name());
            let chunk = DeltaChunk::new(descr, zstd_level(), statistics)?;
            return Ok(ColumnChunk::Delta(Box::new(chunk)));
        }
        let pages = MemoryPages::default();
        let writer = get_column_writer(descr.clone(), props.clone(), Box::new(pages.clone()));
        let writer = Box::new(writer);
        Ok(ColumnChunk::Crate {
            descr,
            writer,
            pages,
        })
    }

    fn descr(&self) -> &ColumnDescPtr {
        match self {
            ColumnChunk::Crate { descr, .. } => descr,
            ColumnChunk::Delta(d) => d.descr(),
        }
    }

    /// The chunk's pages and what the row group needs of it.
    fn close(self) -> Result<(Bytes, ColumnCloseResult), Error> {
        match self {
            ColumnChunk::Crate { writer, pages, .. } => {
                let close = writer.close().map_err(parquet_error)?;
                Ok((pages.into_bytes()?, close))
            }
            ColumnChunk::Delta(d) => match d.descr().physical_type() {
                PhysicalType::INT32 => d.close::<i32>(),
                _ => d.close::<i64>(),
            },
        }
    }

    /// Write `rows` rows of `column`, whose type must be this column's; `uniform` lends the
    /// crate's writers levels all null and all present.
    fn write(
        &mut self,
        rows: usize,
        column: &ColRef<'_>,
        uniform: &mut [Vec<i16>; 2],
    ) -> Result<(), Error> {
        let (descr, writer) = match self {
            ColumnChunk::Delta(d) => {
                let nullable = d.descr().max_def_level() > 0;
                return match column {
                    ColRef::Int32(c) if d.descr().physical_type() == PhysicalType::INT32 => {
                        d.write(rows, &c.values, c.levels(nullable))
                    }
                    ColRef::Int64(c) if d.descr().physical_type() == PhysicalType::INT64 => {
                        d.write(rows, &c.values, c.levels(nullable))
                    }
                    _ => Err(Error::Message(format!(
                        "writing Parquet: column {} given values of another type",
                        d.descr().name()
                    ))),
                };
            }
            ColumnChunk::Crate { descr, writer, .. } => (descr, writer),
        };
        let nullable = descr.max_def_level() > 0;
        let defs = level_slice(descr, rows, column.levels(nullable), uniform)?;
        let written = match (writer.as_mut(), column) {
            (ColumnWriter::Int32ColumnWriter(w), ColRef::Int32(c)) => {
                w.write_batch(&c.values, defs, None)
            }
            (ColumnWriter::Int64ColumnWriter(w), ColRef::Int64(c)) => {
                w.write_batch(&c.values, defs, None)
            }
            (ColumnWriter::ByteArrayColumnWriter(w), ColRef::Str(c)) => {
                w.write_batch(&c.values, defs, None)
            }
            (ColumnWriter::BoolColumnWriter(w), ColRef::Bool(c)) => {
                w.write_batch(&c.values, defs, None)
            }
            _ => {
                return Err(Error::Message(format!(
                    "writing Parquet: column {} given values of another type",
                    descr.name()
                )));
            }
        };
        written.map_err(parquet_error)?;
        Ok(())
    }
}

/// A batch's definition levels for `descr`, one per row, as the crate's writers take them:
/// `None` for a required column; levels all equal are lent from `uniform`.
fn level_slice<'d>(
    descr: &ColumnDescPtr,
    rows: usize,
    levels: Levels<'d>,
    uniform: &'d mut [Vec<i16>; 2],
) -> Result<Option<&'d [i16]>, Error> {
    let defs = match levels {
        Levels::Required => return Ok(None),
        Levels::Each(defs) => defs,
        Levels::Uniform(level, n) => {
            let buf = &mut uniform[usize::from(level != 0)];
            if buf.len() < n {
                buf.resize(n, level);
            }
            &buf[..n]
        }
    };
    if defs.len() != rows {
        return Err(Error::Message(format!(
            "writing Parquet: column {}: {} levels for {rows} rows",
            descr.name(),
            defs.len()
        )));
    }
    Ok(Some(defs))
}

/// A column chunk's pages, serialized in memory as they would be in the file (header, then
/// data) until the row group is spliced into the file. Shared between the column writer (which
/// owns a boxed clone) and its [`ColumnChunk`].
#[derive(Clone, Default)]
struct MemoryPages {
    sink: Arc<Mutex<Option<TrackedWrite<Vec<u8>>>>>,
}

impl MemoryPages {
    /// The pages written, as one buffer whose offsets are the column writer's.
    fn into_bytes(self) -> Result<Bytes, Error> {
        let sink = self
            .sink
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match sink {
            None => Ok(Bytes::new()),
            Some(sink) => Ok(Bytes::from(sink.into_inner().map_err(parquet_error)?)),
        }
    }
}

impl PageWriter for MemoryPages {
    fn write_page(&mut self, page: CompressedPage) -> parquet::errors::Result<PageWriteSpec> {
        let mut sink = self.sink.lock().unwrap_or_else(PoisonError::into_inner);
        let sink = sink.get_or_insert_with(|| TrackedWrite::new(Vec::new()));
        SerializedPageWriter::new(sink).write_page(page)
    }

    fn close(&mut self) -> parquet::errors::Result<()> {
        Ok(())
    }
}

fn parquet_error(e: ParquetError) -> Error {
    Error::Message(format!("writing Parquet: {e}"))
}
