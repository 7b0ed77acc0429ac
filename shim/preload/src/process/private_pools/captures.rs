//! The private pools of CUDA graph captures: where allocations made on a capturing stream come
//! from.
//!
//! # Note [Capture pools]
//!
//! A graph captured on a stream replays, later and as often as the program likes, every kernel
//! that the capture recorded, with the addresses they had at capture time. So memory handed out
//! during a capture belongs to the graph: nothing else may be given it while the graph can
//! replay, even after the program has freed it (a temporary freed inside the capture is still
//! written by every replay). PyTorch's native allocator keeps such memory in a private pool per
//! capture (or one shared by the graphs captured with the same `pool=`), and so do we (Note
//! [Private pools]):
//!
//! * A capture that begins on a stream gets a private pool. Every allocation on that stream
//!   until the capture ends comes from it (never from the driver's graph memory, which
//!   PyTorch's `cudaMallocAsync` backend cannot free outside the graph: the cause of the aborts
//!   under `torch.compile(mode="reduce-overhead")`).
//! * A free of a block of a capture's pool, during the capture or after it, returns the block to
//!   that pool, where only allocations of later captures into the same pool (or of the
//!   `MemPool` of that id) can get it: a shared pool's graphs replay in their capture order,
//!   which the program guarantees, as with PyTorch. Within a capture, a block freed on the
//!   capturing stream is reused at once on that stream: the graph orders the two uses as the
//!   stream did.
//! * The capture, then the graph and every executable graph instantiated from it
//!   (`cudaGraphInstantiate*`, `cudaGraphDestroy`, `cudaGraphExecDestroy`), are the pool's
//!   users; once the last has gone, `empty_cache` or an allocation out of memory gives the
//!   pool's free memory back, as Note [Private pools] says (not at once: the program may still
//!   hold blocks of the pool that a later capture uses).
//! * Which pool a capture uses: a new one, unless the Python integration named the pool of the
//!   thread's next capture ([`Shim::use_capture_pool`]: PyTorch's `torch.cuda.graph(pool=…)`,
//!   `graph_pool_handle()`, a `MemPool`'s id), in which case captures with the same id share it.
//!
//! * Streams that join a capture: a capture begins on one stream, and other streams join it by
//!   waiting on an event recorded in it (`s2.wait_stream(s1)`), which the shim does not see.
//!   Whenever a stream it does not know as capturing allocates or frees while a capture is under
//!   way, the shim asks the driver which capture the stream is in (`cuStreamGetCaptureInfo`,
//!   [`crate::gpu::captures`]); a stream in one of ours is known from then on as capturing into
//!   that capture's pool, until the capture ends. Its blocks are its own, as every stream's:
//!   one freed on it is reused by its later allocations in the capture, never by another
//!   stream's (the two are concurrent branches of the graph unless the program joined them).
//!   Fences, too, ask before they record an event on a stream while a capture is under way: an
//!   event recorded on a joined stream, or a query of it, would break the capture.
//!
//! # Note [The program's graph references]
//!
//! Graph objects are not always the program's word on when its graphs let go of a pool.
//! PyTorch's `CUDAGraph` holds its pool by a reference of its own, taken at `capture_begin`
//! and given back at `reset` (or its destructor), and under `enable_debug_mode()` — a switch
//! of the whole process, which PyTorch never turns off — it keeps every later capture's
//! `cudaGraph_t` and never destroys it, after instantiating it. Counted as a user, such a
//! graph would hold its pool forever, where PyTorch's reference lets it go at `reset`
//! (PyTorch's `test_allocate_in_thread_to_pool`, run after `test_graph_debugdump` in one
//! process, saw its pool keep its segments: docs/pytorch-tests.md). So where the program keeps such references —
//! the C++ allocator for PyTorch passes `beginAllocateToPool` and `releasePool` on
//! ([`Shim::graph_pool_retain`], [`Shim::graph_pool_release`]) — a pool's graphs are its
//! references, and the graph objects no longer count; executable graphs still do (a graph
//! that can run keeps its memory, whatever the program's count says). Programs that keep no
//! references (C and CUDA programs, PyTorch without the C++ allocator) keep the graph
//! objects' count.
//!
//! Not covered: graphs made and destroyed only through the driver API. A block freed in a
//! capture after `record_stream` on a joined stream waits for the capture's end, or, with
//! `graph_capture_record_stream_reuse`, until the graph joins those streams back (Note
//! [Recorded streams]).

use std::cell::Cell;
use std::sync::Arc;

use super::{PoolKey, PoolSettings, PrivatePool, Shim};
use crate::cuda::CudaError;
use crate::gpu::captures::{self, CaptureState};
use crate::streams::Stream;

thread_local! {
    /// The pool the calling thread's next capture allocates from (0: a new pool).
    static NEXT_POOL: Cell<u64> = const { Cell::new(0) };
}

impl Shim {
    /// The Python integration's word: the calling thread's next capture allocates from the
    /// pool `id` (shared by every capture given the same id); 0 for a new pool of its own.
    pub fn use_capture_pool(&self, id: u64) {
        let _ = NEXT_POOL.try_with(|next| next.set(id));
    }

    /// A capture begins on `stream` of `device`: give it its pool.
    pub(in crate::process) fn capture_pool_begin(&self, stream: usize, device: i32) {
        let named = NEXT_POOL.try_with(|next| next.replace(0)).unwrap_or(0);
        let mut book = self.private_book();
        let id = if named != 0 {
            named
        } else {
            Self::own_pool_id(&mut book)
        };
        let settings = PoolSettings {
            for_graphs: true,
            ..PoolSettings::default()
        };
        let Some(pool) = self.private_pool(&mut book, (id, device), settings) else {
            return;
        };
        book.users((id, device)).captures += 1;
        book.capturing.insert(stream, pool);
    }

