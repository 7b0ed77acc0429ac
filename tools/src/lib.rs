//! `cachealloc-tools`: the `cachealloc` command, which inspects cachealloc traces offline,
//! without a GPU. The binary (`main.rs`) is only its command line; everything is here.
//!
//! ```text
//! cachealloc run -- python train.py        # run under the shim, then summarize its trace
//! cachealloc summary cachealloc-trace/host-1234
//! cachealloc snapshot TRACE --at-peak -o snap.pickle   # for PyTorch's memory viewer
//! cachealloc simulate TRACE --conf max_split_size_mb:128
//! cachealloc replay TRACE --backend raw,async,cachealloc   # on a GPU: real allocators compared
//! cachealloc fleet cachealloc-trace/                       # a job of many ranks
//! cachealloc export cachealloc-trace/ --format parquet -o dataset/   # for DuckDB, Spark, Arrow
//! ```
//!
//! # Where things are
//!
//! | module | what |
//! |---|---|
//! | [`walk`] | a trace's records in order with the live state after each: every command starts here |
//! | [`analysis`] | one pass: peaks and when, counts, OOMs, drops, annotations |
//! | [`categories`] | memory by category (PARAMETER, ACTIVATION, …) and by module, from the context records and each block's lifetime |
//! | [`replayed_stats`] | PyTorch's `memory_stats()` recomputed from a trace, in `cachealloc_core`'s `Stats` and key names |
//! | [`commands`] | one module per subcommand, each with its arguments (`cachealloc stats` is [`commands::stats`]; [`commands::replay`]: the only one that calls CUDA) |
//! | [`format`](mod@format), [`progress`] | numbers for people, spinners on long passes |
//! | [`pickle`] | Python pickles from serde values, with shared frame lists (the snapshot's writer) |
//!
//! A `TRACE` argument is a per-process trace directory (`<host>-<pid>[-rank<R>]`) or a directory
//! holding several (`cachealloc-trace/`), which stands for all of them.

pub mod analysis;
pub mod categories;
pub mod commands;
pub mod format;
pub mod pickle;
pub mod progress;
pub mod replayed_stats;
pub mod walk;

use std::path::{Path, PathBuf};

/// Why a command failed.
#[derive(Debug)]
pub enum Error {
    /// Writing the output failed.
    Io(std::io::Error),
    /// Anything else, as a message for the user.
    Message(String),
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::Io(e)
    }
}

impl From<String> for Error {
    fn from(e: String) -> Error {
        Error::Message(e)
    }
}

/// The per-process trace directories `paths` stand for, in order.
pub fn trace_dirs(paths: &[PathBuf]) -> Result<Vec<PathBuf>, Error> {
    let mut dirs = vec![];
    for path in paths {
        if !path.is_dir() {
            return Err(Error::Message(format!(
                "{}: not a directory (give a trace directory, e.g. cachealloc-trace/<host>-<pid>)",
                path.display()
            )));
        }
        if has_trace_files(path) {
            dirs.push(path.clone());
            continue;
        }
        let mut inner: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| Error::Message(format!("{}: {e}", path.display())))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir() && has_trace_files(p))
            .collect();
        if inner.is_empty() {
            return Err(Error::Message(format!(
                "{}: no trace here (no trace-NNNNNN.cat files, nor directories holding them)",
                path.display()
            )));
        }
        inner.sort();
        dirs.extend(inner);
    }
    Ok(dirs)
}

fn has_trace_files(dir: &Path) -> bool {
    cachealloc_recorder::reader::trace_files(dir).is_ok_and(|f| !f.is_empty())
}

/// The one trace directory a single-trace command works on.
pub fn one_trace(path: &Path) -> Result<PathBuf, Error> {
    let dirs = trace_dirs(&[path.to_path_buf()])?;
    match dirs.as_slice() {
        [one] => Ok(one.clone()),
        many => Err(Error::Message(format!(
            "{}: holds {} traces; name one of them: {}",
            path.display(),
            many.len(),
            many.iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}
