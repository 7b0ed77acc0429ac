//! `cachealloc snapshot TRACE -o snap.pickle`: the state at a moment as a PyTorch memory
//! snapshot (`torch.cuda.memory._snapshot()`'s pickle): `segments` with their blocks tiling each
//! segment (free gaps as `inactive` blocks), `device_traces` with the last events before that
//! moment, and `allocator_settings`. It opens in `torch.cuda._memory_viz` and PyTorch's memory
//! viewer.
//!
//! For a trace with context records before that moment (phases, module scopes, tags), each
//! allocated block and each `alloc` entry carries its `category` (`crate::categories`), spelled
//! as PyTorch's profile snapshots spell it (`parameter`, `activation`, …, `unknown`), so that
//! PyTorch's memory viewer can colour by it; finding a block's category takes a walk of the
//! whole trace (a block's category depends on its whole life).
//!
//! Free events carry their own stack where the shim captured one (while the program asks
//! `_record_memory_history` for free context), else their block's allocation stack, as
//! PyTorch's own snapshots do when they record no free context. With `--history` the snapshot
//! shows what the program's history settings keep (`history`).
//!
//! The snapshot is a tree of serde structs (pickled as dicts with these field names) that borrow
//! each stack's frames, built once per stack: a window of 100 000 events with 20-frame stacks
//! is written without 2 million frame dictionaries in memory. The pickle shares them too
//! ([`crate::pickle::Shared`]): each stack's frame list is written once and loads as one
//! Python list, as PyTorch's own snapshots share a traceback's frames.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};

use cachealloc_core::config::Config;
use cachealloc_recorder::{LiveState, Record};
use serde::Serialize;

use super::{When, resolve_when};
use crate::categories::pass::{Outcome, Plan};
use crate::categories::{self, Category};
use crate::format::bytes;
use crate::pickle::Shared;
use crate::progress::Progress;
use crate::walk::{TraceWalk, stack_frames};
use crate::{Error, one_trace};
use history::{Cursor, PYTHON_ONLY};
use texts::{EntryTexts, NO_COMPILE_CONTEXT, TextOverTime};
use window::{Window, WindowWalk, context_comes_early, walk_with_window};

mod history;
mod serve;
mod texts;
mod window;

/// `cachealloc snapshot`'s arguments.
#[derive(clap::Args, Debug)]
pub struct SnapshotArgs {
    /// Trace directory.
    pub trace: PathBuf,
    #[allow(missing_docs)] // clap would show a doc comment here as a help heading
    #[command(flatten)]
    pub when: When,
    /// Events kept in device_traces (the last N before the snapshot time).
    #[arg(long, default_value_t = 100_000)]
    pub events: usize,
    /// Output file.
    #[arg(short, required_unless_present = "serve")]
    pub output: Option<PathBuf>,
    /// Answer requests for snapshots of a trace its program is still writing, one JSON line
    /// each on standard input, walking only what is new each time (`snapshot::serve`; the
    /// Python integration's way).
    #[arg(long, conflicts_with_all = ["output", "at", "at_peak"])]
    pub serve: bool,
    /// The program's `_record_memory_history` settings over time, applied to what the snapshot
    /// shows (`T:ENABLED:CONTEXT:STACKS,…`; the Python integration passes them).
    #[arg(long)]
    pub history: Option<String>,
    /// The program's memory metadata over time (`torch.cuda.memory._set_memory_metadata`): a
    /// JSON file holding a list of `[T, TEXT]` in time order (the Python integration writes
    /// it). Each entry of `device_traces` gets the text in force at its time as
    /// `user_metadata` (empty before the first).
    #[arg(long)]
    pub metadata: Option<PathBuf>,
    /// The compiled regions the program ran in over time (`_record_memory_history(…,
    /// compile_context=True)`): a JSON file of `[T, REGION]` in time order (the Python
    /// integration writes it). Each entry of `device_traces` gets the region in force at its
    /// time as `compile_context` (`N/A` outside any).
    #[arg(long)]
    pub compile_context: Option<PathBuf>,
}

/// One frame, as PyTorch writes it.
#[derive(Serialize, Debug)]
struct Frame {
    filename: String,
    line: u64,
    name: String,
}

