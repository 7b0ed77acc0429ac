//! `cachealloc plot TRACE... -o report.html`: one self-contained HTML file (data and script
//! inline, no network) with, per trace and device:
//!
//! * allocated memory over time, stacked by allocation site (the top sites at the peak, the rest
//!   as "other"), or, for a trace with context records, by category (PyTorch's memory
//!   profiler's, in its colours: the default for such traces) or by module (`--by module`; the
//!   [`series`] submodule), with reserved memory as a line over it;
//! * OOMs and annotations marked on the time axis;
//! * the segments at a chosen time (click the timeline), each block colored by its site.
//!
//! Size is bounded whatever the trace's length: each timeline is downsampled to `--points`
//! buckets (each showing the moment of its highest allocated memory, and its highest reserved),
//! and segment views are kept for a fixed number of moments with a bounded number of blocks.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use cachealloc_recorder::Record;
use serde::Serialize;

pub mod series;

use crate::analysis::Scanner;
use crate::categories::pass::{Plan, run_to_end};
use crate::categories::slices::SliceSpec;
use crate::commands::summary::context::sites_of;
use crate::format::bytes;
use crate::progress::Progress;
use crate::walk::{TraceWalk, site};
use crate::{Error, trace_dirs};

/// `cachealloc plot`'s arguments.
#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// Trace directories (several: side by side).
    #[arg(required = true)]
    pub traces: Vec<PathBuf>,
    /// Points per timeline (the trace is downsampled to this).
    #[arg(long, default_value_t = 2000)]
    pub points: usize,
    /// What the timeline is stacked by (auto: by category for a trace with context records,
    /// else by site).
    #[arg(long, value_enum, default_value_t = StackBy::Auto)]
    pub by: StackBy,
    /// With `--by module`: module paths are cut to this many components
    /// (`Llama.model.layers.3.mlp` to `Llama.model.layers.3` with 4).
    #[arg(long, default_value_t = 4)]
    pub module_depth: usize,
    /// Output HTML.
    #[arg(short, required = true)]
    pub output: PathBuf,
}

/// What `plot`'s timeline is stacked by.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StackBy {
    /// By category when the trace has context records, else by site.
    Auto,
    /// By allocation site.
    Site,
    /// By category (PARAMETER, ACTIVATION, …).
    Category,
    /// By module (the path cut to `--module-depth` components).
    Module,
}

/// Sites shown by name; the rest are "other".
const TOP_SITES: usize = 12;
/// Moments whose segments are kept (evenly spaced, plus the peak).
const SNAPSHOTS: usize = 40;
/// Blocks kept per segment view.
const SNAPSHOT_BLOCKS: usize = 4000;

#[derive(Serialize, Debug, Default, Clone)]
struct Segment {
    address: String,
    size: u64,
    /// `[offset, size, state (0 allocated, 1 pending free), site index]`.
    blocks: Vec<[u64; 4]>,
}

#[derive(Serialize, Debug, Default, Clone)]
struct Snapshot {
    t: f64,
    segments: Vec<Segment>,
    truncated: bool,
}

#[derive(Serialize, Debug)]
struct Mark {
    t: f64,
    kind: &'static str,
    label: String,
}

#[derive(Serialize, Debug, Default)]
struct Panel {
    name: String,
    total_memory: u64,
    peak_allocated: u64,
    peak_reserved: u64,
    t: Vec<f64>,
    allocated: Vec<u64>,
    reserved: Vec<u64>,
    sites: Vec<String>,
    /// Per point, bytes per site (the last entry is "other"); empty when stacked by series.
    by_site: Vec<Vec<u64>>,
    /// The timeline's series when stacked by category or module (the segments stay colored by
    /// site).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    series: Vec<String>,
    /// The series' colors (by category: PyTorch's), empty for the page's palette.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    series_colors: Vec<String>,
    /// Per point, bytes per series.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    by_series: Vec<Vec<u64>>,
    marks: Vec<Mark>,
    snapshots: Vec<Snapshot>,
}

#[derive(Serialize, Debug)]
struct Report {
    title: String,
    panels: Vec<Panel>,
}

/// One bucket of a timeline being built.
#[derive(Debug, Default, Clone)]
struct Bucket {
    t: u64,
    allocated: u64,
    reserved: u64,
    by_site: Vec<u64>,
}

/// A device's timeline being built.
#[derive(Debug)]
struct Builder {
    sites: Vec<String>,
    site_of_stack: HashMap<u32, usize>,
    current: Vec<u64>,
    bucket: Option<(u64, Bucket)>,
    snapshot_at: Vec<u64>,
    panel: Panel,
}

