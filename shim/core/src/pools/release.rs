//! Taking segments out of the pools for release on the device: whole free segments (empty
//! cache), oversize ones (the ladder), old ones (garbage collection); and forgetting everything
//! after a device reset.

use super::{BlockId, BlockState, Pools, ReleasedSegment};
use crate::config::AllocatorConfig;
use crate::sizes::{self, PoolKind};
use crate::stats::StatAt;

impl<F: Clone> Pools<F> {
    /// Take every free whole segment (in the given pools) out of the pools. The caller releases
    /// them on the device.
    pub fn take_free_segments(&mut self, pools: &[PoolKind]) -> Vec<ReleasedSegment> {
        self.settle();
        let mut ids = Vec::new();
        for lists in &self.free {
            for &pool in pools {
                ids.extend(
                    lists
                        .list(pool)
                        .iter()
                        .map(|(_, _, id)| id)
                        .filter(|&id| self.is_whole_segment(id)),
                );
            }
        }
        ids.into_iter().map(|id| self.take_segment(id)).collect()
    }

    /// Take free whole oversize segments of the large pool out, largest that serves `rounded`
    /// first, as PyTorch's `release_available_cached_blocks` does: the smallest one at least as
    /// big as the request if there is one, else the biggest ones until their sizes add up to it
    /// (or all of them: they are released even when they do not add up, as in PyTorch; the
    /// device may have the rest). Only the request's stream's segments are candidates, as in
    /// PyTorch.
    pub fn take_oversize_segments(&mut self, rounded: u64, stream: u64) -> Vec<ReleasedSegment> {
        if self.max_split_size == u64::MAX {
            return Vec::new();
        }
        self.settle();
        let key = rounded.max(self.max_split_size);
        let Some(lists) = self.lists(stream) else {
            return Vec::new();
        };
        let candidates: Vec<(u64, BlockId)> = lists
            .large
            .iter_from(self.max_split_size)
            .filter(|&(_, _, id)| self.is_whole_segment(id))
            .map(|(size, _, id)| (size, id))
            .collect();
        let chosen: Vec<BlockId> =
            if let Some(&(_, id)) = candidates.iter().find(|(size, _)| *size >= key) {
                vec![id]
            } else {
                let mut total = 0;
                let mut chosen = Vec::new();
                for &(size, id) in candidates.iter().rev() {
                    if total >= key {
                        break;
                    }
                    total += size;
                    chosen.push(id);
                }
                chosen
            };
        chosen.into_iter().map(|id| self.take_segment(id)).collect()
    }

    /// Garbage collection (PyTorch's `garbage_collect_cached_blocks`): when reserved memory is
    /// above `threshold × limit`, take out free whole segments of the large pool whose age (free
    /// list searches since they became free) is at least the average, repeatedly, until enough
    /// is reclaimed or nothing more can be.
    pub fn take_garbage(&mut self, threshold: f64, limit: u64) -> Vec<ReleasedSegment> {
        let gc_limit = (threshold * limit as f64) as u64;
        let reserved = self.counted_reserved();
        if threshold <= 0.0 || reserved <= gc_limit {
            return Vec::new();
        }
        let target = reserved - gc_limit;
        self.settle();
        let mut candidates: Vec<(BlockId, u64, u64)> = self
            .free
            .iter()
            .flat_map(|lists| lists.large.iter())
            .map(|(_, _, id)| id)
            .filter(|&id| self.is_whole_segment(id))
            .map(|id| {
                let b = &self.blocks[id as usize];
                (id, b.size, self.lookups - b.free_since)
            })
            .collect();
        let mut reclaimed = 0;
        let mut out = Vec::new();
        while reclaimed < target && !candidates.is_empty() {
            let total_age: u64 = candidates.iter().map(|c| c.2).sum();
            let threshold_age = total_age as f64 / candidates.len() as f64;
            let mut kept = Vec::with_capacity(candidates.len());
            let mut freed_any = false;
            for c in candidates {
                if reclaimed < target && c.2 as f64 >= threshold_age {
                    reclaimed += c.1;
                    freed_any = true;
                    out.push(self.take_segment(c.0));
                } else {
                    kept.push(c);
                }
            }
            candidates = kept;
            if !freed_any {
                break;
            }
        }
        out
    }

