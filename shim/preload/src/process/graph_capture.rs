//! CUDA graph captures: a barrier fence and a private pool when one begins (see
//! Note [Capture pools] in `private_pools::captures`), deferred segment releases when the last one ends
//! (see [`crate::streams`] for how fences avoid capturing streams).

use super::Shim;
use crate::log;
use crate::streams::Stream;

impl Shim {
    /// `stream` is about to begin capturing a graph: every block freed from now on waits for a
    /// fence recorded now, which covers the work enqueued on the stream before its capture
    /// (later fences leave the capturing stream out).
    pub fn capture_beginning(&self, stream: usize) {
        for pool in self.pools() {
            if let Err(e) = pool.alloc.fence_barrier() {
                log::error!("could not fence before a graph capture: {e}");
            }
        }
        let device = self.current_device().unwrap_or(0);
        self.streams.capture_began(Stream(stream), device);
        self.capture_pool_begin(stream, device);
    }

    /// The capture on `stream` has begun (the driver took it).
    pub fn capture_started(&self, stream: usize) {
        self.capture_pool_started(stream);
    }

    /// `stream`'s capture ended, making `graph` (`None` if it failed); after the last one,
    /// release the segments whose release it deferred.
    pub fn capture_ended(&self, stream: usize, graph: Option<usize>) {
        let last = self.streams.capture_ended(Stream(stream));
        self.capture_pool_end(stream, graph);
        self.recorded_capture_ended(stream);
        if last {
            self.release_unused_private_pools(false, None);
            for pool in self.pools() {
                let failed = pool.alloc.device().release_deferred();
                if failed > 0 {
                    log::error!(
                        "{failed} segments released during a graph capture could not be freed"
                    );
                }
            }
        }
    }
}
