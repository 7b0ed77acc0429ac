//! [`Event`]s: what the allocator did, reported to its [`Observer`] under its lock, in order.

use crate::oom::OomReport;
use crate::pools::{Allocation, Freed, ReleasedSegment};
use crate::sizes::PoolKind;

/// One thing the allocator did, reported to its [`Observer`] under the allocator's lock, so that
/// events reach the observer in the order they happened (a trace must never show a block
/// allocated again before its free).
#[derive(Clone, Copy, Debug)]
pub enum Event<'a> {
    /// A block was handed out.
    Alloc(&'a Allocation),
    /// The application freed a block. Unless `pending`, it is reusable at once (and no
    /// `FreeCompleted` follows).
    FreeRequested(&'a Freed),
    /// A pending freed block became reusable (its fence completed).
    FreeCompleted {
        /// Its address.
        address: u64,
        /// Its size.
        size: u64,
    },
    /// A segment was allocated on the device.
    SegmentAlloc {
        /// Its address.
        address: u64,
        /// Its size.
        size: u64,
        /// Its pool.
        pool: PoolKind,
        /// The tag of the request that caused it.
        tag: u64,
    },
    /// A segment left the pools, to be released on the device.
    SegmentFree(&'a ReleasedSegment),
    /// Memory was mapped into an expandable segment.
    SegmentMap {
        /// Where.
        address: u64,
        /// How many bytes.
        size: u64,
        /// The segment's pool.
        pool: PoolKind,
        /// The tag of the request that caused it.
        tag: u64,
    },
    /// Memory of an expandable segment left the pools, to be unmapped on the device.
    SegmentUnmap {
        /// Where.
        address: u64,
        /// How many bytes.
        size: u64,
        /// The segment's pool.
        pool: PoolKind,
    },
    /// A request failed.
    Oom(&'a OomReport),
}

/// Receives the allocator's [`Event`]s. Called with the allocator's lock held: keep it short
/// (the recorder sends one record on a channel).
pub trait Observer: Send + Sync {
    /// One event.
    fn on_event(&self, event: Event<'_>);
}

/// No observer.
impl Observer for () {
    #[inline]
    fn on_event(&self, _event: Event<'_>) {}
}