/// Each stack's frames (innermost first), built once; an id with [`PYTHON_ONLY`] set gets its
/// stack's Python frames only.
fn frame_lists(state: &LiveState, stacks: impl Iterator<Item = u32>) -> HashMap<u32, Vec<Frame>> {
    let mut lists = HashMap::new();
    for stack in stacks {
        lists.entry(stack).or_insert_with(|| {
            let python_only = stack & PYTHON_ONLY != 0;
            stack_frames(state, stack & !PYTHON_ONLY)
                .into_iter()
                .filter(|f| !python_only || f.kind == cachealloc_recorder::schema::FRAME_PYTHON)
                .map(|f| Frame {
                    filename: if f.file.is_empty() {
                        "??".into()
                    } else {
                        f.file.clone()
                    },
                    line: u64::from(f.line),
                    name: if f.name.is_empty() {
                        format!("{:#x}", f.address)
                    } else {
                        f.name.clone()
                    },
                })
                .collect()
        });
    }
    lists
}

#[derive(Serialize, Debug)]
struct Block<'a> {
    address: u64,
    size: u64,
    requested_size: u64,
    state: &'static str,
    frames: Shared<'a, Frame>,
    /// The block's category, as PyTorch's profile snapshots spell it (`activation`, …), for a
    /// trace with context records.
    #[serde(skip_serializing_if = "Option::is_none")]
    category: Option<&'static str>,
}

#[derive(Serialize, Debug)]
struct Segment<'a> {
    device: u32,
    address: u64,
    total_size: u64,
    allocated_size: u64,
    active_size: u64,
    requested_size: u64,
    stream: u64,
    segment_type: &'static str,
    segment_pool_id: (i64, i64),
    is_expandable: bool,
    frames: Shared<'a, Frame>,
    blocks: Vec<Block<'a>>,
}

/// An entry of `device_traces`: `addr` for every action but `oom`, which has `device_free`.
#[derive(Serialize, Debug)]
struct Entry<'a> {
    action: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    addr: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    device_free: Option<u64>,
    size: u64,
    stream: u64,
    frames: Shared<'a, Frame>,
    time_us: u64,
    /// The program's memory metadata when the entry was recorded (`_set_memory_metadata`).
    user_metadata: &'a str,
    /// The compiled region the program was in (`N/A` outside any; `--compile-context`).
    compile_context: &'a str,
    /// The record's time on the trace's clock.
    #[serde(skip)]
    t: u64,
    /// An allocation's category (on `alloc` entries, as `_memory_viz.profile_plot` writes it).
    #[serde(skip_serializing_if = "Option::is_none")]
    category: Option<&'static str>,
}

#[derive(Serialize, Debug)]
struct Settings {
    #[serde(rename = "PYTORCH_CUDA_ALLOC_CONF")]
    conf: String,
    max_split_size: i64,
    garbage_collection_threshold: f64,
    expandable_segments: bool,
    pinned_num_register_threads: i64,
    release_lock_on_cudamalloc: bool,
    pinned_use_cuda_host_register: bool,
    roundup_power2_divisions: HashMap<String, i64>,
}

#[derive(Serialize, Debug)]
struct Snapshot<'a> {
    segments: Vec<Segment<'a>>,
    device_traces: Vec<Vec<Entry<'a>>>,
    allocator_settings: Settings,
}

const NO_FRAMES: Shared<'static, Frame> = Shared(&[]);

