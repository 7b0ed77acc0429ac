//! `cachealloc compare A [B] -o out.svg`: a differential flamegraph of allocated memory — two
//! times of one trace (`--from`, `--to`), or the peaks of two traces. Frames are colored by how
//! their bytes changed from the first to the second (red grew, blue shrank); widths are the
//! second's. With `--categories`, a table instead: allocated bytes by category at each moment
//! (`crate::categories`) and the difference.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::{When, resolve_when, walk_to};
use crate::categories::pass::{Plan, run as categories};
use crate::categories::{ByCategory, Category};
use crate::commands::flamegraph::{Kind, folded, options, write_svg};
use crate::format::parse_time;
use crate::format::{bytes, percent};
use crate::progress::Progress;
use crate::{Error, one_trace};

/// `cachealloc compare`'s arguments.
#[derive(clap::Args, Debug)]
pub struct CompareArgs {
    /// The "before" trace directory.
    pub a: PathBuf,
    /// The "after" trace directory (default: A again, at --to).
    pub b: Option<PathBuf>,
    /// With one trace: the earlier time.
    #[arg(long, value_parser = parse_time)]
    pub from: Option<u64>,
    /// With one trace: the later time.
    #[arg(long, value_parser = parse_time)]
    pub to: Option<u64>,
    /// Output SVG.
    #[arg(short, required_unless_present = "categories")]
    pub output: Option<PathBuf>,
    /// Print allocated bytes by category at each moment and the difference (no SVG).
    #[arg(long)]
    pub categories: bool,
}

/// Run the command.
pub fn run(args: &CompareArgs, out: &mut dyn Write) -> Result<(), Error> {
    let (a, b, from, to, output) = (&args.a, &args.b, args.from, args.to, args.output.as_ref());
    let (before_dir, after_dir, before_when, after_when) = match b {
        Some(b) => (
            one_trace(a)?,
            one_trace(b)?,
            When {
                at: from,
                at_peak: from.is_none(),
            },
            When {
                at: to,
                at_peak: to.is_none(),
            },
        ),
        None => {
            let (Some(_), Some(_)) = (from, to) else {
                return Err(Error::Message(
                    "compare with one trace needs --from and --to (or give two traces)".into(),
                ));
            };
            let dir = one_trace(a)?;
            (
                dir.clone(),
                dir,
                When {
                    at: from,
                    at_peak: false,
                },
                When {
                    at: to,
                    at_peak: false,
                },
            )
        }
    };
    if args.categories {
        return by_category((&before_dir, &before_when), (&after_dir, &after_when), out);
    }
    let Some(output) = output else {
        return Err(Error::Message(
            "compare needs -o OUTPUT.svg (or --categories)".into(),
        ));
    };
    let (before, before_label) = walk_to(&before_dir, &before_when)?;
    let (after, after_label) = walk_to(&after_dir, &after_when)?;
    let before = folded(&before.state, Kind::Memory).join("\n");
    let after = folded(&after.state, Kind::Memory).join("\n");
    let mut diff = vec![];
    inferno::differential::from_readers(
        inferno::differential::Options::default(),
        before.as_bytes(),
        after.as_bytes(),
        &mut diff,
    )
    .map_err(|e| Error::Message(format!("differential: {e}")))?;
    let diff = String::from_utf8_lossy(&diff);
    let lines: Vec<String> = diff.lines().map(str::to_string).collect();
    let title = format!("allocated memory: {after_label} against {before_label}");
    write_svg(&lines, options(title, Kind::Memory), output)?;
    writeln!(
        out,
        "wrote {} ({} stacks; {after_label} against {before_label})",
        output.display(),
        lines.len()
    )?;
    Ok(())
}

/// Allocated bytes by category at a moment of a trace, a label for the moment, and whether the
/// trace has context records.
fn composition(dir: &Path, when: &When) -> Result<(ByCategory, String, bool), Error> {
    if when.at_peak {
        // The peak is found in the pass itself: one walk.
        let plan = Plan {
            peaks: true,
            ..Plan::default()
        };
        let outcome = categories(dir, &plan, &Progress::new("categories"), |_, _| {})?;
        let Some((device, peak)) = outcome
            .peaks
            .iter()
            .max_by_key(|(d, row)| (row.allocated, std::cmp::Reverse(**d)))
        else {
            return Err(Error::Message(format!(
                "{}: the trace has no allocations",
                dir.display()
            )));
        };
        let label = format!(
            "peak allocated of device {device}: {} at {}",
            bytes(peak.allocated),
            crate::format::seconds(peak.t)
        );
        let by_category = outcome
            .at_instant
            .get(device)
            .map_or([0; 8], |c| c.by_category);
        return Ok((by_category, label, outcome.has_context));
    }
    let (index, label) = resolve_when(dir, when)?;
    // Every device's composition at that moment; the one with the most allocated is shown.
    let plan = Plan {
        instants: (0..MAX_DEVICES).map(|d| (d, index)).collect(),
        ..Plan::default()
    };
    let mut allocated = BTreeMap::new();
    let outcome = categories(dir, &plan, &Progress::new("categories"), |walk, step| {
        if step.index == index {
            allocated = walk
                .state
                .totals
                .iter()
                .map(|(d, t)| (*d, t.allocated))
                .collect();
        }
    })?;
    let Some((&device, _)) = allocated
        .iter()
        .max_by_key(|(d, b)| (**b, std::cmp::Reverse(**d)))
    else {
        return Ok(([0; 8], label, outcome.has_context));
    };
    let by_category = outcome
        .at_instant
        .get(&device)
        .map_or([0; 8], |c| c.by_category);
    Ok((
        by_category,
        format!("{label}, device {device}"),
        outcome.has_context,
    ))
}

/// Devices looked at (ordinals below this).
const MAX_DEVICES: u32 = 64;

/// `--categories`: the table of bytes by category at both moments and the difference.
fn by_category(
    (a_dir, a_when): (&Path, &When),
    (b_dir, b_when): (&Path, &When),
    out: &mut dyn Write,
) -> Result<(), Error> {
    let (a, a_label, a_context) = composition(a_dir, a_when)?;
    let (b, b_label, b_context) = composition(b_dir, b_when)?;
    writeln!(out, "A: {} ({a_label})", a_dir.display())?;
    writeln!(out, "B: {} ({b_label})", b_dir.display())?;
    if !a_context || !b_context {
        writeln!(
            out,
            "(a trace without context records has every byte in UNKNOWN)"
        )?;
    }
    let (a_total, b_total): (u64, u64) = (a.iter().sum(), b.iter().sum());
    writeln!(
        out,
        "{:<16} {:>12} {:>7} {:>12} {:>7} {:>13}",
        "category", "A", "share", "B", "share", "B - A"
    )?;
    let row = |name: &str, x: u64, y: u64, out: &mut dyn Write| -> Result<(), Error> {
        let sign = if y >= x { "+" } else { "-" };
        writeln!(
            out,
            "{name:<16} {:>12} {:>7} {:>12} {:>7} {:>13}",
            bytes(x),
            percent(x, a_total),
            bytes(y),
            percent(y, b_total),
            format!("{sign}{}", bytes(y.abs_diff(x)))
        )?;
        Ok(())
    };
    for c in Category::ALL {
        let (x, y) = (a[c.index()], b[c.index()]);
        if x > 0 || y > 0 {
            row(c.name(), x, y, out)?;
        }
    }
    row("total", a_total, b_total, out)
}
