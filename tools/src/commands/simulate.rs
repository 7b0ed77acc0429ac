//! `cachealloc simulate TRACE [--conf K:V,...] [--capacity BYTES] [--granularity BYTES]
//! [--sweep] [--after SECONDS [--repeat TIMES]]`: what another allocator config would have done
//! with the same requests, and with `--repeat`, what a longer run would have done.
//!
//! The trace's allocations and frees, in their recorded order — with the requests the run could
//! not serve (its OOMs), to see whether they would be served — are replayed through
//! `cachealloc-core` — the allocator the shim runs — on a [`SimDevice`](cachealloc_core::sim::SimDevice) per device. Reuse fences
//! follow the recording: a free that waited on a fence in the run waits in the simulation until
//! the trace says it completed (exactly the fences the run saw complete are completed), and `reuse:auto` starts fencing where the run created its first
//! stream. With the recorded config, the simulation makes the same decisions as the run, so its
//! peak reserved is the recorded one (a test checks this on traces made by the shim): where
//! threads raced (one freed a block while another was growing), the recorded growth is followed,
//! and a block the run kept from reuse (behind a fence, or held while other streams'
//! `record_stream`ed work used it, which the trace does not show) is held until the trace says
//! it became reusable. With another config the simulation decides everything itself, one
//! request at a time (a block held for `record_stream` then goes by the simulated fences).
//!
//! The simulated device offers virtual memory in `--granularity` units (2 MiB, CUDA's on
//! current GPUs), so `expandable_segments:True` is simulated as the shim runs it: a recorded run
//! with fixed segments can be asked whether expandable segments would have avoided its OOM, and
//! at how many device calls (maps and unmaps count as device allocations and releases).
//!
//! `recording` reads the trace's requests, `engine` replays them and says what each device did
//! (named results, no printing), and this module prints that: the recorded run, then one
//! simulation or the `--sweep` ranking.

use std::io::Write;
use std::path::PathBuf;

use crate::analysis::scan;
use crate::format::{bytes, percent, seconds};
use crate::progress::Progress;
use crate::{Error, one_trace};

mod engine;
mod recording;

use engine::{DEFAULT_GRANULARITY, SimulatedDevice, SweepResult, config_from, simulate};
pub use engine::{
    DeviceOutcome, DeviceWork, Divergence, Failure, MappedDifferently, Outcome, Repetition,
    simulate_dir,
};
use recording::record;

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
    /// Also count what the device was asked from this time of the run on (seconds from its
    /// start), e.g. after the warm-up: the steady state's segment allocations, mappings,
    /// unmaps and device synchronizations.
    #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
    pub after: Option<u64>,
    /// Go on past the recording: replay the run up to `--after`, then one period of its
    /// requests from there (a step, or a cycle of its shapes, found in the trace) this many
    /// times, and print reserved memory at the end of each: whether a long run would creep.
    #[arg(long, value_name = "TIMES", requires = "after")]
    pub repeat: Option<u64>,
}

fn parse_seconds(text: &str) -> Result<u64, String> {
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && s >= 0.0 => Ok((s * 1e9).round() as u64),
        _ => Err(format!(
            "'{text}' is not a time: expected seconds from the run's start, e.g. 0.5"
        )),
    }
}

fn parse_granularity(text: &str) -> Result<u64, String> {
    match text.parse::<u64>() {
        Ok(g) if g > 0 && g.is_multiple_of(512) => Ok(g),
        _ => Err(format!(
            "'{text}' is not a granularity: expected a positive multiple of 512 bytes, e.g. 2097152"
        )),
    }
}

