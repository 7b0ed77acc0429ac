//! Memory by category (and by module) at the peak of each time slice of one device, without
//! keeping every allocation: a block is added when it is classified, at its free, to the slices
//! whose peaks it was alive at.
//!
//! The peak of a slice (the moment of its most allocated bytes, as a record ordinal) is known
//! once the slice has ended. A block classified later than that is added to the closed slices it
//! spans through a difference array (`+size` at the first, `-size` after the last, summed at the
//! end). A block freed while a slice is still open is added to the open slice's candidate peak
//! if it was alive there; when a later moment of the slice becomes its peak, those bytes are
//! dropped, since every block freed before that moment was not alive at it (the candidate only
//! moves later). Nothing is held per block.

use std::collections::HashMap;

use super::{ByCategory, CATEGORY_COUNT, Category};

/// How time is cut: `count` slices of `width` ns from `start`; or, `adaptive`, about `count`
/// slices over a span not known in advance (from the first event; the width doubles, and
/// neighbouring rows merge, whenever time runs past `2 × count` slices).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceSpec {
    /// The first slice's start, ns since the trace's base.
    pub start: u64,
    /// Each slice's width, ns (≥ 1).
    pub width: u64,
    /// How many slices.
    pub count: u64,
    /// Whether the span is unknown (see above).
    pub adaptive: bool,
}

/// An adaptive spec's first width: 1 µs (each doubling costs a pass over a few rows).
const FIRST_WIDTH_NS: u64 = 1_000;

impl SliceSpec {
    /// `count` slices over `[start, end]`.
    pub fn over(start: u64, end: u64, count: u64) -> SliceSpec {
        let count = count.max(1);
        SliceSpec {
            start,
            width: ((end.saturating_sub(start)) / count + 1).max(1),
            count,
            adaptive: false,
        }
    }

    /// About `count` slices over the whole trace, whose span is not known yet.
    pub fn adaptive(count: u64) -> SliceSpec {
        SliceSpec {
            start: 0,
            width: FIRST_WIDTH_NS,
            count: 2 * count.max(1),
            adaptive: true,
        }
    }

    /// One slice: the whole trace (its row is the trace's peak).
    pub fn whole() -> SliceSpec {
        SliceSpec {
            start: 0,
            width: u64::MAX,
            count: 1,
            adaptive: false,
        }
    }

    /// The slice of time `t` (beyond the last one for an adaptive spec that must widen).
    fn slice_of(&self, t: u64) -> u64 {
        let slice = t.saturating_sub(self.start) / self.width;
        if self.adaptive {
            slice
        } else {
            slice.min(self.count - 1)
        }
    }
}

/// One slice's peak and what memory held then.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SliceRow {
    /// The slice's number.
    pub slice: u64,
    /// Time of its peak, ns since the trace's base.
    pub t: u64,
    /// Ordinal of the record after which its peak was reached.
    pub index: u64,
    /// Allocated bytes at its peak.
    pub allocated: u64,
    /// The most reserved bytes during the slice.
    pub reserved: u64,
    /// Allocated bytes at its peak by category (they add up to `allocated`).
    pub by_category: ByCategory,
    /// Allocated bytes at its peak by scope id (0: outside any module), when asked for.
    pub by_scope: HashMap<u32, u64>,
    /// Allocated bytes and blocks at its peak by stack id, when asked for.
    pub by_stack: HashMap<u32, (u64, u64)>,
}

/// A classified block: alive from record `born` up to record `died` (exclusive).
#[derive(Clone, Copy, Debug)]
pub struct Life {
    /// Ordinal of its allocation (or of the checkpoint that first showed it).
    pub born: u64,
    /// Ordinal of its free (`u64::MAX`: live at the end).
    pub died: u64,
    /// Bytes.
    pub size: u64,
    /// Its category.
    pub category: Category,
    /// Its scope id.
    pub scope: u32,
    /// Its allocation's stack id.
    pub stack: u32,
}

impl Life {
    /// Whether it was allocated at the moment after record `index` (a block live at the end is
    /// alive at every index from its birth, the end's `u64::MAX` included).
    pub fn alive_at(&self, index: u64) -> bool {
        self.born <= index && (index < self.died || self.died == u64::MAX)
    }
}

/// Difference-array entries of one slice boundary.
#[derive(Clone, Debug, Default)]
struct Delta {
    by_category: [i64; CATEGORY_COUNT],
    by_scope: HashMap<u32, i64>,
    by_stack: HashMap<u32, [i64; 2]>,
}

impl Delta {
    /// Add `other` to this one.
    fn absorb(&mut self, other: Delta) {
        for (sum, d) in self.by_category.iter_mut().zip(other.by_category) {
            *sum += d;
        }
        for (scope, d) in other.by_scope {
            *self.by_scope.entry(scope).or_default() += d;
        }
        for (stack, [b, n]) in other.by_stack {
            let e = self.by_stack.entry(stack).or_default();
            e[0] += b;
            e[1] += n;
        }
    }

