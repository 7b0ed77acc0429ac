//! [`DeltaChunk`]: a column chunk of integers written as `DELTA_BINARY_PACKED` data pages by
//! the export itself — the values' encoding and the definition levels — while the `parquet`
//! crate still serializes the pages, the column chunk's metadata and the file.
//!
//! The crate's own delta encoder spends about 45 instructions on a value (it buffers every
//! value, then takes each through a generic bit writer), and its column writer a dozen more on
//! each definition level and value around it: 0.55 G of the export's 2.8 G instructions per
//! million events went to the nine delta columns of `events` (BENCHMARKS.md, issue 26, third
//! session). Here a page's deltas are computed, their minimum taken and the miniblocks
//! bit-packed in one pass over each block of 128 values, and a page's levels, all present or
//! all null nearly always, become one run.
//!
//! The pages are what the crate writes for the same column (Parquet's format, version 1 data
//! pages): the levels as RLE/bit-packed hybrid runs behind their 4-byte length, then the values
//! (blocks of 128 in 4 miniblocks of 32, as the crate's encoder), the whole page compressed
//! with zstd at the table's level. The chunk's metadata says what the crate's would: its
//! encodings, page encoding counts, sizes, statistics (minimum, maximum, nulls and the
//! definition level histogram) where the table asks for them, and the offset index.

use bytes::Bytes;
use parquet::basic::{Compression, Encoding, PageType, ZstdLevel};
use parquet::column::page::{CompressedPage, Page, PageWriter};
use parquet::column::writer::ColumnCloseResult;
use parquet::file::metadata::{
    ColumnChunkMetaData, LevelHistogram, OffsetIndexBuilder, PageEncodingStats,
};
use parquet::file::statistics::{Statistics, ValueStatistics};
use parquet::file::writer::{SerializedPageWriter, TrackedWrite};
use parquet::schema::types::ColumnDescPtr;

use super::column::Levels;
use crate::Error;

/// Rows of a data page (at most): 16 Ki, so that a batch of the tables' 64 Ki rows is four
/// whole pages. (The crate's default is 20 000.)
pub const PAGE_ROWS: usize = 16 * 1024;

/// Values of a block, and of a miniblock (the crate's encoder uses the same).
const BLOCK: usize = 128;
const MINIBLOCK: usize = 32;
const MINIBLOCKS: usize = BLOCK / MINIBLOCK;

/// An integer of a delta column: `i32` or `i64`, whose deltas wrap in its own width.
pub trait DeltaInt: Copy + Ord {
    /// The value, sign-extended (the header's first value, the statistics).
    fn wide(self) -> i64;
    /// `self - prev`, wrapping in the column's width, sign-extended.
    fn delta(self, prev: Self) -> i64;
    /// `delta - min` (deltas of this width), wrapping in the column's width, zero-extended:
    /// what a miniblock packs.
    fn offset(delta: i64, min: i64) -> u64;
    /// The value that [`DeltaInt::wide`] extended.
    fn narrow(wide: i64) -> Self;
    /// Statistics of a column of this type.
    fn statistics(min: Option<Self>, max: Option<Self>, nulls: u64) -> Statistics;
}

impl DeltaInt for i64 {
    #[inline(always)]
    fn wide(self) -> i64 {
        self
    }
    #[inline(always)]
    fn delta(self, prev: Self) -> i64 {
        self.wrapping_sub(prev)
    }
    #[inline(always)]
    fn offset(delta: i64, min: i64) -> u64 {
        delta.wrapping_sub(min) as u64
    }
    fn narrow(wide: i64) -> Self {
        wide
    }
    fn statistics(min: Option<Self>, max: Option<Self>, nulls: u64) -> Statistics {
        Statistics::Int64(
            ValueStatistics::new(min, max, None, Some(nulls), false)
                .with_backwards_compatible_min_max(true),
        )
    }
}

impl DeltaInt for i32 {
    #[inline(always)]
    fn wide(self) -> i64 {
        i64::from(self)
    }
    #[inline(always)]
    fn delta(self, prev: Self) -> i64 {
        i64::from(self.wrapping_sub(prev))
    }
    #[inline(always)]
    fn offset(delta: i64, min: i64) -> u64 {
        u64::from((delta as i32).wrapping_sub(min as i32) as u32)
    }
    fn narrow(wide: i64) -> Self {
        wide as i32
    }
    fn statistics(min: Option<Self>, max: Option<Self>, nulls: u64) -> Statistics {
        Statistics::Int32(
            ValueStatistics::new(min, max, None, Some(nulls), false)
                .with_backwards_compatible_min_max(true),
        )
    }
}

