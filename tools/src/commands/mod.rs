//! The subcommands: their arguments (clap) and dispatch.

pub mod compare;
pub mod flamegraph;
pub mod groups;
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
use std::path::PathBuf;
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

/// What the `cachealloc` command does.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a command under libcachealloc.so, then print the summary of its trace.
    Run {
        /// Allocator settings (CACHEALLOC_CONF), e.g. max_split_size_mb:256,stacks:all.
        #[arg(long)]
        conf: Option<String>,
        /// Where the trace goes (default: ./cachealloc-trace).
        #[arg(long)]
        trace_dir: Option<PathBuf>,
        /// libcachealloc.so to preload (default: the one installed next to this binary).
        #[arg(long)]
        lib: Option<PathBuf>,
        /// The command and its arguments.
        #[arg(required = true, last = true)]
        command: Vec<String>,
    },
    /// Peaks, fragmentation, counts, OOMs, drops and the top allocation sites of one or more
    /// traces (several: one per rank, side by side).
    Summary {
        /// Trace directories.
        #[arg(required = true)]
        traces: Vec<PathBuf>,
    },
    /// PyTorch memory_stats() keys, a memory_summary()-style table and the segment map at a time
    /// (default: the end).
    Stats {
        /// Trace directory.
        trace: PathBuf,
        /// A time since the start: 12.5, 12.5s, 300ms, 5000ns (default: the end).
        #[arg(long, value_parser = parse_time)]
        at: Option<u64>,
        /// Print the keys as JSON only.
        #[arg(long)]
        json: bool,
    },
    /// The event listing.
    Trace {
        /// Trace directory.
        trace: PathBuf,
        /// From this time (default: the start).
        #[arg(long, value_parser = parse_time)]
        from: Option<u64>,
        /// To this time (default: the end).
        #[arg(long, value_parser = parse_time)]
        to: Option<u64>,
        /// Only this device's events.
        #[arg(long)]
        device: Option<u32>,
        /// Print each allocation's stack under it.
        #[arg(long)]
        stacks: bool,
    },
    /// A PyTorch memory snapshot pickle (for torch.cuda._memory_viz and the memory viewer at
    /// pytorch.org/memory_viz).
    Snapshot {
        /// Trace directory.
        trace: PathBuf,
        #[allow(missing_docs)] // clap would show a doc comment here as a help heading
        #[command(flatten)]
        when: When,
        /// Events kept in device_traces (the last N before the snapshot time).
        #[arg(long, default_value_t = 100_000)]
        events: usize,
        /// Output file.
        #[arg(short, required = true)]
        output: PathBuf,
    },
    /// A flamegraph SVG of live memory by stack (memory) or of reserved segments by the stack
    /// that created them (segments).
    Flamegraph {
        /// Trace directory.
        trace: PathBuf,
        /// What to weigh.
        #[arg(long, value_enum, default_value_t = flamegraph::Kind::Memory)]
        kind: flamegraph::Kind,
        #[allow(missing_docs)] // clap would show a doc comment here as a help heading
        #[command(flatten)]
        when: When,
        /// Output SVG.
        #[arg(short, required = true)]
        output: PathBuf,
    },
    /// A differential flamegraph SVG: live memory at B against A (two times of one trace, or the
    /// peaks of two traces).
    Compare {
        /// The "before" trace directory.
        a: PathBuf,
        /// The "after" trace directory (default: A again, at --to).
        b: Option<PathBuf>,
        /// With one trace: the earlier time.
        #[arg(long, value_parser = parse_time)]
        from: Option<u64>,
        /// With one trace: the later time.
        #[arg(long, value_parser = parse_time)]
        to: Option<u64>,
        /// Output SVG.
        #[arg(short, required = true)]
        output: PathBuf,
    },
    /// One self-contained HTML report: memory over time by allocation site, reserved against
    /// allocated, the segments at a chosen time, annotations and OOMs.
    Plot {
        /// Trace directories (several: side by side).
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// Points per timeline (the trace is downsampled to this).
        #[arg(long, default_value_t = 2000)]
        points: usize,
        /// Output HTML.
        #[arg(short, required = true)]
        output: PathBuf,
    },
    /// Chrome/Perfetto trace JSON: allocated and reserved counters per device, segment, OOM and
    /// annotation events (open in ui.perfetto.dev or chrome://tracing).
    Perfetto {
        /// Trace directory.
        trace: PathBuf,
        /// Output JSON.
        #[arg(short, required = true)]
        output: PathBuf,
    },
    /// Blocks still allocated at the end, grouped by stack.
    Leaks {
        /// Trace directory.
        trace: PathBuf,
        /// Stacks to list.
        #[arg(long, default_value_t = 20)]
        top: usize,
    },
    /// What was allocated at the peak, grouped by stack.
    Peak {
        /// Trace directory.
        trace: PathBuf,
        /// Stacks to list.
        #[arg(long, default_value_t = 20)]
        top: usize,
    },
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
        Command::Run {
            conf,
            trace_dir,
            lib,
            command,
        } => return run::run(conf, trace_dir, lib, &command, out),
        Command::Summary { traces } => summary::run(&traces, out)?,
        Command::Stats { trace, at, json } => stats::run(&trace, at, json, out)?,
        Command::Trace {
            trace,
            from,
            to,
            device,
            stacks,
        } => trace::run(&trace, from, to, device, stacks, out)?,
        Command::Snapshot {
            trace,
            when,
            events,
            output,
        } => snapshot::run(&trace, &when, events, &output, out)?,
        Command::Flamegraph {
            trace,
            kind,
            when,
            output,
        } => flamegraph::run(&trace, kind, &when, &output, out)?,
        Command::Compare {
            a,
            b,
            from,
            to,
            output,
        } => compare::run(&a, b.as_deref(), from, to, &output, out)?,
        Command::Plot {
            traces,
            points,
            output,
        } => plot::run(&traces, points, &output, out)?,
        Command::Perfetto { trace, output } => perfetto::run(&trace, &output, out)?,
        Command::Leaks { trace, top } => groups::leaks(&trace, top, out)?,
        Command::Peak { trace, top } => groups::peak(&trace, top, out)?,
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
            crate::replay::last_index_at(dir, t)?,
            format!("at {}", crate::format::seconds(t)),
        )),
    }
}

/// The replay through the moment `when` names, and a label for it.
fn replay_at(dir: &std::path::Path, when: &When) -> Result<(crate::replay::Replay, String), Error> {
    let (index, label) = resolve_when(dir, when)?;
    let mut replay = crate::replay::Replay::open(dir)?;
    replay.run_through(index)?;
    Ok((replay, label))
}
