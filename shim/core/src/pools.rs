//! [`Pools`]: the bookkeeping of one device's caching allocator — segments, blocks, free lists,
//! reuse fences and stats. Every method is pure bookkeeping under the allocator's lock; device
//! memory is never allocated or released here (that is [`crate::Allocator`]'s job, done outside
//! the lock), only fences are recorded and queried, which is cheap.
//!
//! # Note [Reuse fences]
//!
//! A real `cudaFree` waits for the device, so an application may free memory that kernels it
//! queued earlier still read or write. A caching allocator that handed such a block to the next
//! `cudaMalloc` at once would let new work on another stream overwrite it while old work still
//! uses it. PyTorch avoids this by giving every block a home stream and recording events for
//! cross-stream uses (`record_stream`); an interposed `cudaMalloc` knows no streams, so we keep
//! `cudaFree`'s promise differently:
//!
//! * A freed block becomes **pending**: it stays *active* in the stats (PyTorch's
//!   `free_requested`), joins the **open batch**, and is not reusable.
//! * When the allocator next needs memory that the free lists cannot give, or when the batch
//!   holds [`FENCE_BATCH_BLOCKS`] blocks, it **closes** the open batch: [`Device::record_fence`](crate::Device::record_fence) marks all work enqueued so far on every stream that may use
//!   our memory (the shim records one event on the legacy default stream, which orders after all
//!   blocking streams, plus one on each live non-blocking stream).
//! * Batches complete in the order they were closed. A completed batch's blocks become **free**
//!   (PyTorch's `free_completed`): they merge with free neighbours and join the free lists.
//!   Completion is *queried* (never waited for) on the allocation path.
//! * Only when nothing else satisfies a request does the allocator wait for the oldest batch, and
//!   only after that does it grow (see the ladder in [`crate::allocator`]).
//!
//! With [`ReusePolicy::Immediate`] a freed block is free at once: right when all work runs on one
//! stream (CUDA orders it), as in a process that created no stream. [`ReusePolicy::Auto`] starts
//! that way and switches to fenced reuse at the first stream creation
//! ([`Pools::start_fencing`]): every block already in the free lists then goes behind one
//! *gate* fence, recorded before the new stream can have any work, and no free-list block is
//! reused until it completes.
//!
//! # Note [Stream-ordered reuse]
//!
//! The stream-ordered API (`cudaMallocAsync(ptr, size, stream)`, `cudaFreeAsync(ptr, stream)`)
//! tells the allocator what fences have to guess: the stream that will use a block, and the
//! point in that stream's work where the block stops being used. So, as in PyTorch's own
//! allocator, every segment (and every block in it) belongs to one **stream**, and a request is
//! served only from its stream's free lists or from a new segment for that stream:
//!
//! * A block freed **on its own stream** is free at once (with `reuse:auto`): the next request
//!   on that stream is ordered after the free by the stream itself, so no fence is needed and
//!   nothing waits on the host. This is PyTorch's rule; a program that uses a block on another
//!   stream without telling the allocator (`record_stream`, or a `cudaStreamWaitEvent` before
//!   the free) has a bug under PyTorch too. `reuse:fenced` protects such programs by fencing
//!   every free.
//! * A block freed **on another stream** than its own (PyTorch frees a block that
//!   `record_stream` lent to other streams on a side stream that first waits for all of them)
//!   is free once that stream reaches the free: it waits behind a fence recorded on the
//!   freeing stream alone, and batches of such frees complete in any order. When its own
//!   stream needs memory that its lists cannot give, such blocks are **adopted** before
//!   anything waits or grows: the stream is made to wait for the fence on the device
//!   ([`Device::stream_wait`](crate::Device::stream_wait), `cudaStreamWaitEvent`), and the block is reused at once.
//! * A block freed **synchronously** (`cudaFree`) waits behind a fence over every stream like
//!   any other freed block, then returns to its own stream's lists.
//! * Blocks of the synchronous API belong to [`NO_STREAM`]; the gate of
//!   [`Pools::start_fencing`] closes only their lists, since blocks of a stream were freed in
//!   that stream's order and stay safe for it whatever streams appear.
//!
//! Blocks never move between streams; whole free segments of any stream are released by
//! `empty_cache`, garbage collection and the out-of-memory ladder (oversize segments: only the
//! request's stream's, as in PyTorch).
//!
//! # Note [The unlisted rest]
//!
//! Splitting a block creates a free *rest*. The most recent rest is not put into its free list
//! at once but kept in the `unlisted_rest` slot; whatever reads the free lists first
//! settles it into its list, and a free that merges with it takes it straight
//! from there. The common pattern of a temporary tensor — split a block, free it, merge back —
//! thus costs no free-list update for the rest. The rest is free in every other respect (block
//! state, stats), so only the free-list invariant has to know: the free lists plus the unlisted
//! rest hold exactly the free blocks.

