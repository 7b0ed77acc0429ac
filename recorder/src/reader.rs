//! [`TraceReader`]: the records of a trace directory, file after file in order.
//!
//! Each file is streamed chunk by chunk (a reader holds one chunk in memory, whatever the file's
//! size). At the first torn or corrupt chunk the reader stops reading
//! that file, notes a [`Tear`] (file and byte offset, and why), and goes on with the next file,
//! which begins with a checkpoint of its own, so nothing before a tear is lost and nothing after
//! it is guessed. A file deleted before the reader reached it (rotated away by a program still
//! writing the trace) is passed over the same way. Unknown record kinds come through as
//! [`Record::Unknown`] for callers to skip.

use std::fs::{self, File};
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};

use crate::chunk::{CHUNK_HEADER, ChunkError, PayloadDecoder, parse_header, verify};
use crate::schema::{CheckpointEnd, FORMAT_VERSION, MAGIC, Record};

/// Where and why a file stopped being readable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tear {
    /// The file.
    pub path: PathBuf,
    /// Byte offset of the chunk that could not be read.
    pub offset: u64,
    /// Why.
    pub error: ChunkError,
}

/// Why a trace could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The directory or a file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// No trace files in the directory.
    #[error("{0}: no trace files (trace-NNNNNN.cat) here")]
    Empty(PathBuf),
    /// A file is not a cachealloc trace, or from a newer major format.
    #[error("{path}: {reason}")]
    Format {
        /// The path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// One record and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Item {
    /// Index (into [`TraceReader::files`]) of the file it was read from.
    pub file: usize,
    /// The record.
    pub record: Record,
}

/// Streams the records of a trace directory. See the module docs.
#[derive(Debug)]
pub struct TraceReader {
    dir: PathBuf,
    files: Vec<PathBuf>,
    /// Each file's index in its name (`trace-NNNNNN.cat`), for [`TraceReader::refresh`].
    indices: Vec<u32>,
    next_file: usize,
    /// Whether the trace is still being written ([`TraceReader::follow`]).
    follow: bool,
    /// The file being read, a chunk at a time.
    current: Option<Chunks<BufReader<File>>>,
    /// The current chunk's records (a buffer kept from chunk to chunk) …
    buffer: Vec<Record>,
    /// … and the index of the next one to return (those before it may have been taken out by
    /// [`Iterator::next`], leaving a placeholder).
    cursor: usize,
    tears: Vec<Tear>,
}

/// The chunks of one trace file, read from `source` one at a time: the memory a reader needs is
/// one chunk's, whatever the file's size.
#[derive(Debug)]
struct Chunks<R> {
    path: PathBuf,
    source: R,
    /// Bytes in the file (for the numbers in a `Truncated` tear).
    len: u64,
    /// Offset of the next chunk.
    at: u64,
    /// The current chunk's payload (a buffer kept from chunk to chunk).
    payload: Vec<u8>,
    /// Its zstd context and decompression buffer, also kept.
    decoder: PayloadDecoder,
}