    /// Add `sign` × `life`.
    fn add(&mut self, life: &Life, sign: i64, detail: Detail) {
        let size = life.size as i64 * sign;
        self.by_category[life.category.index()] += size;
        if detail.scopes {
            *self.by_scope.entry(life.scope).or_default() += size;
        }
        if detail.stacks {
            let e = self.by_stack.entry(life.stack).or_default();
            e[0] += size;
            e[1] += sign;
        }
    }

    /// Add this one's sums to `row`.
    fn add_to(&self, row: &mut SliceRow) {
        for (bytes, d) in row.by_category.iter_mut().zip(self.by_category) {
            *bytes = bytes.wrapping_add_signed(d);
        }
        for (scope, d) in &self.by_scope {
            if *d != 0 {
                let e = row.by_scope.entry(*scope).or_default();
                *e = e.wrapping_add_signed(*d);
            }
        }
        for (stack, [b, n]) in &self.by_stack {
            if *b != 0 || *n != 0 {
                let e = row.by_stack.entry(*stack).or_default();
                (e.0, e.1) = (e.0.wrapping_add_signed(*b), e.1.wrapping_add_signed(*n));
            }
        }
    }
}

/// What a track adds up besides categories.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Detail {
    /// By scope (module).
    pub scopes: bool,
    /// By stack (allocation site).
    pub stacks: bool,
}

/// The slices of one device being built.
#[derive(Clone, Debug)]
pub struct SliceTrack {
    spec: SliceSpec,
    detail: Detail,
    /// Whether an adaptive spec's start has been set (at the first event).
    started: bool,
    closed: Vec<SliceRow>,
    /// `deltas[k]` applies from closed row `k` on; one more than the rows (past the last).
    deltas: Vec<Delta>,
    open: Option<SliceRow>,
    /// Bytes of blocks already freed that were alive at the open slice's candidate peak.
    freed_alive_at_open: Delta,
}

impl SliceTrack {
    /// Slices cut by `spec`, adding up categories and `detail`.
    pub fn new(spec: SliceSpec, detail: Detail) -> SliceTrack {
        SliceTrack {
            spec,
            detail,
            started: false,
            closed: vec![],
            deltas: vec![Delta::default()],
            open: None,
            freed_alive_at_open: Delta::default(),
        }
    }

    /// An event of this device at `t` (record `index`), after which `allocated` and `reserved`
    /// bytes were in use. Call before [`SliceTrack::classified`] for a free at the same record.
    pub fn event(&mut self, t: u64, index: u64, allocated: u64, reserved: u64) {
        if self.spec.adaptive && !self.started {
            (self.spec.start, self.started) = (t, true);
        }
        let mut slice = self.spec.slice_of(t);
        while slice >= self.spec.count {
            self.coarsen();
            slice = self.spec.slice_of(t);
        }
        if self.open.as_ref().is_some_and(|o| o.slice != slice) {
            self.close();
        }
        match &mut self.open {
            None => {
                self.open = Some(SliceRow {
                    slice,
                    t,
                    index,
                    allocated,
                    reserved,
                    ..SliceRow::default()
                });
                self.freed_alive_at_open = Delta::default();
            }
            Some(open) => {
                if allocated > open.allocated {
                    (open.t, open.index, open.allocated) = (t, index, allocated);
                    self.freed_alive_at_open = Delta::default();
                }
                open.reserved = open.reserved.max(reserved);
            }
        }
    }

    /// A block of this device was classified.
    pub fn classified(&mut self, life: Life) {
        let lo = self.closed.partition_point(|r| r.index < life.born);
        let hi = self.closed.partition_point(|r| r.index < life.died);
        if lo < hi {
            self.deltas[lo].add(&life, 1, self.detail);
            self.deltas[hi].add(&life, -1, self.detail);
        }
        if let Some(open) = &self.open
            && life.alive_at(open.index)
        {
            self.freed_alive_at_open.add(&life, 1, self.detail);
        }
    }

    /// Close the open slice: its peak is final.
    fn close(&mut self) {
        let Some(mut row) = self.open.take() else {
            return;
        };
        std::mem::take(&mut self.freed_alive_at_open).add_to(&mut row);
        self.closed.push(row);
        self.deltas.push(Delta::default());
    }