use std::collections::{BTreeMap, VecDeque};

use rustc_hash::FxHashMap;

use crate::config::{AllocatorConfig, ReusePolicy};
use crate::sizes::{self, PoolKind, Roundup};
use crate::stats::{StatAt, Stats};

use free_list::{BlockId, FreeList};
/// Index of a segment in the segment table.
type SegmentId = u32;
/// The stream of blocks that belong to no stream: those of the synchronous API (`cudaMalloc`,
/// `cudaFree`), whose frees are fenced against every stream. See
/// [Note [Stream-ordered reuse]](self#note-stream-ordered-reuse).
pub const NO_STREAM: u64 = 0;
/// "No block" in the neighbour links.
const NIL: BlockId = u32::MAX;
/// The open fence batch is closed once it holds this many blocks, even without a cache miss, so
/// freed memory keeps flowing back to the free lists at the price of one fence per this many
/// frees.
pub const FENCE_BATCH_BLOCKS: usize = 64;

/// Where a block is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed to the application.
    Active,
    /// Freed by the application; waiting for its fence before it can be reused.
    PendingFree,
    /// In a free list, reusable.
    Free,
    /// Address space of an expandable segment with no memory behind it; see
    /// [Note [Expandable segments]](expandable#note-expandable-segments).
    Unmapped,
}

#[derive(Clone, Debug)]
struct Block {
    address: u64,
    size: u64,
    /// The application's unrounded request (0 for free blocks).
    requested: u64,
    segment: SegmentId,
    prev: BlockId,
    next: BlockId,
    state: BlockState,
    pool: PoolKind,
    /// Value of [`Pools::lookups`] when the block joined a free list (its age for GC).
    free_since: u64,
    /// The caller's tag at allocation (a stack id for the recorder); 0 when none.
    tag: u64,
    /// The stream the block belongs to (its segment's), or [`NO_STREAM`].
    stream: u64,
    /// Which allocation of the pools this active block is (1, 2, … in the order they were
    /// handed out): tells two allocations at one address apart.
    serial: u64,
    /// An [`BlockState::Unmapped`] block being mapped or unmapped outside the lock: in no list,
    /// merged with nothing.
    busy: bool,
}

impl Block {
    fn is_split(&self) -> bool {
        self.prev != NIL || self.next != NIL
    }

    /// Where a change of this block is counted.
    fn stat_at(&self) -> StatAt {
        StatAt::new(self.pool, self.stream)
    }
}

#[derive(Clone, Debug)]
struct Segment {
    address: u64,
    size: u64,
    pool: PoolKind,
    first: BlockId,
    /// The caller's tag when the segment was allocated.
    tag: u64,
    /// The stream whose requests the segment serves, or [`NO_STREAM`].
    stream: u64,
    /// An expandable segment: a reserved address range, mapped in parts.
    expandable: bool,
    /// Its unmapped blocks (not busy) by address.
    unmapped: BTreeMap<u64, BlockId>,
}

/// The free lists of one stream, one per pool.
#[derive(Debug)]
struct StreamFreeLists {
    stream: u64,
    small: FreeList,
    large: FreeList,
}

impl StreamFreeLists {
    fn new(stream: u64) -> Self {
        StreamFreeLists {
            stream,
            small: FreeList::default(),
            large: FreeList::default(),
        }
    }

