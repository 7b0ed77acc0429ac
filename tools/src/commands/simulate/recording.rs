//! Reading a trace's requests for `simulate`: allocations, frees, fence completions, stream
//! creations and refused requests in recorded order, with what the run did for each (whether
//! it grew, how much it mapped) so that a replay with the recorded config can follow it.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use cachealloc_recorder::{LiveState, Record};

use crate::Error;
use crate::progress::Progress;
use crate::walk::TraceWalk;

/// A request, as the trace recorded it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Op {
    Alloc {
        device: u32,
        address: u64,
        requested: u64,
        stack: u32,
        t: u64,
        /// The run served it from a segment allocated for it.
        grew: bool,
        /// The run mapped memory for it: by how many bytes reserved memory changed (maps,
        /// less the unmaps of recycling).
        mapped: Option<i64>,
        /// The size of the block the run gave it.
        size: u64,
        /// The stream it was for (`NO_STREAM` for `cudaMalloc`).
        stream: u64,
    },
    /// A free, on `stream` (`NO_STREAM` for `cudaFree`). `pending`: in the run the block was
    /// not reusable at once (behind a reuse fence, or held while other streams' recorded work
    /// used it); `FenceDone` follows when it became reusable.
    Free {
        device: u32,
        address: u64,
        stream: u64,
        pending: bool,
    },
    /// The run's freed block at `address` on `device` became reusable (its fence completed, or
    /// the work that held it was done).
    FenceDone { device: u32, address: u64 },
    /// The run created a stream (`reuse:auto` starts fencing).
    StreamCreated,
    /// The end of the `n`th repetition of the run's steady requests (`--repeat`; from 1).
    RepetitionEnd(u64),
    /// A request the run could not serve (out of memory).
    Refused {
        device: u32,
        requested: u64,
        stack: u32,
        t: u64,
    },
}

/// The requests of a trace, with what is needed to name them.
#[derive(Debug)]
pub(super) struct Recording {
    pub(super) ops: Vec<Op>,
    /// Stacks and frames, to name the first failing request.
    pub(super) names: LiveState,
    pub(super) config: String,
    pub(super) capacity: BTreeMap<u32, u64>,
    /// Per device, the run's segment allocations in order: `(size, address)`.
    pub(super) segments: BTreeMap<u32, Vec<(u64, u64)>>,
    /// Blocks already live when the trace starts (its first files were rotated away).
    pub(super) live_at_start: usize,
}

pub(super) fn record(dir: &Path) -> Result<Recording, Error> {
    let mut walk = TraceWalk::open(dir)?;
    let progress = Progress::new("reading requests");
    let mut ops = vec![];
    // The segment the last allocator event of each device allocated, if it was one.
    let mut fresh_segment: HashMap<u32, u64> = HashMap::new();
    // Per device, the change of mapped memory since its last other allocator event, once a map
    // came (the next allocation grew).
    let mut map_change: HashMap<u32, (bool, i64)> = HashMap::new();
    let mut segments: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
    let mut live_at_start = None;
    while let Some(step) = walk.step() {
        let step = step?;
        if step.index % 65536 == 0 {
            progress.tick(step.index);
        }
        if step.in_checkpoint {
            if matches!(step.record, Record::CheckpointEnd(_)) && live_at_start.is_none() {
                live_at_start = Some(walk.state.blocks.len());
            }
            continue;
        }
        if let Record::SegmentAlloc(s) = &step.record {
            fresh_segment.insert(s.device, s.address);
            segments
                .entry(s.device)
                .or_default()
                .push((s.size, s.address));
            continue;
        }
        if let Record::SegmentMap(s) | Record::SegmentUnmap(s) = &step.record {
            let change = map_change.entry(s.device).or_default();
            if matches!(step.record, Record::SegmentMap(_)) {
                *change = (true, change.1 + s.size as i64);
            } else {
                change.1 -= s.size as i64;
            }
            continue;
        }
        // What the run did just before, under the same hold of the allocator's lock, belongs
        // to the allocator's next event of the device. Records written from elsewhere (the
        // recorder's stats samples, tags, streams) may land in between and take nothing.
        let allocator_device = match &step.record {
            Record::Alloc(_)
            | Record::Free(_)
            | Record::FreeRequested(_)
            | Record::FreeCompleted(_)
            | Record::SegmentFree(_)
            | Record::Oom(_) => step.record.device(),
            _ => None,
        };
        let mapped = allocator_device
            .and_then(|d| map_change.remove(&d))
            .and_then(|(any_map, change)| any_map.then_some(change));
        let fresh = allocator_device.and_then(|d| fresh_segment.remove(&d));
        ops.push(match step.record {
            Record::Alloc(a) => Op::Alloc {
                device: a.device,
                address: a.address,
                requested: a.requested,
                stack: a.stack,
                t: a.t,
                grew: fresh == Some(a.address) || mapped.is_some(),
                mapped,
                size: a.size,
                stream: a.stream,
            },
            Record::Free(f) | Record::FreeRequested(f) => Op::Free {
                device: f.device,
                address: f.address,
                stream: f.stream,
                pending: matches!(step.record, Record::FreeRequested(_)),
            },
            Record::FreeCompleted(f) => Op::FenceDone {
                device: f.device,
                address: f.address,
            },
            Record::StreamCreated(_) => Op::StreamCreated,
            Record::Oom(o) => Op::Refused {
                device: o.device,
                requested: o.requested,
                stack: o.stack,
                t: o.t,
            },
            _ => continue,
        });
    }
    let header = walk.header.clone();
    let mut names = walk.state;
    names.blocks.clear();
    names.segments.clear();
    Ok(Recording {
        ops,
        segments,
        live_at_start: live_at_start.unwrap_or(0),
        names,
        config: header
            .as_ref()
            .map(|h| h.config.clone())
            .unwrap_or_default(),
        capacity: header
            .map(|h| {
                h.devices
                    .iter()
                    .map(|d| (d.index, d.total_memory))
                    .collect()
            })
            .unwrap_or_default(),
    })
}

