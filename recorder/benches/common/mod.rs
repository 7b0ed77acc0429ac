//! What the recorder's benches share.

use cachealloc_recorder::schema::{FORMAT_VERSION, Header};

/// A trace header for a benchmark's process.
pub fn header() -> Header {
    Header {
        version: FORMAT_VERSION,
        file_index: 0,
        pid: std::process::id(),
        host: "bench".into(),
        rank: -1,
        local_rank: -1,
        world_size: -1,
        cmdline: vec![],
        wall_clock_base_ns: 0,
        monotonic_base_ns: 0,
        config: String::new(),
        devices: vec![],
        modules: vec![],
    }
}
