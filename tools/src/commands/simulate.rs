//! `cachealloc simulate TRACE [--conf K:V,...] [--capacity BYTES] [--granularity BYTES]
//! [--sweep]`: what another allocator config would have done with the same requests.
//!
//! The trace's allocations and frees, in their recorded order — with the requests the run could
//! not serve (its OOMs), to see whether they would be served — are replayed through
//! `cachealloc-core` — the allocator the shim runs — on a [`SimDevice`] per device. Reuse fences
//! follow the recording: a free that waited on a fence in the run waits in the simulation until
//! the trace says it completed (exactly the fences the run saw complete are completed), and `reuse:auto` starts fencing where the run created its first
//! stream. With the recorded config, the simulation makes the same decisions as the run, so its
//! peak reserved is the recorded one (a test checks this on traces made by the shim): where
//! threads raced (one freed a block while another was growing), the recorded growth is followed.
//! With another config the simulation decides everything itself, one request at a time.
//!
//! The simulated device offers virtual memory in `--granularity` units (2 MiB, CUDA's on
//! current GPUs), so `expandable_segments:True` is simulated as the shim runs it: a recorded run
//! with fixed segments can be asked whether expandable segments would have avoided its OOM, and
//! at how many device calls (maps and unmaps count as device allocations and releases).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use cachealloc_core::config::{AllocatorConfig, Config};
use cachealloc_core::sim::{FenceMode, SimDevice};
use cachealloc_core::{AllocError, Allocator};

use crate::analysis::scan;
use crate::format::{bytes, percent, seconds};
use crate::progress::Progress;
use crate::replay::site;
use crate::{Error, one_trace};

mod recording;

use recording::{Op, Recording, record};

/// `cachealloc simulate`'s arguments.
#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// Trace directory.
    pub trace: PathBuf,
    /// Allocator settings to try (default: the recorded ones), e.g. max_split_size_mb:128 or
    /// expandable_segments:True.
    #[arg(long)]
    pub conf: Option<String>,
    /// Device memory to assume, in bytes (default: the recorded device's total).
    #[arg(long)]
    pub capacity: Option<u64>,
    /// The device's mapping granularity for expandable segments, in bytes (a multiple of 512).
    #[arg(long, default_value_t = DEFAULT_GRANULARITY, value_parser = parse_granularity)]
    pub granularity: u64,
    /// Try a grid of configs and rank them by peak reserved.
    #[arg(long)]
    pub sweep: bool,
}

/// CUDA's allocation granularity on current GPUs.
const DEFAULT_GRANULARITY: u64 = 2 << 20;

fn parse_granularity(text: &str) -> Result<u64, String> {
    match text.parse::<u64>() {
        Ok(g) if g > 0 && g.is_multiple_of(512) => Ok(g),
        _ => Err(format!(
            "'{text}' is not a granularity: expected a positive multiple of 512 bytes, e.g. 2097152"
        )),
    }
}

/// What one device did in a simulation.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DeviceOutcome {
    /// Peak reserved bytes.
    pub peak_reserved: u64,
    /// The most bytes allocated while reserved was at its peak.
    pub allocated_at_peak_reserved: u64,
    /// Peak allocated bytes.
    pub peak_allocated: u64,
    /// Segment allocations asked of the device.
    pub device_allocs: u64,
    /// Segment releases.
    pub device_frees: u64,
    /// Waits on reuse fences.
    pub fence_waits: u64,
    /// When the last request that made device calls (allocations, releases, maps, unmaps) was
    /// served: after it, the run was served from the cache alone.
    pub last_device_call: Option<u64>,
}

/// A failed request: time, size, device and allocation site.
pub type Failure = (u64, u64, u32, String);

/// What one simulation found.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    /// Per device.
    pub devices: BTreeMap<u32, DeviceOutcome>,
    /// Requests that failed.
    pub failures: u64,
    /// Requests the run could not serve.
    pub run_ooms: u64,
    /// Of those, the ones served here.
    pub run_ooms_served: u64,
    /// The first of them.
    pub first_failure: Option<Failure>,
    /// With the recorded config: the first request that got a block of another size than in
    /// the run (time, requested, recorded size, simulated size), if any.
    pub diverged_at: Option<(u64, u64, u64, u64)>,
    /// With the recorded config: the first request for which the simulation mapped another
    /// amount of memory than the run (time, recorded change of reserved bytes, simulated), if
    /// any — threads that raced around a map.
    pub mapped_differently_at: Option<(u64, i64, i64)>,
}

impl Outcome {
    fn peak_reserved(&self) -> u64 {
        self.devices.values().map(|d| d.peak_reserved).sum()
    }

    fn fragmentation(&self) -> String {
        let (r, a) = self.devices.values().fold((0, 0), |(r, a), d| {
            (r + d.peak_reserved, a + d.allocated_at_peak_reserved)
        });
        percent(r - a, r)
    }

    fn device_calls(&self) -> u64 {
        self.devices
            .values()
            .map(|d| d.device_allocs + d.device_frees)
            .sum()
    }
}

