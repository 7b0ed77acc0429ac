//! Expandable segments: one reserved address range per stream and pool, backed by device memory
//! only where blocks need it.
//!
//! # Note [Expandable segments]
//!
//! A fixed segment is one `cudaMalloc`: its size is decided by the request that caused it, and
//! it goes back to the device only whole, when none of its bytes are in use. A workload whose
//! tensor sizes change from step to step (variable batch or sequence lengths) leaves segments
//! that fit no later request, and the cache grows with memory nobody can use (fragmentation).
//!
//! With `expandable_segments:True`, on a device that offers virtual memory
//! ([`Device::map_granularity`](crate::Device::map_granularity): CUDA's `cuMemAddressReserve`,
//! `cuMemCreate`, `cuMemMap`), each stream gets one **range** per pool: address space the size
//! of the device and then some (so that memory released in the middle can be mapped again at the
//! end), reserved once, with memory behind it only where it is *mapped*. Its blocks tile the
//! whole range; a block is either mapped (active, pending free or free, as in any segment) or
//! [`BlockState::Unmapped`]. Then:
//!
//! * **Growing** maps memory instead of allocating a segment: the unmapped block that, with
//!   the free mapped block just before it, can hold the request for the fewest new granules is
//!   mapped for as many granules as the request still needs ([`Pools::plan_map`]; when live blocks have cut a
//!   stream's ranges into holes too small, the stream gets another range); the new memory merges with its
//!   free neighbours and the request is carved from it ([`Pools::map_done`]). A request thus
//!   uses the free end of the mapped memory and maps only the difference, so reserved memory
//!   exceeds allocated memory by less than a granule per range, plus what frees leave behind.
//! * **Blocks split and merge freely** inside a range: the `max_split_size` rules (which keep
//!   big fixed segments from being eaten by small requests) do not apply, since no memory is
//!   stuck in a segment for good; a split needs only a rest of at least 512 bytes.
//! * **A map is a few mappings, each unmapped whole.** Each mapping is one physical allocation
//!   (`cuMemCreate` of its size): the driver's calls cost about the same for 2 MiB as for
//!   1 GiB (measured on an H100: 40–60 µs per call, BENCHMARKS.md), so mapping granule by
//!   granule, as PyTorch does, makes a 1 GiB map take tens of milliseconds. The driver unmaps
//!   only whole mappings, so the pools keep every live mapping and unmap those that lie wholly
//!   inside free blocks. A map is made of [`MAPPINGS_PER_MAP`] mappings, none smaller than
//!   [`MIN_MAPPING`] but the last, so that its cost stays bounded while what a live block can
//!   keep mapped beside it stays proportionate (a sixty-fourth of the map it came with). Measured
//!   on recorded runs (`cachealloc simulate`), granule-sized mappings waste least memory but
//!   make a 1 GiB map cost 30 ms; one mapping per map is cheapest but leaves most memory stuck.
//! * **Releasing** (`empty_cache`, the out-of-memory ladder) unmaps the mappings that lie wholly
//!   inside free blocks ([`Pools::take_unmappable`]); what shares a mapping with a live block
//!   stays free and mapped. The range stays reserved.
//! * **Recycling at a new high-water mark.** Free memory in a range can still be the wrong
//!   shape: holes between live blocks that the next request does not fit. Fixed segments, and
//!   PyTorch's expandable segments, keep such holes and reserve more; that is their waste (on a
//!   GPT-2 training run with variable sequence lengths, 3.8 % of the peak). So when a map would
//!   take reserved memory above its peak so far, the allocator first gives up as much free
//!   memory elsewhere in the same range ([`Pools::take_to_recycle`]: the mappings inside the
//!   blocks free the longest, never the block the new memory joins; other ranges keep theirs,
//!   or two pools would take memory from each other at every turn): reserved memory then stays
//!   at its peak, and the peak grows only when the live blocks need it. Where the driver allows
//!   it, the memory given up *moves* into the map rather than being unmapped and created again,
//!   and can flip back later with no driver call ([Note [Moving memory instead of unmapping
//!   it]](moves#note-moving-memory-instead-of-unmapping-it)); what cannot move is unmapped
//!   if no kernel may still use it, and otherwise stays mapped, since waiting for the device
//!   would cost more than the memory is worth ([Note [Unmapping without a wait]](idle#note-unmapping-without-a-wait),
//!   [Note [Recycling never waits]](idle#note-recycling-never-waits)). Below the peak nothing
//!   is given up, so a run whose shapes have all been seen at their peak makes no device calls.
//!   The memory to give up is looked for in the range's free list, never by walking the range:
//!   while a range grows (a model's tensors as it loads) every map passes the peak, and a walk
//!   made each such allocation cost time in proportion to the live blocks.
//! * **Switching at run time.** The program may turn expandable segments on or off while it
//!   runs (PyTorch's `_set_allocator_settings`): growth then maps into ranges, or takes fixed
//!   segments, from the next request on, and segments of the other kind stay and serve what they
//!   hold. Each block follows its own segment's rules (a range's split and merge freely, a
//!   fixed segment's keep the `max_split_size` rules); the geometry stays once known.
//! * **Stats** follow PyTorch's expandable segments: `reserved_bytes` counts mapped bytes,
//!   `num_device_alloc`/`num_device_free` count maps and unmaps, and a range is not counted in
//!   `segment` (nor in `oversize_segments`).
//!
//! Like segment allocation, mapping and unmapping run outside the allocator's lock. The block
//! being mapped or unmapped is *busy* meanwhile: [`BlockState::Unmapped`], in no list, merged
//! with nothing, its bytes counted in [`Pools::reserved`] while they are being mapped and out of
//! it as soon as they are taken for unmapping. Whatever another thread did in between is read
//! again after relocking: if the free block before the mapped memory was taken meanwhile, the
//! new memory joins the free lists and the allocator maps again.
//!
//! # Note [Kept maps]
//!
//! A private pool (a CUDA graph's, a `MemPool`) may not give memory back while it is in use: a
//! graph replays into blocks the program freed after the capture, so memory unmapped under
//! them and mapped again elsewhere would be written by a replay that nobody ordered. Its
//! pools *keep their maps* ([`Pools::keep_maps`]):
//!
//! * nothing is recycled at a new high-water mark, and the out-of-memory ladder unmaps
//!   nothing: only an explicit `empty_cache` unmaps, which the shim calls once the pool has no
//!   user left (with no moves there are no parked places either);
//! * maps are made in PyTorch's pages: whole 20 MiB ([`sizes::LARGE_BUFFER`]) in the large
//!   pool, whole granules in the small one. PyTorch's private pools map so, and its tests of
//!   graph pools with expandable segments compare their snapshots block for block (a 2 MiB
//!   request maps 20 MiB, whose 18 MiB rest serves the pool's next requests). Mapping only
//!   the granules a request needs saves memory where maps can be given back and remade at a
//!   new peak; in a pool that keeps every map, pages cost at most one page per range, and
//!   PyTorch's user sees the layout PyTorch gives;
//! * each page is a mapping of its own ([`MapPlan::mappings`]), so that the pool's
//!   `empty_cache` gives back every free page and keeps the pages live blocks are in, as
//!   PyTorch's does (`test_graph_memory_stats_and_use_result_after_destroy_graph`: a graph's
//!   result alive after the graph is deleted keeps its 20 MiB page). Mappings of at least
//!   [`MIN_MAPPING`] would keep the 8 MiB around it and give back the rest of its page.
//!
//! A kept range is checkpointed by its runs of mapped memory ([Note [Pool
//! checkpoints]](super::checkpoint#note-pool-checkpoints)), and once the pool is emptied its
//! address space is given back too ([`Pools::take_empty_ranges`]).
//!
//! While fencing has just started ([`Pools::start_fencing`]'s gate), no block that was free
//! before the gate may be handed out on [`NO_STREAM`]; new memory is then carved on its own,
//! before it merges with anything.

