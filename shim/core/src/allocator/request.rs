//! [`Request`]: one allocation request on its way down the ladder (see
//! [Note [The allocation ladder and the lock]](super#note-the-allocation-ladder-and-the-lock)):
//! the application's size, its rounded size and the segment size a new segment for it would
//! have.

use crate::sizes;

/// A request on its way down the ladder.
#[derive(Clone, Copy, Debug)]
pub(super) struct Request {
    /// The application's size.
    pub(super) size: u64,
    /// Its rounded size.
    pub(super) rounded: u64,
    /// The size of a new segment for it.
    pub(super) segment_size: u64,
    /// The caller's tag.
    pub(super) tag: u64,
    /// The stream it is for, or [`NO_STREAM`](crate::pools::NO_STREAM).
    pub(super) stream: u64,
}

impl Request {
    /// A request of `size` bytes, rounded to `rounded` by the policy in force.
    pub(super) fn new(size: u64, rounded: u64, stream: u64, tag: u64) -> Self {
        Request {
            size,
            rounded,
            segment_size: sizes::segment_size(rounded),
            tag,
            stream,
        }
    }
}