/// One column chunk being written (see the module docs).
pub struct DeltaChunk {
    descr: ColumnDescPtr,
    level: ZstdLevel,
    zstd: zstd::bulk::Compressor<'static>,
    statistics: bool,
    sink: TrackedWrite<Vec<u8>>,
    /// The page being encoded, and its compressed form.
    page: Vec<u8>,
    compressed: Vec<u8>,
    rows: u64,
    pages: i32,
    uncompressed_bytes: i64,
    compressed_bytes: i64,
    nulls: u64,
    /// The minimum and maximum, sign-extended (the column's type restores them).
    min_max: Option<(i64, i64)>,
    offset_index: OffsetIndexBuilder,
}

impl DeltaChunk {
    /// An empty chunk of the column `descr`, compressed with zstd at `level`, with statistics
    /// if `statistics`.
    pub fn new(descr: ColumnDescPtr, level: ZstdLevel, statistics: bool) -> Result<Self, Error> {
        let zstd = zstd::bulk::Compressor::new(level.compression_level())
            .map_err(|e| format!("writing Parquet: zstd: {e}"))?;
        Ok(DeltaChunk {
            descr,
            level,
            zstd,
            statistics,
            sink: TrackedWrite::new(Vec::new()),
            page: Vec::new(),
            compressed: Vec::new(),
            rows: 0,
            pages: 0,
            uncompressed_bytes: 0,
            compressed_bytes: 0,
            nulls: 0,
            min_max: None,
            offset_index: OffsetIndexBuilder::new(),
        })
    }

    /// The column.
    pub fn descr(&self) -> &ColumnDescPtr {
        &self.descr
    }

    /// Write `rows` rows: `values` the present ones, `levels` their definition levels.
    pub fn write<T: DeltaInt>(
        &mut self,
        rows: usize,
        values: &[T],
        levels: Levels<'_>,
    ) -> Result<(), Error> {
        let nullable = self.descr.max_def_level() > 0;
        let counted = match levels {
            Levels::Required if !nullable => Some(rows),
            Levels::Uniform(level, n) if nullable && n == rows => {
                Some(if level != 0 { rows } else { 0 })
            }
            Levels::Each(defs) if nullable && defs.len() == rows => None,
            _ => return Err(self.error(format!("levels that do not fit {rows} rows"))),
        };
        let (mut row, mut value) = (0, 0);
        while row < rows {
            let n = (rows - row).min(PAGE_ROWS);
            // The page begins with its levels, behind their length.
            self.page.clear();
            let k = match levels {
                Levels::Required => n,
                Levels::Each(defs) => {
                    self.page.extend_from_slice(&[0; 4]);
                    let k = encode_levels(&defs[row..row + n], &mut self.page);
                    let len = (self.page.len() - 4) as u32;
                    self.page[..4].copy_from_slice(&len.to_le_bytes());
                    k
                }
                Levels::Uniform(level, _) => {
                    // One RLE run of the page's rows.
                    let mut run = Vec::with_capacity(8);
                    uleb((n as u64) << 1, &mut run);
                    run.push(u8::from(level != 0));
                    self.page
                        .extend_from_slice(&(run.len() as u32).to_le_bytes());
                    self.page.extend_from_slice(&run);
                    if level != 0 { n } else { 0 }
                }
            };
            if value + k > values.len() {
                return Err(self.error(format!("{} values for more present", values.len())));
            }
            self.write_page(n, &values[value..value + k])?;
            row += n;
            value += k;
        }
        if counted.is_some_and(|c| c != values.len()) || value != values.len() {
            return Err(self.error(format!("{} values for {value} present", values.len())));
        }
        Ok(())
    }

    fn error(&self, what: String) -> Error {
        Error::Message(format!(
            "writing Parquet: column {}: {what}",
            self.descr.name()
        ))
    }

