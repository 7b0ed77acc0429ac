//! `cachealloc snapshot TRACE -o snap.pickle`: the state at a moment as a PyTorch memory
//! snapshot (`torch.cuda.memory._snapshot()`'s pickle): `segments` with their blocks tiling each
//! segment (free gaps as `inactive` blocks), `device_traces` with the last events before that
//! moment, and `allocator_settings`. It opens in `torch.cuda._memory_viz` and PyTorch's memory
//! viewer.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::Write;
use std::path::Path;

use cachealloc_core::config::Config;
use cachealloc_recorder::{LiveState, Record};
use serde_pickle::{HashableValue as K, Value as V};

use super::{When, resolve_when};
use crate::format::bytes;
use crate::replay::{Replay, stack_frames};
use crate::{Error, one_trace};

fn dict(entries: Vec<(&str, V)>) -> V {
    V::Dict(
        entries
            .into_iter()
            .map(|(k, v)| (K::String(k.to_string()), v))
            .collect(),
    )
}

fn int(n: u64) -> V {
    V::I64(n as i64)
}

/// Stacks as PyTorch's `frames` lists (`[{"filename", "line", "name"}]`, innermost first),
/// built once per stack.
struct Frames<'a> {
    state: &'a LiveState,
    cache: HashMap<u32, V>,
}

impl Frames<'_> {
    fn get(&mut self, stack: u32) -> V {
        let state = self.state;
        self.cache
            .entry(stack)
            .or_insert_with(|| {
                V::List(
                    stack_frames(state, stack)
                        .into_iter()
                        .map(|f| {
                            let name = if f.name.is_empty() {
                                format!("{:#x}", f.address)
                            } else {
                                f.name.clone()
                            };
                            let filename = if f.file.is_empty() {
                                "??".to_string()
                            } else {
                                f.file.clone()
                            };
                            dict(vec![
                                ("filename", V::String(filename)),
                                ("line", int(u64::from(f.line))),
                                ("name", V::String(name)),
                            ])
                        })
                        .collect(),
                )
            })
            .clone()
    }
}

/// One event of `device_traces` (`None` for records PyTorch's format has no action for).
fn trace_entries(record: &Record, frames: &mut Frames<'_>, wall_base_ns: u64) -> Vec<(u32, V)> {
    let time_us = |t: u64| int((wall_base_ns + t) / 1000);
    let mut entry = |action: &str, addr: u64, size: u64, stream: u64, stack: u32, t: u64| {
        dict(vec![
            ("action", V::String(action.into())),
            ("addr", int(addr)),
            ("size", int(size)),
            ("stream", int(stream)),
            ("frames", frames.get(stack)),
            ("time_us", time_us(t)),
        ])
    };
    match record {
        Record::Alloc(a) => vec![(
            a.device,
            entry("alloc", a.address, a.size, a.stream, a.stack, a.t),
        )],
        Record::FreeRequested(f) => vec![(
            f.device,
            entry("free_requested", f.address, f.size, f.stream, f.stack, f.t),
        )],
        Record::Free(f) => vec![
            (
                f.device,
                entry("free_requested", f.address, f.size, f.stream, f.stack, f.t),
            ),
            (
                f.device,
                entry("free_completed", f.address, f.size, f.stream, f.stack, f.t),
            ),
        ],
        Record::FreeCompleted(f) => vec![(
            f.device,
            entry("free_completed", f.address, f.size, 0, 0, f.t),
        )],
        Record::SegmentAlloc(s) => vec![(
            s.device,
            entry("segment_alloc", s.address, s.size, 0, s.stack, s.t),
        )],
        Record::SegmentFree(s) => vec![(
            s.device,
            entry("segment_free", s.address, s.size, 0, s.stack, s.t),
        )],
        Record::Oom(o) => vec![(
            o.device,
            dict(vec![
                ("action", V::String("oom".into())),
                ("device_free", int(o.device_free)),
                ("size", int(o.requested)),
                ("stream", int(0)),
                ("frames", frames.get(o.stack)),
                ("time_us", time_us(o.t)),
            ]),
        )],
        _ => vec![],
    }
}