/// The `device_traces` entries of one record (two for an immediate free).
fn entries<'a>(
    record: &Record,
    stack: u32,
    category: Option<&'static str>,
    frames: &'a HashMap<u32, Vec<Frame>>,
    wall_base_ns: u64,
) -> Vec<(u32, Entry<'a>)> {
    let frames = frames.get(&stack).map_or(NO_FRAMES, |f| Shared(f));
    let entry = |action, addr, size, stream, t: u64| Entry {
        action,
        addr: Some(addr),
        device_free: None,
        size,
        stream,
        frames,
        time_us: (wall_base_ns + t) / 1000,
        user_metadata: "",
        compile_context: NO_COMPILE_CONTEXT,
        t,
        category: None,
    };
    match record {
        Record::Alloc(a) => vec![(
            a.device,
            Entry {
                category,
                ..entry("alloc", a.address, a.size, a.stream, a.t)
            },
        )],
        Record::FreeRequested(f) => vec![(
            f.device,
            entry("free_requested", f.address, f.size, f.stream, f.t),
        )],
        Record::Free(f) => vec![
            (
                f.device,
                entry("free_requested", f.address, f.size, f.stream, f.t),
            ),
            (
                f.device,
                entry("free_completed", f.address, f.size, f.stream, f.t),
            ),
        ],
        Record::FreeCompleted(f) => {
            vec![(f.device, entry("free_completed", f.address, f.size, 0, f.t))]
        }
        Record::SegmentAlloc(s) => {
            vec![(s.device, entry("segment_alloc", s.address, s.size, 0, s.t))]
        }
        Record::SegmentFree(s) => {
            vec![(s.device, entry("segment_free", s.address, s.size, 0, s.t))]
        }
        Record::SegmentMap(s) => {
            vec![(s.device, entry("segment_map", s.address, s.size, 0, s.t))]
        }
        Record::SegmentUnmap(s) => {
            vec![(s.device, entry("segment_unmap", s.address, s.size, 0, s.t))]
        }
        Record::Oom(o) => vec![(
            o.device,
            Entry {
                action: "oom",
                addr: None,
                device_free: Some(o.device_free),
                size: o.requested,
                stream: 0,
                frames,
                time_us: (wall_base_ns + o.t) / 1000,
                user_metadata: "",
                compile_context: NO_COMPILE_CONTEXT,
                t: o.t,
                category: None,
            },
        )],
        _ => vec![],
    }
}

/// `segments`: each live segment with its blocks tiling it, gaps as `inactive` blocks.
/// The live segments with their blocks; with `expandable` (the run mapped some memory), each
/// segment not allocated whole is a contiguous mapped run of an expandable segment (as PyTorch
/// reports them). A segment known only from a checkpoint counts as mapped then.
fn segments<'a>(
    state: &LiveState,
    shown: &Window,
    frames: &'a HashMap<u32, Vec<Frame>>,
    categories: Option<&HashMap<(u32, u64), Category>>,
    expandable: bool,
) -> Vec<Segment<'a>> {
    let frames_of = |stack: u32| frames.get(&stack).map_or(NO_FRAMES, |f| Shared(f));
    let inactive = |device, address, size| Block {
        address,
        size,
        requested_size: shown.requested_of_free(device, address, address + size),
        state: "inactive",
        frames: NO_FRAMES,
        category: None,
    };
    let mut out = vec![];
    let ordered = state.blocks.ordered();
    for seg in state.segments.values() {
        let mut blocks = vec![];
        let (mut allocated, mut active, mut requested) = (0, 0, 0);
        let mut cursor = seg.address;
        let end = seg.address + seg.size;
        for b in ordered.range(seg.device, seg.address, end) {
            if b.address > cursor {
                blocks.push(inactive(seg.device, cursor, b.address - cursor));
            }
            let block_state = if b.pending == 0 {
                allocated += b.size;
                "active_allocated"
            } else {
                "active_pending_free"
            };
            active += b.size;
            requested += b.requested;
            blocks.push(Block {
                address: b.address,
                size: b.size,
                requested_size: b.requested,
                state: block_state,
                frames: frames_of(
                    shown
                        .block_stacks
                        .get(&(b.device, b.address))
                        .copied()
                        .unwrap_or(b.stack),
                ),
                category: categories.map(|c| {
                    c.get(&(b.device, b.address))
                        .copied()
                        .unwrap_or(Category::Unknown)
                        .snapshot_name()
                }),
            });
            cursor = b.address + b.size;
        }
        if cursor < end {
            blocks.push(inactive(seg.device, cursor, end - cursor));
        }
        out.push(Segment {
            device: seg.device,
            address: seg.address,
            total_size: seg.size,
            allocated_size: allocated,
            active_size: active,
            requested_size: requested,
            stream: 0,
            segment_type: cachealloc_recorder::schema::pool_name(seg.pool),
            segment_pool_id: (0, 0),
            is_expandable: expandable && !shown.fixed_segments.contains(&(seg.device, seg.address)),
            // PyTorch's snapshot shows a segment's allocation stack only while it holds a
            // live block; so does this one when the program gave its history settings.
            frames: if active == 0 && shown.history_given {
                NO_FRAMES
            } else {
                frames_of(
                    shown
                        .segment_stacks
                        .get(&(seg.device, seg.address))
                        .copied()
                        .unwrap_or(seg.stack),
                )
            },
            blocks,
        });
    }
    out
}

