//! `cachealloc fleet TRACE…`: a job of many ranks on one screen — each rank's peak allocated
//! and reserved, fragmentation, OOMs and the time and step (the last annotation before it) of
//! its peak; the outlier ranks; the ranks above a size (`--above 70GB`); and the job's top
//! allocation sites at each rank's peak.
//!
//! Ranks are read one after the other and each is reduced to one small row per device
//! ([`RankRow`]) before the next is opened, so memory does not grow with the job's size beyond
//! those rows (about a hundred bytes a rank) and the sites' table (bounded by the number of
//! distinct sites, not of ranks).
//!
//! Outliers are judged on peak reserved, robustly: a rank whose `(x − median) / s` exceeds `k`
//! (default 3) in either direction, where `s = 1.4826 · MAD` (the median absolute deviation,
//! scaled to a standard deviation for normal data), and at least 1 % of the median so that a
//! job of identical ranks has no outliers by rounding.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

use crate::analysis::scan;
use crate::commands::summary::sites_live;
use crate::format::{bytes, parse_size, percent, seconds};
use crate::progress::Progress;
use crate::walk::TraceWalk;
use crate::{Error, trace_dirs};

/// `cachealloc fleet`'s arguments.
#[derive(clap::Args, Debug)]
pub struct FleetArgs {
    /// Trace directories: one per rank, or directories holding them.
    #[arg(required = true)]
    pub traces: Vec<PathBuf>,
    /// Ranks listed, by peak reserved (the outliers are always listed).
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// List every rank.
    #[arg(long)]
    pub all: bool,
    /// Outlier threshold: robust z-score (in scaled MADs from the median) beyond which a rank is
    /// an outlier.
    #[arg(long, default_value_t = 3.0, value_parser = parse_k)]
    pub k: f64,
    /// Also list every rank whose peak reserved exceeds this size (70GB, 64GiB, bytes).
    #[arg(long, value_parser = parse_size)]
    pub above: Option<u64>,
}

fn parse_k(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(k) if k > 0.0 && k.is_finite() => Ok(k),
        _ => Err(format!("'{value}' is not a positive number")),
    }
}

/// Sites listed for the job.
const TOP_SITES: usize = 10;

/// One device of one rank, reduced.
#[derive(Debug, Clone, PartialEq)]
pub struct RankRow {
    /// The rank (the trace's `RANK`, else its position among the traces).
    pub rank: i64,
    /// Device.
    pub device: u32,
    /// Peak allocated bytes.
    pub peak_allocated: u64,
    /// When (ns since the trace's base).
    pub peak_allocated_t: u64,
    /// Peak reserved bytes.
    pub peak_reserved: u64,
    /// Reserved but not allocated at peak reserved, in percent of it.
    pub fragmentation: f64,
    /// OOMs on the device.
    pub ooms: usize,
    /// The last annotation at or before peak allocated (the step, in a training loop that
    /// annotates its steps).
    pub step: Option<String>,
    /// The largest allocation site live at peak allocated, and its bytes.
    pub top_site: Option<(String, u64)>,
}

/// The job, reduced: a row per rank and device, and the sites live at each rank's peak.
#[derive(Debug, Default)]
pub struct Fleet {
    /// Rows, in the order the traces were read.
    pub rows: Vec<RankRow>,
    /// Per site: bytes live at each rank's peak allocated, summed over ranks, and how many ranks
    /// had it live then.
    pub sites: HashMap<String, (u64, u64)>,
    /// Traces read.
    pub traces: usize,
    /// Traces that were torn (read up to the tear).
    pub torn: usize,
}

