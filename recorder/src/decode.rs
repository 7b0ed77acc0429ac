//! A fast path for decoding the record kinds that make up nearly all of a trace (allocations,
//! frees, segment events, stats samples, checkpoint blocks and segments), straight from their
//! MessagePack arrays, without serde's generic machinery.
//!
//! It takes only what it fully understands — a fixarray of exactly the struct's field count,
//! each field an unsigned integer (in any of MessagePack's unsigned forms: a positive fixint,
//! `uint 8/16/32/64`) that fits the field's type, and no bytes after the array. Anything else
//! (another kind, a signed or wider form, a map, a short or long body) returns `None`, and the
//! reader (`chunk`) hands the body to rmp-serde ([`Record::decode`]) as before. So the fast path never changes what a
//! trace decodes to: where it answers, it answers what rmp-serde would (the tests check this
//! over random bodies and the golden files); where it does not, rmp-serde does.
//!
//! Why: rmp-serde decodes each integer through a generic visitor (`any_num`), which made
//! MessagePack about a sixth of `cachealloc export`'s time (BENCHMARKS.md, issue 26).

use crate::schema::{
    Alloc, BlockState, FreeCompleted, FreeRequested, Record, SegmentEvent, SegmentState,
    StatsSample, kinds,
};

/// A MessagePack body being read from the front.
struct Body<'a> {
    bytes: &'a [u8],
}

impl<'a> Body<'a> {
    /// Open a body that must be a fixarray of `fields` elements.
    #[inline(always)]
    fn array(bytes: &'a [u8], fields: u8) -> Option<Body<'a>> {
        debug_assert!(fields < 16);
        let (&marker, rest) = bytes.split_first()?;
        (marker == 0x90 | fields).then_some(Body { bytes: rest })
    }

    /// The next unsigned integer, in any of MessagePack's unsigned forms.
    #[inline(always)]
    fn uint(&mut self) -> Option<u64> {
        let (&marker, rest) = self.bytes.split_first()?;
        let (value, rest) = match marker {
            0x00..=0x7f => (u64::from(marker), rest),
            0xcc => {
                let (b, rest) = rest.split_first_chunk::<1>()?;
                (u64::from(b[0]), rest)
            }
            0xcd => {
                let (b, rest) = rest.split_first_chunk::<2>()?;
                (u64::from(u16::from_be_bytes(*b)), rest)
            }
            0xce => {
                let (b, rest) = rest.split_first_chunk::<4>()?;
                (u64::from(u32::from_be_bytes(*b)), rest)
            }
            0xcf => {
                let (b, rest) = rest.split_first_chunk::<8>()?;
                (u64::from_be_bytes(*b), rest)
            }
            _ => return None,
        };
        self.bytes = rest;
        Some(value)
    }

    #[inline(always)]
    fn u64(&mut self) -> Option<u64> {
        self.uint()
    }

    #[inline(always)]
    fn u32(&mut self) -> Option<u32> {
        u32::try_from(self.uint()?).ok()
    }

    #[inline(always)]
    fn u8(&mut self) -> Option<u8> {
        u8::try_from(self.uint()?).ok()
    }

    /// `value` if the body was read to its last byte.
    #[inline(always)]
    fn end<T>(self, value: T) -> Option<T> {
        self.bytes.is_empty().then_some(value)
    }
}

/// Decode a body of one of the hot kinds; `None` for any other kind, and for a body this fast
/// path does not take (see the module docs): the caller then decodes it with rmp-serde.
pub(crate) fn decode_hot(kind: u8, body: &[u8]) -> Option<Record> {
    Some(match kind {
        kinds::ALLOC => Record::Alloc(alloc(body)?),
        kinds::FREE => Record::Free(free_requested(body)?),
        kinds::FREE_REQUESTED => Record::FreeRequested(free_requested(body)?),
        kinds::FREE_COMPLETED => Record::FreeCompleted(free_completed(body)?),
        kinds::SEGMENT_ALLOC => Record::SegmentAlloc(segment_event(body)?),
        kinds::SEGMENT_FREE => Record::SegmentFree(segment_event(body)?),
        kinds::SEGMENT_MAP => Record::SegmentMap(segment_event(body)?),
        kinds::SEGMENT_UNMAP => Record::SegmentUnmap(segment_event(body)?),
        kinds::STATS_SAMPLE => Record::StatsSample(stats_sample(body)?),
        kinds::CHECKPOINT_SEGMENT => Record::CheckpointSegment(segment_state(body)?),
        kinds::CHECKPOINT_BLOCK => Record::CheckpointBlock(block_state(body)?),
        _ => return None,
    })
}

fn alloc(body: &[u8]) -> Option<Alloc> {
    let mut b = Body::array(body, 8)?;
    let value = Alloc {
        t: b.u64()?,
        device: b.u32()?,
        stream: b.u64()?,
        address: b.u64()?,
        requested: b.u64()?,
        size: b.u64()?,
        stack: b.u32()?,
        thread: b.u32()?,
    };
    b.end(value)
}

fn free_requested(body: &[u8]) -> Option<FreeRequested> {
    let mut b = Body::array(body, 7)?;
    let value = FreeRequested {
        t: b.u64()?,
        device: b.u32()?,
        stream: b.u64()?,
        address: b.u64()?,
        size: b.u64()?,
        stack: b.u32()?,
        thread: b.u32()?,
    };
    b.end(value)
}

fn free_completed(body: &[u8]) -> Option<FreeCompleted> {
    let mut b = Body::array(body, 4)?;
    let value = FreeCompleted {
        t: b.u64()?,
        device: b.u32()?,
        address: b.u64()?,
        size: b.u64()?,
    };
    b.end(value)
}

fn segment_event(body: &[u8]) -> Option<SegmentEvent> {
    let mut b = Body::array(body, 6)?;
    let value = SegmentEvent {
        t: b.u64()?,
        device: b.u32()?,
        address: b.u64()?,
        size: b.u64()?,
        pool: b.u8()?,
        stack: b.u32()?,
    };
    b.end(value)
}

fn stats_sample(body: &[u8]) -> Option<StatsSample> {
    let mut b = Body::array(body, 6)?;
    let value = StatsSample {
        t: b.u64()?,
        device: b.u32()?,
        allocated: b.u64()?,
        reserved: b.u64()?,
        active: b.u64()?,
        requested: b.u64()?,
    };
    b.end(value)
}

fn segment_state(body: &[u8]) -> Option<SegmentState> {
    let mut b = Body::array(body, 5)?;
    let value = SegmentState {
        device: b.u32()?,
        address: b.u64()?,
        size: b.u64()?,
        pool: b.u8()?,
        stack: b.u32()?,
    };
    b.end(value)
}

fn block_state(body: &[u8]) -> Option<BlockState> {
    let mut b = Body::array(body, 6)?;
    let value = BlockState {
        device: b.u32()?,
        address: b.u64()?,
        size: b.u64()?,
        requested: b.u64()?,
        stack: b.u32()?,
        pending: b.u8()?,
    };
    b.end(value)
}

#[cfg(test)]
mod tests;