/// The device a simulation runs on.
#[derive(Clone, Copy, Debug)]
struct SimulatedDevice {
    /// Its memory (default: the recorded device's).
    capacity: Option<u64>,
    /// Its mapping granularity.
    granularity: u64,
}

/// Replay `rec` through `config`. With `follow_growth` (the recorded config), an allocation the
/// run served from a new segment is served from a new segment here too (see
/// `Allocator::malloc_from_new_segment`), and segments get the run's addresses, so that even
/// multi-threaded runs replay exactly.
fn simulate(
    rec: &Recording,
    config: &AllocatorConfig,
    device: &SimulatedDevice,
    follow_growth: bool,
) -> Outcome {
    let SimulatedDevice {
        capacity,
        granularity,
    } = *device;
    let mut allocators: BTreeMap<u32, Allocator<SimDevice>> = BTreeMap::new();
    let mut addresses: HashMap<(u32, u64), u64> = HashMap::new();
    // Freed blocks waiting on a fence: the run's address → the simulation's.
    let mut freed: HashMap<(u32, u64), u64> = HashMap::new();
    let mut out = Outcome::default();
    let mut fencing = false;
    let get = |device: u32, fencing: bool| -> Allocator<SimDevice> {
        let cap = capacity
            .or_else(|| rec.capacity.get(&device).copied())
            .unwrap_or(u64::MAX / 4);
        let sim =
            SimDevice::with_fence_mode(cap, FenceMode::Manual).with_map_granularity(granularity);
        if follow_growth {
            // The run's addresses: best fit breaks ties between equal blocks by address.
            sim.plan_addresses(rec.segments.get(&device).into_iter().flatten().copied());
        }
        let a = Allocator::new(sim, config.clone());
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
                grew,
                mapped,
                size,
                stream,
            } => {
                let a = allocators
                    .entry(device)
                    .or_insert_with(|| get(device, fencing));
                let reserved_before = (follow_growth && mapped.is_some())
                    .then(|| a.stats().reserved_bytes.all.current);
                let result = if grew && follow_growth {
                    a.malloc_from_new_segment(requested, stream, u64::from(stack))
                } else {
                    a.malloc_on_stream(requested, stream, u64::from(stack), &mut Default::default())
                };
                match result {
                    Ok(got) => {
                        if follow_growth && got.size != size && out.diverged_at.is_none() {
                            out.diverged_at = Some((t, requested, size, got.size));
                        }
                        addresses.insert((device, address), got.address);
                        let s = a.stats();
                        let reserved = s.reserved_bytes.all.current as u64;
                        if let (Some(before), Some(recorded)) = (reserved_before, mapped) {
                            let simulated = reserved as i64 - before;
                            if simulated != recorded && out.mapped_differently_at.is_none() {
                                out.mapped_differently_at = Some((t, recorded, simulated));
                            }
                        }
                        let allocated = s.allocated_bytes.all.current as u64;
                        let d = out.devices.entry(device).or_default();
                        let calls = s.num_device_alloc + s.num_device_free;
                        if calls != d.device_allocs + d.device_frees {
                            (d.device_allocs, d.device_frees) =
                                (s.num_device_alloc, s.num_device_free);
                            d.last_device_call = Some(t);
                        }
                        if reserved > d.peak_reserved {
                            d.peak_reserved = reserved;
                            d.allocated_at_peak_reserved = allocated;
                        } else if reserved == d.peak_reserved {
                            d.allocated_at_peak_reserved =
                                d.allocated_at_peak_reserved.max(allocated);
                        }
                        d.peak_allocated = d.peak_allocated.max(allocated);
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
            Op::Free {
                device,
                address,
                stream,
            } => {
                if let (Some(a), Some(sim)) = (
                    allocators.get(&device),
                    addresses.remove(&(device, address)),
                ) && a.free_on_stream(sim, stream).is_ok_and(|f| f.pending)
                {
                    freed.insert((device, address), sim);
                }
            }
            Op::FenceDone { device, address } => {
                let Some(a) = allocators.get(&device) else {
                    continue;
                };
                let Some(sim) = freed.remove(&(device, address)) else {
                    continue;
                };
                // Complete exactly the fences the run saw complete: through this block's.
                let fence = a.with_pools(|p| p.fence_of_pending(a.device(), sim));
                if let Ok(Some(fence)) = fence {
                    a.device().complete_through(&fence);
                }
            }
            Op::Refused {
                device,
                requested,
                stack,
                t,
            } => {
                out.run_ooms += 1;
                let a = allocators
                    .entry(device)
                    .or_insert_with(|| get(device, fencing));
                match a.malloc(requested, u64::from(stack)) {
                    Ok(got) => {
                        // Served here; the program never had it, so it goes back at once.
                        out.run_ooms_served += 1;
                        let d = out.devices.entry(device).or_default();
                        let s = a.stats();
                        d.peak_reserved = d.peak_reserved.max(s.reserved_bytes.all.current as u64);
                        d.peak_allocated =
                            d.peak_allocated.max(s.allocated_bytes.all.current as u64);
                        let _ = a.free(got.address);
                    }
                    Err(_) => {
                        out.failures += 1;
                        if out.first_failure.is_none() {
                            out.first_failure =
                                Some((t, requested, device, site(&rec.names, stack)));
                        }
                    }
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
    for (device, a) in &allocators {
        let s = a.stats();
        let d = out.devices.entry(*device).or_default();
        d.device_allocs = s.num_device_alloc;
        d.device_frees = s.num_device_free;
        d.fence_waits = s.num_fence_waits;
    }
    out
}

/// Simulate the trace in `dir` with its recorded config, amended by `conf`, on a device of the
/// default granularity.
pub fn simulate_dir(
    dir: &Path,
    conf: Option<&str>,
    capacity: Option<u64>,
) -> Result<Outcome, Error> {
    let rec = record(dir)?;
    let config = config_from(&rec.config, conf)?;
    let device = SimulatedDevice {
        capacity,
        granularity: DEFAULT_GRANULARITY,
    };
    Ok(simulate(&rec, &config.allocator, &device, conf.is_none()))
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
    for (device, d) in &o.devices {
        writeln!(out, "  device {device}")?;
        writeln!(
            out,
            "    peak reserved   {} ({} B; at most {} allocated then, fragmentation {})",
            bytes(d.peak_reserved),
            d.peak_reserved,
            bytes(d.allocated_at_peak_reserved),
            percent(
                d.peak_reserved - d.allocated_at_peak_reserved,
                d.peak_reserved
            )
        )?;
        writeln!(out, "    peak allocated  {}", bytes(d.peak_allocated))?;
        writeln!(
            out,
            "    device calls    {} allocations, {} releases; {} fence waits{}",
            d.device_allocs,
            d.device_frees,
            d.fence_waits,
            d.last_device_call
                .map_or(String::new(), |t| format!("; the last at {}", seconds(t)))
        )?;
    }
    if let Some((t, recorded, simulated)) = o.mapped_differently_at {
        writeln!(
            out,
            "  note            the replay mapped differently from the run at {}: reserved memory changed by {} B in the run, {} B here (threads raced around a map); figures after that are the simulation's own",
            seconds(t),
            recorded,
            simulated
        )?;
    }
    if let Some((t, requested, recorded, simulated)) = o.diverged_at {
        writeln!(
            out,
            "  note            the replay diverged from the run at {}: a request of {} got {} here, {} in the run (threads raced around reuse fences); figures after that are the simulation's own",
            seconds(t),
            bytes(requested),
            bytes(simulated),
            bytes(recorded)
        )?;
    }
    if o.run_ooms > 0 {
        writeln!(
            out,
            "  the run's OOMs  {} of {} would have been served",
            o.run_ooms_served, o.run_ooms
        )?;
    }
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
const SWEEP: [&str; 12] = [
    "",
    "expandable_segments:True",
    "expandable_segments:False",
    "expandable_segments:True,roundup_power2_divisions:4",
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
pub fn run(args: &SimulateArgs, out: &mut dyn Write) -> Result<(), Error> {
    let conf = args.conf.as_deref();
    let (capacity, sweep) = (args.capacity, args.sweep);
    let device = SimulatedDevice {
        capacity,
        granularity: args.granularity,
    };
    let dir = one_trace(&args.trace)?;
    let recorded = scan(&dir, &Progress::new("scanning"))?;
    let rec = record(&dir)?;
    writeln!(out, "recorded run ({} requests):", rec.ops.len())?;
    for (device, d) in &recorded.devices {
        writeln!(
            out,
            "  device {device}: peak reserved {} ({} B), peak allocated {}, {} device allocations, {} OOMs",
            bytes(d.peak_reserved.bytes),
            d.peak_reserved.bytes,
            bytes(d.peak_allocated.bytes),
            d.segment_allocs,
            recorded.ooms.iter().filter(|o| o.device == *device).count()
        )?;
    }
    writeln!(out, "  config: {}", rec.config)?;
    if rec.live_at_start > 0 {
        writeln!(
            out,
            "  note: the trace starts mid-run (its first files were rotated away); the {} blocks live then are not simulated",
            rec.live_at_start
        )?;
    }
    if sweep {
        let mut results = vec![];
        for extra in SWEEP {
            let merged = [conf.unwrap_or(""), extra]
                .into_iter()
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join(",");
            let config = config_from(&rec.config, Some(&merged))?;
            let o = simulate(&rec, &config.allocator, &device, merged.is_empty());
            results.push((
                if merged.is_empty() {
                    "(recorded)".into()
                } else {
                    merged
                },
                o,
            ));
        }
        results.sort_by_key(|(_, o)| (o.failures, o.peak_reserved(), o.device_calls()));
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
                bytes(o.peak_reserved()),
                o.fragmentation(),
                o.device_calls(),
                o.failures
            )?;
        }
        return Ok(());
    }
    let config = config_from(&rec.config, conf)?;
    let o = simulate(&rec, &config.allocator, &device, conf.is_none());
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
