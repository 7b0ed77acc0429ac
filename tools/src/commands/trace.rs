//! `cachealloc trace TRACE`: the events, one per line, optionally within a time window and for
//! one device, optionally with each allocation's stack; the program's phases, module scopes
//! (with their names) and category tags where the trace has them.

use std::io::Write;
use std::path::PathBuf;

use cachealloc_recorder::Record;

use crate::categories::rules::tagged;
use crate::format::bytes;
use crate::format::parse_time;
use crate::walk::{TraceWalk, frame_label, site, stack_frames};
use crate::{Error, one_trace};

/// `cachealloc trace`'s arguments.
#[derive(clap::Args, Debug)]
pub struct TraceArgs {
    /// Trace directory.
    pub trace: PathBuf,
    /// From this time (default: the start).
    #[arg(long, value_parser = parse_time)]
    pub from: Option<u64>,
    /// To this time (default: the end).
    #[arg(long, value_parser = parse_time)]
    pub to: Option<u64>,
    /// Only this device's events.
    #[arg(long)]
    pub device: Option<u32>,
    /// Print each allocation's stack under it.
    #[arg(long)]
    pub stacks: bool,
}

/// One event as a line (`None` for records that are not events: definitions, checkpoints).
pub fn describe(record: &Record) -> Option<String> {
    Some(match record {
        Record::Alloc(a) => format!(
            "alloc          {:#014x} {:>10} (requested {}) stream {} thread {}",
            a.address,
            bytes(a.size),
            a.requested,
            a.stream,
            a.thread
        ),
        Record::FreeRequested(f) => format!(
            "free_requested {:#014x} {:>10} stream {} thread {} (reusable after its fence)",
            f.address,
            bytes(f.size),
            f.stream,
            f.thread
        ),
        Record::Free(f) => format!(
            "free           {:#014x} {:>10} stream {} thread {}",
            f.address,
            bytes(f.size),
            f.stream,
            f.thread
        ),
        Record::FreeCompleted(f) => {
            format!("free_completed {:#014x} {:>10}", f.address, bytes(f.size))
        }
        Record::SegmentAlloc(s) => format!(
            "segment_alloc  {:#014x} {:>10} {} pool",
            s.address,
            bytes(s.size),
            cachealloc_recorder::schema::pool_name(s.pool)
        ),
        Record::SegmentFree(s) => format!(
            "segment_free   {:#014x} {:>10} {} pool",
            s.address,
            bytes(s.size),
            cachealloc_recorder::schema::pool_name(s.pool)
        ),
        Record::SegmentMap(s) => {
            format!("segment_map    {:#014x} {:>10}", s.address, bytes(s.size))
        }
        Record::SegmentUnmap(s) => {
            format!("segment_unmap  {:#014x} {:>10}", s.address, bytes(s.size))
        }
        Record::Oom(o) => format!(
            "oom            requested {} with {} allocated, {} reserved, {} cached free, device free {}",
            bytes(o.requested),
            bytes(o.allocated),
            bytes(o.reserved),
            bytes(o.cached_free),
            bytes(o.device_free)
        ),
        Record::StreamCreated(s) => format!("stream_created {:#x} flags {}", s.stream, s.flags),
        Record::StreamDestroyed(s) => format!("stream_destroyed {:#x}", s.stream),
        Record::Annotation(a) => format!("annotation     {:?} thread {}", a.name, a.thread),
        Record::StatsSample(s) => format!(
            "stats          allocated {} reserved {} active {}",
            bytes(s.allocated),
            bytes(s.reserved),
            bytes(s.active)
        ),
        Record::Dropped(d) => format!(
            "dropped        {} stacks shed, {} blocked sends ({} ns)",
            d.stacks_shed, d.blocked_sends, d.blocked_ns
        ),
        Record::Phase(p) => format!(
            "phase          {} (step {})",
            cachealloc_recorder::schema::phase_name(p.phase),
            p.step
        ),
        Record::Scope(s) if s.scope == 0 => {
            format!("scope          thread {} outside any module", s.thread)
        }
        Record::Scope(s) => format!("scope          thread {} in scope {}", s.thread, s.scope),
        Record::Tag(g) => format!(
            "tag            {:#014x} {}",
            g.address,
            tagged(g.category).map_or_else(|| format!("tag {}", g.category), |c| c.name().into())
        ),
        _ => return None,
    })
}

/// Run the command.
pub fn run(args: &TraceArgs, out: &mut dyn Write) -> Result<(), Error> {
    let &TraceArgs {
        from,
        to,
        device,
        stacks,
        ..
    } = args;
    let dir = one_trace(&args.trace)?;
    let mut walk = TraceWalk::open(&dir)?;
    while let Some(step) = walk.step() {
        let step = step?;
        if step.in_checkpoint {
            continue;
        }
        let Some(t) = step.record.time() else {
            continue;
        };
        if from.is_some_and(|f| t < f) {
            continue;
        }
        if to.is_some_and(|to| t > to) {
            break;
        }
        let dev = step.record.device();
        if device.is_some() && dev.is_some() && dev != device {
            continue;
        }
        let Some(line) = describe(&step.record) else {
            continue;
        };
        let dev = dev.map_or("-".to_string(), |d| d.to_string());
        write!(out, "{:>14.6} s  dev {dev:>2}  {line}", t as f64 / 1e9)?;
        match &step.record {
            Record::Alloc(a) if a.stack != 0 => {
                writeln!(out, "  at {}", site(&walk.state, a.stack))?;
                if stacks {
                    for f in stack_frames(&walk.state, a.stack) {
                        writeln!(out, "{:>24}{}", "", frame_label(f))?;
                    }
                }
            }
            Record::Scope(s) if s.scope != 0 => {
                let name = walk.state.context.scope_names.get(&s.scope);
                writeln!(out, "  {}", name.map_or("(unnamed)", |n| n.name.as_str()))?;
            }
            _ => writeln!(out)?,
        }
    }
    for tear in walk.tears() {
        writeln!(
            out,
            "(torn: {} at byte {}: {}; read up to there)",
            tear.path.display(),
            tear.offset,
            tear.error
        )?;
    }
    Ok(())
}
