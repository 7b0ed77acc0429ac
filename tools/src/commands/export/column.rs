//! [`Col`]: one column of a table being gathered for the next batch, as Parquet's column writers
//! take it: the present values, dense, and for a nullable column one definition level per row
//! (1 present, 0 null).
//!
//! A row appends to one or two vectors and nothing else: no validity bitmap to pack, no levels
//! to derive from it and no values to gather again, which Arrow arrays would have cost the
//! writer (about a quarter of the export's time, BENCHMARKS.md "The export's speed").

use parquet::data_type::ByteArray;

/// A column's values gathered since the last batch (see the module docs).
#[derive(Debug, Default)]
pub struct Col<T> {
    /// The present values, in row order.
    pub values: Vec<T>,
    /// A nullable column's definition levels, one per row; empty for a required column.
    pub defs: Vec<i16>,
}

impl<T> Col<T> {
    /// An empty column with room for `rows`; `nullable` says whether it gets levels.
    pub fn with_capacity(rows: usize, nullable: bool) -> Self {
        Col {
            values: Vec::with_capacity(rows),
            defs: Vec::with_capacity(if nullable { rows } else { 0 }),
        }
    }

    /// Add a value to a required column.
    #[inline(always)]
    pub fn push(&mut self, value: T) {
        self.values.push(value);
    }

    /// Add a value, or a null, to a nullable column.
    #[inline(always)]
    pub fn push_opt(&mut self, value: Option<T>) {
        self.defs.push(i16::from(value.is_some()));
        if let Some(v) = value {
            self.values.push(v);
        }
    }

    /// Forget the rows (the room stays).
    pub fn clear(&mut self) {
        self.values.clear();
        self.defs.clear();
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
        assert_eq!(c.defs, [1, 0, 1]);
        c.clear();
        assert!(c.values.is_empty() && c.defs.is_empty());
        let mut r = Col::<i32>::with_capacity(2, false);
        r.push(7);
        assert_eq!(r.values, [7]);
        assert!(r.defs.is_empty(), "a required column has no levels");
    }
}
