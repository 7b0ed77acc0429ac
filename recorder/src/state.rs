//! [`LiveState`]: the writer's mirror of what is live — segments (an expandable segment's
//! mapped memory as one segment per contiguous run, see [`crate::spans`]), blocks and the stack
//! and frame definitions they use, and the program's context (its phase, each thread's
//! module scope, each live block's scope, phase and category) — kept by applying every record
//! written. Each new trace file begins with it as a checkpoint, so any file can be read alone.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rustc_hash::FxHashMap;

use crate::schema::{
    BlockContext, BlockState, CheckpointEnd, FrameDef, FreeCompleted, PhaseEvent, Record,
    ScopeEvent, ScopeName, SegmentState, StackDef,
};
use crate::spans::{self, Span};

mod blocks;

pub use blocks::{Blocks, OrderedBlocks};

impl Span for SegmentState {
    fn address(&self) -> u64 {
        self.address
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn pool(&self) -> u8 {
        self.pool
    }
    fn with(self, address: u64, size: u64) -> Self {
        SegmentState {
            address,
            size,
            ..self
        }
    }
}

/// Byte totals of one device, as PyTorch's stats define them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceTotals {
    /// Bytes of allocated blocks.
    pub allocated: u64,
    /// Bytes of allocated and freed-but-pending blocks.
    pub active: u64,
    /// Requested bytes of active blocks.
    pub requested: u64,
    /// Bytes of segments.
    pub reserved: u64,
}

/// The live state of a traced process.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LiveState {
    /// Live segments by `(device, address)`.
    pub segments: BTreeMap<(u32, u64), SegmentState>,
    /// Allocated or pending blocks by `(device, address)`.
    pub blocks: Blocks,
    /// Every stack definition seen.
    pub stacks: HashMap<u32, StackDef>,
    /// Every frame definition seen.
    pub frames: HashMap<u32, FrameDef>,
    /// Byte totals per device, kept with the maps above.
    pub totals: BTreeMap<u32, DeviceTotals>,
    /// The program's context: its phase, the threads' scopes, the live blocks' contexts.
    pub context: ProgramContext,
}

/// What the Python integration said about the program (`Scope`, `Phase` and `Tag` records):
/// its phase, each thread's innermost module, and for each live block where it was allocated
/// and what it holds. Empty for programs that say nothing.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProgramContext {
    /// The phase now, and the step.
    pub phase: PhaseEvent,
    /// Each thread's innermost module (threads outside any are absent).
    pub thread_scopes: BTreeMap<u32, u32>,
    /// Every scope name seen.
    pub scope_names: HashMap<u32, ScopeName>,
    /// Live blocks allocated inside a scope, in a phase, or tagged, by `(device, address)`:
    /// with the Python integration on, every allocation and free inserts or removes one, in
    /// the recorder's thread and in every walk of the tools, so a hash map (as [`Blocks`]: a
    /// B-tree here made `summary` of a 10 M-event trace with categories take 1.56 s instead of
    /// 1.14, BENCHMARKS.md, tenth session); the checkpoint sorts them.
    pub blocks: FxHashMap<(u32, u64), BlockContext>,
}

impl ProgramContext {
    /// The context of a block allocated now by `thread` (`None`: nothing known).
    fn at_allocation(&self, device: u32, address: u64, thread: u32) -> Option<BlockContext> {
        let scope = self.thread_scopes.get(&thread).copied().unwrap_or(0);
        (scope != 0 || self.phase.phase != 0).then_some(BlockContext {
            device,
            address,
            scope,
            phase: self.phase.phase,
            category: 0,
        })
    }
}

impl LiveState {
    /// The byte totals of `device` (zero for a device never seen).
    #[inline]
    pub fn device_totals(&self, device: u32) -> DeviceTotals {
        self.totals.get(&device).copied().unwrap_or_default()
    }