/// Read every trace of `paths`, one at a time.
pub fn read_fleet(paths: &[PathBuf]) -> Result<Fleet, Error> {
    let dirs = trace_dirs(paths)?;
    let mut fleet = Fleet::default();
    for (index, dir) in dirs.iter().enumerate() {
        let s = scan(dir, &Progress::hidden())?;
        fleet.traces += 1;
        fleet.torn += usize::from(!s.tears.is_empty());
        let rank = s
            .header
            .as_ref()
            .filter(|h| h.rank >= 0)
            .map_or(index as i64, |h| i64::from(h.rank));
        for (&device, d) in &s.devices {
            let mut walk = TraceWalk::open(dir)?;
            walk.run_through(d.peak_allocated.index)?;
            let sites = sites_live(&walk, device);
            drop(walk);
            for (site, b, _) in &sites {
                let e = fleet.sites.entry(site.clone()).or_default();
                e.0 += b;
                e.1 += 1;
            }
            let step = s
                .annotations
                .iter()
                .take_while(|a| a.t <= d.peak_allocated.t)
                .last()
                .map(|a| a.name.clone());
            let fragmentation = if d.peak_reserved.bytes == 0 {
                0.0
            } else {
                100.0 * (d.peak_reserved.bytes - d.allocated_at_peak_reserved) as f64
                    / d.peak_reserved.bytes as f64
            };
            fleet.rows.push(RankRow {
                rank,
                device,
                peak_allocated: d.peak_allocated.bytes,
                peak_allocated_t: d.peak_allocated.t,
                peak_reserved: d.peak_reserved.bytes,
                fragmentation,
                ooms: s.ooms.iter().filter(|o| o.device == device).count(),
                step,
                top_site: sites.into_iter().next().map(|(s, b, _)| (s, b)),
            });
        }
    }
    Ok(fleet)
}

/// The median of `values` (sorted in place); 0 for none.
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// The outliers among `rows` by peak reserved: `(row index, robust z-score)`, largest |z|
/// first; and the median and scale used (see the module docs).
pub fn outliers(rows: &[RankRow], k: f64) -> (Vec<(usize, f64)>, f64, f64) {
    let mut values: Vec<f64> = rows.iter().map(|r| r.peak_reserved as f64).collect();
    let m = median(&mut values);
    let mut deviations: Vec<f64> = rows
        .iter()
        .map(|r| (r.peak_reserved as f64 - m).abs())
        .collect();
    let mad = median(&mut deviations);
    let scale = (1.4826 * mad).max(0.01 * m).max(1.0);
    let mut out: Vec<(usize, f64)> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| (i, (r.peak_reserved as f64 - m) / scale))
        .filter(|(_, z)| z.abs() > k)
        .collect();
    out.sort_by(|a, b| b.1.abs().total_cmp(&a.1.abs()));
    (out, m, scale)
}

fn write_row(out: &mut dyn Write, r: &RankRow, z: Option<f64>) -> Result<(), Error> {
    let (site, site_bytes) = match &r.top_site {
        Some((s, b)) => (s.as_str(), bytes(*b)),
        None => ("(none)", String::new()),
    };
    writeln!(
        out,
        "{:>6} {:>6} {:>12} {:>12} {:>6.1}% {:>5} {:>10} {:>12} {:>7}  {site_bytes} {site}",
        r.rank,
        r.device,
        bytes(r.peak_allocated),
        bytes(r.peak_reserved),
        r.fragmentation,
        r.ooms,
        seconds(r.peak_allocated_t),
        r.step.as_deref().unwrap_or("-"),
        z.map_or("-".to_string(), |z| format!("{z:+.1}")),
    )?;
    Ok(())
}