    /// Double an adaptive spec's width: closed rows that fall in one slice merge into the one
    /// with the highest peak (its composition is the sum of the deltas up to it; the deltas
    /// after it move to the next row kept). The open row keeps its own (it may share its slice
    /// with the last closed row until both merge at a later widening).
    fn coarsen(&mut self) {
        self.spec.width = self.spec.width.saturating_mul(2);
        let rows = std::mem::take(&mut self.closed);
        let mut deltas = std::mem::take(&mut self.deltas).into_iter();
        let mut carry = Delta::default();
        let mut rows = rows.into_iter().peekable();
        while let Some(first) = rows.next() {
            let slice = first.slice / 2;
            let mut run = vec![(first, deltas.next().unwrap_or_default())];
            while let Some(next) = rows.next_if(|r| r.slice / 2 == slice) {
                run.push((next, deltas.next().unwrap_or_default()));
            }
            let kept = (0..run.len())
                .reduce(|best, i| {
                    if run[i].0.allocated > run[best].0.allocated {
                        i
                    } else {
                        best
                    }
                })
                .unwrap_or(0);
            let mut delta = std::mem::take(&mut carry);
            let mut kept_row = None;
            for (i, (row, d)) in run.into_iter().enumerate() {
                if i <= kept {
                    delta.absorb(d);
                } else {
                    carry.absorb(d);
                }
                if i == kept {
                    kept_row = Some(row);
                }
            }
            let mut row = kept_row.expect("the run holds its kept row");
            row.slice = slice;
            self.closed.push(row);
            self.deltas.push(delta);
        }
        // Past the last row: what was carried, and the old boundary delta.
        let mut last = carry;
        for d in deltas {
            last.absorb(d);
        }
        self.deltas.push(last);
        if let Some(open) = &mut self.open {
            open.slice /= 2;
        }
    }

    /// Close the last slice (before the blocks live at the end are classified).
    pub fn end_of_events(&mut self) {
        self.close();
    }

    /// The rows, once every block has been classified.
    pub fn finish(mut self) -> Vec<SliceRow> {
        self.close();
        // An adaptive spec ends with at most half its slices used.
        while self.spec.adaptive
            && self
                .closed
                .last()
                .is_some_and(|r| r.slice >= self.spec.count / 2)
        {
            self.coarsen();
        }
        let mut running = Delta::default();
        for (row, delta) in self.closed.iter_mut().zip(self.deltas.drain(..)) {
            running.absorb(delta);
            running.by_scope.retain(|_, sum| *sum != 0);
            running.by_stack.retain(|_, [b, n]| *b != 0 || *n != 0);
            running.add_to(row);
        }
        self.closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random allocations and frees, sliced; each row must equal a recount of the blocks alive
    /// at its peak.
    #[test]
    fn rows_equal_a_recount() {
        let rows = recounted(SliceSpec::over(0, 3000, 7));
        assert_eq!(rows, 7);
    }

    #[test]
    fn adaptive_rows_equal_a_recount() {
        // Times in ns from 5 000 to 5 000 + 3 000 × 7 919: 1 µs slices widen many times.
        let rows = recounted(SliceSpec::adaptive(6));
        assert!((4..=8).contains(&rows), "{rows} rows");
    }

    /// Random allocations and frees cut by `spec`: every row must equal a recount; returns
    /// how many rows there were.
    fn recounted(spec: SliceSpec) -> usize {
        let mut rng = 0x2545f4914f6cdd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let time = |index: u64| {
            if spec.adaptive {
                5_000 + index * 7_919
            } else {
                index
            }
        };
        let mut track = SliceTrack::new(
            spec,
            Detail {
                scopes: true,
                stacks: true,
            },
        );
        let mut live: Vec<Life> = vec![];
        let mut all: Vec<Life> = vec![];
        let mut allocated = 0;
        for index in 0..3000u64 {
            let free = !live.is_empty() && next() % 2 == 0;
            if free {
                let mut life = live.swap_remove((next() % live.len() as u64) as usize);
                allocated -= life.size;
                track.event(time(index), index, allocated, 0);
                life.died = index;
                track.classified(life);
                all.push(life);
            } else {
                let size = 1 + next() % 1000;
                allocated += size;
                live.push(Life {
                    born: index,
                    died: u64::MAX,
                    size,
                    category: Category::ALL[(next() % 8) as usize],
                    scope: (next() % 3) as u32,
                    stack: (next() % 5) as u32,
                });
                track.event(time(index), index, allocated, 0);
            }
        }
        track.end_of_events();
        for life in live {
            track.classified(life);
            all.push(life);
        }
        let rows = track.finish();
        let count = rows.len();
        for row in rows {
            let mut expected = [0u64; CATEGORY_COUNT];
            let mut scopes: HashMap<u32, u64> = HashMap::new();
            for l in all.iter().filter(|l| l.alive_at(row.index)) {
                expected[l.category.index()] += l.size;
                *scopes.entry(l.scope).or_default() += l.size;
            }
            assert_eq!(row.by_category, expected, "row {row:?}");
            assert_eq!(row.by_category.iter().sum::<u64>(), row.allocated);
            scopes.retain(|_, b| *b != 0);
            assert_eq!(row.by_scope, scopes);
            let blocks = all.iter().filter(|l| l.alive_at(row.index)).count() as u64;
            assert_eq!(row.by_stack.values().map(|(_, n)| n).sum::<u64>(), blocks);
        }
        count
    }
}
