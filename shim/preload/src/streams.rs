//! The application's streams as seen through our `cudaStreamCreate*` and
//! `cudaStreamBeginCapture`/`cudaStreamEndCapture` hooks: which exist, which are non-blocking,
//! which are capturing a CUDA graph.
//!
//! Fences need the streams to record on ([`StreamRegistry::with_fence_targets`]): normally the
//! legacy default stream (which orders after every blocking stream) plus each live non-blocking
//! stream. While a stream captures a graph, work enqueued on it is recorded, not run, and an
//! event recorded on it would become part of the graph; and while a *blocking* stream captures,
//! any work on the legacy stream (our event too) would join the capture implicitly and break
//! it. So during captures a fence skips capturing streams, and replaces the legacy stream by
//! each non-capturing blocking stream when a blocking one captures. Work enqueued on a stream
//! before its capture began is covered by a barrier fence recorded at the capture's start (see
//! `Allocator::fence_barrier`), which every later fence completes after.
//!
//! A stream may also join a capture without a call we see, by waiting on an event recorded in
//! it: the shim registers such a stream when it finds it ([`StreamRegistry::joined`], Note
//! [Capture pools]), and a fence asks the driver of every other stream while a capture is
//! under way (the `probe` of [`StreamRegistry::with_fence_targets`]).
//!
//! Whether any stream was ever created decides `reuse:auto`: until the first one, all work is
//! ordered on the legacy stream and freed blocks may be reused at once.
//!
//! **Destroyed streams.** A fence records events on other threads' streams, and a thread may
//! destroy its stream meanwhile; an event recorded on a destroyed stream is undefined behaviour
//! in the driver (on an H100: a segmentation fault, or `CUDA_ERROR_CONTEXT_IS_DESTROYED` on a
//! later call). So the registry is a read-write lock: a fence records while holding a read
//! guard on the streams it chose ([`StreamRegistry::with_fence_targets`]), and
//! [`StreamRegistry::destroyed`], called before the real destroy, takes the write lock, so it
//! waits for every fence that may be using the stream, and no later fence chooses it. Blocks
//! freed on a stream for another stream's reuse wait in an open batch that a later allocation,
//! on any thread, closes with a fence on the freeing stream: before the destroy, the shim closes
//! that batch while the stream exists (`Allocator::stream_destroying`), so no fence is recorded
//! later on its dangling handle.
//!
//! Streams created and captures begun through the driver API (`cuStreamCreate*`,
//! `cuStreamBeginCapture_v2*`, through any door) are seen as the runtime's are; not seen: CUDA
//! 10.0's `cuStreamBeginCapture` and captures into an existing graph (the README's limitations).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::cuda;

/// A stream handle (runtime `cudaStream_t` and driver `CUstream` are the same handle).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Stream(pub usize);

#[derive(Debug)]
struct Entry {
    stream: Stream,
    device: i32,
    non_blocking: bool,
    capturing: bool,
    /// The stream whose capture this one joined through an event (not counted in
    /// [`StreamRegistry::captures`]: its capture ends with the one it joined).
    joined: Option<Stream>,
}

/// Live streams, per device, and the captures under way.
#[derive(Debug, Default)]
pub struct StreamRegistry {
    live: RwLock<Vec<Entry>>,
    any_created: AtomicBool,
    /// Captures under way (the fast path of [`StreamRegistry::is_capturing`]).
    captures: AtomicUsize,
}