pub mod fill;
pub mod idle;
pub mod moves;
mod unmap;

use std::collections::BTreeMap;

use super::{Block, BlockId, BlockState, NIL, Pools, Segment, SegmentId};
use crate::pools::{Allocation, NO_STREAM};
use crate::sizes::{self, PoolKind};
use crate::stats::StatAt;
use moves::{Alias, Move};

/// The shape of expandable segments on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// The unit of mapping (the driver's allocation granularity).
    pub granularity: u64,
    /// The size of each stream's and pool's address range.
    pub range_size: u64,
    /// Whether recycling moves memory ([`Device::alias`](crate::Device::alias)) rather than
    /// unmapping it; see [Note [Moving memory instead of unmapping
    /// it]](moves#note-moving-memory-instead-of-unmapping-it).
    pub moves: bool,
}

impl Geometry {
    /// The geometry for a device of `total` bytes mapping in units of `granularity`: ranges of
    /// 9/8 of the device (as PyTorch reserves), so that memory unmapped early in a range can be
    /// mapped again at its end.
    pub fn for_device(granularity: u64, total: u64) -> Self {
        let range_size = sizes::round_up(total.saturating_add(total / 8).max(1), granularity);
        Geometry {
            granularity,
            range_size,
            moves: false,
        }
    }
}