    /// Encode, compress and write one page of `rows` rows, whose levels are already in the
    /// page.
    fn write_page<T: DeltaInt>(&mut self, rows: usize, values: &[T]) -> Result<(), Error> {
        if !self.statistics {
            encode_delta(values, &mut self.page);
        } else if let Some((min, max)) = encode_delta_with::<T, true>(values, &mut self.page) {
            self.min_max = Some(match self.min_max {
                None => (min, max),
                Some((a, b)) => (a.min(min), b.max(max)),
            });
        }
        self.nulls += (rows - values.len()) as u64;
        self.compressed.clear();
        self.compressed
            .reserve(zstd::zstd_safe::compress_bound(self.page.len()));
        self.zstd
            .compress_to_buffer(&self.page, &mut self.compressed)
            .map_err(|e| self.error(format!("zstd: {e}")))?;
        let page = Page::DataPage {
            buf: Bytes::copy_from_slice(&self.compressed),
            num_values: rows as u32,
            encoding: Encoding::DELTA_BINARY_PACKED,
            def_level_encoding: Encoding::RLE,
            rep_level_encoding: Encoding::RLE,
            statistics: None,
        };
        let spec = SerializedPageWriter::new(&mut self.sink)
            .write_page(CompressedPage::new(page, self.page.len()))
            .map_err(|e| self.error(e.to_string()))?;
        self.offset_index
            .append_offset_and_size(spec.offset as i64, spec.compressed_size as i32);
        self.offset_index.append_row_count(rows as i64);
        self.offset_index
            .append_unencoded_byte_array_data_bytes(None);
        self.uncompressed_bytes += spec.uncompressed_size as i64;
        self.compressed_bytes += spec.compressed_size as i64;
        self.rows += rows as u64;
        self.pages += 1;
        Ok(())
    }

    /// Finish the chunk: its pages (offsets from 0) and what the row group needs of it.
    pub fn close<T: DeltaInt>(self) -> Result<(Bytes, ColumnCloseResult), Error> {
        let bytes_written = self.sink.bytes_written() as u64;
        let mut builder = ColumnChunkMetaData::builder(self.descr.clone())
            .set_compression(Compression::ZSTD(self.level))
            .set_encodings(vec![Encoding::RLE, Encoding::DELTA_BINARY_PACKED])
            .set_page_encoding_stats(if self.pages > 0 {
                vec![PageEncodingStats {
                    page_type: PageType::DATA_PAGE,
                    encoding: Encoding::DELTA_BINARY_PACKED,
                    count: self.pages,
                }]
            } else {
                vec![]
            })
            .set_total_compressed_size(self.compressed_bytes)
            .set_total_uncompressed_size(self.uncompressed_bytes)
            .set_num_values(self.rows as i64)
            .set_data_page_offset(0)
            .set_dictionary_page_offset(None);
        if self.statistics {
            let (min, max) = match self.min_max {
                Some((min, max)) => (Some(T::narrow(min)), Some(T::narrow(max))),
                None => (None, None),
            };
            let histogram = LevelHistogram::try_new(self.descr.max_def_level()).map(|_| {
                LevelHistogram::from(vec![self.nulls as i64, (self.rows - self.nulls) as i64])
            });
            builder = builder
                .set_statistics(T::statistics(min, max, self.nulls))
                .set_definition_level_histogram(histogram);
        }
        let metadata = builder
            .build()
            .map_err(|e| Error::Message(format!("writing Parquet: {e}")))?;
        let close = ColumnCloseResult {
            bytes_written,
            rows_written: self.rows,
            metadata,
            bloom_filter: None,
            column_index: None,
            offset_index: Some(self.offset_index.build()),
        };
        let bytes = self
            .sink
            .into_inner()
            .map_err(|e| Error::Message(format!("writing Parquet: {e}")))?;
        Ok((Bytes::from(bytes), close))
    }
}

