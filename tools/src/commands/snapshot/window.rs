//! The walk to a snapshot's moment ([`walk_with_window`]): the trace's last events, each with
//! the stack its entry shows, and what each live block and segment was (its ordinal, its
//! shown stack, a fixed segment or a mapped run).

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;

use cachealloc_recorder::{Record, TraceReader};
use rustc_hash::{FxHashMap, FxHashSet};

use super::history::{Cursor, EventKind, Settings};
use crate::Error;
use crate::walk::{Step, TraceWalk};

/// What the walk to the snapshot's moment kept: the last events, each with the stack its entry
/// shows, for an allocation its ordinal among `Alloc` records, and the actions skipped when it
/// was recorded (`skip_actions`); and whether context records came before the moment.
pub(super) struct Window {
    pub(super) events: VecDeque<(Record, u32, u64, u16)>,
    pub(super) has_context: bool,
    /// Each block live (allocated or pending) at the moment: its `Alloc` record's ordinal
    /// (`None`: from a checkpoint).
    pub(super) ordinals: FxHashMap<(u32, u64), Option<u64>>,
    /// The stack each live block and segment shows, where the program's history settings
    /// decide it.
    pub(super) block_stacks: FxHashMap<(u32, u64), u32>,
    /// See `block_stacks`.
    pub(super) segment_stacks: FxHashMap<(u32, u64), u32>,
    /// The live segments allocated whole (`segment_alloc`: fixed segments, `cudaMalloc`'s), as
    /// against runs mapped into expandable segments: under the default
    /// (`expandable_segments:stream_ordered`) a process has both.
    pub(super) fixed_segments: FxHashSet<(u32, u64)>,
    /// Each address a block was freed at: when (the record's index) and the size its program
    /// had requested. A free block shows the request of the last block freed inside it, as
    /// PyTorch's merged free block keeps the freed block's (`requested_size` of an `inactive`
    /// block).
    pub(super) last_frees: BTreeMap<(u32, u64), (u64, u64)>,
    /// Whether the program gave its history settings: a segment with no live block then shows
    /// no stack, as PyTorch's do.
    pub(super) history_given: bool,
}

impl Window {
    /// The size requested by the block freed last inside `[address, end)` of `device` (0 if
    /// none was).
    pub(super) fn requested_of_free(&self, device: u32, address: u64, end: u64) -> u64 {
        (self.last_frees.range((device, address)..(device, end)))
            .max_by_key(|(_, (index, _))| *index)
            .map_or(0, |(_, (_, requested))| *requested)
    }
}

/// What the window keeps while the trace is walked: the window itself, the program's history
/// settings, and what it needs of each live block and segment to show their events' stacks.
/// [`WindowWalk::visit`] takes the records in order, from the walk of its own
/// ([`walk_with_window`]) or from another one (the categories pass's, when the snapshot is at
/// the trace's end: one walk instead of two).
pub(super) struct WindowWalk {
    window: Window,
    history: Cursor,
    /// Entries kept (0: none, for a snapshot of the segments alone).
    events: usize,
    /// [`Window::last_frees`] while walking, hashed (a free's insert into the ordered map cost a
    /// tenth of a snapshot's walk); ordered once at the end.
    last_frees: FxHashMap<(u32, u64), (u64, u64)>,
    /// The size requested of each live block, for `last_frees`.
    requested_of: FxHashMap<(u32, u64), u64>,
    /// Each live segment's allocation stack, for its release's entry.
    segment_allocated_at: FxHashMap<(u32, u64), u32>,
    /// Each run mapped into an expandable segment: its end and the stack that mapped it, for
    /// the entries of unmaps inside it that have no stack of their own (as PyTorch's show the
    /// context its segment was allocated in).
    mapped_at: BTreeMap<(u32, u64), (u64, u32)>,
    /// The stack of each free not yet completed, for its `free_completed` entry.
    freed_by: FxHashMap<(u32, u64), u32>,
    /// `Alloc` records so far (the next one's ordinal).
    allocs: u64,
    /// The allocation stack of each live block: a free without a stack of its own shows its
    /// block's (as PyTorch does when it records no free context).
    allocated_at: FxHashMap<(u32, u64), u32>,
    /// The latest time of an event visited (0 before any).
    last_t: u64,
}