    /// The capture on `stream` has begun (the driver took it): note its id, by which streams
    /// that join it are known.
    pub(in crate::process) fn capture_pool_started(&self, stream: usize) {
        if let CaptureState::Active(id) = captures::capture_state(Stream(stream)) {
            self.private_book().capture_ids.insert(id, stream);
        }
    }

    /// Whether `stream`, not known to capture, has joined a capture of ours (asked of the
    /// driver). If so it is known from now on, and allocates from that capture's pool.
    pub(in crate::process) fn capture_joined(&self, stream: usize) -> bool {
        let CaptureState::Active(id) = captures::capture_state(Stream(stream)) else {
            return false;
        };
        let mut book = self.private_book();
        let Some(&origin) = book.capture_ids.get(&id) else {
            return false;
        };
        let Some(pool) = book.capturing.get(&origin).cloned() else {
            return false;
        };
        book.capturing.insert(stream, pool.clone());
        book.joined.insert(stream, origin);
        drop(book);
        self.streams
            .joined(Stream(stream), pool.device, Stream(origin));
        true
    }

    /// The capture on `stream` ended, making `graph` (none if it failed): the graph holds the
    /// pool from now on, instead of the capture.
    pub(in crate::process) fn capture_pool_end(&self, stream: usize, graph: Option<usize>) {
        let mut book = self.private_book();
        if book.joined.contains_key(&stream) {
            return; // a stream that joined a capture ends none (CUDA refuses it)
        }
        let Some(pool) = book.capturing.remove(&stream) else {
            return;
        };
        book.capture_ids.retain(|_, origin| *origin != stream);
        let joined: Vec<usize> = (book.joined.iter())
            .filter(|&(_, &origin)| origin == stream)
            .map(|(&s, _)| s)
            .collect();
        for s in joined {
            book.joined.remove(&s);
            book.capturing.remove(&s);
        }
        let users = book.users(pool.key());
        users.captures = users.captures.saturating_sub(1);
        if let Some(graph) = graph.filter(|&g| g != 0) {
            users.graphs += 1;
            book.graphs.insert(graph, (pool.key(), false));
        }
        self.release_if_unused(&mut book, &pool);
    }

    /// `exec` was instantiated from `graph`: it holds `graph`'s pool too.
    pub fn graph_instantiated(&self, graph: usize, exec: usize) {
        if !self
            .private_pools
            .any
            .load(std::sync::atomic::Ordering::Acquire)
            || exec == 0
        {
            return;
        }
        let mut book = self.private_book();
        let Some(&(key, _)) = book.graphs.get(&graph) else {
            return;
        };
        book.graphs.insert(exec, (key, true));
        book.users(key).execs += 1;
    }

    /// The graph or executable graph `handle` was destroyed: it no longer holds its pool.
    pub fn graph_destroyed(&self, handle: usize) {
        if !self
            .private_pools
            .any
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return;
        }
        let mut book = self.private_book();
        let Some((key, exec)) = book.graphs.remove(&handle) else {
            return;
        };
        let users = book.users(key);
        let count = if exec {
            &mut users.execs
        } else {
            &mut users.graphs
        };
        *count = count.saturating_sub(1);
        if let Some(pool) = self.find_private_pool(key) {
            self.release_if_unused(&mut book, &pool);
        }
    }

    /// The program holds the graph pool `key` for one more of its graphs (PyTorch's
    /// `CUDAGraph::capture_begin`, through the C++ allocator's `beginAllocateToPool`): from now
    /// on its references, not the graph objects, say when the pool's graphs let go (Note [The
    /// program's graph references]). Returns the program's references.
    pub fn graph_pool_retain(&self, key: PoolKey) -> usize {
        let mut book = self.private_book();
        let refs = book.users(key).program_graphs.get_or_insert(0);
        *refs += 1;
        *refs
    }

    /// One of the program's graphs let go of the pool `key` (PyTorch's `CUDAGraph::reset`,
    /// through `releasePool`). Returns the program's references left.
    pub fn graph_pool_release(&self, key: PoolKey) -> usize {
        let mut book = self.private_book();
        let Some(refs) = book
            .users
            .get_mut(&key)
            .and_then(|u| u.program_graphs.as_mut())
        else {
            return 0;
        };
        *refs = refs.saturating_sub(1);
        let left = *refs;
        if left == 0
            && let Some(pool) = self.find_private_pool(key)
        {
            self.release_if_unused(&mut book, &pool);
        }
        left
    }

    /// The stream whose capture `stream` takes part in (itself if it began it), if it
    /// captures into one of ours.
    pub(in crate::process) fn capture_origin(&self, stream: usize) -> Option<usize> {
        let book = self.private_book();
        if let Some(&origin) = book.joined.get(&stream) {
            return Some(origin);
        }
        book.capturing.contains_key(&stream).then_some(stream)
    }

    /// The pool `stream` is capturing into, if it is capturing.
    fn capturing_pool(&self, stream: usize) -> Option<Arc<PrivatePool>> {
        if !self
            .private_pools
            .any
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return None;
        }
        self.private_book().capturing.get(&stream).cloned()
    }

    /// Serve an allocation on the capturing `stream` from its capture's pool; `None` when the
    /// capture has no pool of ours (the shim began without a driver, or the capture began
    /// through a door we do not see).
    pub fn capture_malloc(&self, stream: usize, size: u64) -> Option<Result<u64, CudaError>> {
        let pool = self.capturing_pool(stream)?;
        self.free_recorded_when_done(false);
        let served = self.serve(&pool.alloc, pool.device, size, stream as u64);
        Some(self.observed(pool.device, size, stream as u64, served))
    }
}
