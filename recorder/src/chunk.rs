//! Chunk framing: `len: u32 LE`, `crc32: u32 LE` (of `flags` and the payload), `flags: u8`,
//! `payload: len bytes`. Flag bit 0: the payload is zstd-compressed. The payload, once
//! decompressed, is a run of records (see [`crate::schema`]).
//!
//! A chunk is written with one `write` call after it is complete, so a process killed with
//! `kill -9` leaves at most one torn chunk at the end of its last file; the CRC catches torn and
//! corrupted chunks alike, and a reader stops at the first one.

use crate::schema::{Record, read_leb128};

/// Bytes before the payload.
pub const CHUNK_HEADER: usize = 9;
/// Flag: payload compressed with zstd.
pub const FLAG_ZSTD: u8 = 1;
/// Largest payload a reader accepts (a corrupt length must not make it allocate gigabytes).
pub const MAX_PAYLOAD: usize = 256 << 20;

/// Frame `records` (already encoded back to back) as one chunk, compressed if asked. (A writer
/// of many chunks keeps a [`ChunkEncoder`] instead.)
pub fn encode_chunk(records: &[u8], compress: bool, out: &mut Vec<u8>) {
    ChunkEncoder::default().encode(records, compress, out);
}

/// zstd's level for chunks. Level 3, zstd's default: fast enough for the worker to keep up
/// (see BENCHMARKS.md).
const ZSTD_LEVEL: i32 = 3;

/// Frames chunk after chunk, keeping its zstd context and buffer between them: a fresh context
/// per chunk allocated and cleared its tables each time, an eighth of the recorder thread's work
/// (BENCHMARKS.md, issue 25). The chunks are the same.
#[derive(Default)]
pub struct ChunkEncoder {
    zstd: Option<zstd::bulk::Compressor<'static>>,
    compressed: Vec<u8>,
}

impl std::fmt::Debug for ChunkEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkEncoder")
            .field("compressed", &self.compressed.capacity())
            .finish_non_exhaustive()
    }
}

impl ChunkEncoder {
    /// Frame `records` (already encoded back to back) as one chunk appended to `out`,
    /// compressed if asked (stored plain if zstd fails).
    pub fn encode(&mut self, records: &[u8], compress: bool, out: &mut Vec<u8>) {
        if compress && self.compress(records) {
            frame(FLAG_ZSTD, &self.compressed, out);
        } else {
            frame(0, records, out);
        }
    }

    /// Compress `records` into `self.compressed`; whether that worked.
    fn compress(&mut self, records: &[u8]) -> bool {
        let zstd = match &mut self.zstd {
            Some(z) => z,
            z => match zstd::bulk::Compressor::new(ZSTD_LEVEL) {
                Ok(c) => z.insert(c),
                Err(_) => return false,
            },
        };
        self.compressed.clear();
        self.compressed
            .reserve(zstd::zstd_safe::compress_bound(records.len()));
        zstd.compress_to_buffer(records, &mut self.compressed)
            .is_ok()
    }
}

/// Append the chunk of `payload` with `flags` to `out`.
fn frame(flags: u8, payload: &[u8], out: &mut Vec<u8>) {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&[flags]);
    hasher.update(payload);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&hasher.finalize().to_le_bytes());
    out.push(flags);
    out.extend_from_slice(payload);
}

/// Why a chunk could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    /// Fewer bytes remain than the chunk needs (a torn write at the end of a file).
    #[error("truncated chunk: {needed} bytes needed, {available} available")]
    Truncated {
        /// Bytes the chunk claims.
        needed: usize,
        /// Bytes left in the file.
        available: usize,
    },
    /// The checksum does not match (corruption).
    #[error("checksum mismatch")]
    Checksum,
    /// The payload does not decompress.
    #[error("payload does not decompress: {0}")]
    Decompress(String),
    /// A record inside a valid chunk does not decode.
    #[error("bad record of kind {kind} at payload offset {offset}: {reason}")]
    Record {
        /// Its kind.
        kind: u8,
        /// Where in the payload.
        offset: usize,
        /// Why.
        reason: String,
    },
}

/// A chunk's header: payload length, checksum and flags. A length over [`MAX_PAYLOAD`] is
/// corruption (reported as a checksum failure: the header itself is damaged).
pub fn parse_header(header: &[u8; CHUNK_HEADER]) -> Result<(usize, u32, u8), ChunkError> {
    let len = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
    let crc = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
    if len > MAX_PAYLOAD {
        return Err(ChunkError::Checksum);
    }
    Ok((len, crc, header[8]))
}