impl Builder {
    fn site_index(&mut self, walk: &TraceWalk, stack: u32) -> usize {
        if let Some(&i) = self.site_of_stack.get(&stack) {
            return i;
        }
        let name = site(&walk.state, stack);
        let i = self
            .sites
            .iter()
            .position(|s| *s == name)
            .unwrap_or(self.sites.len());
        self.site_of_stack.insert(stack, i);
        i
    }

    fn flush(&mut self) {
        if let Some((_, b)) = self.bucket.take() {
            self.panel.t.push(b.t as f64 / 1e9);
            self.panel.allocated.push(b.allocated);
            self.panel.reserved.push(b.reserved);
            self.panel.by_site.push(b.by_site);
        }
    }
}

fn snapshot(walk: &TraceWalk, device: u32, b: &mut Builder) -> Snapshot {
    let state = &walk.state;
    let mut out = Snapshot {
        t: walk.t as f64 / 1e9,
        ..Snapshot::default()
    };
    let mut kept = 0;
    let blocks = state.blocks.ordered();
    for seg in state
        .segments
        .range((device, 0)..=(device, u64::MAX))
        .map(|(_, s)| *s)
    {
        let mut segment = Segment {
            address: format!("{:#x}", seg.address),
            size: seg.size,
            blocks: vec![],
        };
        for blk in blocks.range(device, seg.address, seg.address + seg.size) {
            if kept >= SNAPSHOT_BLOCKS {
                out.truncated = true;
                break;
            }
            kept += 1;
            let site = b.site_index(walk, blk.stack) as u64;
            segment.blocks.push([
                blk.address - seg.address,
                blk.size,
                u64::from(blk.pending != 0),
                site,
            ]);
        }
        out.segments.push(segment);
    }
    out
}

