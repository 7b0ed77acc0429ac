//! [`Pools::check_invariants`]: a full recount of the bookkeeping, run after every operation in
//! tests. It is O(blocks) and meant for tests and debugging, not for production paths.

use std::collections::{BTreeSet, HashSet};

use super::{BlockState, NIL, Pools};
use crate::sizes::{self, PoolKind};
use crate::stats::{StatArray, StatAt, Stats};

impl<F: Clone> Pools<F> {
    /// Check that the bookkeeping is consistent:
    ///
    /// * the blocks of each segment tile it exactly, in address order, with consistent links;
    /// * no two adjacent blocks of a segment are both free (they would have been merged), nor
    ///   both unmapped and idle;
    /// * unmapped blocks lie only in expandable segments, cover whole granules, and are in their
    ///   segment's unmapped index exactly when not busy; each stream and pool has at most one
    ///   expandable segment, and `reserved_bytes` counts their mapped blocks;
    /// * every block belongs to its segment's stream;
    /// * the free lists (plus the unlisted rest) hold exactly the free blocks, each in its
    ///   stream's list of its pool;
    /// * the active map holds exactly the allocated blocks; the open and pending batches hold
    ///   exactly the pending-free blocks, each once;
    /// * every current stat equals a recount.
    ///
    /// Returns a description of the first violation found.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut recount = Stats::default();
        let mut free_seen = BTreeSet::new();
        let mut active_seen = HashSet::new();
        let mut pending_seen = HashSet::new();
        let mut segments_seen = 0usize;

        for (segment_id, seg) in self.segments.iter().enumerate() {
            let Some(seg) = seg else { continue };
            segments_seen += 1;
            if self.segment_index.get(&seg.address) != Some(&(segment_id as u32)) {
                return Err(format!(
                    "segment {:#x} missing from the address index",
                    seg.address
                ));
            }
            if seg.expandable {
                let listed = self
                    .ranges
                    .iter()
                    .filter(|&&(stream, pool, id)| {
                        stream == seg.stream && pool == seg.pool && id == segment_id as u32
                    })
                    .count();
                if listed != 1 || self.expandable.is_none() {
                    return Err(format!(
                        "expandable segment {:#x} is listed {listed} times as its stream's range",
                        seg.address
                    ));
                }
            } else {
                recount
                    .segment
                    .increase(StatAt::new(seg.pool, seg.stream), 1);
                recount
                    .reserved_bytes
                    .increase(StatAt::new(seg.pool, seg.stream), seg.size);
                if sizes::is_oversize(seg.size, self.max_split_size) {
                    recount.oversize_segments.increase(1);
                }
            }
            let mut indexed_unmapped = 0;
            let mut previous_unmapped_idle = false;
            let mut expected_address = seg.address;
            let mut prev = NIL;
            let mut id = seg.first;
            let mut previous_free = false;
            while id != NIL {
                let b = &self.blocks[id as usize];
                let here = format!(
                    "block {:#x}+{} of segment {:#x}",
                    b.address, b.size, seg.address
                );
                if b.address != expected_address {
                    return Err(format!(
                        "{here}: expected to start at {expected_address:#x}"
                    ));
                }
                if b.size == 0 || !b.size.is_multiple_of(sizes::MIN_BLOCK_SIZE) {
                    return Err(format!("{here}: size is not a positive multiple of 512"));
                }
                if b.prev != prev
                    || b.segment != segment_id as u32
                    || b.pool != seg.pool
                    || b.stream != seg.stream
                {
                    return Err(format!("{here}: bad prev link, segment, pool or stream"));
                }
                let free = b.state == BlockState::Free;
                if free && previous_free {
                    return Err(format!("{here}: two adjacent free blocks were not merged"));
                }
                previous_free = free;
                let unmapped_idle = b.state == BlockState::Unmapped && !b.busy;
                if unmapped_idle && previous_unmapped_idle {
                    return Err(format!(
                        "{here}: two adjacent unmapped blocks were not merged"
                    ));
                }
                previous_unmapped_idle = unmapped_idle;
                if b.busy && b.state != BlockState::Unmapped {
                    return Err(format!("{here}: busy but {:?}", b.state));
                }
                if seg.expandable && b.state != BlockState::Unmapped {
                    recount.reserved_bytes.increase(b.stat_at(), b.size);
                }
                match b.state {
                    BlockState::Unmapped => {
                        let g = self.expandable.map_or(0, |e| e.granularity);
                        if !seg.expandable
                            || g == 0
                            || !b.address.is_multiple_of(g)
                            || !b.size.is_multiple_of(g)
                        {
                            return Err(format!(
                                "{here}: unmapped, but not whole granules of an expandable segment"
                            ));
                        }
                        if seg.unmapped.get(&b.address) == Some(&id) {
                            indexed_unmapped += 1;
                            if b.busy {
                                return Err(format!("{here}: busy, yet in the unmapped index"));
                            }
                        } else if !b.busy {
                            return Err(format!("{here}: idle, yet not in the unmapped index"));
                        }
                    }
                    BlockState::Free => {
                        free_seen.insert((b.stream, b.pool, b.size, b.address, id));
                        if b.is_split() {
                            recount.inactive_split.increase(b.stat_at(), 1);
                            recount.inactive_split_bytes.increase(b.stat_at(), b.size);
                        }
                    }
                    BlockState::Active | BlockState::PendingFree => {
                        if b.requested > b.size {
                            return Err(format!(
                                "{here}: requested {} exceeds the block",
                                b.requested
                            ));
                        }
                        if b.state == BlockState::Active {
                            active_seen.insert(id);
                            recount.allocation.increase(b.stat_at(), 1);
                            recount.allocated_bytes.increase(b.stat_at(), b.size);
                            if sizes::is_oversize(b.size, self.max_split_size) {
                                recount.oversize_allocations.increase(1);
                            }
                        } else {
                            pending_seen.insert(id);
                        }
                        recount.active.increase(b.stat_at(), 1);
                        recount.active_bytes.increase(b.stat_at(), b.size);
                        recount.requested_bytes.increase(b.stat_at(), b.requested);
                    }
                }
                expected_address += b.size;
                prev = id;
                id = b.next;
            }
            if seg.unmapped.len() != indexed_unmapped {
                return Err(format!(
                    "segment {:#x}: the unmapped index has {} entries for {indexed_unmapped} blocks",
                    seg.address,
                    seg.unmapped.len()
                ));
            }
            if expected_address != seg.address + seg.size {
                return Err(format!(
                    "segment {:#x}: blocks cover {} of {} bytes",
                    seg.address,
                    expected_address - seg.address,
                    seg.size
                ));
            }
        }