    fn list(&self, pool: PoolKind) -> &FreeList {
        match pool {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        }
    }

    fn list_mut(&mut self, pool: PoolKind) -> &mut FreeList {
        match pool {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }
}

/// Freed blocks behind one fence.
#[derive(Debug)]
struct Batch<F> {
    fence: F,
    blocks: Vec<BlockId>,
    /// Completing this batch opens the free lists again ([`Pools::start_fencing`]).
    gate: bool,
}

/// A block handed to the application.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Address of the block.
    pub address: u64,
    /// Size of the block (the rounded request, or more when the rest was too small to split).
    pub size: u64,
    /// The application's request.
    pub requested: u64,
    /// Address of the segment the block lies in.
    pub segment_address: u64,
    /// The pool it came from.
    pub pool: PoolKind,
    /// The caller's tag (a stack id for the recorder).
    pub tag: u64,
    /// The stream the block belongs to, or [`NO_STREAM`].
    pub stream: u64,
}

/// What a successful free did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freed {
    /// Address of the block.
    pub address: u64,
    /// Its size.
    pub size: u64,
    /// The application's request.
    pub requested: u64,
    /// Whether it is reusable already (immediate reuse) or waits for a fence.
    pub pending: bool,
    /// The stream the free was ordered on, or [`NO_STREAM`] for a synchronous free.
    pub stream: u64,
}

/// Why a free was refused. Nothing was changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FreeError {
    /// The pointer is not in any of our segments: it belongs to someone else (pass it on).
    #[error("pointer {0:#x} was not allocated by cachealloc")]
    NotOurs(u64),
    /// The block at this address is not allocated (freed before, or never handed out).
    #[error("double free of {address:#x} (block of {size} bytes, already {state:?})")]
    DoubleFree {
        /// The pointer.
        address: u64,
        /// The block's size.
        size: u64,
        /// The block's state.
        state: BlockState,
    },
    /// The pointer lies inside a block, not at its start.
    #[error("pointer {address:#x} is {offset} bytes into a block of {size} bytes at {block:#x}")]
    InteriorPointer {
        /// The pointer.
        address: u64,
        /// The block that contains it.
        block: u64,
        /// The block's size.
        size: u64,
        /// How far into the block the pointer is.
        offset: u64,
    },
}

/// A segment taken out of the pools, to be released on the device by the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReleasedSegment {
    /// Its address.
    pub address: u64,
    /// Its size.
    pub size: u64,
    /// Its pool.
    pub pool: PoolKind,
}

