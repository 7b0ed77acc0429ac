//! The application's streams as the pools see them: a stream's pool key, whether it captures a
//! graph, its creation (which switches `reuse:auto` to fenced reuse) and its destruction.

use cachealloc_core::NO_STREAM;

use super::Shim;
use crate::cuda;
use crate::log;
use crate::streams::Stream;

impl Shim {
    /// The pool key of a stream handle given to `cudaMallocAsync`/`cudaFreeAsync`: the legacy
    /// default stream's two names (0 and `cudaStreamLegacy`) are one stream; the per-thread
    /// default stream's handle names a different stream on each thread, so its blocks are
    /// treated as the synchronous API's ([`NO_STREAM`]: fenced).
    pub fn stream_key(&self, stream: usize) -> u64 {
        match stream {
            0 | cuda::STREAM_LEGACY => cuda::STREAM_LEGACY as u64,
            cuda::STREAM_PER_THREAD => NO_STREAM,
            other => other as u64,
        }
    }

    /// Whether `stream` is capturing a CUDA graph (one load of the rare word until a capture
    /// first began): it began a capture, or joined one (Note [Capture pools]).
    #[inline]
    pub fn is_capturing(&self, stream: usize) -> bool {
        // Ask the word before the registry's line (Note [Rare conditions in one word]).
        crate::rare::any(crate::rare::CAPTURE)
            && self.streams.captures_active()
            && (self.streams.is_capturing(Stream(stream)) || self.capture_joined(stream))
    }

    /// The application created a stream on the current device.
    pub fn stream_created(&self, stream: usize, flags: u32) {
        self.stream_created_on(self.current_device().unwrap_or(0), stream, flags);
    }

    /// The application created a stream on `device`.
    pub fn stream_created_on(&self, device: i32, stream: usize, flags: u32) {
        let non_blocking = flags & cuda::STREAM_NON_BLOCKING != 0;
        if let Ok(trace) = &self.trace {
            trace.stream_created(device as u32, stream as u64, flags);
        }
        if self.streams.created(Stream(stream), device, non_blocking) {
            log::debug!("first stream created: freed blocks now wait for reuse fences");
            for pool in self.pools() {
                self.start_fencing_on(pool);
            }
        }
    }

    /// The application is destroying a stream (called before the real destroy): fences that
    /// would name it later are recorded now, and no later fence chooses it (see the streams
    /// module's docs).
    pub fn stream_destroyed(&self, stream: usize) {
        for alloc in self.allocators() {
            if let Err(e) = alloc.stream_destroying(stream as u64) {
                log::error!("before destroying stream {stream:#x}: {e}");
            }
        }
        self.streams.destroyed(Stream(stream));
        if let Ok(trace) = &self.trace {
            trace.stream_destroyed(stream as u64);
        }
    }
}
