//! `cachealloc memory-timeline TRACE -o timeline.json`: memory by category over time in the
//! JSON form of `torch.profiler.profile.export_memory_timeline` (`_memory_profiler.py`'s
//! `MemoryProfileTimeline.export_memory_timeline`), so that what reads PyTorch's timeline reads
//! ours: `[times, sizes]`, `times` in microseconds since the Unix epoch (the profiler's clock),
//! and for each time a row of nine byte counts — a leading 0 (the base PyTorch's plot stacks
//! from), then PARAMETER, OPTIMIZER_STATE, INPUT, TEMPORARY, ACTIVATION, GRADIENT,
//! AUTOGRAD_DETAIL and unknown, PyTorch's `_CATEGORY_TO_INDEX` order.
//!
//! PyTorch writes a row per event; ours has a row per time slice (at most `--points` of them,
//! default 10 000: slices start at 1 µs and widen as the trace goes on), each the slice's peak
//! of allocated memory: the same form, a bounded size, and the peaks kept. Categories are `crate::categories`'; a trace without context records has every
//! byte in the unknown column.

use std::io::Write;
use std::path::PathBuf;

use crate::categories::Category;
use crate::categories::pass::{Plan, run_to_end};
use crate::categories::slices::{SliceRow, SliceSpec};
use crate::format::bytes;
use crate::progress::Progress;
use crate::{Error, one_trace};

/// `cachealloc memory-timeline`'s arguments.
#[derive(clap::Args, Debug)]
pub struct MemoryTimelineArgs {
    /// Trace directory.
    pub trace: PathBuf,
    /// The device (default: the one whose allocated memory peaked highest).
    #[arg(long)]
    pub device: Option<u32>,
    /// Rows, at most (time slices, each at its peak).
    #[arg(long, default_value_t = 10_000)]
    pub points: u64,
    /// Output JSON.
    #[arg(short, required = true)]
    pub output: PathBuf,
    /// Instead of the timeline, the bytes by category at each annotation of the program's
    /// (`cachealloc_annotate`), every device: a list of `{"annotation", "time_us", "device",
    /// "bytes": {"PARAMETER": …, …, "UNKNOWN": …}, "requested": {…}}` (blocks' sizes, and what
    /// the program asked for).
    #[arg(long)]
    pub at_annotations: bool,
}

/// `[times, sizes]` of `rows`, times shifted to the Unix epoch by `wall_base_ns`.
pub fn timeline_json(rows: &[SliceRow], wall_base_ns: u64) -> serde_json::Value {
    let times: Vec<u64> = rows.iter().map(|r| (wall_base_ns + r.t) / 1000).collect();
    let sizes: Vec<Vec<u64>> = rows
        .iter()
        .map(|r| std::iter::once(0).chain(r.by_category).collect())
        .collect();
    serde_json::json!([times, sizes])
}

/// Run the command: one walk (the slices widen as the trace goes on; each device's peak picks
/// the default device).
pub fn run(args: &MemoryTimelineArgs, out: &mut dyn Write) -> Result<(), Error> {
    let dir = one_trace(&args.trace)?;
    if args.at_annotations {
        return at_annotations(&dir, args, out);
    }
    let plan = Plan {
        slices: Some(SliceSpec::adaptive(args.points.clamp(1, 10_000_000))),
        peaks: true,
        ..Plan::default()
    };
    let (outcome, walk) = run_to_end(&dir, &plan, &Progress::new("categories"), |_, _| {})?;
    let device = match args.device {
        Some(d) => d,
        None => outcome
            .peaks
            .iter()
            .max_by_key(|(_, row)| row.allocated)
            .map(|(d, _)| *d)
            .ok_or_else(|| format!("{}: the trace has no allocations", dir.display()))?,
    };
    let Some(rows) = outcome.slices.get(&device) else {
        return Err(Error::Message(format!(
            "{}: device {device} has no events",
            dir.display()
        )));
    };
    let wall = walk.header.as_ref().map_or(0, |h| h.wall_clock_base_ns);
    let json = serde_json::to_string(&timeline_json(rows, wall)).map_err(std::io::Error::other)?;
    std::fs::write(&args.output, &json)
        .map_err(|e| Error::Message(format!("{}: {e}", args.output.display())))?;
    writeln!(
        out,
        "wrote {} (device {device}: {} times, {}{})",
        args.output.display(),
        rows.len(),
        bytes(json.len() as u64),
        if outcome.has_context {
            ""
        } else {
            "; the trace has no context records: every byte is unknown"
        }
    )?;
    Ok(())
}

/// `--at-annotations`: the bytes by category at each annotation.
fn at_annotations(
    dir: &std::path::Path,
    args: &MemoryTimelineArgs,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let rows = crate::categories::annotations::at_annotations(dir, &Progress::new("categories"))?;
    let wall = crate::walk::TraceWalk::open(dir)
        .ok()
        .and_then(|mut w| {
            w.step();
            w.header.map(|h| h.wall_clock_base_ns)
        })
        .unwrap_or(0);
    let list: Vec<serde_json::Value> = rows
        .iter()
        .filter(|r| args.device.is_none_or(|d| d == r.device))
        .map(|r| {
            let named = |by: &crate::categories::ByCategory| {
                Category::ALL
                    .iter()
                    .map(|c| (c.name().to_string(), by[c.index()].into()))
                    .collect::<serde_json::Map<String, serde_json::Value>>()
            };
            serde_json::json!({
                "annotation": r.name,
                "time_us": (wall + r.t) / 1000,
                "device": r.device,
                "bytes": named(&r.by_category),
                "requested": named(&r.requested),
            })
        })
        .collect();
    let json = serde_json::to_string_pretty(&list).map_err(std::io::Error::other)?;
    std::fs::write(&args.output, &json)
        .map_err(|e| Error::Message(format!("{}: {e}", args.output.display())))?;
    writeln!(
        out,
        "wrote {} ({} annotations)",
        args.output.display(),
        list.len()
    )?;
    Ok(())
}
