//! [`Blocks`]: the live blocks of a [`super::LiveState`], by `(device, address)`.
//!
//! Every allocation and free of a trace inserts or removes one, in the recorder's thread as the
//! trace is written and in every walk of the offline tools, so they live in a hash map: an
//! ordered map's search and rebalancing was about a tenth of `cachealloc export`'s time. What
//! needs them in address order — the block holding an address inside it (a category tag on a
//! view), a segment's blocks, a checkpoint — asks for it: [`Blocks::holding`] keeps a sorted
//! copy of the keys, made again only when blocks came or went since, and [`Blocks::ordered`]
//! sorts them.

use std::cell::RefCell;

use rustc_hash::FxHashMap;

use crate::schema::BlockState;

/// The live (allocated or pending) blocks, by `(device, address)` (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct Blocks {
    map: FxHashMap<(u32, u64), BlockState>,
    /// The keys in order, for [`Blocks::holding`]; `None` once a block came or went.
    sorted_keys: RefCell<Option<Vec<(u32, u64)>>>,
}

impl PartialEq for Blocks {
    fn eq(&self, other: &Self) -> bool {
        self.map == other.map
    }
}

impl Blocks {
    /// The block at `key` (its start).
    pub fn get(&self, key: &(u32, u64)) -> Option<&BlockState> {
        self.map.get(key)
    }

    /// Whether a block starts at `key`.
    pub fn contains_key(&self, key: &(u32, u64)) -> bool {
        self.map.contains_key(key)
    }

    /// Number of live blocks.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no block is live.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The blocks, in no particular order (for sums and counts; [`Blocks::ordered`] for order).
    pub fn values(&self) -> impl Iterator<Item = &BlockState> {
        self.map.values()
    }

    /// The blocks in `(device, address)` order.
    pub fn ordered(&self) -> OrderedBlocks<'_> {
        let mut blocks: Vec<&BlockState> = self.map.values().collect();
        blocks.sort_unstable_by_key(|b| (b.device, b.address));
        OrderedBlocks(blocks)
    }

    /// The live block of `device` that holds `address` (its start or inside it).
    pub fn holding(&self, device: u32, address: u64) -> Option<&BlockState> {
        if let Some(b) = self.map.get(&(device, address)) {
            return Some(b);
        }
        let key = {
            let mut sorted = self.sorted_keys.borrow_mut();
            let keys = sorted.get_or_insert_with(|| {
                let mut keys: Vec<(u32, u64)> = self.map.keys().copied().collect();
                keys.sort_unstable();
                keys
            });
            let below = keys.partition_point(|&k| k <= (device, address));
            *keys.get(below.checked_sub(1)?)?
        };
        let b = self.map.get(&key)?;
        (b.device == device && address < b.address + b.size.max(1)).then_some(b)
    }

    /// Keep only the blocks `keep` says to.
    pub fn retain(&mut self, mut keep: impl FnMut(&(u32, u64), &BlockState) -> bool) {
        let before = self.map.len();
        self.map.retain(|k, b| keep(k, b));
        if self.map.len() != before {
            *self.sorted_keys.get_mut() = None;
        }
    }

    /// Insert or replace the block at `key`; the one it replaced.
    pub(crate) fn insert(&mut self, key: (u32, u64), block: BlockState) -> Option<BlockState> {
        let old = self.map.insert(key, block);
        if old.is_none() {
            *self.sorted_keys.get_mut() = None;
        }
        old
    }

    /// Remove the block at `key`.
    pub(crate) fn remove(&mut self, key: &(u32, u64)) -> Option<BlockState> {
        let old = self.map.remove(key);
        if old.is_some() {
            *self.sorted_keys.get_mut() = None;
        }
        old
    }

    /// Forget every block.
    pub fn clear(&mut self) {
        self.map.clear();
        *self.sorted_keys.get_mut() = None;
    }
}

/// The blocks in `(device, address)` order ([`Blocks::ordered`]).
pub struct OrderedBlocks<'a>(Vec<&'a BlockState>);

impl<'a> OrderedBlocks<'a> {
    /// Every block, in order.
    pub fn iter(&self) -> impl Iterator<Item = &'a BlockState> + '_ {
        self.0.iter().copied()
    }

    /// The blocks of `device` starting in `[start, end)`, in address order.
    pub fn range(
        &self,
        device: u32,
        start: u64,
        end: u64,
    ) -> impl Iterator<Item = &'a BlockState> + '_ {
        let from = self
            .0
            .partition_point(|b| (b.device, b.address) < (device, start));
        let to = self
            .0
            .partition_point(|b| (b.device, b.address) < (device, end));
        self.0[from..to.max(from)].iter().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(device: u32, address: u64, size: u64) -> BlockState {
        BlockState {
            device,
            address,
            size,
            requested: size,
            stack: 0,
            pending: 0,
        }
    }

    #[test]
    fn holding_finds_the_block_around_an_address_and_follows_changes() {
        let mut b = Blocks::default();
        b.insert((0, 1000), block(0, 1000, 100));
        b.insert((0, 2000), block(0, 2000, 100));
        b.insert((1, 1000), block(1, 1000, 5000));
        assert_eq!(b.holding(0, 1000).map(|x| x.address), Some(1000));
        assert_eq!(b.holding(0, 1050).map(|x| x.address), Some(1000));
        assert_eq!(b.holding(0, 1100), None, "just past the block");
        assert_eq!(b.holding(0, 999), None, "below every block of the device");
        assert_eq!(b.holding(1, 5999).map(|x| x.device), Some(1));
        assert_eq!(b.holding(2, 1000), None, "another device");
        // The sorted keys are made again after a change.
        b.remove(&(0, 1000));
        assert_eq!(b.holding(0, 1050), None);
        b.insert((0, 1024), block(0, 1024, 64));
        assert_eq!(b.holding(0, 1050).map(|x| x.address), Some(1024));
        b.retain(|k, _| k.0 == 1);
        assert_eq!(b.holding(0, 1050), None);
        assert_eq!(b.holding(1, 1001).map(|x| x.address), Some(1000));
    }

    #[test]
    fn ordered_and_in_range_give_address_order() {
        let mut b = Blocks::default();
        for (d, a) in [(1, 5), (0, 30), (0, 10), (0, 20), (1, 1)] {
            b.insert((d, a), block(d, a, 1));
        }
        let ordered = b.ordered();
        let keys: Vec<(u32, u64)> = ordered.iter().map(|x| (x.device, x.address)).collect();
        assert_eq!(keys, [(0, 10), (0, 20), (0, 30), (1, 1), (1, 5)]);
        let r: Vec<u64> = ordered.range(0, 15, 31).map(|x| x.address).collect();
        assert_eq!(r, [20, 30]);
        assert_eq!(ordered.range(1, 6, 100).count(), 0);
        assert_eq!(ordered.range(0, 40, 10).count(), 0, "an empty range");
    }
}
