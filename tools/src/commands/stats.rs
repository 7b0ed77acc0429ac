//! `cachealloc stats TRACE [--at T]`: PyTorch's `memory_stats()` keys at a time, a
//! `memory_summary()`-style table, and a map of the segments like `_memory_viz segsum`.

use std::io::Write;
use std::path::{Path, PathBuf};

use cachealloc_core::stats::StatArray;
use cachealloc_recorder::LiveState;

use crate::format::parse_time;
use crate::format::{bytes, percent, seconds};
use crate::progress::Progress;
use crate::replayed_stats::{DeviceStats, StatsTracker};
use crate::walk::TraceWalk;
use crate::{Error, one_trace};

/// `cachealloc stats`'s arguments.
#[derive(clap::Args, Debug)]
pub struct StatsArgs {
    /// Trace directory.
    pub trace: PathBuf,
    /// A time since the start: 12.5, 12.5s, 300ms, 5000ns (default: the end).
    #[arg(long, value_parser = parse_time)]
    pub at: Option<u64>,
    /// Print the keys as JSON only.
    #[arg(long)]
    pub json: bool,
}

/// Walk `dir` through every event at or before `at` (the end if `None`), keeping stats.
pub fn walk_with_stats(dir: &Path, at: Option<u64>) -> Result<(TraceWalk, StatsTracker), Error> {
    let last = match at {
        None => u64::MAX,
        Some(t) => crate::walk::last_index_at(dir, t)?,
    };
    let progress = Progress::new("replaying");
    let mut walk = TraceWalk::open(dir)?;
    let mut tracker = StatsTracker::default();
    while let Some(step) = walk.step() {
        let step = step?;
        tracker.apply(&step);
        if step.index % 65536 == 0 {
            progress.tick(step.index);
        }
        if step.index >= last {
            break;
        }
    }
    tracker.finish();
    Ok((walk, tracker))
}

