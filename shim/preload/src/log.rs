//! Messages on stderr, prefixed `cachealloc:`. Written with one `write(2)` each (never through
//! Rust's locked stderr), so they stay whole when threads interleave and work in a forked child or
//! at exit.

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};

use cachealloc_core::config::LogLevel;

static LEVEL: AtomicU8 = AtomicU8::new(1);

/// Set the level (from the configuration).
pub fn set_level(level: LogLevel) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

/// Whether messages of `level` are shown.
pub fn enabled(level: LogLevel) -> bool {
    level as u8 <= LEVEL.load(Ordering::Relaxed)
}

/// Write one message at `level`.
pub fn write(level: LogLevel, args: fmt::Arguments<'_>) {
    if level != LogLevel::Quiet && !enabled(level) {
        return;
    }
    let line = format!("cachealloc: {args}\n");
    // SAFETY: fd 2 and a buffer valid for its length; a short or failed write is acceptable for
    // a diagnostic.
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
}

/// An error: always shown.
macro_rules! error {
    ($($t:tt)*) => { $crate::log::write(cachealloc_core::config::LogLevel::Quiet, format_args!($($t)*)) };
}
/// Information: shown unless `log:quiet`.
macro_rules! info {
    ($($t:tt)*) => { $crate::log::write(cachealloc_core::config::LogLevel::Info, format_args!($($t)*)) };
}
/// Detail: shown with `log:debug`.
macro_rules! debug {
    ($($t:tt)*) => { $crate::log::write(cachealloc_core::config::LogLevel::Debug, format_args!($($t)*)) };
}
pub(crate) use {debug, error, info};
