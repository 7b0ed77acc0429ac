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

/// How time is cut: `count` slices of `width` ns from `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceSpec {
    /// The first slice's start, ns since the trace's base.
    pub start: u64,
    /// Each slice's width, ns (≥ 1).
    pub width: u64,
    /// How many slices.
    pub count: u64,
}

impl SliceSpec {
    /// `count` slices over `[start, end]`.
    pub fn over(start: u64, end: u64, count: u64) -> SliceSpec {
        let count = count.max(1);
        SliceSpec {
            start,
            width: ((end.saturating_sub(start)) / count + 1).max(1),
            count,
        }
    }

    /// The slice of time `t`.
    fn slice_of(&self, t: u64) -> u64 {
        (t.saturating_sub(self.start) / self.width).min(self.count - 1)
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
}

impl Life {
    /// Whether it was allocated at the moment after record `index`.
    pub fn alive_at(&self, index: u64) -> bool {
        self.born <= index && index < self.died
    }
}

/// Difference-array entries of one slice boundary.
#[derive(Clone, Debug, Default)]
struct Delta {
    by_category: [i64; CATEGORY_COUNT],
    by_scope: HashMap<u32, i64>,
}

/// The slices of one device being built.
#[derive(Debug)]
pub struct SliceTrack {
    spec: SliceSpec,
    by_scope: bool,
    closed: Vec<SliceRow>,
    deltas: Vec<Delta>,
    open: Option<SliceRow>,
    /// Bytes of blocks already freed that were alive at the open slice's candidate peak.
    freed_alive_at_open: Delta,
}

impl SliceTrack {
    /// Slices cut by `spec`; `by_scope`: also by module.
    pub fn new(spec: SliceSpec, by_scope: bool) -> SliceTrack {
        SliceTrack {
            spec,
            by_scope,
            closed: vec![],
            deltas: vec![Delta::default()],
            open: None,
            freed_alive_at_open: Delta::default(),
        }
    }

    /// An event of this device at `t` (record `index`), after which `allocated` and `reserved`
    /// bytes were in use. Call before [`SliceTrack::classified`] for a free at the same record.
    pub fn event(&mut self, t: u64, index: u64, allocated: u64, reserved: u64) {
        let slice = self.spec.slice_of(t);
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
            let size = life.size as i64;
            self.deltas[lo].by_category[life.category.index()] += size;
            self.deltas[hi].by_category[life.category.index()] -= size;
            if self.by_scope {
                *self.deltas[lo].by_scope.entry(life.scope).or_default() += size;
                *self.deltas[hi].by_scope.entry(life.scope).or_default() -= size;
            }
        }
        if let Some(open) = &self.open
            && life.alive_at(open.index)
        {
            let extra = &mut self.freed_alive_at_open;
            extra.by_category[life.category.index()] += life.size as i64;
            if self.by_scope {
                *extra.by_scope.entry(life.scope).or_default() += life.size as i64;
            }
        }
    }

    /// Close the open slice: its peak is final.
    fn close(&mut self) {
        let Some(mut row) = self.open.take() else {
            return;
        };
        let extra = std::mem::take(&mut self.freed_alive_at_open);
        for (bytes, add) in row.by_category.iter_mut().zip(extra.by_category) {
            *bytes += add as u64;
        }
        for (scope, add) in extra.by_scope {
            *row.by_scope.entry(scope).or_default() += add as u64;
        }
        self.closed.push(row);
        self.deltas.push(Delta::default());
    }

    /// Close the last slice (before the blocks live at the end are classified).
    pub fn end_of_events(&mut self) {
        self.close();
    }

    /// The rows, once every block has been classified.
    pub fn finish(mut self) -> Vec<SliceRow> {
        self.close();
        let mut running = Delta::default();
        for (row, delta) in self.closed.iter_mut().zip(&self.deltas) {
            for (sum, d) in running.by_category.iter_mut().zip(delta.by_category) {
                *sum += d;
            }
            for (scope, d) in &delta.by_scope {
                *running.by_scope.entry(*scope).or_default() += d;
            }
            running.by_scope.retain(|_, sum| *sum != 0);
            for (bytes, sum) in row.by_category.iter_mut().zip(running.by_category) {
                *bytes += sum as u64;
            }
            for (scope, sum) in &running.by_scope {
                if *sum != 0 {
                    *row.by_scope.entry(*scope).or_default() += *sum as u64;
                }
            }
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
        let mut rng = 0x2545f4914f6cdd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let spec = SliceSpec::over(0, 3000, 7);
        let mut track = SliceTrack::new(spec, true);
        let mut live: Vec<Life> = vec![];
        let mut all: Vec<Life> = vec![];
        let mut allocated = 0;
        for index in 0..3000u64 {
            let free = !live.is_empty() && next() % 2 == 0;
            if free {
                let mut life = live.swap_remove((next() % live.len() as u64) as usize);
                allocated -= life.size;
                track.event(index, index, allocated, 0);
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
                });
                track.event(index, index, allocated, 0);
            }
        }
        track.end_of_events();
        for life in live {
            track.classified(life);
            all.push(life);
        }
        let rows = track.finish();
        assert_eq!(rows.len(), 7);
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
        }
    }
}
