//! `cachealloc summary TRACE...`: what a run did with GPU memory, on one screen per trace, and
//! a side-by-side table when several traces (ranks) are given. Traces are read one at a time;
//! for a job of many ranks, `cachealloc fleet` is the shorter view.

pub mod context;

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

use crate::analysis::Scan;
use crate::format::{bytes, percent, seconds};
use crate::walk::{TraceWalk, site};
use crate::{Error, trace_dirs};

/// `cachealloc summary`'s arguments.
#[derive(clap::Args, Debug)]
pub struct SummaryArgs {
    /// Trace directories.
    #[arg(required = true)]
    pub traces: Vec<PathBuf>,
}

/// How many allocation sites to list.
const TOP_SITES: usize = 10;

/// Bytes and block counts of the sites live at one moment, largest first.
pub fn sites_live(walk: &TraceWalk, device: u32) -> Vec<(String, u64, u64)> {
    let mut by_site: HashMap<String, (u64, u64)> = HashMap::new();
    let state = &walk.state;
    for block in state.blocks.values() {
        if block.device == device && block.pending == 0 {
            let e = by_site.entry(site(state, block.stack)).or_default();
            e.0 += block.size;
            e.1 += 1;
        }
    }
    let mut sites: Vec<(String, u64, u64)> =
        by_site.into_iter().map(|(s, (b, n))| (s, b, n)).collect();
    sites.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    sites
}

/// One device of one trace in the side-by-side table of several traces.
struct TableRow {
    name: String,
    device: u32,
    peak_allocated: u64,
    peak_reserved: u64,
    allocated_at_peak_reserved: u64,
    allocs: u64,
    ooms: usize,
}

/// Run the command. Traces are read one after the other, each reduced to its table rows before
/// the next is opened: memory does not grow with the number of traces (ranks) beyond those rows.
pub fn run(args: &SummaryArgs, out: &mut dyn Write) -> Result<(), Error> {
    let dirs = trace_dirs(&args.traces)?;
    let mut table = vec![];
    for (i, dir) in dirs.iter().enumerate() {
        if i > 0 {
            writeln!(out)?;
        }
        // One walk: the scan, and the categories pass that finds each device's peak and what it
        // held (by category, module and site).
        let (scan, context) = context::summarize(dir)?;
        write_one(dir, &scan, &context, out)?;
        if dirs.len() > 1 {
            let name = dir.display().to_string();
            // The end of the path says which trace it is.
            let name = match name.char_indices().rev().nth(31) {
                Some((i, _)) => format!("…{}", &name[i + 1..]),
                None => name,
            };
            for (device, d) in &scan.devices {
                table.push(TableRow {
                    name: name.clone(),
                    device: *device,
                    peak_allocated: d.peak_allocated.bytes,
                    peak_reserved: d.peak_reserved.bytes,
                    allocated_at_peak_reserved: d.allocated_at_peak_reserved,
                    allocs: d.allocs,
                    ooms: scan.ooms.iter().filter(|o| o.device == *device).count(),
                });
            }
        }
    }
    if dirs.len() > 1 {
        writeln!(out)?;
        writeln!(
            out,
            "{:<32} {:>6} {:>12} {:>12} {:>8} {:>10} {:>5}",
            "trace", "device", "peak alloc", "peak resv", "frag", "allocs", "OOMs"
        )?;
        for r in &table {
            writeln!(
                out,
                "{:<32} {:>6} {:>12} {:>12} {:>8} {:>10} {:>5}",
                r.name,
                r.device,
                bytes(r.peak_allocated),
                bytes(r.peak_reserved),
                percent(
                    r.peak_reserved - r.allocated_at_peak_reserved,
                    r.peak_reserved
                ),
                r.allocs,
                r.ooms
            )?;
        }
    }
    Ok(())
}

