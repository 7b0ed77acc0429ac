//! [`TraceReader`]: the records of a trace directory, file after file in order.
//!
//! Each file is read chunk by chunk. At the first torn or corrupt chunk the reader stops reading
//! that file, notes a [`Tear`] (file and byte offset, and why), and goes on with the next file,
//! which begins with a checkpoint of its own, so nothing before a tear is lost and nothing after
//! it is guessed. Unknown record kinds come through as [`Record::Unknown`] for callers to skip.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::chunk::{ChunkError, decode_payload, split_chunk};
use crate::schema::{FORMAT_VERSION, MAGIC, Record};

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
    files: Vec<PathBuf>,
    next_file: usize,
    buffer: Vec<Record>,
    tears: Vec<Tear>,
}

/// The trace files of a directory in order (finished and `.part` alike).
pub fn trace_files(dir: &Path) -> Result<Vec<PathBuf>, ReadError> {
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
    Ok(files.into_iter().map(|(_, p)| p).collect())
}

impl TraceReader {
    /// Open a trace directory.
    pub fn open(dir: impl AsRef<Path>) -> Result<TraceReader, ReadError> {
        let files = trace_files(dir.as_ref())?;
        Ok(TraceReader {
            files,
            next_file: 0,
            buffer: Vec::new(),
            tears: Vec::new(),
        })
    }

    /// The files, in reading order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Tears found so far.
    pub fn tears(&self) -> &[Tear] {
        &self.tears
    }

    /// Read a whole file's records into the buffer (in reverse, to pop from the end).
    fn load(&mut self, index: usize) -> Result<(), ReadError> {
        let path = &self.files[index];
        let bytes = fs::read(path).map_err(|source| ReadError::Io {
            path: path.clone(),
            source,
        })?;
        let (records, tear) = read_file(path, &bytes)?;
        self.buffer = records;
        self.buffer.reverse();
        self.tears.extend(tear);
        Ok(())
    }
}

/// Parse one file: its records up to the first tear, and the tear if any.
pub fn read_file(path: &Path, bytes: &[u8]) -> Result<(Vec<Record>, Option<Tear>), ReadError> {
    let format = |reason: String| ReadError::Format {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.len() < 12 || &bytes[..8] != MAGIC {
        if bytes.len() < 12 && MAGIC.starts_with(&bytes[..bytes.len().min(8)]) {
            // Killed before the prefix was written: an empty file.
            return Ok((Vec::new(), None));
        }
        return Err(format("not a cachealloc trace file".to_string()));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version > FORMAT_VERSION {
        return Err(format(format!(
            "format version {version} is newer than this reader's {FORMAT_VERSION}"
        )));
    }
    let mut records = Vec::new();
    let mut at = 12;
    while at < bytes.len() {
        let result = split_chunk(&bytes[at..])
            .and_then(|(payload, flags, used)| Ok((decode_payload(payload, flags)?, used)));
        match result {
            Ok((chunk_records, used)) => {
                records.extend(chunk_records);
                at += used;
            }
            Err(error) => {
                let tear = Tear {
                    path: path.to_path_buf(),
                    offset: at as u64,
                    error,
                };
                return Ok((records, Some(tear)));
            }
        }
    }
    Ok((records, None))
}

impl Iterator for TraceReader {
    type Item = Result<Item, ReadError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(record) = self.buffer.pop() {
                return Some(Ok(Item {
                    file: self.next_file - 1,
                    record,
                }));
            }
            if self.next_file >= self.files.len() {
                return None;
            }
            let index = self.next_file;
            self.next_file += 1;
            if let Err(e) = self.load(index) {
                return Some(Err(e));
            }
        }
    }
}