/// Check a payload against its header's checksum.
pub fn verify(crc: u32, flags: u8, payload: &[u8]) -> Result<(), ChunkError> {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&[flags]);
    hasher.update(payload);
    if hasher.finalize() == crc {
        Ok(())
    } else {
        Err(ChunkError::Checksum)
    }
}

/// Split the front chunk off `bytes`: `(payload, flags, bytes consumed)`.
pub fn split_chunk(bytes: &[u8]) -> Result<(&[u8], u8, usize), ChunkError> {
    let Some(header) = bytes.first_chunk::<CHUNK_HEADER>() else {
        return Err(ChunkError::Truncated {
            needed: CHUNK_HEADER,
            available: bytes.len(),
        });
    };
    let (len, crc, flags) = parse_header(header)?;
    let end = CHUNK_HEADER + len;
    if bytes.len() < end {
        return Err(ChunkError::Truncated {
            needed: end,
            available: bytes.len(),
        });
    }
    let payload = &bytes[CHUNK_HEADER..end];
    verify(crc, flags, payload)?;
    Ok((payload, flags, end))
}

/// Decompress (if flagged) and decode the records of one chunk.
pub fn decode_payload(payload: &[u8], flags: u8) -> Result<Vec<Record>, ChunkError> {
    let mut records = Vec::new();
    PayloadDecoder::default().decode(payload, flags, &mut records)?;
    Ok(records)
}

/// Largest decompressed payload decoded in one piece into [`PayloadDecoder`]'s buffer, which
/// reserves what the frame's header claims: no more than a plain chunk may hold (a frame
/// claiming more, or not saying its size, is decompressed as a stream, as before).
const MAX_DECOMPRESSED: usize = MAX_PAYLOAD;

/// Decodes chunk after chunk, keeping its zstd context and buffer between them (what a reader
/// of many chunks uses: a fresh context per chunk cost as much as a tenth of the decompression).
#[derive(Default)]
pub struct PayloadDecoder {
    zstd: Option<zstd::bulk::Decompressor<'static>>,
    buffer: Vec<u8>,
}

impl std::fmt::Debug for PayloadDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayloadDecoder")
            .field("buffer", &self.buffer.capacity())
            .finish_non_exhaustive()
    }
}

impl PayloadDecoder {
    /// Decompress (if flagged) and decode the records of one chunk, appended to `records`. On
    /// an error `records` may hold some of the chunk's records: the caller drops them.
    pub fn decode(
        &mut self,
        payload: &[u8],
        flags: u8,
        records: &mut Vec<Record>,
    ) -> Result<(), ChunkError> {
        if flags & FLAG_ZSTD == 0 {
            return decode_records(payload, records);
        }
        let decompress = |e: std::io::Error| ChunkError::Decompress(e.to_string());
        match zstd::bulk::Decompressor::upper_bound(payload) {
            Some(size) if size <= MAX_DECOMPRESSED => {
                let zstd = match &mut self.zstd {
                    Some(z) => z,
                    z => z.insert(zstd::bulk::Decompressor::new().map_err(decompress)?),
                };
                self.buffer.clear();
                self.buffer.reserve(size);
                zstd.decompress_to_buffer(payload, &mut self.buffer)
                    .map_err(decompress)?;
                decode_records(&self.buffer, records)
            }
            _ => {
                let data = zstd::stream::decode_all(payload).map_err(decompress)?;
                decode_records(&data, records)
            }
        }
    }
}

/// Decode the records of a decompressed payload, appended to `records`.
fn decode_records(data: &[u8], records: &mut Vec<Record>) -> Result<(), ChunkError> {
    let mut at = 0;
    while at < data.len() {
        let kind = data[at];
        let bad = |reason: &str| ChunkError::Record {
            kind,
            offset: at,
            reason: reason.to_string(),
        };
        let (len, used) = read_leb128(&data[at + 1..]).ok_or_else(|| bad("bad length"))?;
        let start = at + 1 + used;
        let end = start
            .checked_add(len as usize)
            .filter(|&e| e <= data.len())
            .ok_or_else(|| bad("length past the payload"))?;
        let body = &data[start..end];
        // The fast path first, here rather than only inside `Record::decode`: its `Option` has
        // the record's own layout, where the `Result` moved the record through unaligned copies
        // (a fifth of the decoding's time).
        let record = match crate::decode::decode_hot(kind, body) {
            Some(record) => record,
            None => Record::decode(kind, body).map_err(|e| bad(&e.to_string()))?,
        };
        records.push(record);
        at = end;
    }
    Ok(())
}
