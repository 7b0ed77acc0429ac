//! `summary`'s sections for a trace with context records (phases, module scopes, tags): bytes
//! by category at the peak and over time, the top modules at the peak, and the user's line
//! beside each top allocation site. One categories pass (`crate::categories::pass`) after the
//! scan gives all of it, the sites at the peak included.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

use crate::Error;
use cachealloc_recorder::LiveState;

use crate::analysis::{Scan, Scanner};
use crate::categories::pass::{Composition, Outcome, Plan, run_to_end};
use crate::categories::slices::{SliceRow, SliceSpec};
use crate::categories::{Category, module_prefixes, user_line};
use crate::format::{bytes, percent, seconds};
use crate::progress::Progress;
use crate::walk::site;

/// Rows of the category table over time.
const TIME_SLICES: u64 = 12;
/// Modules listed at the peak.
const TOP_MODULES: usize = 12;

/// A site live at an instant: where it allocated, the user's line of its stack, bytes, blocks.
pub struct SiteBytes {
    /// The innermost Python frame (else native) of its stack.
    pub site: String,
    /// The user's line (`crate::categories::user_line`).
    pub user: Option<String>,
    /// Bytes allocated.
    pub bytes: u64,
    /// Blocks.
    pub blocks: u64,
}

/// What the categories pass found for `summary`.
pub struct Context {
    /// The pass's outcome (each device's peak and what it held, the slices, scope names).
    pub outcome: Outcome,
    /// Per device, the sites live at its peak allocated.
    pub sites: BTreeMap<u32, Vec<SiteBytes>>,
}

/// The scan of `dir` and its categories, in one walk.
pub fn summarize(dir: &Path) -> Result<(Scan, Context), Error> {
    let plan = Plan {
        peaks: true,
        slices: Some(SliceSpec::adaptive(TIME_SLICES)),
        ..Plan::default()
    };
    let mut scanner: Option<Scanner> = None;
    let (outcome, walk) = run_to_end(dir, &plan, &Progress::new("scanning"), |walk, step| {
        scanner
            .get_or_insert_with(|| Scanner::new(walk))
            .step(walk, step);
    })?;
    let scan = scanner.unwrap_or_else(|| Scanner::new(&walk)).finish(&walk);
    let sites = outcome
        .at_instant
        .iter()
        .map(|(device, c)| {
            let sites = sites_of(&walk.state, &c.by_stack, outcome.has_context);
            (*device, sites)
        })
        .collect();
    Ok((scan, Context { outcome, sites }))
}

/// Bytes and blocks by stack as sites (with their user's lines, `user_lines`), largest first.
pub fn sites_of(
    state: &LiveState,
    by_stack: &HashMap<u32, (u64, u64)>,
    user_lines: bool,
) -> Vec<SiteBytes> {
    let mut by_site: HashMap<(String, Option<String>), (u64, u64)> = HashMap::new();
    for (stack, (bytes, blocks)) in by_stack {
        if *blocks == 0 {
            continue;
        }
        let e = by_site
            .entry((
                site(state, *stack),
                user_lines.then(|| user_line(state, *stack)).flatten(),
            ))
            .or_default();
        (e.0, e.1) = (e.0 + bytes, e.1 + blocks);
    }
    let mut sites: Vec<SiteBytes> = by_site
        .into_iter()
        .map(|((site, user), (bytes, blocks))| SiteBytes {
            site,
            user,
            bytes,
            blocks,
        })
        .collect();
    sites.sort_by(|a, b| {
        b.bytes
            .cmp(&a.bytes)
            .then_with(|| (&a.site, &a.user).cmp(&(&b.site, &b.user)))
    });
    sites
}

/// The category lines of `device`: bytes by category at the peak, then over time.
pub fn write_categories(
    context: &Context,
    device: u32,
    peak: u64,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let outcome = &context.outcome;
    let empty = Composition::default();
    let at_peak = outcome.at_instant.get(&device).unwrap_or(&empty);
    writeln!(out, "  by category at peak allocated:")?;
    for c in Category::ALL {
        let b = at_peak.by_category[c.index()];
        if b > 0 {
            writeln!(
                out,
                "    {:<16} {:>12} {:>7}",
                c.name(),
                bytes(b),
                percent(b, peak)
            )?;
        }
    }
    let rows = outcome.slices.get(&device).map_or(&[][..], Vec::as_slice);
    write_over_time(rows, out)?;
    write_modules(outcome, &at_peak.by_scope, peak, out)
}

