//! [`TraceWriter`]: records into rotating, self-contained trace files.
//!
//! A trace is a directory of files `trace-NNNNNN.cat`. The file being written is
//! `trace-NNNNNN.cat.part` and is renamed when complete. Every file starts with the magic, the
//! format version, a chunk holding the [`Header`] and a checkpoint of the live state, so each can
//! be read alone. Records are gathered and written as one chunk when 64 KiB have accumulated or
//! 100 ms have passed (by the injected [`Clock`]); a file past `file_bytes` is finished and a new
//! one begun; files beyond `max_files` are deleted oldest first, which bounds disk use to about
//! `file_bytes × max_files`. Directories and files are private unless the configuration widens
//! them ([`private`]): created `0700` and `0600`, files opened without following a symbolic
//! link.

use std::collections::VecDeque;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::chunk::ChunkEncoder;
use crate::encode::encode;
use crate::private::{self, DEFAULT_FILE_MODE};
use crate::schema::{FORMAT_VERSION, Header, MAGIC, Record};
use crate::state::LiveState;

/// A source of time in nanoseconds (monotonic). Injected so tests control flushing.
pub trait Clock: Send {
    /// Now, in nanoseconds.
    fn now_ns(&self) -> u64;
}

/// The process's monotonic clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct MonotonicClock;

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        crate::monotonic_ns()
    }
}

/// How the writer lays out files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriterConfig {
    /// The trace directory (created if missing).
    pub dir: PathBuf,
    /// A file is rotated once it reaches this many bytes.
    pub file_bytes: u64,
    /// Files kept; older ones are deleted.
    pub max_files: u32,
    /// zstd-compress chunks.
    pub compress: bool,
    /// Write a chunk once this many bytes of records are pending.
    pub flush_bytes: usize,
    /// … or once this much time has passed since the last chunk.
    pub flush_interval_ns: u64,
    /// The files' mode ([`DEFAULT_FILE_MODE`], `0600`, unless widened); directories get
    /// [`private::dir_mode`] of it.
    pub file_mode: u32,
    /// The effective user id an existing trace directory must belong to (`None`: not checked).
    pub owner: Option<u32>,
}

impl WriterConfig {
    /// A configuration with the default flush policy (64 KiB or 100 ms).
    pub fn new(dir: impl Into<PathBuf>, file_bytes: u64, max_files: u32, compress: bool) -> Self {
        WriterConfig {
            dir: dir.into(),
            file_bytes,
            max_files: max_files.max(1),
            compress,
            flush_bytes: 64 << 10,
            flush_interval_ns: 100_000_000,
            file_mode: DEFAULT_FILE_MODE,
            owner: None,
        }
    }
}

/// Name of the `index`-th file of a trace.
pub fn file_name(index: u32) -> String {
    format!("trace-{index:06}.cat")
}

/// Writes records into rotating trace files. See the module docs.
pub struct TraceWriter<C: Clock = MonotonicClock> {
    config: WriterConfig,
    clock: C,
    header: Header,
    state: LiveState,
    file: File,
    file_path: PathBuf,
    file_len: u64,
    file_index: u32,
    finished: VecDeque<PathBuf>,
    pending: Vec<u8>,
    last_flush_ns: u64,
    chunk: Vec<u8>,
    encoder: ChunkEncoder,
}

impl<C: Clock> TraceWriter<C> {
    /// Now, by the writer's clock (the one its flushes, rotations and checkpoints use).
    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// Create the directory and the first file. `header.file_index` is set per file.
    pub fn create(config: WriterConfig, header: Header, clock: C) -> io::Result<Self> {
        private::prepare_dir(&config.dir, config.file_mode, config.owner)?;
        let (file, file_path) = open_file(&config.dir, 0, config.file_mode)?;
        let now = clock.now_ns();
        let mut writer = TraceWriter {
            config,
            clock,
            header,
            state: LiveState::default(),
            file,
            file_path,
            file_len: 0,
            file_index: 0,
            finished: VecDeque::new(),
            pending: Vec::with_capacity(80 << 10),
            last_flush_ns: now,
            chunk: Vec::with_capacity(80 << 10),
            encoder: ChunkEncoder::default(),
        };
        writer.begin_file()?;
        Ok(writer)
    }

