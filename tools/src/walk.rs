//! Walking a trace directory: its records in order, each applied to the live state (segments,
//! blocks, stacks) that the recorder's [`LiveState`] keeps. Every command is built on
//! [`TraceWalk`].
//!
//! A trace may span rotated files. Each file opens with its header and a checkpoint of the live
//! state; the first file's checkpoint seeds the state, and a later file's checkpoint replaces it
//! (it is the truth after a tear, and equal to the walked state otherwise). Records inside a
//! checkpoint are not events: [`Step::in_checkpoint`] says so, and peaks ignore them.

use std::path::Path;

use cachealloc_recorder::schema::{FRAME_PYTHON, FrameDef, Header};
use cachealloc_recorder::{LiveState, Record, Tear, TraceReader};

/// One record of the walk.
#[derive(Debug)]
pub struct Step {
    /// The record (already applied to [`TraceWalk::state`]).
    pub record: Record,
    /// Ordinal of the record in the trace (0-based).
    pub index: u64,
    /// Part of a file's opening checkpoint (live state, not an event).
    pub in_checkpoint: bool,
}

/// One record of the walk, borrowed ([`TraceWalk::step_ref`]).
#[derive(Debug, Clone, Copy)]
pub struct StepRef<'a> {
    /// The record (already applied to `state`).
    pub record: &'a Record,
    /// Ordinal of the record in the trace (0-based).
    pub index: u64,
    /// Part of a file's opening checkpoint (live state, not an event).
    pub in_checkpoint: bool,
    /// The live state after the record ([`TraceWalk::state`]).
    pub state: &'a LiveState,
}

/// A trace directory being walked.
#[derive(Debug)]
pub struct TraceWalk {
    reader: TraceReader,
    /// The live state after the last record returned.
    pub state: LiveState,
    /// The first file's header (`None` until read).
    pub header: Option<Header>,
    /// Time of the last timed record, ns since the trace's base.
    pub t: u64,
    next_index: u64,
    file: Option<usize>,
    in_checkpoint: bool,
}

impl TraceWalk {
    /// Open `dir` (a per-process trace directory).
    pub fn open(dir: &Path) -> Result<TraceWalk, String> {
        let reader = TraceReader::open(dir).map_err(|e| e.to_string())?;
        Ok(TraceWalk {
            reader,
            state: LiveState::default(),
            header: None,
            t: 0,
            next_index: 0,
            file: None,
            in_checkpoint: false,
        })
    }

    /// Open `dir` while its program still writes it ([`TraceReader::follow`]): the walk ends
    /// where the program's flushed records end, and goes on after [`TraceWalk::refresh`].
    pub fn follow(dir: &Path) -> Result<TraceWalk, String> {
        Ok(TraceWalk {
            reader: TraceReader::follow(dir).map_err(|e| e.to_string())?,
            ..TraceWalk::open(dir)?
        })
    }

    /// Take in the files a followed trace's program has begun since.
    pub fn refresh(&mut self) -> Result<(), String> {
        self.reader.refresh().map_err(|e| e.to_string())
    }

    /// Number of trace files.
    pub fn file_count(&self) -> usize {
        self.reader.files().len()
    }

    /// Where files stopped being readable (complete once the walk has ended).
    pub fn tears(&self) -> &[Tear] {
        self.reader.tears()
    }

    /// The next record, applied; `Err` for a record that cannot be decoded.
    pub fn step(&mut self) -> Option<Result<Step, String>> {
        Some(self.step_ref()?.map(|s| Step {
            record: s.record.clone(),
            index: s.index,
            in_checkpoint: s.in_checkpoint,
        }))
    }

    /// [`TraceWalk::step`] with the record borrowed, not moved out of the reader (the export's
    /// hot loop), and the state it was applied to.
    pub fn step_ref(&mut self) -> Option<Result<StepRef<'_>, String>> {
        let (file, record) = match self.reader.next_ref()? {
            Ok(item) => item,
            Err(e) => return Some(Err(e.to_string())),
        };
        if self.file != Some(file) {
            // A new file: its checkpoint replaces the state (stacks and frames are kept).
            if self.file.is_some() {
                self.state.clear_memory();
            }
            self.file = Some(file);
        }
        match record {
            Record::Header(h) => {
                self.in_checkpoint = true;
                if self.header.is_none() {
                    self.header = Some((**h).clone());
                }
            }
            Record::CheckpointEnd(_) => self.in_checkpoint = false,
            r => {
                if let Some(t) = r.time() {
                    self.t = self.t.max(t);
                }
            }
        }
        self.state.apply(record);
        let step = StepRef {
            in_checkpoint: self.in_checkpoint || matches!(record, Record::CheckpointEnd(_)),
            record,
            index: self.next_index,
            state: &self.state,
        };
        self.next_index += 1;
        Some(Ok(step))
    }

    /// Walk through the record of ordinal `index` (inclusive).
    pub fn run_through(&mut self, index: u64) -> Result<(), String> {
        while self.next_index <= index {
            match self.step() {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e),
                None => break,
            }
        }
        Ok(())
    }
}

/// The ordinal of the last record at or before time `t` (events after it are not walked).
pub fn last_index_at(dir: &Path, t: u64) -> Result<u64, String> {
    let mut scan = TraceWalk::open(dir)?;
    let mut last = None;
    while let Some(step) = scan.step() {
        let step = step?;
        if !step.in_checkpoint && step.record.time().is_some_and(|rt| rt > t) {
            break;
        }
        last = Some(step.index);
    }
    last.ok_or_else(|| format!("{}: the trace has no records", dir.display()))
}

/// A frame as one line: `name (file:line)` for Python, the symbol (or address) for native.
pub fn frame_label(frame: &FrameDef) -> String {
    if frame.kind == FRAME_PYTHON {
        format!("{} ({}:{})", frame.name, frame.file, frame.line)
    } else if !frame.name.is_empty() {
        if frame.file.is_empty() {
            frame.name.clone()
        } else {
            format!("{} ({}:{})", frame.name, frame.file, frame.line)
        }
    } else {
        format!("{:#x}", frame.address)
    }
}

/// The frames of stack `id`, innermost first (empty for 0 or an unknown id).
pub fn stack_frames(state: &LiveState, id: u32) -> Vec<&FrameDef> {
    state
        .stacks
        .get(&id)
        .map(|s| {
            s.frames
                .iter()
                .filter_map(|f| state.frames.get(f))
                .collect()
        })
        .unwrap_or_default()
}

/// The allocation site of stack `id`: its innermost Python frame if it has one (the line of the
/// program that allocated), else its innermost native frame; `"(no stack)"` without frames.
pub fn site(state: &LiveState, id: u32) -> String {
    let frames = stack_frames(state, id);
    frames
        .iter()
        .find(|f| f.kind == FRAME_PYTHON)
        .or(frames.first())
        .map(|f| frame_label(f))
        .unwrap_or_else(|| "(no stack)".to_string())
}
