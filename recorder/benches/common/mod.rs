//! What the recorder's benches share.

use cachealloc_recorder::schema::Header;

/// A trace header for a benchmark's process.
pub fn header() -> Header {
    Header::new(std::process::id(), "bench")
}