/// A period of the run's requests is checked against what follows it over at least this many
/// requests (or to the trace's end).
const MIN_CHECKED: usize = 4096;

/// What `--repeat` repeats: the run's requests from the first allocation at or after `from`
/// (ns), one period of them (see [`repeat_steady`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Steady {
    /// When the repeated requests start in the run (ns).
    pub from: u64,
    /// Allocations in one period.
    pub allocations: usize,
}

/// Replace the requests after `from` (ns) with `times` repetitions of one period of them: what
/// the run would have asked had it gone on for `times` more cycles of its steady state.
///
/// A training step asks for the same sizes in the same order every time, and a run of variable
/// shapes every cycle of them, so from the end of the warm-up on the requests repeat with a
/// period: the shortest one whose allocation sizes, streams and frees match the next period's.
/// At least two whole periods must follow `from`. The repetitions keep each block's life: a
/// free in a repetition frees the block that the matching allocation made in the same
/// repetition, or, for a block the period inherits (allocated before its start, as the previous
/// step's gradients are), the one the previous repetition made in its place. The repeated
/// requests carry no recorded growth, so the simulation decides every map itself.
pub(super) fn repeat_steady(rec: &mut Recording, from: u64, times: u64) -> Result<Steady, Error> {
    let ops = &rec.ops;
    let start = ops
        .iter()
        .position(|op| matches!(op, Op::Alloc { t, .. } if *t >= from))
        .ok_or_else(|| Error::Message("--repeat: no allocation at or after --after".into()))?;
    // For each free (and fence completion), the allocation it is of.
    let mut latest: HashMap<(u32, u64), usize> = HashMap::new();
    let mut of = vec![usize::MAX; ops.len()];
    for (k, op) in ops.iter().enumerate() {
        match *op {
            Op::Alloc {
                device, address, ..
            } => {
                latest.insert((device, address), k);
            }
            Op::Free {
                device, address, ..
            }
            | Op::FenceDone { device, address } => {
                if let Some(&i) = latest.get(&(device, address)) {
                    of[k] = i;
                }
            }
            _ => {}
        }
    }
    // An op's shape: what must match one period later. A free is matched by how far back its
    // allocation was.
    let shape = |k: usize| -> (u8, u64, u64) {
        match ops[k] {
            Op::Alloc {
                requested, stream, ..
            } => (0, requested, stream),
            Op::Free { stream, .. } => (1, (k - of[k].min(k)) as u64, stream),
            Op::FenceDone { .. } => (2, (k - of[k].min(k)) as u64, 0),
            Op::StreamCreated => (3, 0, 0),
            Op::Refused { requested, .. } => (4, requested, 0),
            Op::RepetitionEnd(_) => (5, 0, 0),
        }
    };
    // A period must match the next one, and a short one must go on matching for a while (or
    // to the trace's end): two equal requests in a row are not a period of one.
    let rest = ops.len() - start;
    let period = (1..=rest / 2)
        .find(|&p| {
            let checked = p.max(MIN_CHECKED).min(rest - p);
            (start..start + checked).all(|k| shape(k) == shape(k + p))
        })
        .ok_or_else(|| {
            Error::Message(format!(
                "--repeat: the run's requests after {:.3} s do not repeat: give --after a time \
                 past the warm-up, with at least two whole cycles of the program's requests \
                 after it (a training step, or a cycle of its shapes)",
                from as f64 / 1e9
            ))
        })?;
    let allocations = (start..start + period)
        .filter(|&k| matches!(ops[k], Op::Alloc { .. }))
        .count();
    if allocations == 0 {
        return Err(Error::Message(
            "--repeat: the repeating requests after --after allocate nothing".into(),
        ));
    }
    // How long one period lasted in the run: repetition `r` runs `r` of them later.
    let t_of = |k: usize| match ops[k] {
        Op::Alloc { t, .. } => Some(t),
        _ => None,
    };
    let span = match (t_of(start), (start + period..ops.len()).find_map(t_of)) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => 0,
    };
    // Addresses of the repeated blocks: above every address a device has.
    let key = |r: u64, k: usize| (1u64 << 62) + (r << 32) + k as u64;
    let mut repeated: Vec<Op> = ops[..start].to_vec();
    for r in 0..times {
        for k in start..start + period {
            let mut op = ops[k];
            let block = |orig: u64| -> u64 {
                let i = of[k];
                if i == usize::MAX {
                    orig
                } else if i >= start {
                    key(r, i)
                } else if r == 0 || i + period < start {
                    orig
                } else {
                    key(r - 1, i + period)
                }
            };
            match &mut op {
                Op::Alloc {
                    address,
                    grew,
                    mapped,
                    t,
                    ..
                } => {
                    *address = key(r, k);
                    *grew = false;
                    *mapped = None;
                    *t += r * span;
                }
                Op::Refused { t, .. } => *t += r * span,
                Op::Free { address, .. } | Op::FenceDone { address, .. } => {
                    *address = block(*address);
                }
                _ => {}
            }
            repeated.push(op);
        }
        repeated.push(Op::RepetitionEnd(r + 1));
    }
    rec.ops = repeated;
    Ok(Steady { from, allocations })
}