/// Append `v` as an unsigned LEB128 varint.
#[inline(always)]
fn uleb(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Append `v` zigzag-encoded as a varint.
#[inline(always)]
fn zigzag(v: i64, out: &mut Vec<u8>) {
    uleb(((v << 1) ^ (v >> 63)) as u64, out);
}

/// Append `values` as `DELTA_BINARY_PACKED`: the header (block size, miniblocks per block,
/// count, first value), then blocks of 128 deltas, each its minimum, its four miniblocks' bit
/// widths and the miniblocks of `delta - minimum`, 32 values bit-packed from the lowest bit
/// (the last block's unused miniblocks have width 0 and no bytes).
pub fn encode_delta<T: DeltaInt>(values: &[T], out: &mut Vec<u8>) {
    encode_delta_with::<T, false>(values, out);
}

/// [`encode_delta`], and with `STATS` the values' minimum and maximum, sign-extended (found in
/// the same pass; `None` for no values).
#[inline(always)]
fn encode_delta_with<T: DeltaInt, const STATS: bool>(
    values: &[T],
    out: &mut Vec<u8>,
) -> Option<(i64, i64)> {
    uleb(BLOCK as u64, out);
    uleb(MINIBLOCKS as u64, out);
    uleb(values.len() as u64, out);
    let Some(&first) = values.first() else {
        zigzag(0, out);
        return None;
    };
    zigzag(first.wide(), out);
    let (mut lo_value, mut hi_value) = (first.wide(), first.wide());
    let mut deltas = [0i64; BLOCK];
    let mut start = 0;
    while start + 1 < values.len() {
        // The block's values and the one before them: 128 deltas, or fewer at the end.
        let window = &values[start..values.len().min(start + 1 + BLOCK)];
        let n = window.len() - 1;
        start += n;
        // The minimum delta in the column's width (an `i32` delta is sign-extended, so `i64`'s
        // order is its own).
        let mut min = i64::MAX;
        for (d, pair) in deltas.iter_mut().zip(window.windows(2)) {
            let x = pair[1].delta(pair[0]);
            *d = x;
            min = if x < min { x } else { min };
            if STATS {
                let v = pair[1].wide();
                lo_value = if v < lo_value { v } else { lo_value };
                hi_value = if v > hi_value { v } else { hi_value };
            }
        }
        zigzag(min, out);
        let widths_at = out.len();
        out.extend_from_slice(&[0; MINIBLOCKS]);
        for m in 0..n.div_ceil(MINIBLOCK) {
            let lo = m * MINIBLOCK;
            let hi = (lo + MINIBLOCK).min(n);
            let mut or = 0u64;
            let mut packed = [0u64; MINIBLOCK];
            for (p, &d) in packed.iter_mut().zip(&deltas[lo..hi]) {
                *p = T::offset(d, min);
                or |= *p;
            }
            let width = 64 - or.leading_zeros() as usize;
            out[widths_at + m] = width as u8;
            pack(&packed, width, out);
        }
    }
    Some((lo_value, hi_value))
}

/// Append 32 values of `width` bits each, from the lowest bit: `4 * width` bytes.
#[inline(always)]
fn pack(values: &[u64; MINIBLOCK], width: usize, out: &mut Vec<u8>) {
    if width == 0 {
        return;
    }
    let mut acc: u128 = 0;
    let mut bits = 0;
    for &v in values {
        acc |= u128::from(v) << bits;
        bits += width;
        if bits >= 64 {
            out.extend_from_slice(&(acc as u64).to_le_bytes());
            acc >>= 64;
            bits -= 64;
        }
    }
    // 32 values of any width end on a byte.
    out.extend_from_slice(&acc.to_le_bytes()[..bits / 8]);
}

/// Append definition levels (0 or 1) as the RLE/bit-packed hybrid of bit width 1: a run of 8
/// or more equal levels as one RLE run, what lies between as bit-packed groups of 8 (the last
/// group padded with zeros, which readers ignore past the page's count). Returns the levels 1
/// (the values present).
pub fn encode_levels(levels: &[i16], out: &mut Vec<u8>) -> usize {
    let n = levels.len();
    let mut i = 0;
    let mut present = 0;
    // Bit-packed groups gathered, not yet written.
    let mut groups: Vec<u8> = Vec::new();
    let flush = |groups: &mut Vec<u8>, out: &mut Vec<u8>| {
        if !groups.is_empty() {
            uleb(((groups.len() as u64) << 1) | 1, out);
            out.extend_from_slice(groups);
            groups.clear();
        }
    };
    while i < n {
        // The next 8 levels as a byte; a run is looked for only where they are all equal.
        let group = &levels[i..n.min(i + 8)];
        let mut byte = 0u8;
        for (k, &l) in group.iter().enumerate() {
            byte |= u8::from(l != 0) << k;
        }
        if group.len() == 8 && (byte == 0 || byte == 0xff) {
            let v = levels[i];
            let run = 8 + levels[i + 8..].iter().take_while(|&&l| l == v).count();
            flush(&mut groups, out);
            uleb((run as u64) << 1, out);
            out.push(u8::from(v != 0));
            present += if v != 0 { run } else { 0 };
            i += run;
        } else {
            present += byte.count_ones() as usize;
            groups.push(byte);
            i += 8;
            // (At most 63 groups to a run, as the crate writes them.)
            if groups.len() == 63 {
                flush(&mut groups, out);
            }
        }
    }
    flush(&mut groups, out);
    present
}

#[cfg(test)]
mod tests;
