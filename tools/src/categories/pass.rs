//! The categories pass: one walk of a trace that classifies every allocation when it is freed
//! (*Note [Categories by lifetime]*) and adds it to what a command asked for in a [`Plan`]: the
//! composition of memory at an instant of each device (its peak), per time slice, at the moment
//! of a snapshot, or every allocation's category in order.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::Path;

use cachealloc_recorder::Record;
use rustc_hash::FxHashMap;

use super::rules::{Clock, classify};
use super::slices::{Detail, Life, SliceRow, SliceSpec, SliceTrack};
use super::{ByCategory, CATEGORY_COUNT, Category};
use crate::progress::Progress;
use crate::walk::{Step, TraceWalk};

/// What to compute.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// Per device, an instant (the ordinal of the record after which to look, usually its peak
    /// allocated) whose bytes by category and by scope to add up.
    pub instants: BTreeMap<u32, u64>,
    /// Time slices, each reported at its peak ([`super::slices`]).
    pub slices: Option<SliceSpec>,
    /// Slices also by scope.
    pub slices_by_scope: bool,
    /// Each device's peak of allocated memory, found in this same walk (the first moment of
    /// its highest allocated bytes, as `analysis::scan` finds it), with its bytes by category,
    /// scope and stack: [`Outcome::peaks`], and [`Outcome::at_instant`] for devices without an
    /// instant of their own.
    pub peaks: bool,
    /// Keep the category of each block allocated (or freed and pending) after this record (a
    /// snapshot's moment).
    pub blocks_at: Option<u64>,
    /// Keep the category of every allocation, by its ordinal among `Alloc` records.
    pub every_allocation: bool,
}

/// What memory held at one instant of a device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Composition {
    /// Bytes by category.
    pub by_category: ByCategory,
    /// Bytes by scope id (0: outside any module).
    pub by_scope: HashMap<u32, u64>,
    /// Bytes and blocks by stack id.
    pub by_stack: HashMap<u32, (u64, u64)>,
}

/// What the pass found.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Whether the trace has any context record (phase, scope, tag): without one, every block
    /// is UNKNOWN and commands show no categories.
    pub has_context: bool,
    /// Scope names by id.
    pub scope_names: HashMap<u32, String>,
    /// Per device, the composition at [`Plan::instants`] (or, with [`Plan::peaks`], at its
    /// peak).
    pub at_instant: BTreeMap<u32, Composition>,
    /// Per device, the slices' rows.
    pub slices: BTreeMap<u32, Vec<SliceRow>>,
    /// With [`Plan::peaks`], per device, its peak (a row of one slice: the whole trace).
    pub peaks: BTreeMap<u32, SliceRow>,
    /// The category of each block allocated (or freed and pending) at [`Plan::blocks_at`], by
    /// `(device, address)` (and of older blocks at addresses free then).
    pub blocks_at: HashMap<(u32, u64), Category>,
    /// With [`Plan::every_allocation`]: the category of each `Alloc` record, in order.
    pub every_allocation: AllocationCategories,
    /// With [`Plan::every_allocation`]: the blocks first seen in a checkpoint (no `Alloc`
    /// record), with their device, address and life.
    pub checkpoint_blocks: Vec<(u32, u64, Life)>,
}

impl Outcome {
    /// With [`Plan::every_allocation`], the category of the block allocated at `address` of
    /// `device` after record `index`, whose `Alloc` record had `ordinal` (`None`: it came from a
    /// checkpoint).
    pub fn category_of(
        &self,
        device: u32,
        address: u64,
        ordinal: Option<u64>,
        index: u64,
    ) -> Category {
        let found = match ordinal {
            Some(o) => self.every_allocation.get(o),
            None => self
                .checkpoint_blocks
                .iter()
                .find(|(d, a, life)| (*d, *a) == (device, address) && life.alive_at(index))
                .map(|(_, _, life)| life.category),
        };
        found.unwrap_or(Category::Unknown)
    }
}

