//! [`Col`]: one column of a table being gathered for the next batch, as Parquet's column writers
//! take it: the present values, dense, and for a nullable column its definition levels (1
//! present, 0 null).
//!
//! A row appends to one vector and nothing else: no validity bitmap to pack, no levels to
//! derive from it and no values to gather again, which Arrow arrays would have cost the writer
//! (about a quarter of the export's time, BENCHMARKS.md "The export's speed"). Nor are the
//! levels written one per row while they are all the same — a column always present on a
//! batch's rows (a device, a size) or always null there (a pool, a name): they are kept as one
//! level and a count ([`Levels::Uniform`]), and spelled out only from the first row that
//! differs.

use parquet::data_type::ByteArray;

/// A column's values gathered since the last batch (see the module docs).
#[derive(Debug, Default)]
pub struct Col<T> {
    /// The present values, in row order.
    pub values: Vec<T>,
    /// A nullable column's definition levels, one per row — once its rows' levels differ;
    /// empty while they are all `first` (and always for a required column).
    defs: Vec<i16>,
    /// The first row's level.
    first: i16,
    /// Rows gathered.
    rows: usize,
    /// Room kept for the levels.
    capacity: usize,
}

/// A batch's definition levels (see [`Col::levels`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Levels<'a> {
    /// A required column: none.
    Required,
    /// Every one of the rows has this level.
    Uniform(i16, usize),
    /// One per row.
    Each(&'a [i16]),
}

impl<T> Col<T> {
    /// An empty column with room for `rows`; `nullable` says whether it gets levels (the room
    /// for them is taken when they are first spelled out).
    pub fn with_capacity(rows: usize, nullable: bool) -> Self {
        Col {
            values: Vec::with_capacity(rows),
            defs: Vec::new(),
            first: 0,
            rows: 0,
            capacity: if nullable { rows } else { 0 },
        }
    }

    /// Add a value to a required column.
    #[inline(always)]
    pub fn push(&mut self, value: T) {
        self.values.push(value);
        self.rows += 1;
    }

    /// Add a value, or a null, to a nullable column.
    #[inline(always)]
    pub fn push_opt(&mut self, value: Option<T>) {
        let level = i16::from(value.is_some());
        if let Some(v) = value {
            self.values.push(v);
        }
        if !self.defs.is_empty() {
            self.defs.push(level);
        } else if self.rows == 0 {
            self.first = level;
        } else if level != self.first {
            self.spell_out(level);
        }
        self.rows += 1;
    }

    /// The first row whose level differs from those before: the levels are written out.
    #[cold]
    #[inline(never)]
    fn spell_out(&mut self, level: i16) {
        self.defs.reserve(self.capacity.max(self.rows + 1));
        self.defs.resize(self.rows, self.first);
        self.defs.push(level);
    }

    /// Rows gathered.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The rows' definition levels; `nullable` says whether the column has them.
    pub fn levels(&self, nullable: bool) -> Levels<'_> {
        if !nullable {
            Levels::Required
        } else if self.defs.is_empty() {
            Levels::Uniform(self.first, self.rows)
        } else {
            Levels::Each(&self.defs)
        }
    }

    /// Forget the rows (the room stays).
    pub fn clear(&mut self) {
        self.values.clear();
        self.defs.clear();
        self.first = 0;
        self.rows = 0;
    }
}

/// A column of a table, whatever its type: what [`super::table_file::TableFile::write`] takes.
pub enum ColRef<'a> {
    /// `int32`.
    Int32(&'a mut Col<i32>),
    /// `int64`.
    Int64(&'a mut Col<i64>),
    /// `string`.
    Str(&'a mut Col<ByteArray>),
    /// `boolean`.
    Bool(&'a mut Col<bool>),
}

impl ColRef<'_> {
    /// The column's definition levels ([`Col::levels`]).
    pub fn levels(&self, nullable: bool) -> Levels<'_> {
        match self {
            ColRef::Int32(c) => c.levels(nullable),
            ColRef::Int64(c) => c.levels(nullable),
            ColRef::Str(c) => c.levels(nullable),
            ColRef::Bool(c) => c.levels(nullable),
        }
    }

    /// Forget the column's rows.
    pub fn clear(&mut self) {
        match self {
            ColRef::Int32(c) => c.clear(),
            ColRef::Int64(c) => c.clear(),
            ColRef::Str(c) => c.clear(),
            ColRef::Bool(c) => c.clear(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nulls_are_levels_and_only_present_values_are_kept() {
        let mut c = Col::<i64>::with_capacity(4, true);
        for v in [Some(1), None, Some(-3)] {
            c.push_opt(v);
        }
        assert_eq!(c.values, [1, -3]);
        assert_eq!(c.levels(true), Levels::Each(&[1, 0, 1]));
        c.clear();
        assert!(c.values.is_empty());
        assert_eq!(c.levels(true), Levels::Uniform(0, 0));
        let mut r = Col::<i32>::with_capacity(2, false);
        r.push(7);
        assert_eq!(r.values, [7]);
        assert_eq!(
            r.levels(false),
            Levels::Required,
            "a required column has no levels"
        );
    }

    #[test]
    fn equal_levels_stay_one_level_and_a_count() {
        let mut c = Col::<i64>::with_capacity(4, true);
        for _ in 0..3 {
            c.push_opt(None);
        }
        assert_eq!(c.levels(true), Levels::Uniform(0, 3));
        c.push_opt(Some(5));
        c.push_opt(None);
        assert_eq!(c.levels(true), Levels::Each(&[0, 0, 0, 1, 0]));
        assert_eq!((c.values.as_slice(), c.rows()), (&[5][..], 5));
        c.clear();
        for v in 0..4 {
            c.push_opt(Some(v));
        }
        assert_eq!(c.levels(true), Levels::Uniform(1, 4));
    }
}
