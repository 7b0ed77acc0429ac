//! [`FreeList`]: the free blocks of one pool, ordered by `(size, address)` for best fit.
//!
//! Layout: an ordered map from each distinct *size* to a *bucket* of the free blocks of exactly
//! that size, kept sorted by address from high to low, so the lowest address — the one best fit
//! takes — is at the end of the vector.
//!
//! Why not one ordered map keyed by `(size, address)`: a training loop allocates the same few
//! hundred tensor shapes over and over, so free lists hold many blocks of few distinct sizes. Here
//! an exact-size hit searches a small tree of sizes and pops a vector's last element, and the
//! matching free pushes it back; a flat map would search and rebalance a tree of all free blocks
//! twice per pair. Buckets that become empty are kept (with their capacity) so steady-state churn
//! allocates nothing, and are swept out when they are more than a quarter of all buckets.
//!
//! Worst case: inserting or removing a block in a bucket of `n` blocks moves up to `n` entries
//! (16 bytes each); in practice the freed block is the one just taken, which goes back at the end.

use std::collections::BTreeMap;

/// Index of a block in the pools' block table.
pub(super) type BlockId = u32;

/// Blocks of one size: `(address, block)`, sorted by descending address.
type Bucket = Vec<(u64, BlockId)>;

/// The free blocks of one pool. See the module docs.
#[derive(Debug, Default)]
pub(super) struct FreeList {
    buckets: BTreeMap<u64, Bucket>,
    len: usize,
    empty_buckets: usize,
}

impl FreeList {
    /// Number of free blocks.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no free blocks.
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Add a free block.
    #[inline]
    pub(super) fn insert(&mut self, size: u64, address: u64, id: BlockId) {
        let bucket = self.buckets.entry(size).or_default();
        if bucket.is_empty() && bucket.capacity() > 0 {
            self.empty_buckets -= 1;
        }
        // Descending by address: the common case (re-inserting the lowest) lands at the end.
        let at = match bucket.last() {
            Some(&(last, _)) if last > address => bucket.len(),
            _ => bucket.partition_point(|&(a, _)| a > address),
        };
        debug_assert!(
            bucket.get(at).is_none_or(|&(a, _)| a != address),
            "block listed twice"
        );
        bucket.insert(at, (address, id));
        self.len += 1;
    }

    /// Remove the free block of `size` at `address`; returns its id.
    #[inline]
    pub(super) fn remove(&mut self, size: u64, address: u64) -> Option<BlockId> {
        let bucket = self.buckets.get_mut(&size)?;
        let at = match bucket.last() {
            Some(&(last, _)) if last == address => bucket.len() - 1,
            _ => {
                let at = bucket.partition_point(|&(a, _)| a > address);
                if bucket.get(at).is_none_or(|&(a, _)| a != address) {
                    return None;
                }
                at
            }
        };
        let (_, id) = bucket.remove(at);
        self.len -= 1;
        if bucket.is_empty() {
            self.note_empty_bucket();
        }
        Some(id)
    }

    /// The best fit for `size`: the block with the smallest `(size, address)` whose size is at
    /// least `size`, as `(size, address, id)`.
    #[inline]
    pub(super) fn best_fit(&self, size: u64) -> Option<(u64, u64, BlockId)> {
        self.buckets
            .range(size..)
            .find_map(|(&s, bucket)| bucket.last().map(|&(address, id)| (s, address, id)))
    }

    /// The largest free block's size.
    pub(super) fn largest(&self) -> Option<u64> {
        self.buckets
            .iter()
            .rev()
            .find(|(_, b)| !b.is_empty())
            .map(|(&s, _)| s)
    }

    /// Every free block as `(size, address, id)`, in `(size, address)` order.
    pub(super) fn iter(&self) -> impl DoubleEndedIterator<Item = (u64, u64, BlockId)> + '_ {
        self.buckets.iter().flat_map(|(&size, bucket)| {
            bucket
                .iter()
                .rev()
                .map(move |&(address, id)| (size, address, id))
        })
    }

    /// Blocks of at least `size`, in `(size, address)` order.
    pub(super) fn iter_from(
        &self,
        size: u64,
    ) -> impl DoubleEndedIterator<Item = (u64, u64, BlockId)> + '_ {
        self.buckets.range(size..).flat_map(|(&size, bucket)| {
            bucket
                .iter()
                .rev()
                .map(move |&(address, id)| (size, address, id))
        })
    }

    fn note_empty_bucket(&mut self) {
        self.empty_buckets += 1;
        if self.empty_buckets > 8 && self.empty_buckets * 4 > self.buckets.len() {
            self.buckets.retain(|_, b| !b.is_empty());
            self.empty_buckets = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_is_smallest_size_then_lowest_address() {
        let mut l = FreeList::default();
        l.insert(4096, 0x3000, 1);
        l.insert(4096, 0x1000, 2);
        l.insert(8192, 0x0, 3);
        l.insert(4096, 0x2000, 4);
        assert_eq!(l.best_fit(4000), Some((4096, 0x1000, 2)));
        assert_eq!(l.best_fit(4097), Some((8192, 0x0, 3)));
        assert_eq!(l.best_fit(8193), None);
        let all: Vec<_> = l.iter().map(|(s, a, _)| (s, a)).collect();
        assert_eq!(
            all,
            vec![(4096, 0x1000), (4096, 0x2000), (4096, 0x3000), (8192, 0)]
        );
        assert_eq!(l.largest(), Some(8192));
        assert_eq!(l.len(), 4);
    }

    #[test]
    fn empty_buckets_are_skipped_and_swept() {
        let mut l = FreeList::default();
        for i in 0..200u64 {
            l.insert(512 * (i + 1), 0x10_0000 * i, i as u32);
        }
        for i in 0..199u64 {
            assert_eq!(l.remove(512 * (i + 1), 0x10_0000 * i), Some(i as u32));
        }
        assert_eq!(l.best_fit(512), Some((512 * 200, 0x10_0000 * 199, 199)));
        assert!(l.buckets.len() < 200, "empty buckets were swept");
        assert_eq!(l.remove(512, 0), None);
        assert_eq!(l.remove(512 * 200, 1), None, "wrong address");
        assert_eq!(l.len(), 1);
        assert_eq!(l.largest(), Some(512 * 200));
    }
}