impl WindowWalk {
    /// A window of the last `events` events that `history` keeps.
    pub(super) fn new(events: usize, history: Cursor) -> WindowWalk {
        WindowWalk {
            window: Window {
                events: VecDeque::new(),
                has_context: false,
                ordinals: FxHashMap::default(),
                block_stacks: FxHashMap::default(),
                segment_stacks: FxHashMap::default(),
                fixed_segments: FxHashSet::default(),
                last_frees: BTreeMap::new(),
                history_given: history.given(),
            },
            history,
            events,
            last_frees: FxHashMap::default(),
            requested_of: FxHashMap::default(),
            segment_allocated_at: FxHashMap::default(),
            mapped_at: BTreeMap::new(),
            freed_by: FxHashMap::default(),
            allocs: 0,
            allocated_at: FxHashMap::default(),
            last_t: 0,
        }
    }

    /// Take in the walk's next record.
    pub(super) fn visit(&mut self, step: &Step) {
        let history = &mut self.history;
        let window = &mut self.window;
        if !step.in_checkpoint
            && let Some(t) = step.record.time()
            && history.advance(t)
        {
            window.events.clear();
        }
        let mut ordinal = u64::MAX;
        let stack = match &step.record {
            r if r.is_context() => {
                window.has_context = true;
                None
            }
            Record::Alloc(a) => {
                ordinal = self.allocs;
                self.allocs += 1;
                self.allocated_at.insert((a.device, a.address), a.stack);
                self.requested_of.insert((a.device, a.address), a.requested);
                window.ordinals.insert((a.device, a.address), Some(ordinal));
                if history.given() {
                    let shown = history.block_stack(a.stack);
                    window.block_stacks.insert((a.device, a.address), shown);
                }
                Some(history.event_stack(EventKind::Alloc, a.stack, 0))
            }
            Record::CheckpointBlock(b) => {
                self.allocated_at.insert((b.device, b.address), b.stack);
                window.ordinals.entry((b.device, b.address)).or_insert(None);
                None
            }
            Record::FreeRequested(f) => {
                let at = self.allocated_at.get(&(f.device, f.address)).copied();
                self.freed_by.insert((f.device, f.address), f.stack);
                Some(history.event_stack(EventKind::Free, f.stack, at.unwrap_or(0)))
            }
            Record::Free(f) => {
                if let Some(requested) = self.requested_of.remove(&(f.device, f.address)) {
                    (self.last_frees).insert((f.device, f.address), (step.index, requested));
                }
                window.ordinals.remove(&(f.device, f.address));
                window.block_stacks.remove(&(f.device, f.address));
                let at = self.allocated_at.remove(&(f.device, f.address));
                Some(history.event_stack(EventKind::Free, f.stack, at.unwrap_or(0)))
            }
            Record::FreeCompleted(f) => {
                if let Some(requested) = self.requested_of.remove(&(f.device, f.address)) {
                    (self.last_frees).insert((f.device, f.address), (step.index, requested));
                }
                window.ordinals.remove(&(f.device, f.address));
                window.block_stacks.remove(&(f.device, f.address));
                let at = self
                    .allocated_at
                    .remove(&(f.device, f.address))
                    .unwrap_or(0);
                let own = self.freed_by.remove(&(f.device, f.address)).unwrap_or(0);
                Some(history.event_stack(EventKind::Free, own, at))
            }
            Record::SegmentAlloc(s) => {
                self.segment_allocated_at
                    .insert((s.device, s.address), s.stack);
                window.fixed_segments.insert((s.device, s.address));
                if history.given() {
                    let shown = history.block_stack(s.stack);
                    window.segment_stacks.insert((s.device, s.address), shown);
                }
                Some(history.event_stack(EventKind::Alloc, s.stack, 0))
            }
            Record::CheckpointSegment(s) => {
                self.segment_allocated_at
                    .insert((s.device, s.address), s.stack);
                None
            }
            Record::SegmentMap(s) => {
                (self.mapped_at).insert((s.device, s.address), (s.address + s.size, s.stack));
                if history.given() {
                    let shown = history.block_stack(s.stack);
                    window.segment_stacks.insert((s.device, s.address), shown);
                }
                Some(history.event_stack(EventKind::Alloc, s.stack, 0))
            }
            Record::SegmentFree(s) => {
                window.segment_stacks.remove(&(s.device, s.address));
                window.fixed_segments.remove(&(s.device, s.address));
                let at = self.segment_allocated_at.remove(&(s.device, s.address));
                Some(history.event_stack(EventKind::Free, s.stack, at.unwrap_or(0)))
            }
            Record::SegmentUnmap(s) => {
                let mapped = unmap(&mut self.mapped_at, s.device, s.address, s.size);
                Some(history.event_stack(EventKind::Free, s.stack, mapped))
            }
            Record::Oom(o) => Some(history.event_stack(EventKind::Alloc, o.stack, 0)),
            _ => None,
        };
        if stack.is_some()
            && !step.in_checkpoint
            && let Some(t) = step.record.time()
        {
            // The history settings decided what this event shows.
            self.last_t = self.last_t.max(t);
        }
        if let Some(stack) = stack
            && self.events > 0
            && !step.in_checkpoint
            && history.keeps_events()
        {
            let skipped = history.skipped_actions();
            window
                .events
                .push_back((step.record.clone(), stack, ordinal, skipped));
            // The last `events` events (a record makes one or two entries).
            if window.events.len() > self.events {
                window.events.pop_front();
            }
        }
    }