fn write_one(
    dir: &std::path::Path,
    scan: &Scan,
    context: &context::Context,
    out: &mut dyn Write,
) -> Result<(), Error> {
    writeln!(
        out,
        "trace     {} ({} file{}, {} records)",
        dir.display(),
        scan.files,
        if scan.files == 1 { "" } else { "s" },
        scan.records
    )?;
    if let Some(h) = &scan.header {
        let rank = if h.rank >= 0 {
            format!(", rank {} of {}", h.rank, h.world_size)
        } else {
            String::new()
        };
        writeln!(out, "process   pid {} on {}{rank}", h.pid, h.host)?;
        writeln!(out, "command   {}", h.cmdline.join(" "))?;
        if !h.config.is_empty() {
            writeln!(out, "config    {}", h.config)?;
        }
    }
    writeln!(
        out,
        "duration  {} (events from {} to {})",
        seconds(scan.duration()),
        seconds(scan.span.0),
        seconds(scan.span.1)
    )?;
    for (device, d) in &scan.devices {
        let name = scan
            .header
            .as_ref()
            .and_then(|h| h.devices.iter().find(|i| i.index == *device))
            .map(|i| format!(" ({}, {})", i.name, bytes(i.total_memory)))
            .unwrap_or_default();
        writeln!(out)?;
        writeln!(out, "device {device}{name}")?;
        writeln!(
            out,
            "  peak allocated  {} at {}",
            bytes(d.peak_allocated.bytes),
            seconds(d.peak_allocated.t)
        )?;
        writeln!(
            out,
            "  peak reserved   {} at {}: at most {} allocated then, fragmentation {} (reserved, not allocated)",
            bytes(d.peak_reserved.bytes),
            seconds(d.peak_reserved.t),
            bytes(d.allocated_at_peak_reserved),
            percent(
                d.peak_reserved.bytes - d.allocated_at_peak_reserved,
                d.peak_reserved.bytes
            )
        )?;
        writeln!(
            out,
            "  events          {} allocs ({} requested), {} frees, {} segments allocated, {} released",
            d.allocs,
            bytes(d.requested_bytes),
            d.frees,
            d.segment_allocs,
            d.segment_frees
        )?;
        writeln!(
            out,
            "  at the end      {} allocated, {} reserved",
            bytes(d.allocated_at_end),
            bytes(d.reserved_at_end)
        )?;
        if scan.has_context {
            context::write_categories(context, *device, d.peak_allocated.bytes, out)?;
        }
        let sites = context.sites.get(device).map_or(&[][..], Vec::as_slice);
        write_sites(sites, d.peak_allocated.bytes, scan.has_context, out)?;
    }
    writeln!(out)?;
    if scan.ooms.is_empty() {
        writeln!(out, "OOMs      none")?;
    } else {
        writeln!(out, "OOMs      {}", scan.ooms.len())?;
        for o in scan.ooms.iter().take(5) {
            writeln!(
                out,
                "  at {} on device {}: requested {} with {} allocated, {} reserved, {} cached free (largest block {}), device free {} of {}",
                seconds(o.t),
                o.device,
                bytes(o.requested),
                bytes(o.allocated),
                bytes(o.reserved),
                bytes(o.cached_free),
                bytes(o.largest_free_block),
                bytes(o.device_free),
                bytes(o.device_total)
            )?;
        }
    }
    if scan.stacks_shed == 0 && scan.blocked_sends.0 == 0 {
        writeln!(out, "drops     none")?;
    } else {
        writeln!(
            out,
            "drops     {} stacks shed under overload; {} sends blocked for {:.1} ms in all (no event was dropped)",
            scan.stacks_shed,
            scan.blocked_sends.0,
            scan.blocked_sends.1 as f64 / 1e6
        )?;
    }
    if scan.tears.is_empty() {
        writeln!(out, "tears     none")?;
    } else {
        for t in &scan.tears {
            writeln!(out, "tear      {t} (read up to there)")?;
        }
    }
    if !scan.annotations.is_empty() {
        writeln!(out, "annotations {}", scan.annotations.len())?;
        for a in scan.annotations.iter().take(10) {
            writeln!(out, "  {} {}", seconds(a.t), a.name)?;
        }
    }
    Ok(())
}

/// The top sites at the peak; for traces with context records, with the user's line of each
/// (`← train.py:42`).
fn write_sites(
    sites: &[context::SiteBytes],
    peak: u64,
    user_lines: bool,
    out: &mut dyn Write,
) -> Result<(), Error> {
    if sites.is_empty() {
        return Ok(());
    }
    if user_lines {
        writeln!(
            out,
            "  top allocation sites live at peak allocated (← the user's line):"
        )?;
    } else {
        writeln!(out, "  top allocation sites live at peak allocated:")?;
    }
    writeln!(
        out,
        "    {:>12} {:>7} {:>7}  site",
        "bytes", "share", "blocks"
    )?;
    for s in sites.iter().take(TOP_SITES) {
        let user = match &s.user {
            Some(user) if user_lines && *user != s.site => format!("  ← {user}"),
            _ => String::new(),
        };
        writeln!(
            out,
            "    {:>12} {:>7} {:>7}  {}{user}",
            bytes(s.bytes),
            percent(s.bytes, peak),
            s.blocks,
            s.site
        )?;
    }
    if sites.len() > TOP_SITES {
        let rest: u64 = sites[TOP_SITES..].iter().map(|s| s.bytes).sum();
        writeln!(
            out,
            "    {:>12} {:>7} {:>7}  ({} other sites)",
            bytes(rest),
            percent(rest, peak),
            "",
            sites.len() - TOP_SITES
        )?;
    }
    Ok(())
}
