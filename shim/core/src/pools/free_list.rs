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
//! allocates nothing, and are swept out when they are more than a quarter of all buckets; their
//! vectors wait (up to [`SPARE_BUCKETS`]) for the next new sizes. A step that splits blocks
//! leaves remainders of sizes seen only in passing, one bucket each: before the spares, each
//! sweep freed those vectors and the next step allocated them again, a `malloc` and a `free` per
//! allocation of the step, whose cold lines were a tenth of what a pair touched (BENCHMARKS.md,
//! fifteenth session).
//!
//! Worst case: inserting or removing a block in a bucket of `n` blocks moves up to `n` entries
//! (16 bytes each); in practice the freed block is the one just taken, which goes back at the end.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;

/// Index of a block in the pools' block table.
pub(super) type BlockId = u32;

/// Blocks of one size: `(address, block)`, sorted by descending address.
type Bucket = Vec<(u64, BlockId)>;

/// How many swept buckets' vectors a free list keeps for new sizes.
const SPARE_BUCKETS: usize = 64;

/// The free blocks of one pool. See the module docs.
#[derive(Debug, Default)]
pub(super) struct FreeList {
    buckets: BTreeMap<u64, Bucket>,
    len: usize,
    empty_buckets: usize,
    /// Empty vectors of swept buckets, with their capacity, for the next new sizes.
    spare: Vec<Bucket>,
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
        let bucket = match self.buckets.entry(size) {
            Entry::Occupied(o) => {
                let bucket = o.into_mut();
                // An empty bucket that is kept was counted when it became empty.
                if bucket.is_empty() {
                    self.empty_buckets -= 1;
                }
                bucket
            }
            Entry::Vacant(v) => v.insert(self.spare.pop().unwrap_or_default()),
        };
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
            let spare = &mut self.spare;
            self.buckets.retain(|_, b| {
                if !b.is_empty() {
                    return true;
                }
                if spare.len() < SPARE_BUCKETS {
                    spare.push(std::mem::take(b));
                }
                false
            });
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

    #[test]
    fn swept_buckets_serve_new_sizes_without_allocating() {
        let mut l = FreeList::default();
        // A step's remainders: sizes seen once, each freed again before the next step.
        for step in 0..3u64 {
            for i in 0..40u64 {
                let size = 512 * (1000 * step + i + 1);
                l.insert(size, 0x10_0000 * i, i as u32);
                assert_eq!(l.remove(size, 0x10_0000 * i), Some(i as u32));
            }
            assert!(!l.spare.is_empty(), "step {step}: swept vectors are kept");
            assert!(l.spare.len() <= SPARE_BUCKETS);
            let spare = l.spare.len();
            let size = 512 * (1000 * step + 999);
            l.insert(size, 0x4000, 7);
            assert_eq!(l.spare.len(), spare - 1, "a new size takes a spare vector");
            assert!(l.buckets[&size].capacity() > 0);
            assert_eq!(l.remove(size, 0x4000), Some(7));
        }
        assert!(l.is_empty());
        // The empty buckets' count stays true: reusing a kept empty bucket uncounts it.
        let kept = *l.buckets.keys().next().expect("a kept empty bucket");
        let empty = l.empty_buckets;
        l.insert(kept, 0x8000, 9);
        assert_eq!(l.empty_buckets, empty - 1);
        assert_eq!(l.best_fit(1), Some((kept, 0x8000, 9)));
    }
}
