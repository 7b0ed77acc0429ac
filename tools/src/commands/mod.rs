//! The subcommands and their dispatch: one module per command, each declaring its arguments
//! (`XxxArgs`, derived with clap) beside the code that runs it.

pub mod compare;
pub mod export;
pub mod flamegraph;
pub mod fleet;
pub mod groups;
pub mod memory_timeline;
pub mod perfetto;
pub mod plot;
pub mod replay;
pub mod run;
pub mod simulate;
pub mod snapshot;
pub mod stats;
pub mod summary;
pub mod trace;

use std::io::Write;
use std::process::ExitCode;

use clap::Subcommand;

use crate::Error;
use crate::format::parse_time;

/// When to look: a time, or the peak.
#[derive(clap::Args, Debug, Clone)]
pub struct When {
    /// A time since the start of the trace: 12.5 (seconds), 12.5s, 300ms, 5000ns.
    #[arg(long, value_parser = parse_time, conflicts_with = "at_peak")]
    at: Option<u64>,
    /// The moment allocated memory peaked (on the busiest device).
    #[arg(long)]
    at_peak: bool,
}

/// What the `cachealloc` command does. A variant's doc comment is its command's help; its
/// arguments are the `…Args` struct of the module that runs it.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a command under libcachealloc.so, then print the summary of its trace.
    Run(run::RunArgs),
    /// Peaks, fragmentation, counts, OOMs, drops and the top allocation sites of one or more
    /// traces (several: one per rank, side by side).
    Summary(summary::SummaryArgs),
    /// A job of many ranks on one screen: each rank's peaks, fragmentation, OOMs, the time and
    /// step of its peak; the outlier ranks; the job's top sites at the ranks' peaks. Reads one
    /// rank at a time (memory does not grow with the number of ranks).
    Fleet(fleet::FleetArgs),
    /// PyTorch memory_stats() keys, a memory_summary()-style table and the segment map at a time
    /// (default: the end).
    Stats(stats::StatsArgs),
    /// The event listing.
    Trace(trace::TraceArgs),
    /// A PyTorch memory snapshot pickle (for torch.cuda._memory_viz and the memory viewer at
    /// pytorch.org/memory_viz).
    Snapshot(snapshot::SnapshotArgs),
    /// A flamegraph SVG of live memory by stack (memory) or of reserved segments by the stack
    /// that created them (segments).
    Flamegraph(flamegraph::FlamegraphArgs),
    /// A differential flamegraph SVG: live memory at B against A (two times of one trace, or the
    /// peaks of two traces).
    Compare(compare::CompareArgs),
    /// One self-contained HTML report: memory over time by allocation site, reserved against
    /// allocated, the segments at a chosen time, annotations and OOMs.
    Plot(plot::PlotArgs),
    /// Traces as a Parquet dataset for DuckDB, Spark and Arrow: events, stacks and memory
    /// samples, partitioned by job and rank (DIR/job=…/rank=…/events.parquet).
    Export(export::ExportArgs),
    /// Memory by category over time in the JSON form of torch.profiler's
    /// export_memory_timeline ([times, sizes by category]), one row per time slice at its peak.
    MemoryTimeline(memory_timeline::MemoryTimelineArgs),
    /// Chrome/Perfetto trace JSON: allocated and reserved counters per device, segment, OOM and
    /// annotation events (open in ui.perfetto.dev or chrome://tracing).
    Perfetto(perfetto::PerfettoArgs),
    /// Blocks still allocated at the end, grouped by stack.
    Leaks(groups::GroupsArgs),
    /// What was allocated at the peak, grouped by stack.
    Peak(groups::GroupsArgs),
    /// Replay the trace's requests through the allocator with another config: peak reserved,
    /// fragmentation, device calls, and the first request that would fail.
    Simulate(simulate::SimulateArgs),
    /// On a GPU: replay the trace's requests, with their threads and streams, through real
    /// allocators (raw cudaMalloc, cudaMallocAsync, cachealloc) and compare their latency
    /// (p50/p99/p99.9), time, peak device memory and driver calls.
    Replay(replay::ReplayArgs),
}

/// Run `command`, writing its report to `out`.
pub fn run(command: Command, out: &mut dyn Write) -> Result<ExitCode, Error> {
    match command {
        Command::Run(args) => return run::run(&args, out),
        Command::Summary(args) => summary::run(&args, out)?,
        Command::Fleet(args) => fleet::run(&args, out)?,
        Command::Stats(args) => stats::run(&args, out)?,
        Command::Trace(args) => trace::run(&args, out)?,
        Command::Snapshot(args) => snapshot::run(&args, out)?,
        Command::Flamegraph(args) => flamegraph::run(&args, out)?,
        Command::Compare(args) => compare::run(&args, out)?,
        Command::Plot(args) => plot::run(&args, out)?,
        Command::Perfetto(args) => perfetto::run(&args, out)?,
        Command::Export(args) => export::run(&args, out)?,
        Command::MemoryTimeline(args) => memory_timeline::run(&args, out)?,
        Command::Leaks(args) => groups::leaks(&args, out)?,
        Command::Peak(args) => groups::peak(&args, out)?,
        Command::Simulate(args) => simulate::run(&args, out)?,
        Command::Replay(args) => replay::run(&args, out)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// The ordinal of the last record at the moment `when` names (`u64::MAX`: the end), and a label
/// for that moment.
fn resolve_when(dir: &std::path::Path, when: &When) -> Result<(u64, String), Error> {
    if when.at_peak {
        let scan = crate::analysis::scan(dir, &crate::progress::Progress::new("scanning"))?;
        let (device, d) = scan
            .devices
            .iter()
            .max_by_key(|(_, d)| d.peak_allocated.bytes)
            .ok_or_else(|| {
                Error::Message(format!("{}: the trace has no allocations", dir.display()))
            })?;
        let label = format!(
            "peak allocated of device {device}: {} at {}",
            crate::format::bytes(d.peak_allocated.bytes),
            crate::format::seconds(d.peak_allocated.t)
        );
        return Ok((d.peak_allocated.index, label));
    }
    match when.at {
        None => Ok((u64::MAX, "at the end".into())),
        Some(t) => Ok((
            crate::walk::last_index_at(dir, t)?,
            format!("at {}", crate::format::seconds(t)),
        )),
    }
}

/// The trace walked through the moment `when` names, and a label for it.
fn walk_to(dir: &std::path::Path, when: &When) -> Result<(crate::walk::TraceWalk, String), Error> {
    let (index, label) = resolve_when(dir, when)?;
    let mut walk = crate::walk::TraceWalk::open(dir)?;
    walk.run_through(index)?;
    Ok((walk, label))
}
