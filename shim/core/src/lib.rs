//! `cachealloc-core`: the caching allocator of cachealloc as pure Rust — no CUDA, no FFI, no
//! globals, no `unsafe`.
//!
//! The preloaded shim (`libcachealloc.so`) wraps an [`Allocator`] per GPU around the real CUDA
//! backend; `cachealloc simulate` replays a recorded trace through one over [`SimDevice`]; the
//! tests and benchmarks here use [`SimDevice`] too. The policy is PyTorch's
//! CUDACachingAllocator (size classes, split and merge, `max_split_size`, garbage collection,
//! the out-of-memory ladder, stats with PyTorch's names), plus *reuse fences*, which let an
//! allocator that sees no streams keep `cudaFree`'s promise. The design of the whole project is
//! `docs/design.md` in the repository; the allocator's parts are explained here, in the Notes
//! of [`sizes`], [`pools`], [`allocator`] and [`pools::expandable`].
//!
//! ```
//! use cachealloc_core::{Allocator, AllocatorConfig, SimDevice};
//!
//! let alloc = Allocator::new(SimDevice::new(1 << 30), AllocatorConfig::default());
//! let a = alloc.malloc(1000, 0).unwrap();          // rounded to 1024 B, small pool
//! assert_eq!(a.size, 1024);
//! alloc.free(a.address).unwrap();
//! let b = alloc.malloc(1000, 0).unwrap();          // served from the cache
//! assert_eq!(b.address, a.address);
//! assert_eq!(alloc.stats().num_device_alloc, 1);
//! alloc.check_invariants().unwrap();
//! ```
//!
//! # Where things are
//!
//! | module | what |
//! |---|---|
//! | [`sizes`] | rounding, pool choice, segment size, split rules — and the note on their waste |
//! | [`pools`] | segments, blocks, split and merge, stats bookkeeping; its submodules: `carve` (handing out a block), `checkpoint` (a pool's layout and putting it back to one), `free` (freeing, merging, the free lists), `free_list`, `fences` (fence batches), `cross_stream`, `release` (segments out for release), `expandable` (ranges, maps, unmaps, recycling), `queries` (lookup, snapshots), `invariants` (`check_invariants`) |
//! | [`allocator`] | the lock and the out-of-memory ladder around [`pools::Pools`]; its submodules: `checkpoint` (checkpoints and restores under the lock), `expandable` (mapping and unmapping outside the lock), `maintenance` (empty cache, fences, device reset) |
//! | [`events`] | the [`Event`]s an [`Observer`] (the recorder) hears, in order |
//! | [`oom`] | [`OomReport`]: what is known about a request that failed |
//! | [`device`] | the [`Device`] trait: the only source of memory and fences |
//! | [`sim`] | [`SimDevice`], a capacity-limited simulated device |
//! | [`stats`] | [`Stats`] with PyTorch's names |
//! | [`config`] | [`Config`]: the `key:value,…` syntax, every default, clear errors |
//!
//! # Glossary
//!
//! * **Segment** — one device allocation (`cudaMalloc`) held by the allocator. It is released
//!   whole and only when none of its bytes are in use.
//! * **Block** — a contiguous part of a segment: *active* (handed to the application),
//!   *pending free* (freed, waiting for its fence), or *free* (reusable). A segment's blocks
//!   tile it exactly; a segment with more than one block is *split*.
//! * **Pool** — the *small* pool (requests ≤ 1 MiB, 2 MiB segments) or the *large* pool. Blocks
//!   never move between pools.
//! * **Size class** — the rounded size of a request (512 B steps, or power-of-two divisions),
//!   which decides the pool and the segment size; see [`sizes`].
//! * **Oversize block** — a block of at least `max_split_size`; never split.
//! * **Expandable segment** (range) — with `expandable_segments:True`: a reserved address range
//!   per stream and pool whose blocks tile it, *mapped* (backed by device memory, in
//!   *mappings* made by maps and unmapped whole) or *unmapped*; see
//!   [Note [Expandable segments]](pools::expandable#note-expandable-segments).
//! * **Fence** — a device-side marker after all work enqueued so far on every stream that may
//!   touch our memory (CUDA events). A freed block is reused only after a fence recorded after
//!   its free has completed; see [Note [Reuse fences]](pools#note-reuse-fences).
//! * **Batch** — the freed blocks behind one fence.
//! * **Stream** — a CUDA queue of work. Work on one stream runs in order; work on different
//!   streams does not, which is why reuse needs fences once the application creates streams.
//! * **Reserved / allocated** — bytes held from the device / bytes handed to the application.
//!   Their difference is the cache.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod allocator;
pub mod config;
pub mod device;
pub mod events;
pub mod oom;
pub mod pools;
pub mod sim;
pub mod sizes;
pub mod stats;

pub use allocator::{AllocError, Allocator, SegmentChanges};
pub use config::{AllocatorConfig, Config, ConfigError, Expandable, ReusePolicy};
pub use device::{Device, DeviceError, MemInfo, SharedLimit};
pub use events::{Event, Observer};
pub use oom::{OomReport, format_bytes};
pub use pools::{
    AddressInfo, Allocation, BlockState, Checkpoint, CheckpointBlock, CheckpointSegment, FreeError,
    Freed, NO_STREAM, RestoreError, Restored, SegmentSnapshot,
};
pub use sim::{FenceMode, SimDevice};
pub use sizes::PoolKind;
pub use stats::{Stat, StatArray, Stats};