/// Memory to map outside the lock, then report with [`Pools::map_done`] or
/// [`Pools::map_failed`].
#[derive(Debug, PartialEq, Eq)]
pub struct MapPlan {
    /// Where to map.
    pub address: u64,
    /// How many bytes (whole granules).
    pub size: u64,
    /// The pool of the range.
    pub pool: PoolKind,
    block: BlockId,
    /// Recycled memory moved into the start of the plan ([`Pools::plan_moves`]).
    pub moves: Vec<Move>,
    /// Where the new memory starts: after the moves.
    fresh_from: u64,
    /// The page each mapping is, in pools that keep their maps (0 elsewhere): Note [Kept
    /// maps].
    page: u64,
}

/// How many mappings a map is made of (at most one more, for the rest): a mapping costs the
/// driver about the same whatever its size, but it is unmapped only whole, so free memory next
/// to a live block stays mapped up to one mapping's size. Sixty-fourths keep a map's cost
/// bounded (65 calls, a few milliseconds for a 1 GiB map, nearly all in warm-up) and what can
/// stay stuck small. Measured with `cachealloc simulate` on five recorded training runs
/// (BENCHMARKS.md, "Maps of 64 mappings"): against sixteenths, the allocation-heavy Llama's
/// peak reserved fell from 1.040× to 1.016× its peak allocated (2.4 %), the others' stayed
/// within 0.2 %, and the timed steps' maps fell while moves rose.
pub const MAPPINGS_PER_MAP: u64 = 64;

/// The smallest mapping (rounded up to the granularity), but for a map's last: every mapping
/// costs an unmap call of about 40 µs (the driver frees its memory), so small maps made of
/// granule-sized mappings made recycling slow. Measured with `cachealloc simulate` on the
/// recorded GPT-2 run (BENCHMARKS.md): 8 MiB took the driver calls of its timed steps from
/// 288 mappings and 512 unmaps to 240 and 222, and peak reserved from 1.021× to 1.015× the
/// peak allocated.
pub const MIN_MAPPING: u64 = 8 << 20;

impl MapPlan {
    /// The new mappings that make the plan's memory after its moves, in address order:
    /// sixty-fourths of it, in whole granules of `granularity`, none smaller than
    /// [`MIN_MAPPING`] but the last (see [`MAPPINGS_PER_MAP`]) — or, in pools that keep their
    /// maps, one mapping a page, so that what a live block keeps mapped is its pages, as in
    /// PyTorch (Note [Kept maps]).
    pub fn mappings(&self, granularity: u64) -> impl Iterator<Item = (u64, u64)> + use<> {
        let (start, end) = (self.fresh_from, self.address + self.size);
        let piece = if self.page != 0 {
            self.page
        } else {
            let piece = ((end - start) / MAPPINGS_PER_MAP / granularity).max(1) * granularity;
            piece.max(MIN_MAPPING.div_ceil(granularity) * granularity)
        };
        (start..end)
            .step_by(piece as usize)
            .map(move |address| (address, piece.min(end - address)))
    }
}

/// A mapping: address and size.
type Mapping = (u64, u64);

/// What [`Pools::plan_map`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum MapOutcome {
    /// Map this.
    Planned(MapPlan),
    /// No range of the stream has room for the request: reserve another
    /// ([`Pools::add_range`]).
    NeedsRange,
    /// Mapping would take the pools over the limit.
    OverLimit,
}