/// The category of each `Alloc` record, by its ordinal ([`Plan::every_allocation`]). A pass
/// over a whole trace keeps every one (a byte each); a followed pass
/// ([`FollowedPass::forget_before`]) keeps those from an ordinal on and the few before it that
/// it is told to keep.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AllocationCategories {
    /// The ordinal of `recent[0]`.
    first: u64,
    /// The categories from `first` on.
    recent: VecDeque<Category>,
    /// Categories set before `first` (of blocks live when they were forgotten).
    older: FxHashMap<u64, Category>,
}

impl AllocationCategories {
    /// The category of the allocation with `ordinal`, if kept.
    pub fn get(&self, ordinal: u64) -> Option<Category> {
        match ordinal.checked_sub(self.first) {
            Some(i) => self.recent.get(usize::try_from(i).ok()?).copied(),
            None => self.older.get(&ordinal).copied(),
        }
    }

    /// The ordinal the next allocation gets: how many were ever taken in.
    pub fn len(&self) -> u64 {
        self.first + self.recent.len() as u64
    }

    /// Whether no allocation was taken in.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The kept categories from the first ordinal kept on, in order (all of them unless a
    /// followed pass forgot some).
    pub fn to_vec(&self) -> Vec<Category> {
        self.recent.iter().copied().collect()
    }

    fn push_unknown(&mut self) {
        self.recent.push_back(Category::Unknown);
    }

    fn set(&mut self, ordinal: u64, category: Category) {
        match ordinal.checked_sub(self.first) {
            Some(i) => {
                if let Some(c) = usize::try_from(i).ok().and_then(|i| self.recent.get_mut(i)) {
                    *c = category;
                }
            }
            None => {
                self.older.insert(ordinal, category);
            }
        }
    }

    fn all_unknown(&mut self) {
        self.recent.iter_mut().for_each(|c| *c = Category::Unknown);
        self.older.values_mut().for_each(|c| *c = Category::Unknown);
    }

    /// Keep no category of an allocation before `ordinal`, but those `kept` says.
    fn forget_before(&mut self, ordinal: u64, kept: impl Fn(u64) -> bool) {
        let ordinal = ordinal.min(self.len());
        while self.first < ordinal {
            if let Some(category) = self.recent.pop_front()
                && kept(self.first)
            {
                self.older.insert(self.first, category);
            }
            self.first += 1;
        }
        self.older.retain(|o, _| kept(*o));
    }
}

impl Outcome {
    /// Every byte UNKNOWN: a trace without context records says nothing of its blocks (the
    /// rules would otherwise read them all as allocated outside any phase).
    fn all_unknown(&mut self) {
        let unknown = |by: &mut ByCategory| {
            let total = by.iter().sum();
            *by = [0; CATEGORY_COUNT];
            by[Category::Unknown.index()] = total;
        };
        for c in self.at_instant.values_mut() {
            unknown(&mut c.by_category);
        }
        for row in self.slices.values_mut().flatten() {
            unknown(&mut row.by_category);
        }
        for row in self.peaks.values_mut() {
            unknown(&mut row.by_category);
        }
        self.blocks_at
            .values_mut()
            .for_each(|c| *c = Category::Unknown);
        self.every_allocation.all_unknown();
    }

    /// A scope's name (`(no module)` for 0, `scope N` for an undefined id).
    pub fn scope_name(&self, scope: u32) -> String {
        if scope == 0 {
            return "(no module)".into();
        }
        self.scope_names
            .get(&scope)
            .cloned()
            .unwrap_or_else(|| format!("scope {scope}"))
    }
}

/// A live block as the pass tracks it.
#[derive(Clone, Copy, Debug)]
struct Live {
    born_index: u64,
    born: Clock,
    size: u64,
    tag: u8,
    scope: u32,
    stack: u32,
    /// Ordinal among `Alloc` records (`u64::MAX`: seen first in a checkpoint).
    ordinal: u64,
}