/// The bookkeeping of one device's allocator. See the module docs.
#[derive(Debug)]
pub struct Pools<F> {
    max_split_size: u64,
    /// `roundup_power2_divisions`, read under the lock so that the program may change it.
    roundup: Roundup,
    /// `garbage_collection_threshold` (0: off), likewise.
    garbage_collection_threshold: f64,
    reuse: ReusePolicy,
    /// Whether frees currently go behind fences.
    fencing: bool,
    /// While a gate batch is pending, no free-list block may be reused.
    gated: bool,
    blocks: Vec<Block>,
    spare_blocks: Vec<BlockId>,
    segments: Vec<Option<Segment>>,
    spare_segments: Vec<SegmentId>,
    /// Live segments by address, to find the segment containing a pointer.
    segment_index: BTreeMap<u64, SegmentId>,
    /// Free lists per stream; the first entry is always [`NO_STREAM`]'s. A process has few
    /// streams, so a linear search finds a stream's lists faster than a map.
    free: Vec<StreamFreeLists>,
    /// The most recent split-off rest, free but not yet in its free list (NIL when none); see
    /// [Note [The unlisted rest]](self#note-the-unlisted-rest).
    unlisted_rest: BlockId,
    /// Allocated blocks by address.
    active: FxHashMap<u64, BlockId>,
    /// Freed blocks not yet behind a fence.
    open_batch: Vec<BlockId>,
    /// Blocks the program freed that the caller holds back from reuse, by address: the block
    /// and the stream it was freed on; see [Note [Held frees]](held#note-held-frees).
    held: FxHashMap<u64, (BlockId, u64)>,
    /// Fenced batches, oldest first.
    pending: VecDeque<Batch<F>>,
    /// Blocks freed on another stream than their own, not yet behind a fence: per freeing
    /// stream. See [Note [Stream-ordered reuse]](self#note-stream-ordered-reuse).
    open_cross: Vec<(u64, Vec<BlockId>)>,
    /// Closed batches of such blocks, each behind a fence on its freeing stream alone; they
    /// complete in any order.
    cross: Vec<Batch<F>>,
    /// Number of free-list searches so far (the clock of GC ages, PyTorch's
    /// `get_free_blocks_call_count`).
    lookups: u64,
    /// Allocations handed out so far (the last one's [`AddressInfo::serial`]).
    allocations_handed_out: u64,
    /// Bytes of device allocations in progress outside the lock (counted against the limit).
    growing: u64,
    /// Whether the memory limit counts synchronous requests' memory
    /// ([`AllocatorConfig::fraction_counts_synchronous`]).
    limit_counts_synchronous: bool,
    /// Once expandable segments were on: the mapping granularity and the size of each
    /// segment's address range; see [Note [Expandable segments]](expandable#note-expandable-segments).
    expandable: Option<expandable::Geometry>,
    /// Whether the pools grow by mapping into expandable segments now (else by fixed segments;
    /// the program may switch at run time, and both kinds then live side by side: each block
    /// follows the rules of its own segment's kind).
    grows_expandable: bool,
    /// Whether the synchronous API's requests grow by fixed segments even while
    /// `grows_expandable` ([`Pools::set_synchronous_fixed`]).
    synchronous_fixed: bool,
    /// Whether what is mapped stays mapped until the cache is emptied, mapped in PyTorch's
    /// pages (a private pool's); see [Note [Kept maps]](expandable#note-kept-maps).
    keeps_maps: bool,
    /// The expandable segments: stream, pool, segment.
    ranges: Vec<(u64, PoolKind, SegmentId)>,
    /// The live mappings of expandable segments, by address: one per map, unmapped whole.
    mappings: BTreeMap<u64, u64>,
    /// Places of expandable segments whose memory moved to a mapping elsewhere in the range,
    /// still mapped to it by the driver; see [Note [Moving memory instead of unmapping
    /// it]](expandable::moves#note-moving-memory-instead-of-unmapping-it).
    parked: BTreeMap<u64, expandable::moves::Parked>,
    /// Each expandable segment's idle horizon; see
    /// [Note [Unmapping without a wait]](expandable::idle#note-unmapping-without-a-wait).
    idle: Vec<expandable::idle::RangeIdle<F>>,
    /// The statistics.
    pub stats: Stats,
}

impl<F: Clone> Pools<F> {
    /// Empty pools with the given policy.
    pub fn new(config: &AllocatorConfig) -> Self {
        Pools {
            max_split_size: config.max_split_size,
            roundup: config.roundup.clone(),
            garbage_collection_threshold: config.garbage_collection_threshold,
            reuse: config.reuse,
            fencing: config.reuse == ReusePolicy::Fenced,
            gated: false,
            blocks: Vec::new(),
            spare_blocks: Vec::new(),
            segments: Vec::new(),
            spare_segments: Vec::new(),
            segment_index: BTreeMap::new(),
            free: vec![StreamFreeLists::new(NO_STREAM)],
            unlisted_rest: NIL,
            active: FxHashMap::default(),
            open_batch: Vec::new(),
            held: FxHashMap::default(),
            pending: VecDeque::new(),
            open_cross: Vec::new(),
            cross: Vec::new(),
            lookups: 0,
            allocations_handed_out: 0,
            growing: 0,
            limit_counts_synchronous: config.fraction_counts_synchronous,
            expandable: None,
            grows_expandable: false,
            synchronous_fixed: false,
            keeps_maps: false,
            ranges: Vec::new(),
            mappings: BTreeMap::new(),
            parked: BTreeMap::new(),
            idle: Vec::new(),
            stats: Stats {
                max_split_size: config.max_split_size,
                ..Stats::default()
            },
        }
    }