        // Mappings: disjoint, inside expandable segments, and every mapped block inside them.
        let mut previous_end = 0;
        for (&address, &size) in &self.mappings {
            if address < previous_end || size == 0 {
                return Err(format!("mapping {address:#x}+{size} overlaps another"));
            }
            previous_end = address + size;
            let inside = self
                .segment_index
                .range(..=address)
                .next_back()
                .map(|(_, &id)| self.segment(id))
                .is_some_and(|seg| seg.expandable && address + size <= seg.address + seg.size);
            if !inside {
                return Err(format!("mapping {address:#x}+{size} outside every range"));
            }
        }
        for seg in self.segments.iter().flatten().filter(|seg| seg.expandable) {
            let mut id = seg.first;
            while id != NIL {
                let b = &self.blocks[id as usize];
                if b.state != BlockState::Unmapped {
                    let covered = self
                        .mappings
                        .range(..b.address + b.size)
                        .rev()
                        .take_while(|&(&address, &size)| address + size > b.address)
                        .map(|(&address, &size)| {
                            (address + size).min(b.address + b.size) - address.max(b.address)
                        })
                        .sum::<u64>();
                    if covered != b.size {
                        return Err(format!(
                            "block {:#x}+{} is {:?} but only {covered} bytes of it are mapped",
                            b.address, b.size, b.state
                        ));
                    }
                }
                id = b.next;
            }
        }

        self.check_parked()?;