/// The pass's state between records.
#[derive(Clone)]
struct Pass<'p> {
    plan: &'p Plan,
    clock: Clock,
    live: FxHashMap<(u32, u64), Live>,
    tracks: BTreeMap<u32, SliceTrack>,
    peak_tracks: BTreeMap<u32, SliceTrack>,
    out: Outcome,
    allocs: u64,
    blocks_at_born: FxHashMap<(u32, u64), (u64, Category)>,
}

impl Pass<'_> {
    /// Classify `block` of `device` at `address`, freed after record `died`.
    fn classify(&mut self, device: u32, address: u64, block: Live, died: u64) {
        let category = classify(block.tag, &block.born, &self.clock);
        let life = Life {
            born: block.born_index,
            died,
            size: block.size,
            category,
            scope: block.scope,
            stack: block.stack,
        };
        if let Some(&instant) = self.plan.instants.get(&device)
            && life.alive_at(instant)
        {
            let c = self.out.at_instant.entry(device).or_default();
            c.by_category[category.index()] += block.size;
            *c.by_scope.entry(block.scope).or_default() += block.size;
            let s = c.by_stack.entry(block.stack).or_default();
            (s.0, s.1) = (s.0 + block.size, s.1 + 1);
        }
        if let Some(track) = self.peak_tracks.get_mut(&device) {
            track.classified(life);
        }
        // The block at an address at that moment is the last one allocated there before it
        // (allocated then, or freed and pending).
        if let Some(at) = self.plan.blocks_at
            && life.born <= at
        {
            let entry = self
                .blocks_at_born
                .entry((device, address))
                .or_insert((life.born, category));
            if entry.0 <= life.born {
                *entry = (life.born, category);
            }
        }
        if self.plan.every_allocation {
            if block.ordinal == u64::MAX {
                self.out.checkpoint_blocks.push((device, address, life));
            } else {
                self.out.every_allocation.set(block.ordinal, category);
            }
        }
        if let Some(track) = self.tracks.get_mut(&device) {
            track.classified(life);
        }
    }

    /// A checkpoint ended: blocks it does not hold were freed (in a lost stretch), blocks it
    /// holds that the pass does not know were allocated before the walk could see them.
    fn reconcile(&mut self, walk: &TraceWalk, index: u64) {
        let state = &walk.state;
        let gone: Vec<((u32, u64), Live)> = self
            .live
            .iter()
            .filter(|(key, _)| state.blocks.get(key).is_none_or(|b| b.pending != 0))
            .map(|(k, v)| (*k, *v))
            .collect();
        for (key, block) in gone {
            self.live.remove(&key);
            self.classify(key.0, key.1, block, index);
        }
        for b in state.blocks.values() {
            if b.pending != 0 {
                continue;
            }
            let key = &(b.device, b.address);
            let context = state.context.blocks.get(key);
            if let Some(known) = self.live.get_mut(key) {
                if known.tag == 0 {
                    known.tag = context.map_or(0, |c| c.category);
                }
                continue;
            }
            self.live.insert(
                *key,
                Live {
                    born_index: index,
                    born: self.clock.guess_birth(context.map_or(0, |c| c.phase)),
                    size: b.size,
                    tag: context.map_or(0, |c| c.category),
                    scope: context.map_or(0, |c| c.scope),
                    stack: b.stack,
                    ordinal: u64::MAX,
                },
            );
        }
    }

    /// Apply one step (already applied to `walk.state`).
    fn step(&mut self, walk: &TraceWalk, step: &Step) {
        let record = &step.record;
        match record {
            Record::Phase(p) => {
                self.out.has_context = true;
                self.clock.enter(p.phase);
            }
            Record::Scope(_) | Record::CheckpointBlockContext(_) | Record::Tag(_) => {
                self.out.has_context = true;
            }
            Record::ScopeName(n) => {
                self.out.scope_names.insert(n.id, n.name.clone());
            }
            _ => {}
        }
        if let Record::CheckpointEnd(_) = record {
            self.reconcile(walk, step.index);
            return;
        }
        if step.in_checkpoint {
            return;
        }
        if let Some(device) = record.device()
            && matches!(
                record,
                Record::Alloc(_)
                    | Record::Free(_)
                    | Record::FreeRequested(_)
                    | Record::FreeCompleted(_)
                    | Record::SegmentAlloc(_)
                    | Record::SegmentFree(_)
                    | Record::SegmentMap(_)
                    | Record::SegmentUnmap(_)
            )
        {
            let totals = walk.state.device_totals(device);
            let plan = self.plan;
            if let Some(spec) = plan.slices {
                let detail = Detail {
                    scopes: plan.slices_by_scope,
                    stacks: false,
                };
                let track = self.tracks.entry(device);
                let track = track.or_insert_with(|| SliceTrack::new(spec, detail));
                track.event(walk.t, step.index, totals.allocated, totals.reserved);
            }
            if plan.peaks {
                let detail = Detail {
                    scopes: true,
                    stacks: true,
                };
                let track = self.peak_tracks.entry(device);
                let track = track.or_insert_with(|| SliceTrack::new(SliceSpec::whole(), detail));
                track.event(walk.t, step.index, totals.allocated, totals.reserved);
            }
        }
        match record {
            Record::Alloc(a) => {
                let scope = walk
                    .state
                    .context
                    .thread_scopes
                    .get(&a.thread)
                    .copied()
                    .unwrap_or(0);
                if self.plan.every_allocation {
                    self.out.every_allocation.push_unknown();
                }
                let block = Live {
                    born_index: step.index,
                    born: self.clock,
                    size: a.size,
                    tag: 0,
                    scope,
                    stack: a.stack,
                    ordinal: self.allocs,
                };
                self.allocs += 1;
                if let Some(old) = self.live.insert((a.device, a.address), block) {
                    // A free was lost (a tear): the old block ended here.
                    self.classify(a.device, a.address, old, step.index);
                }
            }
            Record::Free(f) | Record::FreeRequested(f) => {
                if let Some(block) = self.live.remove(&(f.device, f.address)) {
                    self.classify(f.device, f.address, block, step.index);
                }
            }
            Record::Tag(g) => {
                if let Some(b) = walk.state.block_holding(g.device, g.address)
                    && let Some(block) = self.live.get_mut(&(b.device, b.address))
                {
                    block.tag = g.category;
                }
            }
            _ => {}
        }
    }
}