impl<R: Read> Chunks<R> {
    /// Check the file's prefix; `None` for a file killed before its prefix was written.
    fn start(path: &Path, mut source: R, len: u64) -> Result<Option<Chunks<R>>, ReadError> {
        let format = |reason: String| ReadError::Format {
            path: path.to_path_buf(),
            reason,
        };
        let mut prefix = [0u8; 12];
        let got = read_up_to(&mut source, &mut prefix).map_err(|source| ReadError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if got < 12 || &prefix[..8] != MAGIC {
            if got < 12 && MAGIC.starts_with(&prefix[..got.min(8)]) {
                // Killed before the prefix was written: an empty file.
                return Ok(None);
            }
            return Err(format("not a cachealloc trace file".to_string()));
        }
        let version = u32::from_le_bytes(prefix[8..12].try_into().expect("4 bytes"));
        if version > FORMAT_VERSION {
            return Err(format(format!(
                "format version {version} is newer than this reader's {FORMAT_VERSION}"
            )));
        }
        Ok(Some(Chunks {
            path: path.to_path_buf(),
            source,
            len,
            at: 12,
            payload: Vec::new(),
            decoder: PayloadDecoder::default(),
        }))
    }

    /// The next chunk's records, appended to `records`; `Ok(false)` at the end of the file,
    /// `Err` at a tear (after which the file is not read further; `records` is then as it was).
    fn next_chunk(&mut self, records: &mut Vec<Record>) -> Result<bool, Tear> {
        let tear = |at: u64, error| Tear {
            path: self.path.clone(),
            offset: at,
            error,
        };
        let available = |at: u64| self.len.saturating_sub(at) as usize;
        let mut header = [0u8; CHUNK_HEADER];
        let got = read_up_to(&mut self.source, &mut header).unwrap_or(0);
        if got == 0 {
            return Ok(false);
        }
        if got < CHUNK_HEADER {
            let error = ChunkError::Truncated {
                needed: CHUNK_HEADER,
                available: got,
            };
            return Err(tear(self.at, error));
        }
        let (len, crc, flags) = parse_header(&header).map_err(|e| tear(self.at, e))?;
        self.payload.resize(len, 0);
        let got = read_up_to(&mut self.source, &mut self.payload).unwrap_or(0);
        if got < len {
            let error = ChunkError::Truncated {
                needed: CHUNK_HEADER + len,
                available: available(self.at),
            };
            return Err(tear(self.at, error));
        }
        let before = records.len();
        verify(crc, flags, &self.payload)
            .and_then(|()| self.decoder.decode(&self.payload, flags, records))
            .map_err(|e| {
                records.truncate(before);
                tear(self.at, e)
            })?;
        self.at += (CHUNK_HEADER + len) as u64;
        Ok(true)
    }
}

impl Chunks<BufReader<File>> {
    /// Go back to the start of the chunk not yet read (its bytes were not all written yet).
    fn rewind(&mut self) -> io::Result<()> {
        use std::io::{Seek, SeekFrom};
        self.source.seek(SeekFrom::Start(self.at)).map(|_| ())
    }
}

/// Fill `buf` as far as the source allows: the number of bytes read (short only at its end).
fn read_up_to(source: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match source.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// The trace files of a directory in order (finished and `.part` alike).
pub fn trace_files(dir: &Path) -> Result<Vec<PathBuf>, ReadError> {
    Ok(indexed_trace_files(dir)?
        .into_iter()
        .map(|(_, p)| p)
        .collect())
}

/// [`trace_files`] with each file's index.
fn indexed_trace_files(dir: &Path) -> Result<Vec<(u32, PathBuf)>, ReadError> {
    let entries = fs::read_dir(dir).map_err(|source| ReadError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut files: Vec<(u32, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let stem = name.strip_suffix(".part").unwrap_or(&name);
            let index: u32 = stem
                .strip_prefix("trace-")?
                .strip_suffix(".cat")?
                .parse()
                .ok()?;
            Some((index, e.path()))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ReadError::Empty(dir.to_path_buf()));
    }
    Ok(files)
}

impl TraceReader {
    /// Open a trace directory.
    pub fn open(dir: impl AsRef<Path>) -> Result<TraceReader, ReadError> {
        let (indices, files) = indexed_trace_files(dir.as_ref())?.into_iter().unzip();
        Ok(TraceReader {
            dir: dir.as_ref().to_path_buf(),
            files,
            indices,
            next_file: 0,
            follow: false,
            current: None,
            buffer: Vec::new(),
            cursor: 0,
            tears: Vec::new(),
        })
    }

    /// Open a trace directory that a running program is still writing. At the end of its last
    /// file the reader stops without closing it, and a chunk there not yet written whole is
    /// not a tear: after [`TraceReader::refresh`] the reader goes on from there (the file
    /// grew) or into the files the program has begun since.
    pub fn follow(dir: impl AsRef<Path>) -> Result<TraceReader, ReadError> {
        Ok(TraceReader {
            follow: true,
            ..TraceReader::open(dir)?
        })
    }

    /// Look for files begun since the reader was opened (or last refreshed): the reader
    /// reads them after the ones it knows.
    pub fn refresh(&mut self) -> Result<(), ReadError> {
        let last = self.indices.last().copied();
        for (index, path) in indexed_trace_files(&self.dir)? {
            if last.is_none_or(|last| index > last) {
                self.indices.push(index);
                self.files.push(path);
            }
        }
        Ok(())
    }

    /// Whether the file being read is the last one known, in a followed trace.
    fn following_last_file(&self) -> bool {
        self.follow && self.next_file >= self.files.len()
    }

    /// The files, in reading order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Tears found so far.
    pub fn tears(&self) -> &[Tear] {
        &self.tears
    }

    /// Start reading file `index`. A file listed while the program was writing it
    /// (`….cat.part`) may have been finished since: it is then read by its final name.
    fn open_file(&mut self, index: usize) -> Result<(), ReadError> {
        let listed = &self.files[index];
        let file = match File::open(listed) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let finished = listed.to_str().and_then(|p| p.strip_suffix(".part"));
                match finished.map(|p| (File::open(p), PathBuf::from(p))) {
                    Some((Ok(file), path)) => {
                        self.files[index] = path;
                        Ok(file)
                    }
                    _ => Err(e),
                }
            }
            opened => opened,
        };
        let path = &self.files[index];
        let io_error = |source| ReadError::Io {
            path: path.clone(),
            source,
        };
        let file = file.map_err(io_error)?;
        let len = file.metadata().map_err(io_error)?.len();
        self.current = Chunks::start(path, BufReader::with_capacity(1 << 16, file), len)?;
        Ok(())
    }
}