/// Short column names for the table over time.
fn short_name(c: Category) -> &'static str {
    match c {
        Category::Parameter => "PARAM",
        Category::OptimizerState => "OPT_STATE",
        Category::Input => "INPUT",
        Category::Temporary => "TEMP",
        Category::Activation => "ACTIV",
        Category::Gradient => "GRAD",
        Category::AutogradDetail => "AUTOGRAD",
        Category::Unknown => "UNKNOWN",
    }
}

/// One row per time slice, at its peak: its time, allocated bytes and the categories that hold
/// any bytes in some row.
fn write_over_time(rows: &[SliceRow], out: &mut dyn Write) -> Result<(), Error> {
    // Times in a unit the trace's length can tell apart.
    let end = rows.last().map_or(0, |r| r.t);
    let time = |t: u64| {
        if end >= 10_000_000_000 {
            seconds(t)
        } else if end >= 10_000_000 {
            format!("{:.3} ms", t as f64 / 1e6)
        } else {
            format!("{:.3} µs", t as f64 / 1e3)
        }
    };
    let shown: Vec<Category> = Category::ALL
        .into_iter()
        .filter(|c| rows.iter().any(|r| r.by_category[c.index()] > 0))
        .collect();
    if rows.is_empty() {
        return Ok(());
    }
    writeln!(
        out,
        "  by category over time (each time slice at its peak allocated):"
    )?;
    write!(out, "    {:>12} {:>11}", "peak at", "allocated")?;
    for c in &shown {
        write!(out, " {:>11}", short_name(*c))?;
    }
    writeln!(out)?;
    for r in rows {
        write!(out, "    {:>12} {:>11}", time(r.t), bytes(r.allocated))?;
        for c in &shown {
            write!(out, " {:>11}", bytes(r.by_category[c.index()]))?;
        }
        writeln!(out)?;
    }
    Ok(())
}

/// Bytes by module path, each with its submodules (`inclusive`) and its own.
pub fn module_bytes(outcome: &Outcome, by_scope: &HashMap<u32, u64>) -> Vec<(String, u64, u64)> {
    let mut modules: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for (&scope, &b) in by_scope {
        if scope == 0 || b == 0 {
            continue;
        }
        let name = outcome.scope_name(scope);
        modules.entry(name.clone()).or_default().1 += b;
        for prefix in module_prefixes(&name) {
            modules.entry(prefix.to_string()).or_default().0 += b;
        }
    }
    modules
        .into_iter()
        .map(|(m, (inc, own))| (m, inc, own))
        .collect()
}

/// The top modules at the peak by bytes with their submodules, in path order (a parent above
/// its children, indented), and the bytes allocated outside any module.
fn write_modules(
    outcome: &Outcome,
    by_scope: &HashMap<u32, u64>,
    peak: u64,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let mut modules = module_bytes(outcome, by_scope);
    if modules.is_empty() {
        return Ok(());
    }
    modules.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    modules.truncate(TOP_MODULES);
    modules.sort_by(|a, b| path_order(&a.0).cmp(&path_order(&b.0)));
    writeln!(
        out,
        "  top modules at peak allocated (bytes made inside each, with its submodules):"
    )?;
    writeln!(
        out,
        "    {:>12} {:>7} {:>12}  module",
        "bytes", "share", "own"
    )?;
    for (name, inclusive, own) in &modules {
        let depth = name.matches('.').count();
        writeln!(
            out,
            "    {:>12} {:>7} {:>12}  {}{name}",
            bytes(*inclusive),
            percent(*inclusive, peak),
            bytes(*own),
            "  ".repeat(depth)
        )?;
    }
    let outside = by_scope.get(&0).copied().unwrap_or(0);
    if outside > 0 {
        writeln!(
            out,
            "    {:>12} {:>7} {:>12}  (no module)",
            bytes(outside),
            percent(outside, peak),
            ""
        )?;
    }
    Ok(())
}

/// A module path's sort key: its components, numbers by value (`layers.2` before `layers.10`).
fn path_order(path: &str) -> Vec<(u64, &str)> {
    path.split('.')
        .map(|part| (part.parse::<u64>().unwrap_or(u64::MAX), part))
        .collect()
}