/// Walk `dir` once, classifying every allocation, and compute what `plan` asks for. `visit` is
/// called after each record with the walk (the live state after it): a command that needs
/// more of the same walk (a scan, the state at an instant) takes it there.
pub fn run(
    dir: &Path,
    plan: &Plan,
    progress: &Progress,
    visit: impl FnMut(&TraceWalk, &Step),
) -> Result<Outcome, String> {
    Ok(run_to_end(dir, plan, progress, visit)?.0)
}

/// [`run`], also returning the walk at its end (its state, header and tears).
pub fn run_to_end(
    dir: &Path,
    plan: &Plan,
    progress: &Progress,
    mut visit: impl FnMut(&TraceWalk, &Step),
) -> Result<(Outcome, TraceWalk), String> {
    let mut walk = TraceWalk::open(dir)?;
    let mut pass = Pass::new(plan);
    while let Some(step) = walk.step() {
        let step = step?;
        if step.index % 65536 == 0 {
            progress.tick(step.index);
        }
        pass.step(&walk, &step);
        visit(&walk, &step);
    }
    Ok((pass.finish(), walk))
}

/// The categories pass over a walk that goes on ([`TraceWalk::follow`]): records are taken in
/// as the walk reaches them, and [`FollowedPass::outcome_now`] says what a pass ending there
/// would find, as often as asked.
#[derive(Clone)]
pub struct FollowedPass(Pass<'static>);

impl FollowedPass {
    /// A pass computing what `plan` asks for.
    pub fn new(plan: &'static Plan) -> FollowedPass {
        FollowedPass(Pass::new(plan))
    }

    /// Take in the walk's next record (already applied to `walk`).
    pub fn step(&mut self, walk: &TraceWalk, step: &Step) {
        self.0.step(walk, step);
    }

    /// The outcome of a pass that ends after the last record taken in (the pass itself goes
    /// on: this is a copy's end).
    pub fn outcome_now(&self) -> Outcome {
        self.0.clone().finish()
    }

    /// Keep the categories of allocations from `ordinal` on and of those `kept` says (a
    /// snapshot's window and its live and pending blocks: the categories it shows). A pass
    /// that follows a long run otherwise keeps a byte for every allocation it ever saw, and
    /// each snapshot copies them.
    pub fn forget_before(&mut self, ordinal: u64, kept: impl Fn(u64) -> bool) {
        self.0.out.every_allocation.forget_before(ordinal, kept);
    }
}

impl<'p> Pass<'p> {
    fn new(plan: &'p Plan) -> Pass<'p> {
        Pass {
            plan,
            clock: Clock::default(),
            live: FxHashMap::default(),
            tracks: BTreeMap::new(),
            peak_tracks: BTreeMap::new(),
            out: Outcome::default(),
            allocs: 0,
            blocks_at_born: FxHashMap::default(),
        }
    }

    /// The trace's end: blocks still live are classified, tracks closed.
    fn finish(mut self) -> Outcome {
        let plan = self.plan;
        for track in self
            .tracks
            .values_mut()
            .chain(self.peak_tracks.values_mut())
        {
            track.end_of_events();
        }
        let mut live: Vec<((u32, u64), Live)> = self.live.drain().collect();
        live.sort_by_key(|(key, _)| *key);
        for (key, block) in live {
            self.classify(key.0, key.1, block, u64::MAX);
        }
        self.out.blocks_at = self
            .blocks_at_born
            .drain()
            .map(|(key, (_, category))| (key, category))
            .collect();
        let tracks = std::mem::take(&mut self.tracks);
        self.out.slices = tracks.into_iter().map(|(d, t)| (d, t.finish())).collect();
        for (device, track) in std::mem::take(&mut self.peak_tracks) {
            let Some(row) = track.finish().pop() else {
                continue;
            };
            if !plan.instants.contains_key(&device) {
                let by_stack = row.by_stack.clone();
                self.out.at_instant.insert(
                    device,
                    Composition {
                        by_category: row.by_category,
                        by_scope: row.by_scope.clone(),
                        by_stack,
                    },
                );
            }
            self.out.peaks.insert(device, row);
        }
        if !self.out.has_context {
            self.out.all_unknown();
        }
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forgotten_categories_are_dropped_but_those_kept() {
        let mut c = AllocationCategories::default();
        for _ in 0..10 {
            c.push_unknown();
        }
        c.set(2, Category::Input);
        c.set(7, Category::Parameter);
        c.forget_before(6, |o| o == 2);
        assert_eq!(c.len(), 10, "ordinals go on");
        assert_eq!(c.to_vec().len(), 4, "only ordinals 6..10 kept in order");
        assert_eq!(c.get(2), Some(Category::Input), "kept: a block still shown");
        assert_eq!((c.get(3), c.get(7)), (None, Some(Category::Parameter)));
        c.set(3, Category::Activation);
        assert_eq!(c.get(3), Some(Category::Activation), "a live block's end");
        c.forget_before(8, |_| false);
        assert_eq!((c.get(2), c.get(3), c.to_vec().len()), (None, None, 2));
    }
}