    /// The window, after the whole trace was walked: the program's changes after its last
    /// record (a history cleared just before the snapshot) apply too.
    pub(super) fn at_end(mut self) -> Window {
        if self.history.advance(u64::MAX) {
            self.window.events.clear();
        }
        self.before_end()
    }

    /// The window at a moment before the trace's end.
    fn before_end(mut self) -> Window {
        self.window.last_frees = self.last_frees.into_iter().collect();
        self.window
    }

    /// The window at the end of what a followed trace has so far, the walk going on after it
    /// (`serve`): every history change the program has made applies now, as at a trace's end
    /// (the changes a later request brings start the walk over).
    pub(super) fn now(&mut self) -> &Window {
        if self.history.advance(u64::MAX) {
            self.window.events.clear();
        }
        self.window.last_frees = self.last_frees.iter().map(|(k, v)| (*k, *v)).collect();
        &self.window
    }
}

impl WindowWalk {
    /// Take the program's history changes so far, where they add to the ones the walk has,
    /// after the records it has visited (`Cursor::extend`); false if the walk must start over.
    pub(super) fn extend_history(&mut self, changes: &[Settings]) -> bool {
        self.history.extend(changes, self.last_t)
    }

    /// The ordinal of the first allocation the window still shows (the next allocation's when
    /// it shows none): no later snapshot of this walk shows an earlier one's event.
    pub(super) fn first_ordinal(&self) -> u64 {
        (self.window.events.iter())
            .map(|(_, _, ordinal, _)| *ordinal)
            .find(|ordinal| *ordinal != u64::MAX)
            .unwrap_or(self.allocs)
    }

    /// The ordinals of the blocks live or pending now, which a snapshot shows whenever they
    /// were allocated.
    pub(super) fn live_ordinals(&self) -> FxHashSet<u64> {
        self.window.ordinals.values().flatten().copied().collect()
    }
}

/// Take `[address, address + size)` of `device` out of the mapped runs `mapped_at` (start ->
/// (end, stack)); returns the stack that mapped `address` (0 if none did).
fn unmap(
    mapped_at: &mut BTreeMap<(u32, u64), (u64, u32)>,
    device: u32,
    address: u64,
    size: u64,
) -> u32 {
    let end = address + size;
    let overlapping: Vec<_> = (mapped_at.range(..(device, end)).rev())
        // Runs do not overlap: the first one back that ends before `address`, all before it do.
        .take_while(|((d, _), (run_end, _))| *d == device && *run_end > address)
        .map(|(&(_, start), &(run_end, stack))| (start, run_end, stack))
        .collect();
    let mut mapped = 0;
    for (start, run_end, stack) in overlapping {
        mapped_at.remove(&(device, start));
        if start <= address {
            mapped = stack;
        }
        if start < address {
            mapped_at.insert((device, start), (address, stack));
        }
        if run_end > end {
            mapped_at.insert((device, end), (run_end, stack));
        }
    }
    mapped
}

/// Walk `dir` through record `index`, keeping the last `events` events that `history` keeps.
pub(super) fn walk_with_window(
    dir: &Path,
    index: u64,
    events: usize,
    history: Cursor,
) -> Result<(TraceWalk, Window), Error> {
    let mut walk = TraceWalk::open(dir)?;
    let mut window = WindowWalk::new(events, history);
    while let Some(step) = walk.step() {
        let step = step?;
        window.visit(&step);
        if step.index >= index {
            return Ok((walk, window.before_end()));
        }
    }
    Ok((walk, window.at_end()))
}

/// Records read for a context record (a phase, scope or tag) before a snapshot at the trace's
/// end chooses two walks: a PyTorch program says its first ones in its first training step.
const CONTEXT_WITHIN: usize = 100_000;

/// Whether a context record comes within the trace's first [`CONTEXT_WITHIN`] records (read,
/// not walked: a few milliseconds).
pub(super) fn context_comes_early(dir: &Path) -> Result<bool, Error> {
    let mut reader = TraceReader::open(dir).map_err(|e| Error::Message(e.to_string()))?;
    for _ in 0..CONTEXT_WITHIN {
        match reader.next_ref() {
            Some(Ok((_, record))) if record.is_context() => return Ok(true),
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(Error::Message(e.to_string())),
            None => break,
        }
    }
    Ok(false)
}
