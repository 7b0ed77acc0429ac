//! What a simulation computes: a recording replayed through `cachealloc-core`'s [`Allocator`]
//! on a [`SimDevice`] per device, and what each device did (peaks, device calls, failures). No
//! printing here; `simulate.rs` reports it.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use cachealloc_core::config::{AllocatorConfig, Config};
use cachealloc_core::sim::{FenceMode, SimCounters, SimDevice};
use cachealloc_core::{AllocError, Allocator};

use super::recording::{Op, Recording, record};
use crate::Error;
use crate::walk::site;

/// CUDA's allocation granularity on current GPUs.
pub(super) const DEFAULT_GRANULARITY: u64 = 2 << 20;

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
    /// What the device was asked from `simulate --after` on (the steady state, once the
    /// warm-up is over), if that point was reached.
    pub after: Option<DeviceWork>,
}

/// What a simulated device was asked to do over part of a run, counted as the driver counts
/// its calls: a map of expandable segments is several mappings, each one physical allocation,
/// and its cost is per mapping (BENCHMARKS.md, "What mapping costs").
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DeviceWork {
    /// Fixed segments allocated (`cudaMalloc`).
    pub segment_allocs: u64,
    /// Fixed segments released (`cudaFree`).
    pub segment_frees: u64,
    /// Mappings made (`cuMemCreate` + `cuMemMap` each).
    pub mappings: u64,
    /// Memory moved by mapping it at a second place (`cuMemMap` of its handle).
    pub aliases: u64,
    /// Mappings unmapped (`cuMemUnmap` + `cuMemRelease` each).
    pub unmaps: u64,
    /// Waits for the whole device before unmapping (`cuCtxSynchronize`).
    pub synchronizes: u64,
}

impl DeviceWork {
    fn of(counters: SimCounters) -> Self {
        DeviceWork {
            segment_allocs: counters.allocs,
            segment_frees: counters.frees,
            mappings: counters.maps,
            aliases: counters.aliases,
            unmaps: counters.unmaps,
            synchronizes: counters.synchronizes,
        }
    }

    fn since(self, start: DeviceWork) -> Self {
        DeviceWork {
            segment_allocs: self.segment_allocs - start.segment_allocs,
            segment_frees: self.segment_frees - start.segment_frees,
            mappings: self.mappings - start.mappings,
            aliases: self.aliases - start.aliases,
            unmaps: self.unmaps - start.unmaps,
            synchronizes: self.synchronizes - start.synchronizes,
        }
    }
}

/// A request that failed in the simulation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// When the trace made it.
    pub t: u64,
    /// Its size in bytes.
    pub size: u64,
    /// The device it was for.
    pub device: u32,
    /// Its allocation site.
    pub site: String,
}

/// With the recorded config: a request that got a block of another size than in the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Divergence {
    /// When the trace made it.
    pub t: u64,
    /// Its requested size.
    pub requested: u64,
    /// The block size the run gave it.
    pub recorded: u64,
    /// The block size the simulation gave it.
    pub simulated: u64,
}

/// With the recorded config: a request for which the simulation mapped another amount of
/// memory than the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappedDifferently {
    /// When the trace made it.
    pub t: u64,
    /// By how many bytes reserved memory changed in the run.
    pub recorded: i64,
    /// By how many here.
    pub simulated: i64,
}

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
    /// the run, if any.
    pub diverged_at: Option<Divergence>,
    /// With the recorded config: the first request for which the simulation mapped another
    /// amount of memory than the run, if any — threads that raced around a map.
    pub mapped_differently_at: Option<MappedDifferently>,
    /// With `--repeat`: each device's state at the end of each repetition.
    pub repetitions: Vec<Repetition>,
}

/// A device at the end of a repetition of the run's steady requests (`--repeat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repetition {
    /// Which repetition (from 1).
    pub repetition: u64,
    /// The device.
    pub device: u32,
    /// Reserved bytes then.
    pub reserved: u64,
    /// Peak reserved bytes so far.
    pub peak_reserved: u64,
    /// Device calls so far (segment allocations and releases, maps and unmaps).
    pub device_calls: u64,
}

impl Outcome {
    /// Peak reserved bytes, summed over devices.
    pub fn peak_reserved(&self) -> u64 {
        self.devices.values().map(|d| d.peak_reserved).sum()
    }

    /// The bytes allocated at each device's peak reserved, summed over devices.
    pub fn allocated_at_peak_reserved(&self) -> u64 {
        self.devices
            .values()
            .map(|d| d.allocated_at_peak_reserved)
            .sum()
    }

    /// Device allocations and releases, over all devices.
    pub fn device_calls(&self) -> u64 {
        self.devices
            .values()
            .map(|d| d.device_allocs + d.device_frees)
            .sum()
    }

    /// Count a failed request; the first is kept, named by `site`.
    fn failed(&mut self, t: u64, size: u64, device: u32, site: impl FnOnce() -> String) {
        self.failures += 1;
        if self.first_failure.is_none() {
            self.first_failure = Some(Failure {
                t,
                size,
                device,
                site: site(),
            });
        }
    }
}

/// The device a simulation runs on.
#[derive(Clone, Copy, Debug)]
pub(super) struct SimulatedDevice {
    /// Its memory (default: the recorded device's).
    pub(super) capacity: Option<u64>,
    /// Its mapping granularity.
    pub(super) granularity: u64,
    /// Count the device's work from this time of the run on as well (nanoseconds from its
    /// start), e.g. after the warm-up.
    pub(super) after: Option<u64>,
}

