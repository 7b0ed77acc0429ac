//! `cachealloc flamegraph TRACE --kind memory|segments -o out.svg`: live memory (or reserved
//! segments) at a moment as a flamegraph, made in-process with `inferno`.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use cachealloc_recorder::LiveState;

use super::{When, walk_to};
use crate::format::bytes;
use crate::walk::{frame_label, stack_frames};
use crate::{Error, one_trace};

/// `cachealloc flamegraph`'s arguments.
#[derive(clap::Args, Debug)]
pub struct FlamegraphArgs {
    /// Trace directory.
    pub trace: PathBuf,
    /// What to weigh.
    #[arg(long, value_enum, default_value_t = Kind::Memory)]
    pub kind: Kind,
    #[allow(missing_docs)] // clap would show a doc comment here as a help heading
    #[command(flatten)]
    pub when: When,
    /// Output SVG.
    #[arg(short, required = true)]
    pub output: PathBuf,
}

/// What a flamegraph weighs.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Allocated blocks, by the stack that allocated them.
    Memory,
    /// Reserved segments, by the stack whose allocation created them.
    Segments,
}

/// Folded stacks (`device N;outermost;…;innermost bytes`), one line per distinct stack.
pub fn folded(state: &LiveState, kind: Kind) -> Vec<String> {
    let mut weights: HashMap<(u32, u32), u64> = HashMap::new();
    match kind {
        Kind::Memory => {
            for b in state.blocks.values().filter(|b| b.pending == 0) {
                *weights.entry((b.device, b.stack)).or_default() += b.size;
            }
        }
        Kind::Segments => {
            for s in state.segments.values() {
                *weights.entry((s.device, s.stack)).or_default() += s.size;
            }
        }
    }
    let mut lines: Vec<String> = weights
        .into_iter()
        .map(|((device, stack), weight)| {
            let mut path = vec![format!("device {device}")];
            let frames = stack_frames(state, stack);
            if frames.is_empty() {
                path.push("(no stack)".into());
            }
            // Folded stacks go root first; ours are innermost first. ';' separates frames.
            path.extend(
                frames
                    .iter()
                    .rev()
                    .map(|f| frame_label(f).replace(';', ",")),
            );
            format!("{} {weight}", path.join(";"))
        })
        .collect();
    lines.sort();
    lines
}

/// Options shared by every flamegraph we draw.
pub fn options(title: String, kind: Kind) -> inferno::flamegraph::Options<'static> {
    let mut options = inferno::flamegraph::Options::default();
    options.title = title;
    options.count_name = "bytes".into();
    options.name_type = "Frame:".into();
    options.colors = inferno::flamegraph::color::Palette::Basic(match kind {
        Kind::Memory => inferno::flamegraph::color::BasicPalette::Mem,
        Kind::Segments => inferno::flamegraph::color::BasicPalette::Io,
    });
    options
}

/// Write `lines` as an SVG flamegraph to `output`.
pub fn write_svg(
    lines: &[String],
    mut options: inferno::flamegraph::Options<'_>,
    output: &Path,
) -> Result<(), Error> {
    let file = std::fs::File::create(output)
        .map_err(|e| Error::Message(format!("{}: {e}", output.display())))?;
    let mut writer = std::io::BufWriter::new(file);
    let width: u64 = lines
        .iter()
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    if width == 0 {
        // inferno refuses empty input; an empty picture says "nothing live" plainly.
        let empty = [String::from("(nothing live) 1")];
        inferno::flamegraph::from_lines(&mut options, empty.iter().map(String::as_str), &mut writer)
    } else {
        inferno::flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), &mut writer)
    }
    .map_err(|e| Error::Message(format!("{}: {e}", output.display())))?;
    writer.flush()?;
    Ok(())
}

/// Run the command.
pub fn run(args: &FlamegraphArgs, out: &mut dyn Write) -> Result<(), Error> {
    let (kind, output) = (args.kind, &args.output);
    let dir = one_trace(&args.trace)?;
    let (walk, label) = walk_to(&dir, &args.when)?;
    let lines = folded(&walk.state, kind);
    let total: u64 = lines
        .iter()
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    let what = match kind {
        Kind::Memory => "allocated memory",
        Kind::Segments => "reserved segments",
    };
    write_svg(&lines, options(format!("{what}, {label}"), kind), output)?;
    writeln!(
        out,
        "wrote {} ({what} {label}: {} in {} stacks)",
        output.display(),
        bytes(total),
        lines.len()
    )?;
    Ok(())
}