/// Run the command.
pub fn run(args: &StatsArgs, out: &mut dyn Write) -> Result<(), Error> {
    let dir = one_trace(&args.trace)?;
    let (walk, tracker) = walk_with_stats(&dir, args.at)?;
    if args.json {
        let devices: serde_json::Map<String, serde_json::Value> = tracker
            .devices
            .iter()
            .map(|(d, s)| (d.to_string(), serde_json::to_value(s.to_map()).unwrap()))
            .collect();
        serde_json::to_writer_pretty(&mut *out, &devices).map_err(std::io::Error::other)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(out, "at {} ({})", seconds(walk.t), dir.display())?;
    for (device, stats) in &tracker.devices {
        writeln!(out)?;
        summary_table(*device, stats, out)?;
        writeln!(out)?;
        segment_map(&walk.state, *device, out)?;
        writeln!(out)?;
        writeln!(out, "memory_stats() of device {device}:")?;
        for (key, value) in stats.to_map() {
            writeln!(out, "  {key}: {value}")?;
        }
    }
    Ok(())
}

/// A `torch.cuda.memory_summary()`-style table.
fn summary_table(device: u32, s: &DeviceStats, out: &mut dyn Write) -> Result<(), Error> {
    let rule = format!("|{}|", "=".repeat(75));
    let thin = format!("|{}|", "-".repeat(75));
    writeln!(out, "{rule}")?;
    writeln!(
        out,
        "|{:^75}|",
        format!("cachealloc CUDA memory summary, device ID {device}")
    )?;
    writeln!(out, "{thin}")?;
    writeln!(
        out,
        "|{:^37}|{:^37}|",
        format!("CUDA OOMs: {}", s.stats.num_ooms),
        format!(
            "device allocs: {} / frees: {}",
            s.stats.num_device_alloc, s.stats.num_device_free
        )
    )?;
    writeln!(out, "{rule}")?;
    writeln!(
        out,
        "| {:<21} | {:>10} | {:>10} | {:>10} | {:>10} |",
        "Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"
    )?;
    let stats = &s.stats;
    let rows: [(&str, &StatArray, bool); 7] = [
        ("Allocated memory", &stats.allocated_bytes, true),
        ("Active memory", &stats.active_bytes, true),
        ("Requested memory", &stats.requested_bytes, true),
        ("GPU reserved memory", &stats.reserved_bytes, true),
        ("Allocations", &stats.allocation, false),
        ("Active allocs", &stats.active, false),
        ("GPU reserved segments", &stats.segment, false),
    ];
    for (name, array, is_bytes) in rows {
        writeln!(out, "{thin}")?;
        for (st, label) in [
            (array.all, name),
            (array.large_pool, "      from large pool"),
            (array.small_pool, "      from small pool"),
        ] {
            let f = |v: i64| {
                if is_bytes {
                    bytes(v.max(0) as u64)
                } else {
                    v.to_string()
                }
            };
            writeln!(
                out,
                "| {:<21} | {:>10} | {:>10} | {:>10} | {:>10} |",
                label,
                f(st.current),
                f(st.peak),
                f(st.allocated),
                f(st.freed)
            )?;
        }
    }
    writeln!(out, "{thin}")?;
    let split = s.stats.inactive_split_bytes;
    writeln!(
        out,
        "| {:<21} | {:>10} | {:>10} | {:>10} | {:>10} |",
        "Non-releasable memory",
        bytes(split.all.current.max(0) as u64),
        "-",
        "-",
        "-"
    )?;
    writeln!(out, "{rule}")?;
    Ok(())
}

/// Width of a segment's bar.
const BAR: usize = 64;

/// One line per segment: its address, size and pool, a bar of its blocks (a letter per block
/// allocated, `.` for blocks freed but waiting on their reuse fence, blank for free space), and
/// its free bytes.
pub fn segment_map(state: &LiveState, device: u32, out: &mut dyn Write) -> Result<(), Error> {
    let segments: Vec<_> = state
        .segments
        .range((device, 0)..=(device, u64::MAX))
        .map(|(_, s)| *s)
        .collect();
    writeln!(
        out,
        "segments of device {device}: {} ({} reserved)",
        segments.len(),
        bytes(segments.iter().map(|s| s.size).sum())
    )?;
    let (mut total, mut allocated, mut internal) = (0u64, 0u64, 0u64);
    let ordered = state.blocks.ordered();
    for seg in &segments {
        let mut bar = [b' '; BAR];
        let mut seg_allocated = 0;
        let blocks = ordered.range(device, seg.address, seg.address + seg.size);
        for (i, b) in blocks.enumerate() {
            let from =
                ((b.address - seg.address) as u128 * BAR as u128 / seg.size as u128) as usize;
            let to = (((b.address - seg.address + b.size) as u128 * BAR as u128)
                .div_ceil(seg.size as u128) as usize)
                .min(BAR);
            let mark = if b.pending != 0 {
                b'.'
            } else {
                b'a' + (i % 26) as u8
            };
            bar[from..to.max(from + 1).min(BAR)].fill(mark);
            if b.pending == 0 {
                seg_allocated += b.size;
                internal += b.size - b.requested.min(b.size);
            }
        }
        total += seg.size;
        allocated += seg_allocated;
        writeln!(
            out,
            "  {:#014x} {:>10} {} [{}] {} free",
            seg.address,
            bytes(seg.size),
            cachealloc_recorder::schema::pool_name(seg.pool),
            String::from_utf8_lossy(&bar),
            bytes(seg.size - seg_allocated)
        )?;
    }
    writeln!(
        out,
        "  allocated {} of {} reserved; free {} ({}) between blocks, {} inside blocks (rounding)",
        bytes(allocated),
        bytes(total),
        bytes(total - allocated),
        percent(total - allocated, total),
        bytes(internal)
    )?;
    Ok(())
}