/// `allocator_settings`, from the recorded configuration (PyTorch writes `SIZE_MAX`, read as
/// -1, for an unlimited `max_split_size`).
fn settings(conf: &str) -> Settings {
    let config = Config::parse_recorded(conf, "the trace header").unwrap_or_default();
    let a = &config.allocator;
    Settings {
        conf: conf.to_string(),
        max_split_size: i64::try_from(a.max_split_size).unwrap_or(-1),
        garbage_collection_threshold: a.garbage_collection_threshold,
        expandable_segments: a.expandable_segments.any(),
        pinned_num_register_threads: 1,
        release_lock_on_cudamalloc: false,
        pinned_use_cuda_host_register: false,
        roundup_power2_divisions: HashMap::new(),
    }
}

/// Write the snapshot of `dir` through record `index`, with up to `events` trace entries per
/// device, to `output`; `categories`: a categories pass already made with
/// [`Plan::every_allocation`] (else one is made if the trace has context records before the
/// moment). Returns the walk (the state at that moment).
pub fn write(
    dir: &Path,
    index: u64,
    events: usize,
    output: &Path,
    categories: Option<Outcome>,
    history: Cursor,
    texts: &EntryTexts,
) -> Result<TraceWalk, Error> {
    // Categories need each block's whole life: a pass over the whole trace, only for traces
    // that say something about the program. At the trace's end (what the Python integration
    // asks for) the window rides on that pass's walk when the program's context shows from the
    // start; else the window's walk comes first and the pass follows if the trace had context.
    let (walk, window, categories) = match categories {
        None if index == u64::MAX && context_comes_early(dir)? => {
            let mut window = WindowWalk::new(events, history);
            let (outcome, walk) = categories::pass::run_to_end(
                dir,
                &every_category(),
                &Progress::new("categories"),
                |_, step| window.visit(step),
            )?;
            let categories = outcome.has_context.then_some(outcome);
            (walk, window.at_end(), categories)
        }
        given => {
            let (walk, window) = walk_with_window(dir, index, events, history)?;
            let categories = match given {
                Some(c) => c.has_context.then_some(c),
                None if window.has_context => Some(categories::pass::run(
                    dir,
                    &every_category(),
                    &Progress::new("categories"),
                    |_, _| {},
                )?),
                None => None,
            };
            (walk, window, categories)
        }
    };
    write_pickle(
        output,
        &walk,
        &window,
        categories.as_ref(),
        index,
        events,
        texts,
    )?;
    Ok(walk)
}