impl StreamRegistry {
    fn live(&self) -> RwLockReadGuard<'_, Vec<Entry>> {
        self.live.read().unwrap_or_else(|p| p.into_inner())
    }

    fn live_mut(&self) -> RwLockWriteGuard<'_, Vec<Entry>> {
        self.live.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The application created `stream` on `device`. Returns whether it is the first stream of
    /// the process.
    pub fn created(&self, stream: Stream, device: i32, non_blocking: bool) -> bool {
        let mut live = self.live_mut();
        live.retain(|e| e.stream != stream); // a handle value reused after a destroy we missed
        live.push(Entry {
            stream,
            device,
            non_blocking,
            capturing: false,
            joined: None,
        });
        !self.any_created.swap(true, Ordering::AcqRel)
    }

    /// The application is destroying `stream` (called before the real destroy): waits for any
    /// fence recording on it, and no later fence chooses it.
    pub fn destroyed(&self, stream: Stream) {
        let mut live = self.live_mut();
        if live
            .iter()
            .any(|e| e.stream == stream && e.capturing && e.joined.is_none())
        {
            self.captures.fetch_sub(1, Ordering::AcqRel);
            Self::unjoin(&mut live, stream);
        }
        live.retain(|e| e.stream != stream);
    }

    /// Whether the process ever created a stream.
    pub fn any_created(&self) -> bool {
        self.any_created.load(Ordering::Acquire)
    }

    /// `stream` of `device` began capturing a graph. A stream we did not see created (made
    /// through the driver, say) is taken to be blocking, the cautious guess for fences.
    pub fn capture_began(&self, stream: Stream, device: i32) {
        let mut live = self.live_mut();
        match live.iter_mut().find(|e| e.stream == stream) {
            Some(e) if e.capturing => return,
            Some(e) => {
                e.capturing = true;
                e.joined = None;
            }
            None => live.push(Entry {
                stream,
                device,
                non_blocking: false,
                capturing: true,
                joined: None,
            }),
        }
        crate::rare::note(crate::rare::CAPTURE);
        self.captures.fetch_add(1, Ordering::AcqRel);
    }

    /// `stream` of `device` joined the capture begun on `origin` (found by asking the driver:
    /// it waited on an event recorded in the capture). It is capturing until that capture ends.
    pub fn joined(&self, stream: Stream, device: i32, origin: Stream) {
        let mut live = self.live_mut();
        match live.iter_mut().find(|e| e.stream == stream) {
            Some(e) if e.capturing => {}
            Some(e) => {
                e.capturing = true;
                e.joined = Some(origin);
            }
            None => live.push(Entry {
                stream,
                device,
                non_blocking: false,
                capturing: true,
                joined: Some(origin),
            }),
        }
    }

    /// The streams that joined `origin`'s capture capture no more.
    fn unjoin(live: &mut [Entry], origin: Stream) {
        for e in live.iter_mut().filter(|e| e.joined == Some(origin)) {
            e.capturing = false;
            e.joined = None;
        }
    }

    /// `stream`'s capture ended (successfully or not). Returns whether no capture is under way
    /// any more.
    pub fn capture_ended(&self, stream: Stream) -> bool {
        let mut live = self.live_mut();
        if let Some(e) = live
            .iter_mut()
            .find(|e| e.stream == stream && e.capturing && e.joined.is_none())
        {
            e.capturing = false;
            self.captures.fetch_sub(1, Ordering::AcqRel);
            Self::unjoin(&mut live, stream);
        }
        self.captures.load(Ordering::Acquire) == 0
    }

    /// Whether any stream is capturing a graph (one load of the rare word until a capture
    /// first began, then also the count).
    #[inline]
    pub fn captures_active(&self) -> bool {
        // No capture ever began: one line for the answer (Note [Rare conditions in one word]).
        crate::rare::any(crate::rare::CAPTURE) && self.captures.load(Ordering::Acquire) > 0
    }

    /// Whether `stream` is capturing a graph.
    #[inline]
    pub fn is_capturing(&self, stream: Stream) -> bool {
        self.captures_active()
            && self
                .live()
                .iter()
                .any(|e| e.stream == stream && e.capturing)
    }

    /// Run `record` on the streams a fence for `device` records on, none of which can be
    /// destroyed before it returns; see the module docs. While a capture is under way, `probe`
    /// says whether a stream not known to capture does (it joined a capture through an event).
    pub fn with_fence_targets<T>(
        &self,
        device: i32,
        probe: impl Fn(Stream) -> bool,
        record: impl FnOnce(&[Stream]) -> T,
    ) -> T {
        let live = self.live();
        record(&Self::targets(&live, device, self.captures_active(), probe))
    }

    /// The streams a fence for `device` records on; see the module docs.
    #[cfg(test)]
    fn fence_targets(&self, device: i32) -> Vec<Stream> {
        Self::targets(&self.live(), device, self.captures_active(), |_| false)
    }

    fn targets(
        live: &[Entry],
        device: i32,
        captures_active: bool,
        probe: impl Fn(Stream) -> bool,
    ) -> Vec<Stream> {
        let legacy = Stream(cuda::STREAM_LEGACY);
        let on_device = live.iter().filter(|e| e.device == device);
        if !captures_active {
            return std::iter::once(legacy)
                .chain(on_device.filter(|e| e.non_blocking).map(|e| e.stream))
                .collect();
        }
        // (stream, non-blocking, capturing), each stream probed once.
        let streams: Vec<(Stream, bool, bool)> = on_device
            .map(|e| (e.stream, e.non_blocking, e.capturing || probe(e.stream)))
            .collect();
        let blocking_captures = streams.iter().any(|&(_, nb, capturing)| capturing && !nb);
        let mut targets: Vec<Stream> = streams
            .iter()
            .filter(|&&(_, nb, capturing)| !capturing && (nb || blocking_captures))
            .map(|&(stream, _, _)| stream)
            .collect();
        if !blocking_captures {
            targets.insert(0, legacy);
        }
        targets
    }

    /// Number of live streams (for the exit summary).
    pub fn live_count(&self) -> usize {
        self.live().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEGACY: Stream = Stream(cuda::STREAM_LEGACY);

    /// Regression (found by `load` on an H100, where a thread's fence recorded an event on a
    /// stream another thread had just destroyed: a segmentation fault): destroying a stream
    /// waits for a fence that chose it to finish recording, and later fences do not choose it.
    #[test]
    fn destroying_a_stream_waits_for_fences_recording_on_it() {
        use std::sync::atomic::AtomicBool;
        use std::sync::{Arc, mpsc};
        use std::time::Duration;

        let r = Arc::new(StreamRegistry::default());
        r.created(Stream(0x10), 0, true);
        let recording = Arc::new(AtomicBool::new(false));
        let (started, wait_started) = mpsc::channel();
        let fence = {
            let (r, recording) = (r.clone(), recording.clone());
            std::thread::spawn(move || {
                r.with_fence_targets(
                    0,
                    |_| false,
                    |targets| {
                        recording.store(true, Ordering::SeqCst);
                        started.send(()).unwrap();
                        std::thread::sleep(Duration::from_millis(200));
                        recording.store(false, Ordering::SeqCst);
                        targets.to_vec()
                    },
                )
            })
        };
        wait_started.recv().unwrap();
        r.destroyed(Stream(0x10));
        assert!(
            !recording.load(Ordering::SeqCst),
            "the stream was destroyed while a fence recorded on it"
        );
        assert_eq!(fence.join().unwrap(), vec![LEGACY, Stream(0x10)]);
        assert_eq!(r.fence_targets(0), vec![LEGACY]);
    }

    #[test]
    fn fences_cover_the_legacy_stream_and_non_blocking_streams_per_device() {
        let r = StreamRegistry::default();
        assert!(!r.any_created());
        assert!(r.created(Stream(0x10), 0, true));
        assert!(!r.created(Stream(0x20), 0, false));
        assert!(!r.created(Stream(0x30), 1, true));
        assert_eq!(r.fence_targets(0), vec![LEGACY, Stream(0x10)]);
        assert_eq!(r.fence_targets(1), vec![LEGACY, Stream(0x30)]);
        r.destroyed(Stream(0x10));
        assert_eq!(r.fence_targets(0), vec![LEGACY]);
        assert!(r.any_created(), "stays true after the streams are gone");
        assert_eq!(r.live_count(), 2);
    }

    #[test]
    fn a_capturing_non_blocking_stream_is_left_out_of_fences() {
        let r = StreamRegistry::default();
        r.created(Stream(0x10), 0, true);
        r.created(Stream(0x20), 0, true);
        r.capture_began(Stream(0x10), 0);
        assert!(r.captures_active() && r.is_capturing(Stream(0x10)));
        assert!(!r.is_capturing(Stream(0x20)));
        assert_eq!(r.fence_targets(0), vec![LEGACY, Stream(0x20)]);
        assert!(r.capture_ended(Stream(0x10)), "no capture left");
        assert_eq!(r.fence_targets(0), vec![LEGACY, Stream(0x10), Stream(0x20)]);
    }

    #[test]
    fn a_capturing_blocking_stream_replaces_the_legacy_stream_by_each_other_stream() {
        let r = StreamRegistry::default();
        r.created(Stream(0x10), 0, false);
        r.created(Stream(0x20), 0, false);
        r.created(Stream(0x30), 0, true);
        r.capture_began(Stream(0x10), 0);
        assert_eq!(
            r.fence_targets(0),
            vec![Stream(0x20), Stream(0x30)],
            "an event on the legacy stream would join the blocking stream's capture"
        );
        r.capture_began(Stream(0x10), 0); // counted once
        assert!(r.capture_ended(Stream(0x10)));
        assert!(!r.captures_active());
    }

    #[test]
    fn a_joined_stream_captures_until_the_capture_it_joined_ends() {
        let r = StreamRegistry::default();
        r.created(Stream(0x10), 0, true);
        r.created(Stream(0x20), 0, true);
        r.capture_began(Stream(0x10), 0);
        r.joined(Stream(0x20), 0, Stream(0x10));
        assert!(r.is_capturing(Stream(0x20)));
        assert_eq!(r.fence_targets(0), vec![LEGACY]);
        assert!(
            !r.capture_ended(Stream(0x20)),
            "a joined stream ends no capture"
        );
        assert!(r.is_capturing(Stream(0x20)));
        assert!(r.capture_ended(Stream(0x10)));
        assert!(
            !r.is_capturing(Stream(0x20)),
            "the joined stream's capture ended with it"
        );
        assert_eq!(r.fence_targets(0), vec![LEGACY, Stream(0x10), Stream(0x20)]);
    }

    #[test]
    fn two_captures_keep_their_own_joined_streams() {
        let r = StreamRegistry::default();
        for s in [0x10, 0x20, 0x30, 0x40] {
            r.created(Stream(s), 0, true);
        }
        r.capture_began(Stream(0x10), 0);
        r.capture_began(Stream(0x30), 0);
        r.joined(Stream(0x20), 0, Stream(0x10));
        r.joined(Stream(0x40), 0, Stream(0x30));
        assert!(
            !r.capture_ended(Stream(0x10)),
            "the other capture is under way"
        );
        assert!(!r.is_capturing(Stream(0x20)));
        assert!(
            r.is_capturing(Stream(0x40)),
            "joined to the capture still under way"
        );
        r.destroyed(Stream(0x40)); // a joined stream's destruction ends no capture
        assert!(r.captures_active());
        assert!(r.capture_ended(Stream(0x30)));
    }

    #[test]
    fn fences_leave_out_streams_the_probe_finds_capturing() {
        let r = StreamRegistry::default();
        r.created(Stream(0x10), 0, true);
        r.created(Stream(0x20), 0, false); // blocking: joined unseen, it replaces the legacy stream
        r.created(Stream(0x30), 0, true);
        r.capture_began(Stream(0x10), 0);
        let targets = r.with_fence_targets(0, |s| s == Stream(0x20), |t| t.to_vec());
        assert_eq!(targets, vec![Stream(0x30)]);
        assert!(r.capture_ended(Stream(0x10)));
        let targets = r.with_fence_targets(0, |_| panic!("no capture: no probe"), |t| t.to_vec());
        assert_eq!(targets, vec![LEGACY, Stream(0x10), Stream(0x30)]);
    }

    #[test]
    fn destroying_a_capturing_stream_ends_its_capture() {
        let r = StreamRegistry::default();
        r.capture_began(Stream(0x40), 0); // not seen created: taken as blocking
        assert_eq!(r.fence_targets(0), Vec::<Stream>::new());
        r.destroyed(Stream(0x40));
        assert!(!r.captures_active());
    }
}