    /// Apply one record.
    pub fn apply(&mut self, record: &Record) {
        match record {
            Record::Alloc(a) => {
                self.put_block(BlockState {
                    device: a.device,
                    address: a.address,
                    size: a.size,
                    requested: a.requested,
                    stack: a.stack,
                    pending: 0,
                });
                if let Some(c) = self.context.at_allocation(a.device, a.address, a.thread) {
                    self.context.blocks.insert((a.device, a.address), c);
                }
            }
            Record::FreeRequested(f) => {
                if let Some(mut b) = self.blocks.get(&(f.device, f.address)).copied() {
                    b.pending = 1;
                    self.put_block(b);
                }
            }
            Record::FreeCompleted(FreeCompleted {
                device, address, ..
            }) => self.take_block(*device, *address),
            Record::Free(f) => self.take_block(f.device, f.address),
            Record::SegmentAlloc(s) => self.put_segment(SegmentState {
                device: s.device,
                address: s.address,
                size: s.size,
                pool: s.pool,
                stack: s.stack,
            }),
            Record::SegmentFree(s) => {
                if let Some(old) = self.segments.remove(&(s.device, s.address)) {
                    self.totals.entry(old.device).or_default().reserved -= old.size;
                }
            }
            Record::SegmentMap(s) => {
                let device = s.device;
                spans::map(
                    &mut self.segments,
                    |a| (device, a),
                    SegmentState {
                        device,
                        address: s.address,
                        size: s.size,
                        pool: s.pool,
                        stack: s.stack,
                    },
                );
                self.totals.entry(device).or_default().reserved += s.size;
            }
            Record::SegmentUnmap(s) => {
                let device = s.device;
                if spans::unmap(&mut self.segments, |a| (device, a), s.address, s.size).is_some() {
                    self.totals.entry(device).or_default().reserved -= s.size;
                }
            }
            Record::CheckpointSegment(s) => self.put_segment(*s),
            Record::CheckpointBlock(b) => self.put_block(*b),
            Record::StackDef(s) => {
                self.stacks.insert(s.id, (**s).clone());
            }
            Record::FrameDef(f) => {
                self.frames.insert(f.id, (**f).clone());
            }
            Record::ScopeName(n) => {
                self.context.scope_names.insert(n.id, (**n).clone());
            }
            Record::Scope(ScopeEvent { thread, scope, .. }) => {
                if *scope == 0 {
                    self.context.thread_scopes.remove(thread);
                } else {
                    self.context.thread_scopes.insert(*thread, *scope);
                }
            }
            Record::Phase(p) => {
                // A phase ends every thread's scope (autograd's threads keep none from the
                // last backward).
                self.context.phase = *p;
                self.context.thread_scopes.clear();
            }
            Record::Tag(g) => {
                if let Some(&BlockState {
                    device, address, ..
                }) = self.block_holding(g.device, g.address)
                {
                    let c = self
                        .context
                        .blocks
                        .entry((device, address))
                        .or_insert(BlockContext {
                            device,
                            address,
                            scope: 0,
                            phase: 0,
                            category: 0,
                        });
                    c.category = g.category;
                }
            }
            Record::CheckpointBlockContext(c) => {
                self.context.blocks.insert((c.device, c.address), *c);
            }
            _ => {}
        }
    }

    /// Insert or replace a block, keeping the totals (one search of the map, not two: this is
    /// the walk's hottest path).
    fn put_block(&mut self, block: BlockState) {
        let key = (block.device, block.address);
        if !self.context.blocks.is_empty() {
            self.context.blocks.remove(&key);
        }
        let t = self.totals.entry(block.device).or_default();
        if let Some(old) = self.blocks.insert(key, block) {
            if old.pending == 0 {
                t.allocated -= old.size;
            }
            t.active -= old.size;
            t.requested -= old.requested;
        }
        if block.pending == 0 {
            t.allocated += block.size;
        }
        t.active += block.size;
        t.requested += block.requested;
    }

    /// The live block of `device` that holds `address` (its start or inside it).
    pub fn block_holding(&self, device: u32, address: u64) -> Option<&BlockState> {
        self.blocks.holding(device, address)
    }

    /// Forget the memory (segments, blocks, totals, blocks' contexts), keeping definitions and
    /// the program's phase and scopes: a new file's checkpoint is about to say what is live.
    pub fn clear_memory(&mut self) {
        self.segments.clear();
        self.blocks.clear();
        self.totals.clear();
        self.context.blocks.clear();
    }

    /// Remove a block, keeping the totals.
    fn take_block(&mut self, device: u32, address: u64) {
        if !self.context.blocks.is_empty() {
            self.context.blocks.remove(&(device, address));
        }
        if let Some(old) = self.blocks.remove(&(device, address)) {
            let t = self.totals.entry(device).or_default();
            if old.pending == 0 {
                t.allocated -= old.size;
            }
            t.active -= old.size;
            t.requested -= old.requested;
        }
    }

    /// Insert or replace a segment, keeping the totals.
    fn put_segment(&mut self, segment: SegmentState) {
        let t = self.totals.entry(segment.device).or_default();
        if let Some(old) = self
            .segments
            .insert((segment.device, segment.address), segment)
        {
            t.reserved -= old.size;
        }
        t.reserved += segment.size;
    }

