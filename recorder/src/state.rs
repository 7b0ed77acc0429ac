//! [`LiveState`]: the writer's mirror of what is live — segments, blocks and the stack and
//! frame definitions they use — kept by applying every record written. Each new trace file
//! begins with it as a checkpoint, so any file can be read alone.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::schema::{BlockState, CheckpointEnd, FrameDef, Record, SegmentState, StackDef};

/// The live state of a traced process.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LiveState {
    /// Live segments by `(device, address)`.
    pub segments: BTreeMap<(u32, u64), SegmentState>,
    /// Allocated or pending blocks by `(device, address)`.
    pub blocks: BTreeMap<(u32, u64), BlockState>,
    /// Every stack definition seen.
    pub stacks: HashMap<u32, StackDef>,
    /// Every frame definition seen.
    pub frames: HashMap<u32, FrameDef>,
}

impl LiveState {
    /// Apply one record.
    pub fn apply(&mut self, record: &Record) {
        match record {
            Record::Alloc(a) => {
                self.blocks.insert(
                    (a.device, a.address),
                    BlockState {
                        device: a.device,
                        address: a.address,
                        size: a.size,
                        requested: a.requested,
                        stack: a.stack,
                        pending: 0,
                    },
                );
            }
            Record::FreeRequested(f) => {
                if let Some(b) = self.blocks.get_mut(&(f.device, f.address)) {
                    b.pending = 1;
                }
            }
            Record::FreeCompleted(f) => {
                self.blocks.remove(&(f.device, f.address));
            }
            Record::Free(f) => {
                self.blocks.remove(&(f.device, f.address));
            }
            Record::SegmentAlloc(s) => {
                self.segments.insert(
                    (s.device, s.address),
                    SegmentState {
                        device: s.device,
                        address: s.address,
                        size: s.size,
                        pool: s.pool,
                        stack: s.stack,
                    },
                );
            }
            Record::SegmentFree(s) => {
                self.segments.remove(&(s.device, s.address));
            }
            Record::CheckpointSegment(s) => {
                self.segments.insert((s.device, s.address), *s);
            }
            Record::CheckpointBlock(b) => {
                self.blocks.insert((b.device, b.address), *b);
            }
            Record::StackDef(s) => {
                self.stacks.insert(s.id, (**s).clone());
            }
            Record::FrameDef(f) => {
                self.frames.insert(f.id, (**f).clone());
            }
            _ => {}
        }
    }

    /// The checkpoint records: the frames and stacks in use, then segments, then blocks, then
    /// the end marker.
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
        out.extend(self.blocks.values().map(|b| Record::CheckpointBlock(*b)));
        out.push(Record::CheckpointEnd(CheckpointEnd { t }));
        out
    }
}