        if self.segment_index.len() != segments_seen {
            return Err(format!(
                "address index has {} segments, table {segments_seen}",
                self.segment_index.len()
            ));
        }
        if self.free.first().map(|l| l.stream) != Some(super::NO_STREAM) {
            return Err("the first free lists are not NO_STREAM's".to_string());
        }
        let listed: BTreeSet<_> = self
            .free
            .iter()
            .flat_map(|lists| {
                [
                    (lists.stream, PoolKind::Small, &lists.small),
                    (lists.stream, PoolKind::Large, &lists.large),
                ]
            })
            .flat_map(|(stream, pool, list)| {
                list.iter()
                    .map(move |(size, address, id)| (stream, pool, size, address, id))
            })
            .chain((self.unlisted_rest != NIL).then(|| {
                let b = &self.blocks[self.unlisted_rest as usize];
                (b.stream, b.pool, b.size, b.address, self.unlisted_rest)
            }))
            .collect();
        let rest = usize::from(self.unlisted_rest != NIL);
        let lengths: usize = self
            .free
            .iter()
            .map(|l| l.small.len() + l.large.len())
            .sum();
        if lengths + rest != listed.len() {
            return Err("free list length counter is wrong".to_string());
        }
        if listed != free_seen {
            return Err(format!(
                "free lists ({} entries) differ from the free blocks ({})",
                listed.len(),
                free_seen.len()
            ));
        }
        let mapped: HashSet<u32> = self.active.values().copied().collect();
        if mapped != active_seen || self.active.len() != active_seen.len() {
            return Err("active map differs from the allocated blocks".to_string());
        }
        for (&address, &id) in &self.active {
            if self.blocks[id as usize].address != address {
                return Err(format!(
                    "active map key {address:#x} points at another block"
                ));
            }
        }
        let mut batched = HashSet::new();
        for &id in self
            .open_batch
            .iter()
            .chain(self.pending.iter().flat_map(|b| b.blocks.iter()))
            .chain(self.open_cross.iter().flat_map(|(_, b)| b.iter()))
            .chain(self.cross.iter().flat_map(|b| b.blocks.iter()))
        {
            if !batched.insert(id) {
                return Err(format!("block id {id} is in two fence batches"));
            }
        }
        for id in self.held_blocks() {
            if !batched.insert(id) {
                return Err(format!("block id {id} is held and in a fence batch"));
            }
        }
        for (&address, &(id, _)) in &self.held {
            if self.blocks[id as usize].address != address {
                return Err(format!("held block {address:#x} points at another block"));
            }
        }
        if batched != pending_seen {
            return Err(
                "fence batches and held blocks differ from the pending-free blocks".to_string(),
            );
        }
        if self.open_cross.iter().any(|(_, b)| b.is_empty())
            || self.cross.iter().any(|b| b.blocks.is_empty() || b.gate)
        {
            return Err("an empty or gating cross-stream batch".to_string());
        }
        if self.gated != self.pending.iter().any(|b| b.gate) {
            return Err("gate flag disagrees with the pending batches".to_string());
        }

        let pairs: [(&str, &StatArray, &StatArray); 9] = [
            ("allocation", &self.stats.allocation, &recount.allocation),
            ("segment", &self.stats.segment, &recount.segment),
            ("active", &self.stats.active, &recount.active),
            (
                "inactive_split",
                &self.stats.inactive_split,
                &recount.inactive_split,
            ),
            (
                "allocated_bytes",
                &self.stats.allocated_bytes,
                &recount.allocated_bytes,
            ),
            (
                "reserved_bytes",
                &self.stats.reserved_bytes,
                &recount.reserved_bytes,
            ),
            (
                "active_bytes",
                &self.stats.active_bytes,
                &recount.active_bytes,
            ),
            (
                "inactive_split_bytes",
                &self.stats.inactive_split_bytes,
                &recount.inactive_split_bytes,
            ),
            (
                "requested_bytes",
                &self.stats.requested_bytes,
                &recount.requested_bytes,
            ),
        ];
        for (name, kept, counted) in pairs {
            let [o_all, o_small, o_large] = kept.stream_ordered();
            let [c_all, c_small, c_large] = counted.stream_ordered();
            for (pool, a, b) in [
                ("all", &kept.all, &counted.all),
                ("small_pool", &kept.small_pool, &counted.small_pool),
                ("large_pool", &kept.large_pool, &counted.large_pool),
                ("all (stream-ordered)", o_all, c_all),
                ("small_pool (stream-ordered)", o_small, c_small),
                ("large_pool (stream-ordered)", o_large, c_large),
            ] {
                if a.current != b.current {
                    return Err(format!(
                        "{name}.{pool}.current is {} but a recount gives {}",
                        a.current, b.current
                    ));
                }
                if a.peak < a.current {
                    return Err(format!(
                        "{name}.{pool}.peak {} is below current {}",
                        a.peak, a.current
                    ));
                }
            }
        }
        if self.stats.oversize_allocations.current != recount.oversize_allocations.current
            || self.stats.oversize_segments.current != recount.oversize_segments.current
        {
            return Err("oversize stats differ from a recount".to_string());
        }
        Ok(())
    }
}
