//! `record_stream`: blocks that the program used on streams other than the one they were
//! allocated for, kept from reuse until that work is done.
//!
//! # Note [Recorded streams]
//!
//! `tensor.record_stream(s)` tells PyTorch's allocator that work queued on `s` uses the
//! tensor's memory, so that freeing the tensor must not let another allocation have the memory
//! before that work has run. PyTorch's native allocator keeps the streams with the block and,
//! at the free, records an event on each; the block becomes reusable once they have completed
//! (and, during a graph capture with `graph_capture_record_stream_reuse`, once the capture has
//! joined them). PyTorch's `cudaMallocAsync` backend, which the shim runs under, instead makes a
//! side stream wait for every recorded stream at the free and frees the block on it. During a
//! capture that wait is illegal (an event of a capturing stream waited on by one that is not,
//! or the reverse) and the backend's error kills the process (`std::terminate` in a deleter):
//! PyTorch's `test_graph_capture_pre_capture_stream_use` aborts that way.
//!
//! So the Python integration gives `Tensor.record_stream` to the library
//! (`cachealloc_record_stream`), and PyTorch's backend never sees the streams. Here:
//!
//! * Recording `s` for a live pooled block notes `s` with the block's address; a block that is
//!   not ours is left to PyTorch (the call answers "not ours").
//! * Freeing a block with recorded streams (other than the freeing stream, which orders the
//!   free itself) does not free it yet: a fence is recorded on each recorded stream that is not
//!   capturing, and the free waits in a list ([`DeferredFree`]). A recorded stream that is
//!   capturing — one that joined a capture — cannot be fenced (an event on it would be part of
//!   the graph, and querying it is illegal); the free then also waits for that capture to end,
//!   by which time the capture has joined the stream back (CUDA refuses to end a capture
//!   otherwise).
//! * With `graph_capture_record_stream_reuse` (PyTorch's key, off by default as in PyTorch),
//!   a capture's free need not wait for the capture's end. At the free, the shim notes where
//!   each capturing recorded stream's work stands: its dependency nodes in the capture's graph
//!   (`cuStreamGetCaptureInfo`). The block may be reused once every one of those nodes precedes
//!   the freeing stream's next work in the graph — the program has joined the recorded streams
//!   back into it (`s1.wait_stream(s2)`) — which the shim finds by walking the graph back from
//!   the freeing stream's dependencies (`cuGraphNodeGetDependencies`;
//!   [`crate::gpu::captures::Ancestry`], which keeps what it walked for the capture's rest).
//!   Every replay then orders the recorded work before the block's next use, as the stream
//!   order did outside the capture. A block whose recorded streams are in another capture than
//!   the freeing stream's, or whose graph the driver cannot describe, waits for the capture's
//!   end as without the key.
//! * The waiting frees are looked at on every allocation (one atomic load while there are
//!   none), at the end of a capture and before `empty_cache`; those whose fences have completed
//!   (a query: never a wait) and whose capture has ended, or joined their streams back, are
//!   freed then, as the program freed them, on the stream it freed them on. An allocation that
//!   runs out of memory waits for them (outside captures) and tries again.
//!
//! A block of the ordinary pools freed while its recorded work has not run is handed to its pool
//! at once as a *held* free (Note [Held frees] in the core): no longer allocated, still active,
//! not reusable until released here — as PyTorch's native allocator counts it, and the trace has
//! the free at the program's free, with its stack, and the completed free when the work is done.
//! A block of a private pool, or one shared with another process, keeps its whole free waiting
//! here (still allocated meanwhile). Not covered: `recordStream` called from PyTorch's C++
//! (its NCCL process group, for instance) still reaches PyTorch's backend, whose side-stream
//! wait is right outside captures.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use cachealloc_core::Device;

use super::Shim;
use crate::cuda::{self, CudaError};
use crate::gpu::captures::{self, Ancestry, Node};
use crate::gpu::fences::Fence;
use crate::log;
use crate::streams::Stream;

/// The streams recorded for live blocks, and the frees waiting for them.
#[derive(Debug, Default)]
pub(super) struct RecordedStreams {
    /// Whether frees are waiting (allocations look no further while none are).
    waiting: AtomicBool,
    /// `graph_capture_record_stream_reuse`: a capture's free may be reused within the capture
    /// once the graph has joined its recorded streams back.
    reuse_in_capture: AtomicBool,
    book: Mutex<Book>,
}

#[derive(Debug, Default)]
struct Book {
    /// Block address → the streams recorded for it (stream keys).
    uses: HashMap<u64, Vec<u64>>,
    waiting: Vec<DeferredFree>,
    /// Freeing stream → what precedes its next work in its capture's graph, with the stream
    /// that began that capture (forgotten when it ends).
    ancestry: HashMap<usize, (usize, Ancestry)>,
}