/// Memory taken out of the pools, to unmap outside the lock and report with
/// [`Pools::unmap_done`] or [`Pools::unmap_failed`].
#[derive(Debug, PartialEq, Eq)]
pub struct Unmapping {
    /// Where to unmap.
    pub address: u64,
    /// How many bytes (whole granules).
    pub size: u64,
    /// The pool of the range.
    pub pool: PoolKind,
    block: BlockId,
    /// The range.
    range: SegmentId,
    /// When the memory became free (its block's [`Pools::lookups`] stamp).
    free_since: u64,
    /// Whether this unmaps a parked place only (its memory stays with its holder); `block` is
    /// then the busy unmapped block that keeps its addresses from other maps meanwhile: for a
    /// place a plan clears, the part of it past the plan, or `NIL` where the plan covers it.
    parked: bool,
    /// For a parked place: the mapping that holds its memory.
    holder: u64,
    /// The memory's parked places, unmapped first (the driver frees memory with its last
    /// mapping).
    pub aliases: Vec<Alias>,
}

impl Unmapping {
    /// Whether this unmaps a parked place only: no memory goes back to the device.
    pub fn is_parked_place(&self) -> bool {
        self.parked
    }
}

impl<F: Clone> Pools<F> {
    /// Grow by mapping memory into expandable segments of this geometry from now on, for every
    /// request (until [`Pools::set_synchronous_fixed`]).
    pub fn enable_expandable(&mut self, geometry: Geometry) {
        self.expandable = Some(geometry);
        self.grows_expandable = true;
        self.synchronous_fixed = false;
    }

    /// Whether requests of the synchronous API ([`NO_STREAM`]) keep growing by fixed segments
    /// while stream-ordered ones map ([`Expandable::StreamOrdered`](crate::Expandable)).
    pub fn set_synchronous_fixed(&mut self, fixed: bool) {
        self.synchronous_fixed = fixed;
    }

    /// Grow by fixed segments from now on (`expandable_segments:False` at run time); the
    /// expandable segments keep serving what they have mapped, and keep their geometry for a
    /// later [`Pools::enable_expandable`].
    pub fn disable_expandable(&mut self) {
        self.grows_expandable = false;
    }

    /// The geometry of expandable segments, once they were on.
    pub fn expandable(&self) -> Option<Geometry> {
        self.expandable
    }

    /// Whether the pools grow by mapping into expandable segments now (stream-ordered requests
    /// at least).
    pub fn grows_expandable(&self) -> bool {
        self.grows_expandable
    }

    /// Keep what is mapped until the cache is emptied, and map in PyTorch's pages, from now
    /// on (a private pool's pools; see [Note [Kept maps]](self#note-kept-maps)).
    pub fn keep_maps(&mut self) {
        self.keeps_maps = true;
    }

    /// Whether the pools keep what they map ([`Pools::keep_maps`]).
    pub fn keeps_maps(&self) -> bool {
        self.keeps_maps
    }

    /// The memory a request of `rounded` bytes maps at most, in whole units of its pool's
    /// maps (granules, or PyTorch's pages: Note [Kept maps]); `None` before expandable segments
    /// were on.
    pub fn map_size_for(&self, rounded: u64) -> Option<u64> {
        let g = self.expandable?.granularity;
        let step = self.map_step(sizes::pool_for(rounded), g);
        Some(rounded.div_ceil(step).max(1) * step)
    }

    /// The unit a map of `pool` is made of: the granularity `g`, or PyTorch's pages when the
    /// pools keep their maps (Note [Kept maps]).
    fn map_step(&self, pool: PoolKind, g: u64) -> u64 {
        match pool {
            PoolKind::Large if self.keeps_maps => sizes::LARGE_BUFFER.div_ceil(g) * g,
            _ => g,
        }
    }

    /// Whether a request for `stream` grows by mapping into an expandable segment now.
    pub fn grows_expandable_for(&self, stream: u64) -> bool {
        self.grows_expandable && !(self.synchronous_fixed && stream == NO_STREAM)
    }