/// `segments`: each live segment with its blocks tiling it, gaps as `inactive` blocks.
fn segments(state: &LiveState, frames: &mut Frames<'_>) -> Vec<V> {
    let mut out = vec![];
    for seg in state.segments.values() {
        let mut blocks = vec![];
        let (mut allocated, mut active, mut requested) = (0, 0, 0);
        let mut cursor = seg.address;
        let end = seg.address + seg.size;
        let inactive = |address: u64, size: u64| {
            dict(vec![
                ("address", int(address)),
                ("size", int(size)),
                ("requested_size", int(0)),
                ("state", V::String("inactive".into())),
                ("frames", V::List(vec![])),
            ])
        };
        for b in state
            .blocks
            .range((seg.device, seg.address)..(seg.device, end))
            .map(|(_, b)| b)
        {
            if b.address > cursor {
                blocks.push(inactive(cursor, b.address - cursor));
            }
            let state_name = if b.pending == 0 {
                allocated += b.size;
                "active_allocated"
            } else {
                "active_pending_free"
            };
            active += b.size;
            requested += b.requested;
            blocks.push(dict(vec![
                ("address", int(b.address)),
                ("size", int(b.size)),
                ("requested_size", int(b.requested)),
                ("state", V::String(state_name.into())),
                ("frames", frames.get(b.stack)),
            ]));
            cursor = b.address + b.size;
        }
        if cursor < end {
            blocks.push(inactive(cursor, end - cursor));
        }
        out.push(dict(vec![
            ("device", int(u64::from(seg.device))),
            ("address", int(seg.address)),
            ("total_size", int(seg.size)),
            ("allocated_size", int(allocated)),
            ("active_size", int(active)),
            ("requested_size", int(requested)),
            ("stream", int(0)),
            (
                "segment_type",
                V::String(if seg.pool == 0 { "small" } else { "large" }.into()),
            ),
            ("segment_pool_id", V::Tuple(vec![int(0), int(0)])),
            ("is_expandable", V::Bool(false)),
            ("frames", frames.get(seg.stack)),
            ("blocks", V::List(blocks)),
        ]));
    }
    out
}

/// `allocator_settings`, from the recorded configuration.
fn settings(conf: &str) -> V {
    let config = Config::parse(conf, "the trace header").unwrap_or_default();
    let a = &config.allocator;
    dict(vec![
        ("PYTORCH_CUDA_ALLOC_CONF", V::String(conf.to_string())),
        (
            "max_split_size",
            V::I64(a.max_split_size.min(i64::MAX as u64) as i64),
        ),
        (
            "garbage_collection_threshold",
            V::F64(a.garbage_collection_threshold),
        ),
        ("expandable_segments", V::Bool(a.expandable_segments)),
        ("pinned_num_register_threads", int(1)),
        ("release_lock_on_cudamalloc", V::Bool(false)),
        ("pinned_use_cuda_host_register", V::Bool(false)),
        ("roundup_power2_divisions", V::Dict(BTreeMap::new())),
    ])
}

/// The snapshot of `dir` through record `index`, with up to `events` trace entries per device.
pub fn build(dir: &Path, index: u64, events: usize) -> Result<(V, Replay), Error> {
    let mut replay = Replay::open(dir)?;
    let mut window: VecDeque<Record> = VecDeque::new();
    while let Some(step) = replay.step() {
        let step = step?;
        if !step.in_checkpoint
            && matches!(
                step.record,
                Record::Alloc(_)
                    | Record::FreeRequested(_)
                    | Record::Free(_)
                    | Record::FreeCompleted(_)
                    | Record::SegmentAlloc(_)
                    | Record::SegmentFree(_)
                    | Record::Oom(_)
            )
        {
            window.push_back(step.record);
            // The last `events` events (a record makes one or two entries).
            if window.len() > events.max(1) {
                window.pop_front();
            }
        }
        if step.index >= index {
            break;
        }
    }
    let header = replay.header.clone();
    let wall = header.as_ref().map_or(0, |h| h.wall_clock_base_ns);
    let device_count = header.as_ref().map(|h| h.devices.len()).unwrap_or(0).max(
        replay
            .state
            .segments
            .keys()
            .map(|(d, _)| *d as usize + 1)
            .max()
            .unwrap_or(1),
    );
    let mut traces: Vec<VecDeque<V>> = vec![VecDeque::new(); device_count];
    let mut frames = Frames {
        state: &replay.state,
        cache: HashMap::new(),
    };
    for record in &window {
        for (device, entry) in trace_entries(record, &mut frames, wall) {
            if let Some(t) = traces.get_mut(device as usize) {
                t.push_back(entry);
                if t.len() > events {
                    t.pop_front();
                }
            }
        }
    }
    let conf = header.as_ref().map_or("", |h| h.config.as_str());
    let snapshot = dict(vec![
        ("segments", V::List(segments(&replay.state, &mut frames))),
        (
            "device_traces",
            V::List(traces.into_iter().map(|t| V::List(t.into())).collect()),
        ),
        ("allocator_settings", settings(conf)),
    ]);
    Ok((snapshot, replay))
}

/// Run the command.
pub fn run(
    trace: &Path,
    when: &When,
    events: usize,
    output: &Path,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let dir = one_trace(trace)?;
    let (index, label) = resolve_when(&dir, when)?;
    let (snapshot, replay) = build(&dir, index, events)?;
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(output)
            .map_err(|e| Error::Message(format!("{}: {e}", output.display())))?,
    );
    serde_pickle::value_to_writer(&mut file, &snapshot, serde_pickle::SerOptions::new())
        .map_err(|e| Error::Message(format!("{}: {e}", output.display())))?;
    file.flush()?;
    let reserved: u64 = replay.state.segments.values().map(|s| s.size).sum();
    writeln!(
        out,
        "wrote {} ({label}: {} segments, {} reserved, {} blocks)",
        output.display(),
        replay.state.segments.len(),
        bytes(reserved),
        replay.state.blocks.len()
    )?;
    Ok(())
}