impl RecordedStreams {
    /// With `graph_capture_record_stream_reuse` as configured.
    pub(super) fn new(reuse_in_capture: bool) -> RecordedStreams {
        let recorded = RecordedStreams::default();
        recorded
            .reuse_in_capture
            .store(reuse_in_capture, Ordering::Relaxed);
        recorded
    }

    /// `graph_capture_record_stream_reuse` changed at run time (`_set_allocator_settings`).
    pub(super) fn set_reuse_in_capture(&self, on: bool) {
        self.reuse_in_capture.store(on, Ordering::Relaxed);
    }
}

/// A free that waits for the work queued on a block's recorded streams.
#[derive(Debug)]
struct DeferredFree {
    /// The device whose ordinary pool recorded the fences.
    device: i32,
    address: u64,
    /// The stream the program freed the block on.
    stream: u64,
    /// One fence per recorded stream that was not capturing at the free.
    fences: Vec<Fence>,
    /// The stream whose capture a recorded stream had joined, if one had: the free also waits
    /// for that capture to end, or for the graph to join the recorded streams back.
    capture: Option<usize>,
    /// For a free on a capturing stream that may be reused within the capture: that stream,
    /// and where the work of the capturing recorded streams stood at the free (their
    /// dependency nodes in the capture's graph), which must all precede the stream's work.
    /// `None` waits for the capture's end.
    joined_after: Option<(usize, Vec<Node>)>,
    /// Whether the device's ordinary pool holds the block already freed (Note [Held frees] in
    /// the core: no longer allocated, not reusable): it is released when done. Otherwise (a
    /// block of a private pool, or one shared with another process) the program's free itself
    /// waits here and is made when done.
    held: bool,
}

impl Shim {
    /// `tensor.record_stream(stream)` for the block at `address`: work queued on `stream` uses
    /// it. Returns false if `address` is not the base of a live block of ours (the caller leaves
    /// it to PyTorch).
    pub fn record_stream(&self, address: u64, stream: u64) -> bool {
        if self.live_block(address).is_none() {
            return false;
        }
        let mut book = self.recorded.book.lock().unwrap_or_else(|p| p.into_inner());
        let streams = book.uses.entry(address).or_default();
        if !streams.contains(&stream) {
            streams.push(stream);
        }
        // Whether any stream was ever recorded is the rare word's bit: the free path looks no
        // further until then (Note [Rare conditions in one word]).
        crate::rare::note(crate::rare::RECORDED);
        true
    }

    /// Forget what `record_stream` recorded for the block at `address`, which the library freed
    /// itself (a graph pool put back to a checkpoint).
    pub(super) fn forget_recorded_uses(&self, address: u64) {
        if !crate::rare::any(crate::rare::RECORDED) {
            return;
        }
        let mut book = self.recorded.book.lock().unwrap_or_else(|p| p.into_inner());
        book.uses.remove(&address);
    }

    /// The free of `address` on `stream` (a pool key; with `capturing`, the free is on that
    /// capturing stream), if streams were recorded for it: it waits for them (Note [Recorded
    /// streams]). `None`: nothing recorded, free it now.
    pub(super) fn free_after_recorded_streams(
        &self,
        address: u64,
        stream: u64,
        capturing: Option<usize>,
    ) -> Option<CudaError> {
        if !crate::rare::any(crate::rare::RECORDED) {
            return None;
        }
        let recorded = {
            let mut book = self.recorded.book.lock().unwrap_or_else(|p| p.into_inner());
            book.uses.remove(&address)?
        };
        let freeing = capturing.map_or(stream, |s| s as u64);
        let others: Vec<u64> = recorded.into_iter().filter(|&s| s != freeing).collect();
        if others.is_empty() {
            return None;
        }
        let (device, _) = self.live_block(address)?;
        let pool = self.pool(device).ok()?;
        let mut fences = Vec::with_capacity(others.len());
        let mut capture = None;
        let mut joined = Vec::new();
        for &s in &others {
            if self.is_capturing(s as usize) {
                capture = capture.or_else(|| self.capture_origin(s as usize));
                joined.push(s);
                continue;
            }
            match pool.alloc.device().record_stream_fence(s) {
                Ok(fence) => fences.push(fence),
                Err(e) => {
                    // Without the fence, wait for the stream's work here (never during a
                    // capture: a capturing stream is not fenced at all).
                    log::error!("record_stream: fencing stream {s:#x}: {e}; waiting for it");
                    if let Ok(fence) = pool.alloc.device().record_fence() {
                        let _ = pool.alloc.device().wait_fence(&fence);
                        pool.alloc.device().release_fence(fence);
                    }
                }
            }
        }
        if fences.is_empty() && capture.is_none() {
            return None;
        }
        let joined_after = capture.zip(capturing).and_then(|(origin, freeing)| {
            let nodes = self.recorded_work_in_capture(origin, freeing, &joined)?;
            Some((freeing, nodes))
        });
        // The program no longer holds the block: hand the free to its pool now, held for the
        // recorded work, so that the statistics stop counting it as allocated (as PyTorch's
        // do). Blocks of private pools (their checkpoints refuse blocks waiting for work) and
        // blocks shared with other processes (a free of theirs waits for those too) keep the
        // free waiting here.
        let held = !self.ipc_shares(address)
            && pool.may_contain(address)
            && self
                .with_free_stack(|| pool.alloc.free_held(address, stream))
                .is_ok();
        let mut book = self.recorded.book.lock().unwrap_or_else(|p| p.into_inner());
        book.waiting.push(DeferredFree {
            device,
            address,
            stream,
            fences,
            capture,
            joined_after,
            held,
        });
        self.recorded.waiting.store(true, Ordering::Release);
        Some(cuda::SUCCESS)
    }