/// Parse one file held in memory: its records up to the first tear, and the tear if any.
pub fn read_file(path: &Path, bytes: &[u8]) -> Result<(Vec<Record>, Option<Tear>), ReadError> {
    let Some(mut chunks) = Chunks::start(path, bytes, bytes.len() as u64)? else {
        return Ok((Vec::new(), None));
    };
    let mut records = Vec::new();
    loop {
        match chunks.next_chunk(&mut records) {
            Ok(true) => {}
            Ok(false) => return Ok((records, None)),
            Err(tear) => return Ok((records, Some(tear))),
        }
    }
}

impl TraceReader {
    /// Make `buffer[cursor]` the next record: `None` at the end of the trace, `Err` for a file
    /// that cannot be opened.
    fn advance(&mut self) -> Option<Result<(), ReadError>> {
        while self.cursor >= self.buffer.len() {
            // (The buffer's allocation is reused for the next chunk.)
            self.buffer.clear();
            self.cursor = 0;
            let last = self.following_last_file();
            if let Some(chunks) = &mut self.current {
                match chunks.next_chunk(&mut self.buffer) {
                    Ok(true) => continue,
                    // The program may still write more there.
                    Ok(false) if last => return None,
                    Ok(false) => self.current = None,
                    // A chunk being written: read it whole later.
                    Err(Tear {
                        error: ChunkError::Truncated { .. },
                        ..
                    }) if last => {
                        if let Err(source) = chunks.rewind() {
                            let path = chunks.path.clone();
                            return Some(Err(ReadError::Io { path, source }));
                        }
                        return None;
                    }
                    Err(tear) => {
                        self.tears.push(tear);
                        self.current = None;
                    }
                }
            }
            if self.next_file >= self.files.len() {
                return None;
            }
            let index = self.next_file;
            self.next_file += 1;
            match self.open_file(index) {
                // Rotated away (the program keeps its last files) since the directory was
                // listed: the next file's checkpoint says what was live.
                Err(ReadError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                    continue;
                }
                Err(e) => return Some(Err(e)),
                Ok(()) => {}
            }
            if self.current.is_none() && self.following_last_file() {
                // Its prefix is not written yet: open it again later.
                self.next_file -= 1;
                return None;
            }
        }
        Some(Ok(()))
    }

    /// The next record, borrowed, and the index of its file: [`Iterator::next`] without moving
    /// the record out (what a walk that only looks at each record uses; a record is about 64
    /// bytes, and moving it through the layers of a walk cost a tenth of `cachealloc export`).
    pub fn next_ref(&mut self) -> Option<Result<(usize, &Record), ReadError>> {
        if let Err(e) = self.advance()? {
            return Some(Err(e));
        }
        self.cursor += 1;
        Some(Ok((self.next_file - 1, &self.buffer[self.cursor - 1])))
    }
}

impl Iterator for TraceReader {
    type Item = Result<Item, ReadError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Err(e) = self.advance()? {
            return Some(Err(e));
        }
        // Taken out, a cheap placeholder left behind (the buffer is cleared before refilling).
        let placeholder = Record::CheckpointEnd(CheckpointEnd { t: 0 });
        let record = std::mem::replace(&mut self.buffer[self.cursor], placeholder);
        self.cursor += 1;
        Some(Ok(Item {
            file: self.next_file - 1,
            record,
        }))
    }
}