    /// The live state as of the records written so far.
    pub fn state(&self) -> &LiveState {
        &self.state
    }

    /// Index of the file being written.
    pub fn file_index(&self) -> u32 {
        self.file_index
    }

    /// Add a record; writes a chunk if enough has accumulated.
    pub fn write(&mut self, record: &Record) -> io::Result<()> {
        self.state.apply(record);
        encode(record, &mut self.pending);
        if self.pending.len() >= self.config.flush_bytes {
            self.flush()?;
        }
        Ok(())
    }

    /// Write a chunk if the flush interval has passed since the last one.
    pub fn tick(&mut self) -> io::Result<()> {
        if !self.pending.is_empty()
            && self.clock.now_ns().saturating_sub(self.last_flush_ns)
                >= self.config.flush_interval_ns
        {
            self.flush()?;
        }
        Ok(())
    }

    /// Write pending records as one chunk now; rotate if the file is full.
    pub fn flush(&mut self) -> io::Result<()> {
        self.last_flush_ns = self.clock.now_ns();
        if self.pending.is_empty() {
            return Ok(());
        }
        self.chunk.clear();
        self.encoder
            .encode(&self.pending, self.config.compress, &mut self.chunk);
        self.pending.clear();
        self.file.write_all(&self.chunk)?;
        self.file_len += self.chunk.len() as u64;
        if self.file_len >= self.config.file_bytes {
            self.rotate()?;
        }
        Ok(())
    }

    /// Write a checkpoint of the live state into the stream now, and flush it: the forensic
    /// record of an out-of-memory failure (`oom_checkpoint`).
    pub fn checkpoint(&mut self) -> io::Result<()> {
        let t = self
            .clock
            .now_ns()
            .saturating_sub(self.header.monotonic_base_ns);
        for r in self.state.checkpoint(t) {
            encode(&r, &mut self.pending);
        }
        self.flush()
    }

    /// Flush and finish the current file (rename it from `.part`).
    pub fn finish(mut self) -> io::Result<PathBuf> {
        self.flush()?;
        self.file.flush()?;
        let done = finished_path(&self.file_path);
        fs::rename(&self.file_path, &done)?;
        Ok(done)
    }

    fn rotate(&mut self) -> io::Result<()> {
        let done = finished_path(&self.file_path);
        fs::rename(&self.file_path, &done)?;
        self.finished.push_back(done);
        self.file_index += 1;
        let (file, path) = open_file(&self.config.dir, self.file_index, self.config.file_mode)?;
        self.file = file;
        self.file_path = path;
        self.file_len = 0;
        // Keep max_files in all, the new one included.
        while self.finished.len() + 1 > self.config.max_files as usize {
            if let Some(old) = self.finished.pop_front() {
                let _ = fs::remove_file(old);
            }
        }
        self.begin_file()
    }

    /// Magic, version, then a chunk with the header and a checkpoint of the live state.
    fn begin_file(&mut self) -> io::Result<()> {
        let mut prefix = Vec::with_capacity(12);
        prefix.extend_from_slice(MAGIC);
        prefix.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        self.file.write_all(&prefix)?;
        self.file_len = prefix.len() as u64;
        let mut header = self.header.clone();
        header.file_index = self.file_index;
        let mut records = Vec::new();
        encode(&Record::Header(Box::new(header)), &mut records);
        let t = self
            .clock
            .now_ns()
            .saturating_sub(self.header.monotonic_base_ns);
        for r in self.state.checkpoint(t) {
            encode(&r, &mut records);
        }
        self.chunk.clear();
        self.encoder
            .encode(&records, self.config.compress, &mut self.chunk);
        self.file.write_all(&self.chunk)?;
        self.file_len += self.chunk.len() as u64;
        Ok(())
    }
}

fn open_file(dir: &Path, index: u32, mode: u32) -> io::Result<(File, PathBuf)> {
    let path = dir.join(format!("{}.part", file_name(index)));
    let file = private::create_file(&path, mode)?;
    Ok((file, path))
}

fn finished_path(part: &Path) -> PathBuf {
    part.with_extension("")
}