/// Run the command.
pub fn run(args: &SimulateArgs, out: &mut dyn Write) -> Result<(), Error> {
    let conf = args.conf.as_deref();
    let capacity = args.capacity;
    let device = SimulatedDevice {
        capacity,
        granularity: args.granularity,
        after: args.after,
    };
    let dir = one_trace(&args.trace)?;
    let recorded = scan(&dir, &Progress::new("scanning"))?;
    let mut rec = record(&dir)?;
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
    let steady = match (args.repeat, args.after) {
        (Some(times), Some(after)) => {
            let steady = recording::repeat_steady(&mut rec, after, times)?;
            writeln!(
                out,
                "  repeated        from {} on, one period of {} allocations, {} times",
                seconds(steady.from),
                steady.allocations,
                times
            )?;
            Some(times)
        }
        _ => None,
    };
    if args.sweep {
        return sweep_table(&engine::sweep(&rec, conf, &device)?, out);
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
    describe(&o, args.after, out)?;
    if let Some(times) = steady {
        repetitions(&o, times, out)?;
    }
    Ok(())
}

/// With `--repeat`: each device's reserved memory at the end of some repetitions (all of up to
/// twelve, else twelve spread over them), and how it changed from the first to the last.
fn repetitions(o: &Outcome, times: u64, out: &mut dyn Write) -> Result<(), Error> {
    let shown: Vec<u64> = if times <= 12 {
        (1..=times).collect()
    } else {
        (0..12).map(|i| 1 + i * (times - 1) / 11).collect()
    };
    for device in o.devices.keys() {
        let rows: Vec<&Repetition> = (o.repetitions.iter())
            .filter(|r| r.device == *device)
            .collect();
        let (Some(first), Some(last)) = (rows.first(), rows.last()) else {
            continue;
        };
        writeln!(out, "  device {device}, repeated")?;
        writeln!(
            out,
            "    {:>10}  {:>12}  {:>13}  {:>12}",
            "repetition", "reserved", "peak reserved", "device calls"
        )?;
        for r in rows.iter().filter(|r| shown.contains(&r.repetition)) {
            writeln!(
                out,
                "    {:>10}  {:>12}  {:>13}  {:>12}",
                r.repetition,
                bytes(r.reserved),
                bytes(r.peak_reserved),
                r.device_calls
            )?;
        }
        // The second half: past what the first repetitions still settle.
        let middle = rows[(rows.len() - 1) / 2];
        let change = last.reserved as i64 - middle.reserved as i64;
        let per = if last.repetition > middle.repetition {
            change as f64 / (last.repetition - middle.repetition) as f64
        } else {
            0.0
        };
        writeln!(
            out,
            "    reserved over the second half (repetitions {} to {}): {}{} ({}{} a repetition); from the first: {}{}",
            middle.repetition,
            last.repetition,
            if change < 0 { "-" } else { "+" },
            bytes(change.unsigned_abs()),
            if per < 0.0 { "-" } else { "+" },
            bytes(per.abs().round() as u64),
            if last.reserved < first.reserved {
                "-"
            } else {
                "+"
            },
            bytes(last.reserved.abs_diff(first.reserved))
        )?;
    }
    Ok(())
}

/// Print what one simulation found, per device, then its notes and failures.
fn describe(o: &Outcome, after: Option<u64>, out: &mut dyn Write) -> Result<(), Error> {
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
        match (d.after, after) {
            (Some(w), Some(after)) => writeln!(
                out,
                "    after {:<9} {} segment allocations, {} releases; {} mappings, {} moves, {} unmaps, {} device synchronizations",
                seconds(after),
                w.segment_allocs,
                w.segment_frees,
                w.mappings,
                w.aliases,
                w.unmaps,
                w.synchronizes
            )?,
            (None, Some(after)) => writeln!(
                out,
                "    after {:<9} nothing: the run made no request that late",
                seconds(after)
            )?,
            _ => {}
        }
    }
    if let Some(MappedDifferently {
        t,
        recorded,
        simulated,
    }) = o.mapped_differently_at
    {
        writeln!(
            out,
            "  note            the replay mapped differently from the run at {}: reserved memory changed by {} B in the run, {} B here (threads raced around a map); figures after that are the simulation's own",
            seconds(t),
            recorded,
            simulated
        )?;
    }
    if let Some(Divergence {
        t,
        requested,
        recorded,
        simulated,
    }) = o.diverged_at
    {
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
        Some(Failure {
            t,
            size,
            device,
            site,
        }) => writeln!(
            out,
            "  failures        {}; the first: {} at {} on device {device}, from {site}",
            o.failures,
            bytes(*size),
            seconds(*t)
        )?,
    }
    Ok(())
}

/// Print `--sweep`'s ranking: per config its peak reserved, fragmentation at that peak, device
/// calls and failures.
fn sweep_table(results: &[SweepResult], out: &mut dyn Write) -> Result<(), Error> {
    writeln!(out)?;
    writeln!(
        out,
        "{:<4} {:<56} {:>12} {:>8} {:>9} {:>8}",
        "rank", "config", "peak resv", "frag", "dev calls", "failures"
    )?;
    for (i, SweepResult { conf, outcome: o }) in results.iter().enumerate() {
        let name = if conf.is_empty() { "(recorded)" } else { conf };
        let reserved = o.peak_reserved();
        writeln!(
            out,
            "{:<4} {:<56} {:>12} {:>8} {:>9} {:>8}",
            i + 1,
            name,
            bytes(reserved),
            percent(reserved - o.allocated_at_peak_reserved(), reserved),
            o.device_calls(),
            o.failures
        )?;
    }
    Ok(())
}