    /// Whether the free block `id` is a whole fixed segment, which can be released (the blocks
    /// of expandable segments are unmapped instead; see [`Pools::take_unmappable`]).
    fn is_whole_segment(&self, id: BlockId) -> bool {
        let b = &self.blocks[id as usize];
        !b.is_split() && !self.segment(b.segment).expandable
    }

    /// Remove the segment whose only block is the free block `id`.
    fn take_segment(&mut self, id: BlockId) -> ReleasedSegment {
        self.remove_free(id);
        let b = &self.blocks[id as usize];
        debug_assert!(!b.is_split() && b.state == BlockState::Free);
        let segment = b.segment;
        let seg = self.segments[segment as usize]
            .take()
            .expect("live segment");
        self.spare_segments.push(segment);
        self.spare_blocks.push(id);
        self.segment_index.remove(&seg.address);
        let at = StatAt::new(seg.pool, seg.stream);
        self.stats.segment.decrease(at, 1);
        self.stats.reserved_bytes.decrease(at, seg.size);
        if sizes::is_oversize(seg.size, self.max_split_size) {
            self.stats.oversize_segments.decrease(1);
        }
        self.stats.num_device_free += 1;
        ReleasedSegment {
            address: seg.address,
            size: seg.size,
            pool: seg.pool,
        }
    }

    /// Forget everything without releasing it (the device context was reset). Accumulated
    /// counters are kept; current values drop to zero.
    pub fn forget_all(&mut self) {
        let config = AllocatorConfig {
            max_split_size: self.max_split_size,
            reuse: self.reuse,
            ..AllocatorConfig::default()
        };
        let mut stats = std::mem::take(&mut self.stats);
        for seg in self.segments.iter().flatten().filter(|seg| !seg.expandable) {
            let at = StatAt::new(seg.pool, seg.stream);
            stats.segment.decrease(at, 1);
            stats.reserved_bytes.decrease(at, seg.size);
            if sizes::is_oversize(seg.size, self.max_split_size) {
                stats.oversize_segments.decrease(1);
            }
        }
        for b in self.live_blocks() {
            if b.state != BlockState::Unmapped && self.segment(b.segment).expandable {
                stats.reserved_bytes.decrease(b.stat_at(), b.size);
            }
            match b.state {
                BlockState::Unmapped => continue,
                BlockState::Active => {
                    stats.allocation.decrease(b.stat_at(), 1);
                    stats.allocated_bytes.decrease(b.stat_at(), b.size);
                    if sizes::is_oversize(b.size, self.max_split_size) {
                        stats.oversize_allocations.decrease(1);
                    }
                }
                BlockState::PendingFree => {}
                BlockState::Free => {
                    if b.is_split() {
                        stats.inactive_split.decrease(b.stat_at(), 1);
                        stats.inactive_split_bytes.decrease(b.stat_at(), b.size);
                    }
                    continue;
                }
            }
            stats.active.decrease(b.stat_at(), 1);
            stats.active_bytes.decrease(b.stat_at(), b.size);
            stats.requested_bytes.decrease(b.stat_at(), b.requested);
        }
        let (fencing, expandable, grows, synchronous_fixed, keeps_maps) = (
            self.fencing,
            self.expandable,
            self.grows_expandable,
            self.synchronous_fixed,
            self.keeps_maps,
        );
        *self = Pools::new(&config);
        self.fencing = fencing;
        self.expandable = expandable;
        self.grows_expandable = grows;
        self.synchronous_fixed = synchronous_fixed;
        self.keeps_maps = keeps_maps;
        self.stats = stats;
    }
}
