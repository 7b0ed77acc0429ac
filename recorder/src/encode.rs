//! A fast path for encoding the record kinds the recorder writes most (allocations, frees,
//! segment events, samples, the categories' scope, phase and tag events, checkpoint blocks
//! and segments): each body written straight as the MessagePack array rmp-serde writes —
//! byte for byte the same (the tests compare both over random records), so the trace format
//! does not change.
//!
//! rmp-serde writes a struct as a fixarray of its fields and every unsigned integer in its
//! shortest form (a positive fixint below 128, then `uint 8/16/32/64`). Going through serde's
//! generic serializer, with a fresh vector per record, took about 1 300 instructions a record on
//! the recorder thread, as much as the rest of its work together (callgrind, BENCHMARKS.md, issue
//! 25); the fast path takes about a fifth of that. The writer encodes through [`encode`]; other
//! kinds, and every other caller of [`Record::encode`], go through rmp-serde as before.

use crate::schema::{
    Alloc, BlockState, FreeCompleted, FreeRequested, PhaseEvent, Record, ScopeEvent, SegmentEvent,
    SegmentState, StatsSample, TagEvent, write_leb128,
};

/// The longest body of the fast path: a fixarray header and up to 15 fields of 9 bytes.
const MAX_BODY: usize = 1 + 15 * 9;

/// A body being written into a buffer on the stack.
struct Body {
    bytes: [u8; MAX_BODY],
    len: usize,
}

impl Body {
    /// A fixarray of `fields` elements (fewer than 16).
    #[inline(always)]
    fn array(fields: u8) -> Body {
        debug_assert!(fields < 16);
        let mut bytes = [0; MAX_BODY];
        bytes[0] = 0x90 | fields;
        Body { bytes, len: 1 }
    }

    #[inline(always)]
    fn put(&mut self, bytes: &[u8]) {
        self.bytes[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    /// An unsigned integer in its shortest form, as rmp's `write_uint`.
    #[inline(always)]
    fn uint(&mut self, value: u64) -> &mut Body {
        if value < 128 {
            self.put(&[value as u8]);
        } else if value < 1 << 8 {
            self.put(&[0xcc, value as u8]);
        } else if value < 1 << 16 {
            self.put(&[0xcd]);
            self.put(&(value as u16).to_be_bytes());
        } else if value < 1 << 32 {
            self.put(&[0xce]);
            self.put(&(value as u32).to_be_bytes());
        } else {
            self.put(&[0xcf]);
            self.put(&value.to_be_bytes());
        }
        self
    }

    /// Append `kind, length, body` to `out`.
    #[inline(always)]
    fn finish(self, kind: u8, out: &mut Vec<u8>) {
        out.push(kind);
        write_leb128(out, self.len as u64);
        out.extend_from_slice(&self.bytes[..self.len]);
    }
}

/// Append `kind, length, body` of `record` to `out`: the hot kinds by the fast path, the
/// others through rmp-serde ([`Record::encode`]). The same bytes either way.
#[inline]
pub(crate) fn encode(record: &Record, out: &mut Vec<u8>) {
    if !encode_hot(record, out) {
        record.encode(out);
    }
}

/// Append `kind, length, body` of `record` to `out` if its kind is one of the fast path's;
/// false (nothing written) for any other kind.
pub(crate) fn encode_hot(record: &Record, out: &mut Vec<u8>) -> bool {
    let body = match record {
        Record::Alloc(a) => alloc(a),
        Record::Free(f) | Record::FreeRequested(f) => free_requested(f),
        Record::FreeCompleted(f) => free_completed(f),
        Record::SegmentAlloc(s)
        | Record::SegmentFree(s)
        | Record::SegmentMap(s)
        | Record::SegmentUnmap(s) => segment_event(s),
        Record::StatsSample(s) => stats_sample(s),
        Record::Scope(s) => scope(s),
        Record::Phase(p) => phase(p),
        Record::Tag(t) => tag(t),
        Record::CheckpointSegment(s) => segment_state(s),
        Record::CheckpointBlock(b) => block_state(b),
        _ => return false,
    };
    body.finish(record.kind(), out);
    true
}

fn alloc(a: &Alloc) -> Body {
    let mut b = Body::array(8);
    b.uint(a.t)
        .uint(a.device.into())
        .uint(a.stream)
        .uint(a.address)
        .uint(a.requested)
        .uint(a.size)
        .uint(a.stack.into())
        .uint(a.thread.into());
    b
}

fn free_requested(f: &FreeRequested) -> Body {
    let mut b = Body::array(7);
    b.uint(f.t)
        .uint(f.device.into())
        .uint(f.stream)
        .uint(f.address)
        .uint(f.size)
        .uint(f.stack.into())
        .uint(f.thread.into());
    b
}

fn free_completed(f: &FreeCompleted) -> Body {
    let mut b = Body::array(4);
    b.uint(f.t)
        .uint(f.device.into())
        .uint(f.address)
        .uint(f.size);
    b
}

fn segment_event(s: &SegmentEvent) -> Body {
    let mut b = Body::array(6);
    b.uint(s.t)
        .uint(s.device.into())
        .uint(s.address)
        .uint(s.size)
        .uint(s.pool.into())
        .uint(s.stack.into());
    b
}

fn stats_sample(s: &StatsSample) -> Body {
    let mut b = Body::array(6);
    b.uint(s.t)
        .uint(s.device.into())
        .uint(s.allocated)
        .uint(s.reserved)
        .uint(s.active)
        .uint(s.requested);
    b
}

fn scope(s: &ScopeEvent) -> Body {
    let mut b = Body::array(3);
    b.uint(s.t).uint(s.thread.into()).uint(s.scope.into());
    b
}

fn phase(p: &PhaseEvent) -> Body {
    let mut b = Body::array(3);
    b.uint(p.t).uint(p.phase.into()).uint(p.step);
    b
}

fn tag(t: &TagEvent) -> Body {
    let mut b = Body::array(4);
    b.uint(t.t)
        .uint(t.device.into())
        .uint(t.address)
        .uint(t.category.into());
    b
}

fn segment_state(s: &SegmentState) -> Body {
    let mut b = Body::array(5);
    b.uint(s.device.into())
        .uint(s.address)
        .uint(s.size)
        .uint(s.pool.into())
        .uint(s.stack.into());
    b
}

fn block_state(s: &BlockState) -> Body {
    let mut b = Body::array(6);
    b.uint(s.device.into())
        .uint(s.address)
        .uint(s.size)
        .uint(s.requested)
        .uint(s.stack.into())
        .uint(s.pending.into());
    b
}

#[cfg(test)]
mod tests;
