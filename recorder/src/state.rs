//! [`LiveState`]: the writer's mirror of what is live — segments (an expandable segment's
//! mapped memory as one segment per contiguous run, see [`crate::spans`]), blocks and the stack
//! and frame definitions they use — kept by applying every record written. Each new trace file
//! begins with it as a checkpoint, so any file can be read alone.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::schema::{
    BlockState, CheckpointEnd, FrameDef, FreeCompleted, Record, SegmentState, StackDef,
};
use crate::spans::{self, Span};

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
    pub blocks: BTreeMap<(u32, u64), BlockState>,
    /// Every stack definition seen.
    pub stacks: HashMap<u32, StackDef>,
    /// Every frame definition seen.
    pub frames: HashMap<u32, FrameDef>,
    /// Byte totals per device, kept with the maps above.
    pub totals: BTreeMap<u32, DeviceTotals>,
}

impl LiveState {
    /// The byte totals of `device` (zero for a device never seen).
    pub fn device_totals(&self, device: u32) -> DeviceTotals {
        self.totals.get(&device).copied().unwrap_or_default()
    }

    /// Apply one record.
    pub fn apply(&mut self, record: &Record) {
        match record {
            Record::Alloc(a) => self.put_block(BlockState {
                device: a.device,
                address: a.address,
                size: a.size,
                requested: a.requested,
                stack: a.stack,
                pending: 0,
            }),
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
            _ => {}
        }
    }

    /// Insert or replace a block, keeping the totals.
    fn put_block(&mut self, block: BlockState) {
        self.take_block(block.device, block.address);
        let t = self.totals.entry(block.device).or_default();
        if block.pending == 0 {
            t.allocated += block.size;
        }
        t.active += block.size;
        t.requested += block.requested;
        self.blocks.insert((block.device, block.address), block);
    }

    /// Remove a block, keeping the totals.
    fn take_block(&mut self, device: u32, address: u64) {
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