/// Replay `rec` through `config`. With `follow_growth` (the recorded config), an allocation the
/// run served from a new segment is served from a new segment here too (see
/// `Allocator::malloc_from_new_segment`), and segments get the run's addresses, so that even
/// multi-threaded runs replay exactly.
pub(super) fn simulate(
    rec: &Recording,
    config: &AllocatorConfig,
    device: &SimulatedDevice,
    follow_growth: bool,
) -> Outcome {
    let SimulatedDevice {
        capacity,
        granularity,
        after,
    } = *device;
    // Each device's work when the run reached `after`.
    let mut work_at_after: Option<BTreeMap<u32, DeviceWork>> = None;
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
                if work_at_after.is_none() && after.is_some_and(|after| t >= after) {
                    work_at_after = Some(work_of(&allocators));
                }
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
                            out.diverged_at = Some(Divergence {
                                t,
                                requested,
                                recorded: size,
                                simulated: got.size,
                            });
                        }
                        addresses.insert((device, address), got.address);
                        let s = a.stats();
                        let reserved = s.reserved_bytes.all.current as u64;
                        if let (Some(before), Some(recorded)) = (reserved_before, mapped) {
                            let simulated = reserved as i64 - before;
                            if simulated != recorded && out.mapped_differently_at.is_none() {
                                out.mapped_differently_at = Some(MappedDifferently {
                                    t,
                                    recorded,
                                    simulated,
                                });
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
                        out.failed(t, requested, device, || site(&rec.names, stack));
                    }
                }
            }
            Op::Free {
                device,
                address,
                stream,
                pending,
            } => {
                let (Some(a), Some(sim)) = (
                    allocators.get(&device),
                    addresses.remove(&(device, address)),
                ) else {
                    continue;
                };
                // With the recorded config, a block the run kept from reuse until its
                // `FenceDone` is held until then: the run may have held it for work the trace
                // does not show (`record_stream`'s streams), which no simulated fence models.
                // Otherwise the simulation's own fences decide.
                let pending = if pending && follow_growth {
                    a.free_held(sim, stream).is_ok()
                } else {
                    a.free_on_stream(sim, stream).is_ok_and(|f| f.pending)
                };
                if pending {
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
                // A held block goes where its free would have sent it now, perhaps behind a
                // fence; then complete exactly the fences the run saw complete: through this
                // block's.
                a.release_held(sim);
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
                        out.failed(t, requested, device, || site(&rec.names, stack));
                    }
                }
            }
            Op::RepetitionEnd(n) => {
                for (device, a) in &allocators {
                    let s = a.stats();
                    out.repetitions.push(Repetition {
                        repetition: n,
                        device: *device,
                        reserved: s.reserved_bytes.all.current as u64,
                        peak_reserved: s.reserved_bytes.all.peak as u64,
                        device_calls: s.num_device_alloc + s.num_device_free,
                    });
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
    if let Some(start) = work_at_after {
        for (device, work) in work_of(&allocators) {
            let start = start.get(&device).copied().unwrap_or_default();
            out.devices.entry(device).or_default().after = Some(work.since(start));
        }
    }
    out
}

/// Each simulated device's work so far.
fn work_of(allocators: &BTreeMap<u32, Allocator<SimDevice>>) -> BTreeMap<u32, DeviceWork> {
    allocators
        .iter()
        .map(|(device, a)| (*device, DeviceWork::of(a.device().counters())))
        .collect()
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
        after: None,
    };
    Ok(simulate(&rec, &config.allocator, &device, conf.is_none()))
}

/// The trace's recorded config `recorded`, amended by `conf`.
pub(super) fn config_from(recorded: &str, conf: Option<&str>) -> Result<Config, Error> {
    let mut config = Config::parse_recorded(recorded, "the trace's recorded config")
        .map_err(|e| Error::Message(e.to_string()))?;
    if let Some(conf) = conf {
        config
            .apply(conf, "--conf")
            .map_err(|e| Error::Message(e.to_string()))?;
    }
    Ok(config)
}

/// The configs `--sweep` tries, on top of the recorded one.
const SWEEP: [&str; 13] = [
    "",
    "expandable_segments:True",
    "expandable_segments:stream_ordered",
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

/// One config `--sweep` tried, and what it did.
#[derive(Debug, Clone)]
pub(super) struct SweepResult {
    /// The settings on top of the recorded config (empty: the recorded config itself).
    pub(super) conf: String,
    /// What the simulation found.
    pub(super) outcome: Outcome,
}

/// Simulate `rec` with each of the [`SWEEP`] configs on top of its recorded one and of `conf`;
/// the best first: fewest failures, then least peak reserved, then fewest device calls.
pub(super) fn sweep(
    rec: &Recording,
    conf: Option<&str>,
    device: &SimulatedDevice,
) -> Result<Vec<SweepResult>, Error> {
    let mut results = vec![];
    for extra in SWEEP {
        let merged = [conf.unwrap_or(""), extra]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join(",");
        let config = config_from(&rec.config, Some(&merged))?;
        let outcome = simulate(rec, &config.allocator, device, merged.is_empty());
        results.push(SweepResult {
            conf: merged,
            outcome,
        });
    }
    results.sort_by_key(|r| {
        let o = &r.outcome;
        (o.failures, o.peak_reserved(), o.device_calls())
    });
    Ok(results)
}
