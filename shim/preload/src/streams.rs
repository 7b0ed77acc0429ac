//! The streams the application created, as seen through our `cudaStreamCreate*` hooks.
//!
//! Fences need the live non-blocking streams of each device (blocking ones are covered by the
//! legacy stream's event). Whether any stream was ever created decides `reuse:auto`: until the
//! first one, all work is ordered on the legacy stream and freed blocks may be reused at once.
//!
//! Not seen: streams created through the driver API (`cuStreamCreate`) by libraries that bypass
//! the runtime. Their work is not covered by fences; see the README's limitations.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::driver::Stream;

#[derive(Debug)]
struct Entry {
    stream: Stream,
    device: i32,
    non_blocking: bool,
}

/// Live streams, per device.
#[derive(Debug, Default)]
pub struct StreamRegistry {
    live: Mutex<Vec<Entry>>,
    any_created: AtomicBool,
}

impl StreamRegistry {
    /// The application created `stream` on `device`. Returns whether it is the first stream of
    /// the process.
    pub fn created(&self, stream: Stream, device: i32, non_blocking: bool) -> bool {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        live.retain(|e| e.stream != stream); // a handle value reused after a destroy we missed
        live.push(Entry {
            stream,
            device,
            non_blocking,
        });
        !self.any_created.swap(true, Ordering::AcqRel)
    }

    /// The application destroyed `stream`.
    pub fn destroyed(&self, stream: Stream) {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|e| e.stream != stream);
    }

    /// Whether the process ever created a stream.
    pub fn any_created(&self) -> bool {
        self.any_created.load(Ordering::Acquire)
    }

    /// The live non-blocking streams of `device`.
    pub fn non_blocking(&self, device: i32) -> Vec<Stream> {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        live.iter()
            .filter(|e| e.device == device && e.non_blocking)
            .map(|e| e.stream)
            .collect()
    }

    /// Number of live streams (for the exit summary).
    pub fn live_count(&self) -> usize {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracks_non_blocking_streams_per_device() {
        let r = StreamRegistry::default();
        assert!(!r.any_created());
        assert!(r.created(Stream(0x10), 0, true));
        assert!(!r.created(Stream(0x20), 0, false));
        assert!(!r.created(Stream(0x30), 1, true));
        assert_eq!(r.non_blocking(0), vec![Stream(0x10)]);
        assert_eq!(r.non_blocking(1), vec![Stream(0x30)]);
        r.destroyed(Stream(0x10));
        assert!(r.non_blocking(0).is_empty());
        assert!(r.any_created(), "stays true after the streams are gone");
        assert_eq!(r.live_count(), 2);
    }
}