    /// A reserved range at `address` becomes a range of `stream` for requests like `rounded`;
    /// the first request's `tag` is kept as the segment's.
    pub fn add_range(&mut self, address: u64, rounded: u64, stream: u64, tag: u64) {
        let geometry = self.expandable.expect("expandable segments are on");
        let pool = sizes::pool_for(rounded);
        let segment = self.new_segment_slot();
        let id = self.new_block(Block {
            address,
            size: geometry.range_size,
            requested: 0,
            segment,
            prev: NIL,
            next: NIL,
            state: BlockState::Unmapped,
            pool,
            free_since: self.lookups,
            tag: 0,
            stream,
            serial: 0,
            busy: false,
        });
        self.segments[segment as usize] = Some(Segment {
            address,
            size: geometry.range_size,
            pool,
            first: id,
            tag,
            stream,
            expandable: true,
            unmapped: BTreeMap::from([(address, id)]),
        });
        self.segment_index.insert(address, segment);
        self.ranges.push((stream, pool, segment));
    }

    /// Where to map memory for a request of `rounded` bytes on `stream`: in the stream's ranges,
    /// the unmapped block that can hold the request together with the free block before it
    /// with the fewest granules still missing — not counting parked places at its start whose
    /// memory can flip back (see [`moves`]) — (the lowest such block on a tie; PyTorch takes
    /// the lowest of all, which can map more than needed or fail where this fits). A place whose
    /// map stays within `limit` comes before one that would not. The map is only the granules
    /// the request still needs, even where it ends inside a parked place: that place is
    /// cleared whole before the map ([`Pools::take_clears`]), which holds its part past the map
    /// meanwhile. The bytes count as [`Pools::reserved`] until the map is reported.
    pub fn plan_map(&mut self, rounded: u64, stream: u64, limit: u64) -> MapOutcome {
        let Some(Geometry { granularity: g, .. }) = self.expandable else {
            return MapOutcome::NeedsRange;
        };
        let pool = sizes::pool_for(rounded);
        let step = self.map_step(pool, g);
        // Under the gate, the free block before the unmapped one may not be used.
        let gated = self.gated && stream == NO_STREAM;
        // Memory that can flip back to parked places costs nothing (see moves.rs).
        let flippable = (!gated)
            .then(|| self.flippable_holders(stream, pool))
            .flatten();
        let counted = self.limited_reserved(stream);
        let found = self
            .ranges
            .iter()
            .filter(|&&(s, p, _)| s == stream && p == pool)
            .flat_map(|&(_, _, segment)| {
                self.segment(segment)
                    .unmapped
                    .values()
                    .map(move |&id| (segment, id))
            })
            .filter_map(|(segment, id)| {
                let b = &self.blocks[id as usize];
                let before = match b.prev {
                    NIL => 0,
                    prev if !gated && self.blocks[prev as usize].state == BlockState::Free => {
                        self.blocks[prev as usize].size
                    }
                    _ => 0,
                };
                let size = rounded.saturating_sub(before).div_ceil(step).max(1) * step;
                if size > b.size {
                    return None;
                }
                let free = flippable.as_ref().map_or(0, |holders| {
                    self.flippable_prefix(b.address, size, b.prev, holders)
                });
                // Parked places that cannot flip are in the way: each would be unmapped first,
                // after a wait for the device if it was in use lately. Elsewhere if possible.
                let in_the_way = (self.parked.range(b.address + free..b.address + size))
                    .next()
                    .is_some();
                let over_limit = counted.is_some_and(|c| c.saturating_add(size) > limit);
                Some((
                    segment,
                    id,
                    size,
                    (over_limit, in_the_way, size.saturating_sub(free)),
                ))
            })
            .min_by_key(|&(_, _, size, (over_limit, in_the_way, new))| {
                (over_limit, in_the_way, new, size)
            })
            .map(|(segment, id, size, (over_limit, ..))| (segment, id, size, over_limit));
        let Some((segment, id, size, over_limit)) = found else {
            return MapOutcome::NeedsRange;
        };
        if over_limit {
            return MapOutcome::OverLimit;
        }
        let address = self.blocks[id as usize].address;
        self.segment_mut(segment).unmapped.remove(&address);
        let b = &self.blocks[id as usize];
        if size < b.size {
            let rest = Block {
                address: b.address + size,
                size: b.size - size,
                prev: id,
                ..b.clone()
            };
            let rest = self.new_block(rest);
            self.link_after(id, rest);
            let address = self.blocks[rest as usize].address;
            self.segment_mut(segment).unmapped.insert(address, rest);
            self.blocks[id as usize].size = size;
        }
        let b = &mut self.blocks[id as usize];
        b.busy = true;
        self.growing += size;
        MapOutcome::Planned(MapPlan {
            address: b.address,
            size,
            pool,
            block: id,
            moves: Vec::new(),
            fresh_from: b.address,
            page: if self.keeps_maps { step } else { 0 },
        })
    }

