//! `cachealloc simulate TRACE [--conf K:V,...] [--capacity BYTES] [--sweep]`: what another
//! allocator config would have done with the same requests.
//!
//! The trace's allocations and frees, in their recorded order, are replayed through
//! `cachealloc-core` — the allocator the shim runs — on a [`SimDevice`] per device. Reuse fences
//! follow the recording: a free that waited on a fence in the run waits in the simulation until
//! the trace says it completed, and `reuse:auto` starts fencing where the run created its first
//! stream. With the recorded config, the simulation makes the same decisions as the run, so its
//! peak reserved is the recorded one (a test checks this on traces made by the shim).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

use cachealloc_core::config::{AllocatorConfig, Config};
use cachealloc_core::sim::{FenceMode, SimDevice};
use cachealloc_core::{AllocError, Allocator};
use cachealloc_recorder::{LiveState, Record};

use crate::analysis::scan;
use crate::format::{bytes, percent, seconds};
use crate::progress::Progress;
use crate::replay::{Replay, site};
use crate::{Error, one_trace};

/// A request, as the trace recorded it.
#[derive(Debug, Clone, Copy)]
enum Op {
    Alloc {
        device: u32,
        address: u64,
        requested: u64,
        stack: u32,
        t: u64,
    },
    /// A free (one that waited on a reuse fence in the run is followed by `FencesDone`).
    Free { device: u32, address: u64 },
    /// The run's pending frees on `device` so far became reusable.
    FencesDone { device: u32 },
    /// The run created a stream (`reuse:auto` starts fencing).
    StreamCreated,
}

/// The requests of a trace, with what is needed to name them.
#[derive(Debug)]
struct Recording {
    ops: Vec<Op>,
    /// Stacks and frames, to name the first failing request.
    names: LiveState,
    config: String,
    capacity: BTreeMap<u32, u64>,
}