/// Run the command.
pub fn run(args: &FleetArgs, out: &mut dyn Write) -> Result<(), Error> {
    let fleet = read_fleet(&args.traces)?;
    let rows = &fleet.rows;
    if rows.is_empty() {
        let names: Vec<String> = args
            .traces
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        return Err(Error::Message(format!(
            "{}: no allocations in these traces",
            names.join(", ")
        )));
    }
    let (outliers, m, scale) = outliers(rows, args.k);
    let z_of: HashMap<usize, f64> = outliers.iter().copied().collect();
    let ranks = {
        let mut r: Vec<i64> = rows.iter().map(|r| r.rank).collect();
        r.dedup();
        r.len()
    };
    writeln!(
        out,
        "job       {} traces, {} ranks, {} rank-devices{}",
        fleet.traces,
        ranks,
        rows.len(),
        if fleet.torn > 0 {
            format!(" ({} torn: read up to the tear)", fleet.torn)
        } else {
            String::new()
        }
    )?;
    let max = rows.iter().max_by_key(|r| r.peak_reserved).expect("rows");
    let min = rows.iter().min_by_key(|r| r.peak_reserved).expect("rows");
    writeln!(
        out,
        "peak reserved  median {}, scale {} (1.4826 MAD); max {} (rank {}), min {} (rank {})",
        bytes(m as u64),
        bytes(scale as u64),
        bytes(max.peak_reserved),
        max.rank,
        bytes(min.peak_reserved),
        min.rank
    )?;
    let with_ooms: Vec<&RankRow> = rows.iter().filter(|r| r.ooms > 0).collect();
    writeln!(
        out,
        "OOMs      {} on {} rank-devices",
        with_ooms.iter().map(|r| r.ooms).sum::<usize>(),
        with_ooms.len()
    )?;
    writeln!(
        out,
        "outliers  {} by peak reserved beyond {} scaled MADs of the median",
        outliers.len(),
        args.k
    )?;
    let header = || {
        format!(
            "{:>6} {:>6} {:>12} {:>12} {:>7} {:>5} {:>10} {:>12} {:>7}  top site at peak allocated",
            "rank", "device", "peak alloc", "peak resv", "frag", "OOMs", "peak at", "step", "z"
        )
    };
    if !outliers.is_empty() {
        writeln!(out, "{}", header())?;
        for (i, z) in &outliers {
            write_row(out, &rows[*i], Some(*z))?;
        }
    }
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&a, &b| {
        rows[b]
            .peak_reserved
            .cmp(&rows[a].peak_reserved)
            .then(rows[a].rank.cmp(&rows[b].rank))
    });
    if let Some(limit) = args.above {
        let above: Vec<usize> = order
            .iter()
            .copied()
            .filter(|&i| rows[i].peak_reserved > limit)
            .collect();
        writeln!(out)?;
        writeln!(
            out,
            "above     {} rank-devices peaked above {} reserved",
            above.len(),
            bytes(limit)
        )?;
        if !above.is_empty() {
            writeln!(out, "{}", header())?;
            for i in above {
                write_row(out, &rows[i], z_of.get(&i).copied())?;
            }
        }
    }
    let listed = if args.all { rows.len() } else { args.top };
    writeln!(out)?;
    writeln!(
        out,
        "ranks by peak reserved ({} of {}; --all lists every one)",
        listed.min(rows.len()),
        rows.len()
    )?;
    writeln!(out, "{}", header())?;
    for &i in order.iter().take(listed) {
        write_row(out, &rows[i], z_of.get(&i).copied())?;
    }
    let total: u64 = rows.iter().map(|r| r.peak_allocated).sum();
    let mut sites: Vec<(&String, &(u64, u64))> = fleet.sites.iter().collect();
    sites.sort_by(|a, b| b.1.0.cmp(&a.1.0).then_with(|| a.0.cmp(b.0)));
    writeln!(out)?;
    writeln!(
        out,
        "top allocation sites live at each rank's peak allocated, over the job:"
    )?;
    writeln!(
        out,
        "    {:>12} {:>7} {:>7}  site",
        "bytes", "share", "ranks"
    )?;
    for (site, (b, n)) in sites.iter().take(TOP_SITES) {
        writeln!(
            out,
            "    {:>12} {:>7} {:>7}  {site}",
            bytes(*b),
            percent(*b, total),
            n
        )?;
    }
    if sites.len() > TOP_SITES {
        writeln!(out, "    ({} other sites)", sites.len() - TOP_SITES)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(rank: i64, peak_reserved: u64) -> RankRow {
        RankRow {
            rank,
            device: 0,
            peak_allocated: peak_reserved,
            peak_allocated_t: 0,
            peak_reserved,
            fragmentation: 0.0,
            ooms: 0,
            step: None,
            top_site: None,
        }
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn outliers_are_far_from_the_median_in_scaled_mads_either_way() {
        let mut rows: Vec<RankRow> = (0..20)
            .map(|r| row(r, 1000 + (r as u64 % 5) * 10))
            .collect();
        rows.push(row(20, 2000));
        rows.push(row(21, 100));
        let (found, m, scale) = outliers(&rows, 3.0);
        assert_eq!(m, 1020.0);
        assert!((scale - 1.4826 * 10.0).abs() < 1e-9, "{scale}");
        let ranks: Vec<i64> = found.iter().map(|(i, _)| rows[*i].rank).collect();
        assert_eq!(ranks, [20, 21], "largest |z| first");
        assert!(found[0].1 > 0.0 && found[1].1 < 0.0);
    }

    #[test]
    fn identical_ranks_have_no_outliers() {
        let mut rows: Vec<RankRow> = (0..10).map(|r| row(r, 1 << 30)).collect();
        assert!(outliers(&rows, 3.0).0.is_empty());
        // Within 1 % of the median: still none, though the MAD is 0.
        rows[3].peak_reserved += (1 << 30) / 200;
        assert!(outliers(&rows, 3.0).0.is_empty());
        rows[4].peak_reserved *= 2;
        assert_eq!(outliers(&rows, 3.0).0.len(), 1);
    }
}
