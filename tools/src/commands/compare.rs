//! `cachealloc compare A [B] -o out.svg`: a differential flamegraph of allocated memory — two
//! times of one trace (`--from`, `--to`), or the peaks of two traces. Frames are colored by how
//! their bytes changed from the first to the second (red grew, blue shrank); widths are the
//! second's.

use std::io::Write;
use std::path::PathBuf;

use super::{When, walk_to};
use crate::commands::flamegraph::{Kind, folded, options, write_svg};
use crate::format::parse_time;
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
    #[arg(short, required = true)]
    pub output: PathBuf,
}

/// Run the command.
pub fn run(args: &CompareArgs, out: &mut dyn Write) -> Result<(), Error> {
    let (a, b, from, to, output) = (&args.a, &args.b, args.from, args.to, &args.output);
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