fn record(dir: &Path) -> Result<Recording, Error> {
    let mut replay = Replay::open(dir)?;
    let progress = Progress::new("reading requests");
    let mut ops = vec![];
    while let Some(step) = replay.step() {
        let step = step?;
        if step.index % 65536 == 0 {
            progress.tick(step.index);
        }
        if step.in_checkpoint {
            continue;
        }
        ops.push(match step.record {
            Record::Alloc(a) => Op::Alloc {
                device: a.device,
                address: a.address,
                requested: a.requested,
                stack: a.stack,
                t: a.t,
            },
            Record::Free(f) | Record::FreeRequested(f) => Op::Free {
                device: f.device,
                address: f.address,
            },
            Record::FreeCompleted(f) => Op::FencesDone { device: f.device },
            Record::StreamCreated(_) => Op::StreamCreated,
            _ => continue,
        });
    }
    let header = replay.header.clone();
    let mut names = replay.state;
    names.blocks.clear();
    names.segments.clear();
    Ok(Recording {
        ops,
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

/// What one simulation found.
#[derive(Debug, Default, Clone)]
struct Outcome {
    peak_reserved: u64,
    allocated_at_peak_reserved: u64,
    peak_allocated: u64,
    device_allocs: u64,
    device_frees: u64,
    fence_waits: u64,
    failures: u64,
    first_failure: Option<(u64, u64, u32, String)>,
}

fn simulate(rec: &Recording, config: &AllocatorConfig, capacity: Option<u64>) -> Outcome {
    let mut allocators: BTreeMap<u32, Allocator<SimDevice>> = BTreeMap::new();
    let mut addresses: HashMap<(u32, u64), u64> = HashMap::new();
    let mut out = Outcome::default();
    let mut fencing = false;
    let fence_mode = FenceMode::Manual;
    let get = |device: u32, fencing: bool| -> Allocator<SimDevice> {
        let cap = capacity
            .or_else(|| rec.capacity.get(&device).copied())
            .unwrap_or(u64::MAX / 4);
        let a = Allocator::new(SimDevice::with_fence_mode(cap, fence_mode), config.clone());
        if fencing {
            let _ = a.start_fencing();
        }
        a
    };
    for op in &rec.ops {
        match *op {
            Op::Alloc {
                device,
                address,
                requested,
                stack,
                t,
            } => {
                let a = allocators
                    .entry(device)
                    .or_insert_with(|| get(device, fencing));
                match a.malloc(requested, u64::from(stack)) {
                    Ok(got) => {
                        addresses.insert((device, address), got.address);
                        let s = a.stats();
                        let reserved = s.reserved_bytes.all.current as u64;
                        let allocated = s.allocated_bytes.all.current as u64;
                        if reserved > out.peak_reserved {
                            out.peak_reserved = reserved;
                            out.allocated_at_peak_reserved = allocated;
                        } else if reserved == out.peak_reserved {
                            out.allocated_at_peak_reserved =
                                out.allocated_at_peak_reserved.max(allocated);
                        }
                        out.peak_allocated = out.peak_allocated.max(allocated);
                    }
                    Err(AllocError::OutOfMemory(_) | AllocError::Device(_)) => {
                        out.failures += 1;
                        if out.first_failure.is_none() {
                            out.first_failure =
                                Some((t, requested, device, site(&rec.names, stack)));
                        }
                    }
                }
            }
            Op::Free { device, address } => {
                if let (Some(a), Some(sim)) = (
                    allocators.get(&device),
                    addresses.remove(&(device, address)),
                ) {
                    let _ = a.free(sim);
                }
            }
            Op::FencesDone { device } => {
                if let Some(a) = allocators.get(&device) {
                    a.device().complete_fences();
                }
            }
            Op::StreamCreated => {
                if !fencing {
                    fencing = true;
                    for a in allocators.values() {
                        let _ = a.start_fencing();
                    }
                }
            }
        }
    }
    for a in allocators.values() {
        let s = a.stats();
        out.device_allocs += s.num_device_alloc;
        out.device_frees += s.num_device_free;
        out.fence_waits += s.num_fence_waits;
    }
    out
}

fn config_from(recorded: &str, conf: Option<&str>) -> Result<Config, Error> {
    let mut config = Config::parse(recorded, "the trace's recorded config")
        .map_err(|e| Error::Message(e.to_string()))?;
    if let Some(conf) = conf {
        config
            .apply(conf, "--conf")
            .map_err(|e| Error::Message(e.to_string()))?;
    }
    Ok(config)
}

fn describe(o: &Outcome, out: &mut dyn Write) -> Result<(), Error> {
    writeln!(
        out,
        "  peak reserved   {} (allocated then {}, fragmentation {})",
        bytes(o.peak_reserved),
        bytes(o.allocated_at_peak_reserved),
        percent(
            o.peak_reserved - o.allocated_at_peak_reserved,
            o.peak_reserved
        )
    )?;
    writeln!(out, "  peak allocated  {}", bytes(o.peak_allocated))?;
    writeln!(
        out,
        "  device calls    {} allocations, {} releases; {} fence waits",
        o.device_allocs, o.device_frees, o.fence_waits
    )?;
    match &o.first_failure {
        None => writeln!(out, "  failures        none")?,
        Some((t, size, device, site)) => writeln!(
            out,
            "  failures        {}; the first: {} at {} on device {device}, from {site}",
            o.failures,
            bytes(*size),
            seconds(*t)
        )?,
    }
    Ok(())
}

/// The configs `--sweep` tries, on top of the recorded one.
const SWEEP: [&str; 9] = [
    "",
    "max_split_size_mb:64",
    "max_split_size_mb:256",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:8",
    "garbage_collection_threshold:0.8",
    "max_split_size_mb:64,roundup_power2_divisions:4",
    "max_split_size_mb:256,roundup_power2_divisions:8",
    "max_split_size_mb:64,garbage_collection_threshold:0.8",
];

/// Run the command.
pub fn run(
    trace: &Path,
    conf: Option<&str>,
    capacity: Option<u64>,
    sweep: bool,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let dir = one_trace(trace)?;
    let recorded = scan(&dir, &Progress::new("scanning"))?;
    let rec = record(&dir)?;
    writeln!(out, "recorded run ({} requests):", rec.ops.len())?;
    for (device, d) in &recorded.devices {
        writeln!(
            out,
            "  device {device}: peak reserved {}, peak allocated {}, {} device allocations, {} OOMs",
            bytes(d.peak_reserved.bytes),
            bytes(d.peak_allocated.bytes),
            d.segment_allocs,
            recorded.ooms.iter().filter(|o| o.device == *device).count()
        )?;
    }
    writeln!(out, "  config: {}", rec.config)?;
    if sweep {
        let mut results = vec![];
        for extra in SWEEP {
            let merged = [conf.unwrap_or(""), extra]
                .into_iter()
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join(",");
            let config = config_from(&rec.config, Some(&merged))?;
            let o = simulate(&rec, &config.allocator, capacity);
            results.push((
                if merged.is_empty() {
                    "(recorded)".into()
                } else {
                    merged
                },
                o,
            ));
        }
        results.sort_by_key(|(_, o)| (o.failures, o.peak_reserved, o.device_allocs));
        writeln!(out)?;
        writeln!(
            out,
            "{:<4} {:<56} {:>12} {:>8} {:>9} {:>8}",
            "rank", "config", "peak resv", "frag", "dev calls", "failures"
        )?;
        for (i, (name, o)) in results.iter().enumerate() {
            writeln!(
                out,
                "{:<4} {:<56} {:>12} {:>8} {:>9} {:>8}",
                i + 1,
                name,
                bytes(o.peak_reserved),
                percent(
                    o.peak_reserved - o.allocated_at_peak_reserved,
                    o.peak_reserved
                ),
                o.device_allocs + o.device_frees,
                o.failures
            )?;
        }
        return Ok(());
    }
    let config = config_from(&rec.config, conf)?;
    let o = simulate(&rec, &config.allocator, capacity);
    writeln!(out)?;
    writeln!(
        out,
        "simulated with {}{}:",
        config.allocator.to_conf_string(),
        capacity.map_or(String::new(), |c| format!(", capacity {}", bytes(c)))
    )?;
    describe(&o, out)?;
    Ok(())
}