    /// Free the waiting blocks whose recorded work is done (with `wait`, outside captures: wait
    /// for it). Returns how many were freed.
    pub(super) fn free_recorded_when_done(&self, wait: bool) -> usize {
        // Note [Rare conditions in one word]: `record_stream` was never used.
        if !crate::rare::any(crate::rare::RECORDED)
            || !self.recorded.waiting.load(Ordering::Acquire)
        {
            return 0;
        }
        let wait = wait && !self.streams.captures_active();
        let ready: Vec<DeferredFree> = {
            let mut book = self.recorded.book.lock().unwrap_or_else(|p| p.into_inner());
            let mut ancestry = std::mem::take(&mut book.ancestry);
            let (ready, still): (Vec<_>, Vec<_>) = std::mem::take(&mut book.waiting)
                .into_iter()
                .partition(|d| self.recorded_work_done(d, wait, &mut ancestry));
            book.waiting = still;
            book.ancestry = ancestry;
            self.recorded
                .waiting
                .store(!book.waiting.is_empty(), Ordering::Release);
            ready
        };
        let freed = ready.len();
        for d in ready {
            if let Ok(pool) = self.pool(d.device) {
                for fence in d.fences {
                    pool.alloc.device().release_fence(fence);
                }
                if d.held {
                    pool.alloc.release_held(d.address);
                    continue;
                }
            }
            if let Some(code) = self.free_from(d.address, d.stream, None)
                && code != cuda::SUCCESS
            {
                log::error!(
                    "freeing {:#x} after its recorded streams: error {code}",
                    d.address
                );
            }
        }
        freed
    }

    /// The capture that began on `origin` ended: frees that waited for it wait no more for it.
    pub(super) fn recorded_capture_ended(&self, origin: usize) {
        if !self.recorded.waiting.load(Ordering::Acquire) {
            return;
        }
        {
            let mut book = self.recorded.book.lock().unwrap_or_else(|p| p.into_inner());
            for d in book.waiting.iter_mut() {
                if d.capture == Some(origin) {
                    d.capture = None;
                    d.joined_after = None;
                }
            }
            book.ancestry.retain(|_, (began, _)| *began != origin);
        }
        self.free_recorded_when_done(false);
    }

    /// With `graph_capture_record_stream_reuse`, where the work of the `joined` recorded
    /// streams stands in the capture that `origin` began, for a block freed on the capturing
    /// `stream`: their dependency nodes (the block is reusable once they precede `stream`'s
    /// work). `None` (wait for the capture's end) without the key, when a stream is in another
    /// capture than the freeing stream's, or when the driver cannot say.
    fn recorded_work_in_capture(
        &self,
        origin: usize,
        stream: usize,
        joined: &[u64],
    ) -> Option<Vec<Node>> {
        if !self.recorded.reuse_in_capture.load(Ordering::Relaxed)
            || self.capture_origin(stream) != Some(origin)
        {
            return None;
        }
        let mut nodes = Vec::new();
        for &s in joined {
            if self.capture_origin(s as usize) != Some(origin) {
                return None;
            }
            nodes.extend(captures::capture_dependencies(Stream(s as usize))?);
        }
        Some(nodes)
    }

    /// Whether `d`'s recorded work is done: its fences completed, and its capture ended or
    /// joined the recorded streams back into the freeing stream's work (`ancestry`: what is
    /// known to precede each freeing stream's work).
    fn recorded_work_done(
        &self,
        d: &DeferredFree,
        wait: bool,
        ancestry: &mut HashMap<usize, (usize, Ancestry)>,
    ) -> bool {
        if let Some(origin) = d.capture {
            let Some((freed_on, nodes)) = &d.joined_after else {
                return false;
            };
            let freed_on = *freed_on;
            let (_, known) = ancestry
                .entry(freed_on)
                .or_insert_with(|| (origin, Ancestry::default()));
            if !known.all_precede(Stream(freed_on), nodes) {
                return false;
            }
        }
        let Ok(pool) = self.pool(d.device) else {
            return true; // no pool: nothing to wait with (never after a free of ours)
        };
        let device = pool.alloc.device();
        d.fences.iter().all(|fence| {
            device.fence_completed(fence) || (wait && device.wait_fence(fence).is_ok())
        })
    }
}