    /// The memory of `plan` is mapped: it becomes free, merges with its free neighbours, and a
    /// request of `rounded` bytes (`requested` by the application) is carved from it if it is
    /// big enough now — `None` when the free block before it was taken meanwhile (the new
    /// memory is then in the free lists, and the caller maps again).
    pub fn map_done(
        &mut self,
        plan: MapPlan,
        rounded: u64,
        requested: u64,
        tag: u64,
    ) -> Option<Allocation> {
        let granularity = self
            .expandable
            .expect("expandable segments are on")
            .granularity;
        self.mappings.extend(plan.mappings(granularity));
        let MapPlan {
            size,
            pool,
            block: id,
            moves,
            ..
        } = plan;
        self.growing -= size;
        let at = StatAt::new(pool, self.blocks[id as usize].stream);
        self.stats.reserved_bytes.increase(at, size);
        self.stats.num_device_alloc += 1;
        self.moves_done(moves);
        let b = &mut self.blocks[id as usize];
        b.busy = false;
        b.state = BlockState::Free;
        b.free_since = self.lookups;
        let gated = self.gated && b.stream == NO_STREAM;
        if gated {
            // Carve from the new memory alone; only what is left merges.
            debug_assert!(size >= rounded);
            let allocation = self.carve(id, rounded, requested, tag);
            let rest = self.blocks[id as usize].next;
            if rest != NIL && rest == self.unlisted_rest {
                self.remove_free(rest);
                self.make_free(rest);
            }
            return Some(allocation);
        }
        self.merge_free_neighbours(id);
        if self.blocks[id as usize].size >= rounded {
            Some(self.carve(id, rounded, requested, tag))
        } else {
            self.add_free(id);
            None
        }
    }

    /// Mapping the memory of `plan` failed: it is unmapped address space again.
    pub fn map_failed(&mut self, plan: MapPlan) {
        self.growing -= plan.size;
        self.make_unmapped(plan.block);
        self.moves_failed(plan.moves);
    }

    // ----- helpers ----------------------------------------------------------------------------

    /// Link the new block `new` (whose own links are set) in after `id`.
    fn link_after(&mut self, id: BlockId, new: BlockId) {
        let next = self.blocks[id as usize].next;
        if next != NIL {
            self.blocks[next as usize].prev = new;
        }
        self.blocks[id as usize].next = new;
    }

    /// Link the new block `new` (whose own links are set) in before `id`.
    fn link_before(&mut self, id: BlockId, new: BlockId) {
        let prev = self.blocks[id as usize].prev;
        if prev != NIL {
            self.blocks[prev as usize].next = new;
        } else {
            let segment = self.blocks[id as usize].segment;
            self.segment_mut(segment).first = new;
        }
        self.blocks[id as usize].prev = new;
    }

    /// The (unlisted, uncounted) free block `id` merges with its free neighbours.
    fn merge_free_neighbours(&mut self, id: BlockId) {
        for neighbour in [self.blocks[id as usize].prev, self.blocks[id as usize].next] {
            if neighbour != NIL && self.blocks[neighbour as usize].state == BlockState::Free {
                self.merge_into(id, neighbour);
            }
        }
    }

    /// The (unlisted, uncounted) free block `id` merges with its free neighbours and joins its
    /// free list.
    fn make_free(&mut self, id: BlockId) {
        self.merge_free_neighbours(id);
        self.add_free(id);
    }

    /// The busy block `id` becomes unmapped address space, merged with its unmapped
    /// neighbours.
    fn make_unmapped(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        b.busy = false;
        b.state = BlockState::Unmapped;
        let segment = b.segment;
        for neighbour in [b.prev, b.next] {
            if neighbour == NIL {
                continue;
            }
            let n = &self.blocks[neighbour as usize];
            if n.state == BlockState::Unmapped && !n.busy {
                let address = n.address;
                self.segment_mut(segment).unmapped.remove(&address);
                self.absorb(id, neighbour);
            }
        }
        let address = self.blocks[id as usize].address;
        self.segment_mut(segment).unmapped.insert(address, id);
    }
}