    /// Whether block `id` lies in an expandable segment (split and merge freely there).
    fn in_range(&self, id: BlockId) -> bool {
        self.segment(self.blocks[id as usize].segment).expandable
    }

    // ----- allocation -------------------------------------------------------------------------

    /// Serve a rounded request on `stream` from that stream's free lists, or `None` when no
    /// cached block fits.
    pub fn alloc_cached(
        &mut self,
        rounded: u64,
        requested: u64,
        tag: u64,
        stream: u64,
    ) -> Option<Allocation> {
        self.lookups += 1;
        if self.gated && stream == NO_STREAM {
            return None;
        }
        self.settle();
        let pool = sizes::pool_for(rounded);
        let (size, address, id) = self.lists(stream)?.list(pool).best_fit(rounded)?;
        if !self.in_range(id) && !sizes::fits(size, rounded, self.max_split_size) {
            return None;
        }
        self.remove_free(id);
        debug_assert_eq!(self.blocks[id as usize].address, address);
        self.stats.num_cache_hits += 1;
        Some(self.carve(id, rounded, requested, tag))
    }

    /// Take a new segment from the device into the pool and serve the request from it at once
    /// (so no other thread can take it first).
    pub fn add_segment_and_alloc(
        &mut self,
        address: u64,
        segment_size: u64,
        rounded: u64,
        requested: u64,
        tag: u64,
        stream: u64,
    ) -> Allocation {
        let pool = sizes::pool_for(rounded);
        let segment = self.new_segment_slot();
        let id = self.new_block(Block {
            address,
            size: segment_size,
            requested: 0,
            segment,
            prev: NIL,
            next: NIL,
            state: BlockState::Free,
            pool,
            free_since: self.lookups,
            tag,
            stream,
            serial: 0,
            busy: false,
        });
        self.segments[segment as usize] = Some(Segment {
            address,
            size: segment_size,
            pool,
            first: id,
            tag,
            stream,
            expandable: false,
            unmapped: BTreeMap::new(),
        });
        self.segment_index.insert(address, segment);
        let at = StatAt::new(pool, stream);
        self.stats.segment.increase(at, 1);
        self.stats.reserved_bytes.increase(at, segment_size);
        if sizes::is_oversize(segment_size, self.max_split_size) {
            self.stats.oversize_segments.increase(1);
        }
        self.stats.num_device_alloc += 1;
        self.carve(id, rounded, requested, tag)
    }

    // ----- small helpers ----------------------------------------------------------------------

    fn new_block(&mut self, block: Block) -> BlockId {
        match self.spare_blocks.pop() {
            Some(id) => {
                self.blocks[id as usize] = block;
                id
            }
            None => {
                self.blocks.push(block);
                (self.blocks.len() - 1) as BlockId
            }
        }
    }

    fn new_segment_slot(&mut self) -> SegmentId {
        self.spare_segments.pop().unwrap_or_else(|| {
            self.segments.push(None);
            (self.segments.len() - 1) as SegmentId
        })
    }

    fn segment(&self, id: SegmentId) -> &Segment {
        self.segments[id as usize].as_ref().expect("live segment")
    }

    fn segment_mut(&mut self, id: SegmentId) -> &mut Segment {
        self.segments[id as usize].as_mut().expect("live segment")
    }

    /// Blocks of live segments, in address order per segment.
    fn live_blocks(&self) -> impl Iterator<Item = &Block> {
        self.segments.iter().flatten().flat_map(move |seg| {
            let mut id = seg.first;
            std::iter::from_fn(move || {
                if id == NIL {
                    return None;
                }
                let b = &self.blocks[id as usize];
                id = b.next;
                Some(b)
            })
        })
    }
}

mod carve;
pub mod checkpoint;
mod cross_stream;
pub mod expandable;
mod fences;
mod free;
mod free_list;
pub mod held;
mod invariants;
mod policy;
mod queries;
mod release;

pub use checkpoint::{Checkpoint, CheckpointBlock, CheckpointSegment, RestoreError, Restored};
pub use expandable::{MapOutcome, MapPlan, Unmapping};
pub use queries::{AddressInfo, BlockSnapshot, SegmentSnapshot};