/// Write the snapshot after record `index` of `walk` (walked through it), with `window`'s last
/// `events` entries per device and `categories` (a pass with every allocation's category, for
/// a trace with context), to `output`.
fn write_pickle(
    output: &Path,
    walk: &TraceWalk,
    window: &Window,
    categories: Option<&Outcome>,
    index: u64,
    events: usize,
    texts: &EntryTexts,
) -> Result<(), Error> {
    let category_of = |ordinal: u64| {
        let c = categories?;
        let category = c.every_allocation.get(ordinal)?;
        Some(category.snapshot_name())
    };
    let block_categories: Option<HashMap<(u32, u64), Category>> = categories.map(|c| {
        window
            .ordinals
            .iter()
            .map(|(&(device, address), &ordinal)| {
                let category = c.category_of(device, address, ordinal, index);
                ((device, address), category)
            })
            .collect()
    });
    let header = walk.header.clone();
    let wall = header.as_ref().map_or(0, |h| h.wall_clock_base_ns);
    let device_count = header.as_ref().map_or(0, |h| h.devices.len()).max(
        walk.state
            .segments
            .keys()
            .map(|(d, _)| *d as usize + 1)
            .max()
            .unwrap_or(1),
    );
    let state = &walk.state;
    let stacks = window
        .events
        .iter()
        .map(|(_, stack, _, _)| *stack)
        .chain(state.blocks.values().map(|b| b.stack))
        .chain(window.block_stacks.values().copied())
        .chain(window.segment_stacks.values().copied())
        .chain(state.segments.values().map(|s| s.stack));
    let frames = frame_lists(state, stacks);
    let mut traces: Vec<VecDeque<Entry<'_>>> = (0..device_count).map(|_| VecDeque::new()).collect();
    for (record, stack, ordinal, skipped) in &window.events {
        for (device, mut entry) in entries(record, *stack, category_of(*ordinal), &frames, wall) {
            if skipped & history::action_bit(entry.action) != 0 {
                continue;
            }
            entry.user_metadata = texts.metadata.at(entry.t);
            entry.compile_context = texts.compile_context.at(entry.t);
            if let Some(t) = traces.get_mut(device as usize) {
                t.push_back(entry);
                if t.len() > events {
                    t.pop_front();
                }
            }
        }
    }
    let allocator_settings = settings(header.as_ref().map_or("", |h| h.config.as_str()));
    let snapshot = Snapshot {
        segments: segments(
            state,
            window,
            &frames,
            block_categories.as_ref(),
            allocator_settings.expandable_segments,
        ),
        device_traces: traces.into_iter().map(Vec::from).collect(),
        allocator_settings,
    };
    let file = std::fs::File::create(output)
        .map_err(|e| Error::Message(format!("{}: {e}", output.display())))?;
    let mut file = std::io::BufWriter::new(file);
    crate::pickle::to_writer(&mut file, &snapshot)
        .map_err(|e| Error::Message(format!("{}: {e}", output.display())))?;
    file.flush()?;
    Ok(())
}

/// A categories pass that keeps every allocation's category.
fn every_category() -> Plan {
    Plan {
        every_allocation: true,
        ..Plan::default()
    }
}

/// [`every_category`] and each device's peak (`--at-peak`).
fn every_allocation() -> Plan {
    Plan {
        peaks: true,
        ..every_category()
    }
}

/// Run the command. At the peak, the categories pass finds it (one walk), then a second walk
/// goes to it; at a time, a walk to it, and the categories pass only for a trace with context.
pub fn run(args: &SnapshotArgs, out: &mut dyn Write) -> Result<(), Error> {
    if args.serve {
        return serve::serve(&one_trace(&args.trace)?, std::io::stdin(), out);
    }
    let events = args.events;
    let output = args
        .output
        .as_ref()
        .expect("clap requires -o without --serve");
    let history = Cursor::new(match &args.history {
        Some(spec) => history::parse(spec)?,
        None => vec![],
    });
    let mut texts = EntryTexts::default();
    if let Some(path) = &args.metadata {
        texts.metadata = TextOverTime::read(path, "")?;
    }
    if let Some(path) = &args.compile_context {
        texts.compile_context = TextOverTime::read(path, NO_COMPILE_CONTEXT)?;
    }
    let dir = one_trace(&args.trace)?;
    let (index, label, categories) = if args.when.at_peak {
        let outcome = categories::pass::run(
            &dir,
            &every_allocation(),
            &Progress::new("scanning"),
            |_, _| {},
        )?;
        // The busiest device, as `--at-peak` chooses it everywhere (the last of equals).
        let (device, peak) = outcome
            .peaks
            .iter()
            .max_by_key(|(_, row)| row.allocated)
            .ok_or_else(|| format!("{}: the trace has no allocations", dir.display()))?;
        let label = format!(
            "peak allocated of device {device}: {} at {}",
            bytes(peak.allocated),
            crate::format::seconds(peak.t)
        );
        (peak.index, label, Some(outcome))
    } else {
        let (index, label) = resolve_when(&dir, &args.when)?;
        (index, label, None)
    };
    let walk = write(&dir, index, events, output, categories, history, &texts)?;
    let reserved: u64 = walk.state.segments.values().map(|s| s.size).sum();
    writeln!(
        out,
        "wrote {} ({label}: {} segments, {} reserved, {} blocks)",
        output.display(),
        walk.state.segments.len(),
        bytes(reserved),
        walk.state.blocks.len()
    )?;
    Ok(())
}