    /// The checkpoint records: the frames and stacks in use, then segments, then blocks, then
    /// the program's context (the scope names in use, the phase, each thread's scope, each live
    /// block's context), then the end marker.
    pub fn checkpoint(&self, t: u64) -> Vec<Record> {
        let used_stacks: BTreeSet<u32> = self
            .segments
            .values()
            .map(|s| s.stack)
            .chain(self.blocks.values().map(|b| b.stack))
            .filter(|&id| id != 0)
            .collect();
        let stacks: Vec<&StackDef> = used_stacks
            .iter()
            .filter_map(|id| self.stacks.get(id))
            .collect();
        let used_frames: BTreeSet<u32> = stacks
            .iter()
            .flat_map(|s| s.frames.iter().copied())
            .collect();
        let mut out: Vec<Record> = used_frames
            .iter()
            .filter_map(|id| self.frames.get(id))
            .map(|f| Record::FrameDef(Box::new(f.clone())))
            .collect();
        out.extend(
            stacks
                .into_iter()
                .map(|s| Record::StackDef(Box::new(s.clone()))),
        );
        out.extend(
            self.segments
                .values()
                .map(|s| Record::CheckpointSegment(*s)),
        );
        out.extend(
            self.blocks
                .ordered()
                .iter()
                .map(|b| Record::CheckpointBlock(*b)),
        );
        self.context_checkpoint(t, &mut out);
        out.push(Record::CheckpointEnd(CheckpointEnd { t }));
        out
    }
}

impl LiveState {
    /// The program's context as checkpoint records (nothing for a program that said nothing).
    fn context_checkpoint(&self, t: u64, out: &mut Vec<Record>) {
        let c = &self.context;
        let used: BTreeSet<u32> = c
            .thread_scopes
            .values()
            .copied()
            .chain(c.blocks.values().map(|b| b.scope))
            .filter(|&id| id != 0)
            .collect();
        out.extend(
            used.iter()
                .filter_map(|id| c.scope_names.get(id))
                .map(|n| Record::ScopeName(Box::new(n.clone()))),
        );
        if c.phase != PhaseEvent::default() {
            out.push(Record::Phase(PhaseEvent { t, ..c.phase }));
        }
        out.extend(
            c.thread_scopes
                .iter()
                .map(|(&thread, &scope)| Record::Scope(ScopeEvent { t, thread, scope })),
        );
        let mut blocks: Vec<&BlockContext> = c.blocks.values().collect();
        blocks.sort_unstable_by_key(|b| (b.device, b.address));
        out.extend(
            blocks
                .into_iter()
                .map(|b| Record::CheckpointBlockContext(*b)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{Alloc, PHASE_FORWARD};

    fn alloc(device: u32, address: u64, thread: u32) -> Record {
        Record::Alloc(Alloc {
            t: 1,
            device,
            stream: 0,
            address,
            requested: 512,
            size: 512,
            stack: 0,
            thread,
        })
    }

    /// The blocks' contexts live in a hash map; the checkpoint still gives them in
    /// `(device, address)` order, and a state rebuilt from it has the same contexts.
    #[test]
    fn the_checkpoint_gives_block_contexts_in_address_order_and_rebuilds_them() {
        let mut state = LiveState::default();
        state.apply(&Record::Phase(PhaseEvent {
            t: 0,
            phase: PHASE_FORWARD,
            step: 1,
        }));
        let keys = [
            (1, 0x9000),
            (0, 0x5000),
            (1, 0x1000),
            (0, 0x7000),
            (0, 0x1000),
        ];
        for (i, &(device, address)) in keys.iter().enumerate() {
            state.apply(&alloc(device, address, i as u32));
        }
        assert_eq!(state.context.blocks.len(), keys.len());
        let records = state.checkpoint(2);
        let order: Vec<(u32, u64)> = records
            .iter()
            .filter_map(|r| match r {
                Record::CheckpointBlockContext(c) => Some((c.device, c.address)),
                _ => None,
            })
            .collect();
        let mut sorted = keys.to_vec();
        sorted.sort_unstable();
        assert_eq!(order, sorted);
        let mut rebuilt = LiveState::default();
        for r in &records {
            rebuilt.apply(r);
        }
        assert_eq!(rebuilt.context.blocks, state.context.blocks);
        assert_eq!(rebuilt.blocks, state.blocks);
    }
}