fn panels_of(dir: &Path, points: usize, args: &PlotArgs) -> Result<Vec<Panel>, Error> {
    // One walk for the scan, each device's peak with what it held, and the timelines by
    // category or module; a second draws the timeline by site and the segment views.
    let plan = Plan {
        peaks: true,
        slices: (args.by != StackBy::Site).then(|| SliceSpec::adaptive(points as u64)),
        slices_by_scope: args.by == StackBy::Module,
        ..Plan::default()
    };
    let mut scanner: Option<Scanner> = None;
    let (outcome, end) = run_to_end(dir, &plan, &Progress::new("scanning"), |walk, step| {
        scanner
            .get_or_insert_with(|| Scanner::new(walk))
            .step(walk, step);
    })?;
    let scan = scanner.unwrap_or_else(|| Scanner::new(&end)).finish(&end);
    let by_series = match args.by {
        StackBy::Site => None,
        _ if !outcome.has_context => None,
        by => Some(series::timelines(
            &outcome,
            by == StackBy::Module,
            args.module_depth,
        )),
    };
    let (t0, t1) = scan.span;
    let width = ((t1 - t0) / points.max(1) as u64).max(1);
    let mut builders: HashMap<u32, Builder> = HashMap::new();
    for (&device, d) in &scan.devices {
        // The top sites: those holding the most at this device's peak.
        let by_stack = outcome.at_instant.get(&device).map(|c| &c.by_stack);
        let mut sites: Vec<String> = by_stack
            .map(|b| sites_of(&end.state, b, false))
            .unwrap_or_default()
            .into_iter()
            .take(TOP_SITES)
            .map(|s| s.site)
            .collect();
        sites.sort();
        let name = dir.file_name().unwrap_or_default().to_string_lossy();
        let total_memory = scan
            .header
            .as_ref()
            .and_then(|h| h.devices.iter().find(|i| i.index == device))
            .map_or(0, |i| i.total_memory);
        let mut snapshot_at: Vec<u64> = (0..SNAPSHOTS as u64)
            .map(|i| t0 + (t1 - t0) * (i + 1) / SNAPSHOTS as u64)
            .collect();
        snapshot_at.push(d.peak_allocated.t);
        snapshot_at.sort();
        builders.insert(
            device,
            Builder {
                current: vec![0; sites.len() + 1],
                sites,
                site_of_stack: HashMap::new(),
                bucket: None,
                snapshot_at,
                panel: Panel {
                    name: format!("{name} device {device}"),
                    total_memory,
                    peak_allocated: d.peak_allocated.bytes,
                    peak_reserved: d.peak_reserved.bytes,
                    ..Panel::default()
                },
            },
        );
    }
    for o in &scan.ooms {
        if let Some(b) = builders.get_mut(&o.device) {
            b.panel.marks.push(Mark {
                t: o.t as f64 / 1e9,
                kind: "oom",
                label: format!("OOM: {} requested", bytes(o.requested)),
            });
        }
    }
    for b in builders.values_mut() {
        for a in &scan.annotations {
            b.panel.marks.push(Mark {
                t: a.t as f64 / 1e9,
                kind: "annotation",
                label: a.name.clone(),
            });
        }
    }
    // Allocated blocks: (device, address) → (site index, size).
    let mut live: HashMap<(u32, u64), (usize, u64)> = HashMap::new();
    let mut walk = TraceWalk::open(dir)?;
    let progress = Progress::new("plotting");
    while let Some(step) = walk.step() {
        let step = step?;
        if step.index % 65536 == 0 {
            progress.tick(step.index);
        }
        if let Record::CheckpointEnd(_) = step.record {
            // (Re)build the per-site bytes from the checkpoint's state.
            live.clear();
            for b in builders.values_mut() {
                b.current.iter_mut().for_each(|v| *v = 0);
            }
            for blk in walk.state.blocks.values().filter(|b| b.pending == 0) {
                if let Some(b) = builders.get_mut(&blk.device) {
                    let i = b.site_index(&walk, blk.stack);
                    b.current[i] += blk.size;
                    live.insert((blk.device, blk.address), (i, blk.size));
                }
            }
            continue;
        }
        if step.in_checkpoint {
            continue;
        }
        let (Some(device), Some(t)) = (step.record.device(), step.record.time()) else {
            continue;
        };
        let Some(b) = builders.get_mut(&device) else {
            continue;
        };
        match &step.record {
            Record::Alloc(a) => {
                let i = b.site_index(&walk, a.stack);
                b.current[i] += a.size;
                live.insert((device, a.address), (i, a.size));
            }
            Record::FreeRequested(f) | Record::Free(f) => {
                if let Some((i, size)) = live.remove(&(device, f.address)) {
                    b.current[i] -= size;
                }
            }
            _ => {}
        }
        let totals = walk.state.device_totals(device);
        let index = (t.saturating_sub(t0)) / width;
        if b.bucket.as_ref().is_some_and(|(i, _)| *i != index) {
            b.flush();
        }
        let bucket = &mut b
            .bucket
            .get_or_insert_with(|| {
                (
                    index,
                    Bucket {
                        t,
                        ..Bucket::default()
                    },
                )
            })
            .1;
        if totals.allocated >= bucket.allocated || bucket.by_site.is_empty() {
            bucket.t = t;
            bucket.allocated = totals.allocated;
            bucket.by_site.clone_from(&b.current);
        }
        bucket.reserved = bucket.reserved.max(totals.reserved);
        while b.snapshot_at.first().is_some_and(|&at| at <= t) {
            b.snapshot_at.remove(0);
            let s = snapshot(&walk, device, b);
            b.panel.snapshots.push(s);
        }
    }
    let mut panels = vec![];
    let mut devices: Vec<u32> = builders.keys().copied().collect();
    devices.sort();
    for device in devices {
        let mut b = builders.remove(&device).expect("present");
        b.flush();
        if !b.snapshot_at.is_empty() {
            let s = snapshot(&walk, device, &mut b);
            b.panel.snapshots.push(s);
        }
        b.panel.sites = b.sites.clone();
        b.panel.sites.push("other".into());
        if let Some(s) = by_series.as_ref().and_then(|all| all.get(&device)) {
            let p = &mut b.panel;
            (p.t, p.allocated, p.reserved) = (s.t.clone(), s.allocated.clone(), s.reserved.clone());
            (p.series, p.series_colors) = (s.names.clone(), s.colors.clone());
            p.by_series = s.values.clone();
            p.by_site.clear();
        }
        panels.push(b.panel);
    }
    Ok(panels)
}

/// Run the command.
pub fn run(args: &PlotArgs, out: &mut dyn Write) -> Result<(), Error> {
    let (points, output) = (args.points, &args.output);
    let dirs = trace_dirs(&args.traces)?;
    let mut panels = vec![];
    for dir in &dirs {
        panels.extend(panels_of(dir, points.clamp(10, 100_000), args)?);
    }
    let title = dirs
        .iter()
        .map(|d| {
            d.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        })
        .collect::<Vec<_>>()
        .join(", ");
    let report = Report {
        title: format!("cachealloc: {title}"),
        panels,
    };
    // `</` never appears inside the inline JSON, so it cannot close the script element.
    let data = serde_json::to_string(&report)
        .map_err(std::io::Error::other)?
        .replace("</", "<\\/");
    let html = TEMPLATE
        .replace("/*TITLE*/", &html_escape(&report.title))
        .replace("/*DATA*/null", &data);
    std::fs::write(output, &html)
        .map_err(|e| Error::Message(format!("{}: {e}", output.display())))?;
    writeln!(
        out,
        "wrote {} ({} panel{}, {})",
        output.display(),
        report.panels.len(),
        if report.panels.len() == 1 { "" } else { "s" },
        bytes(html.len() as u64)
    )?;
    Ok(())
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The page: styles, markup and script, with the data spliced in at `/*DATA*/`.
const TEMPLATE: &str = include_str!("plot.html");
