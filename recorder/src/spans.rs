//! Mapped memory as segments. An expandable segment's memory comes and goes in
//! [`SegmentMap`](crate::schema::Record::SegmentMap) and
//! [`SegmentUnmap`](crate::schema::Record::SegmentUnmap) records of any granule-aligned size;
//! a reader keeps it as one segment per contiguous mapped run of a pool, as PyTorch's snapshots
//! report expandable segments: a map joins the runs it touches, an unmap cuts its range out of
//! the run that holds it (an unmap never spans two runs: it frees granules of one free block).

use std::collections::BTreeMap;

/// A segment in a map keyed by its address (through a key function, so that a map may be
/// keyed by device and address).
pub trait Span: Copy {
    /// Its address.
    fn address(&self) -> u64;
    /// Its size.
    fn size(&self) -> u64;
    /// Its pool byte.
    fn pool(&self) -> u8;
    /// The same segment moved to `address` with `size`.
    fn with(self, address: u64, size: u64) -> Self;
}

/// Add the mapped run `span`, joining the runs of its pool that end where it begins or begin
/// where it ends. `key` makes a map key from an address and must keep their order.
pub fn map<K: Ord + Copy, S: Span>(spans: &mut BTreeMap<K, S>, key: impl Fn(u64) -> K, span: S) {
    let (mut start, mut size) = (span.address(), span.size());
    let end = start + size;
    if let Some((&k, &before)) = spans.range(key(0)..key(start)).next_back()
        && before.pool() == span.pool()
        && before.address() + before.size() == start
    {
        spans.remove(&k);
        start = before.address();
        size += before.size();
    }
    if let Some(after) = spans.get(&key(end)).copied()
        && after.pool() == span.pool()
    {
        spans.remove(&key(end));
        size += after.size();
    }
    spans.insert(key(start), span.with(start, size));
}

/// Cut `[address, address + size)` out of the run that holds it. Returns the run as it was, or
/// `None` when no run holds the whole range (the map came before the trace's first file).
pub fn unmap<K: Ord + Copy, S: Span>(
    spans: &mut BTreeMap<K, S>,
    key: impl Fn(u64) -> K,
    address: u64,
    size: u64,
) -> Option<S> {
    let (&k, &run) = spans.range(key(0)..=key(address)).next_back()?;
    let run_end = run.address() + run.size();
    if address + size > run_end {
        return None;
    }
    spans.remove(&k);
    if run.address() < address {
        spans.insert(
            key(run.address()),
            run.with(run.address(), address - run.address()),
        );
    }
    if address + size < run_end {
        spans.insert(
            key(address + size),
            run.with(address + size, run_end - address - size),
        );
    }
    Some(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq)]
    struct S(u64, u64, u8);
    impl Span for S {
        fn address(&self) -> u64 {
            self.0
        }
        fn size(&self) -> u64 {
            self.1
        }
        fn pool(&self) -> u8 {
            self.2
        }
        fn with(self, address: u64, size: u64) -> Self {
            S(address, size, self.2)
        }
    }

    #[test]
    fn maps_join_and_unmaps_cut() {
        let mut m = BTreeMap::new();
        map(&mut m, |a| a, S(0, 2, 1));
        map(&mut m, |a| a, S(4, 2, 1));
        map(&mut m, |a| a, S(2, 2, 1));
        assert_eq!(m.values().copied().collect::<Vec<_>>(), [S(0, 6, 1)]);
        map(&mut m, |a| a, S(6, 2, 0));
        assert_eq!(m.len(), 2, "another pool does not join");
        assert_eq!(unmap(&mut m, |a| a, 2, 2), Some(S(0, 6, 1)));
        assert_eq!(
            m.values().copied().collect::<Vec<_>>(),
            [S(0, 2, 1), S(4, 2, 1), S(6, 2, 0)]
        );
        assert_eq!(unmap(&mut m, |a| a, 3, 2), None, "not mapped");
        assert_eq!(unmap(&mut m, |a| a, 0, 2), Some(S(0, 2, 1)));
        assert_eq!(m.len(), 2);
    }
}
