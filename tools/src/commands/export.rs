//! `cachealloc export TRACE… --format parquet -o DIR`: traces as a Parquet dataset that DuckDB,
//! Spark and Arrow read as one table per kind of row.
//!
//! Each trace (one per rank) becomes `DIR/job=<job>/rank=<rank>/` holding `events.parquet`,
//! `stacks.parquet` and `samples.parquet` ([`tables`] has their schemas; docs/design.md, "The
//! exported dataset", is the reference). Traces are exported one after the other, each in one
//! streaming pass, so memory does not grow with the number of ranks. A trace that is torn (a
//! process killed mid-write) or corrupt is exported up to the tear, and the command says so;
//! one whose first files were rotated away is exported from its oldest remaining file.
//!
//! Ranks are independent: `--jobs` exports several at once, each in one thread, each streaming
//! its own trace, so memory grows with the jobs (each holds one row group of its rank), never
//! with the ranks. Every trace's header is read first, so that a job's name and every rank are
//! known, and two traces of one rank refused, before anything is written.

pub mod column;
mod context;
mod delta;
mod ranks;
pub mod table_file;
pub mod tables;

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use cachealloc_recorder::Record;
use cachealloc_recorder::schema::{FRAME_PYTHON, pool_name};

use crate::walk::{TraceWalk, site, stack_frames};
use crate::{Error, trace_dirs};
use cachealloc_recorder::state::DeviceTotals;
pub use ranks::{RankPlan, for_each_exported, parse_job, plan_ranks};
use tables::{BATCH_ROWS, BlockEvent, EventRow, Events, FrameRow, Samples, Stacks, TableFile};

/// Trace time between derived samples (for traces without stats samples): 100 ms, the
/// recorder's own sampling interval.
pub const DERIVED_SAMPLE_NS: u64 = 100_000_000;

/// The output formats.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Apache Parquet files in a hive-partitioned directory (`job=…/rank=…/`).
    Parquet,
}

/// `cachealloc export`'s arguments.
#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// Trace directories (a directory of per-rank traces stands for all of them).
    #[arg(required = true)]
    pub traces: Vec<PathBuf>,
    /// The output format.
    #[arg(long, value_enum, default_value = "parquet")]
    pub format: Format,
    /// The dataset's root directory (created if missing; a rank already there is replaced).
    #[arg(short, long)]
    pub output: PathBuf,
    /// The job's name, the `job=` partition (default: the host name in the first trace).
    #[arg(long, value_parser = parse_job)]
    pub job: Option<String>,
    /// Traces exported at once, each by one thread holding one row group of its rank in memory
    /// (tens of MB); 0: one per CPU.
    #[arg(short = 'j', long, default_value_t = 0)]
    pub jobs: usize,
}

/// What one trace's export wrote.
#[derive(Debug, Clone, Default)]
pub struct RankExport {
    /// The rank (the trace's `RANK`, else its position among the traces given).
    pub rank: i64,
    /// Its partition directory.
    pub dir: PathBuf,
    /// Rows of `events`.
    pub events: u64,
    /// Rows of `stacks`.
    pub frames: u64,
    /// Rows of `samples`.
    pub samples: u64,
    /// Whether the samples were derived from the events (the trace has none).
    pub derived_samples: bool,
    /// Where reading stopped early (a tear or an undecodable record), if it did.
    pub torn: Option<String>,
    /// The index of the oldest file left (older ones were rotated away).
    pub first_file: u32,
}

/// Run the command.
pub fn run(args: &ExportArgs, out: &mut dyn Write) -> Result<(), Error> {
    let dirs = trace_dirs(&args.traces)?;
    let ranks = plan_ranks(&dirs, args.job.clone(), &args.output)?;
    let jobs = match args.jobs {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let mut events = 0;
    for_each_exported(&ranks, jobs, |plan, r| {
        events += r.events;
        writeln!(
            out,
            "{}: rank {}: {} events, {} stack frames, {} samples{}",
            plan.dir.display(),
            r.rank,
            r.events,
            r.frames,
            r.samples,
            if r.derived_samples {
                " (derived: the trace has no stats samples)"
            } else {
                ""
            }
        )?;
        if r.first_file > 0 {
            writeln!(
                out,
                "  rotated: files before trace-{:06}.cat were rotated away; exported from there",
                r.first_file
            )?;
        }
        if let Some(tear) = &r.torn {
            writeln!(out, "  torn: {tear}; exported up to the tear")?;
        }
        Ok(())
    })?;
    let job = ranks.first().map_or("", |p| p.job.as_str());
    writeln!(
        out,
        "exported {} trace{} ({events} events) to {} (schema version {})",
        dirs.len(),
        if dirs.len() == 1 { "" } else { "s" },
        args.output.join(format!("job={job}")).display(),
        tables::SCHEMA_VERSION
    )?;
    Ok(())
}

/// Export one trace into its partition, replacing what is there.
pub fn export_rank(plan: &RankPlan) -> Result<RankExport, Error> {
    let (dir, part, header) = (&plan.dir, &plan.part, &plan.header);
    std::fs::create_dir_all(part).map_err(|e| format!("{}: {e}", part.display()))?;
    let metadata = vec![
        ("cachealloc.job".to_string(), plan.job.clone()),
        ("cachealloc.rank".to_string(), plan.rank.to_string()),
        ("cachealloc.trace".to_string(), dir.display().to_string()),
        ("cachealloc.host".to_string(), header.host.clone()),
        ("cachealloc.pid".to_string(), header.pid.to_string()),
        (
            "cachealloc.world_size".to_string(),
            header.world_size.to_string(),
        ),
    ];
    let wall = header.wall_clock_base_ns;
    // The export starts without the program's context; a trace that has some is exported again
    // with it, from its first record (see `context`).
    let mut row_context = None;
    let written = loop {
        match write_rank(dir, part, &metadata, wall, row_context.as_mut())? {
            Walked::Done(written) => break written,
            Walked::ContextFound => row_context = Some(context::RowContext::for_trace(dir)?),
        }
    };
    Ok(RankExport {
        rank: plan.rank,
        dir: part.clone(),
        first_file: header.file_index,
        ..written
    })
}

/// How [`write_rank`] ended.
enum Walked {
    /// The rank's files are written (`rank`, `dir` and `first_file` left to the caller).
    Done(RankExport),
    /// Walking without the program's context, it met a context record: the rank must be
    /// written again with it.
    ContextFound,
}

/// Walk the trace in `dir` once and write its three tables into `part`; without `row_context`,
/// stop at the first context record.
fn write_rank(
    dir: &Path,
    part: &Path,
    metadata: &[(String, String)],
    wall: u64,
    mut row_context: Option<&mut context::RowContext>,
) -> Result<Walked, Error> {
    let mut walk = TraceWalk::open(dir)?;
    let create =
        |name: &str, schema, layout| TableFile::create(&part.join(name), schema, layout, metadata);
    let mut events_file = create("events.parquet", Events::schema(), &Events::LAYOUT)?;
    let mut stacks_file = create("stacks.parquet", Stacks::schema(), &Stacks::LAYOUT)?;
    let mut samples_file = create("samples.parquet", Samples::schema(), &Samples::LAYOUT)?;
    let mut events = Events::new(wall);
    let mut stacks = Stacks::new();
    let mut recorded = Samples::new(wall);
    let mut derived = DerivedSamples::new(wall);
    let mut exported_stacks: HashSet<u32> = HashSet::new();
    let mut torn = None;
    // The records are walked borrowed, not moved (`step_ref`): this loop is the export's whole
    // reading cost.
    loop {
        let s = match walk.step_ref() {
            None => break,
            Some(Ok(s)) => s,
            Some(Err(e)) => {
                torn = Some(format!(
                    "an undecodable record after {:.3} s of the trace: {e}",
                    walk.t as f64 / 1e9
                ));
                break;
            }
        };
        if row_context.is_none() && s.record.is_context() {
            return Ok(Walked::ContextFound);
        }
        if let Record::StackDef(def) = s.record
            && exported_stacks.insert(def.id)
        {
            let label = site(s.state, def.id);
            for (depth, f) in stack_frames(s.state, def.id).into_iter().enumerate() {
                stacks.push(&FrameRow {
                    stack_id: def.id,
                    site: &label,
                    depth: depth as u32,
                    frame_id: f.id,
                    kind: if f.kind == FRAME_PYTHON {
                        "python"
                    } else {
                        "native"
                    },
                    name: &f.name,
                    file: &f.file,
                    line: f.line,
                    address: f.address,
                });
            }
            if stacks.len() >= BATCH_ROWS {
                stacks.write_to(&mut stacks_file)?;
            }
        }
        if s.in_checkpoint {
            continue;
        }
        if let Record::StatsSample(x) = s.record {
            recorded.push(
                x.t,
                x.device,
                x.allocated,
                x.reserved,
                Some((x.active, x.requested)),
            );
        } else if let Some(block) = block_event(s.record) {
            let totals = s.state.device_totals(block.device);
            derived.observe(block.t_ns, block.device, totals);
            let (category, module) = match row_context.as_deref_mut() {
                Some(c) => c.of(s.record, s.index, s.state),
                None => (None, None),
            };
            let totals = (totals.allocated, totals.reserved);
            events.push_block(s.index, &block, totals, category, module);
        } else if let Some(mut row) = event_row(s.record) {
            row.seq = s.index;
            if let Some(c) = row_context.as_deref_mut() {
                (row.category, row.module) = c.of(s.record, s.index, s.state);
            }
            if let Some(device) = row.device {
                let totals = s.state.device_totals(device);
                row.allocated = Some(totals.allocated);
                row.reserved = Some(totals.reserved);
                derived.observe(row.t_ns, device, totals);
            }
            events.push(&row);
        }
        if events.len() >= BATCH_ROWS {
            events.write_to(&mut events_file)?;
        }
    }
    if !events.is_empty() {
        events.write_to(&mut events_file)?;
    }
    if !stacks.is_empty() {
        stacks.write_to(&mut stacks_file)?;
    }
    let derived_samples = recorded.is_empty();
    let samples = if derived_samples {
        &mut derived.samples
    } else {
        &mut recorded
    };
    if !samples.is_empty() {
        samples.write_to(&mut samples_file)?;
    }
    if torn.is_none()
        && let Some(t) = walk.tears().first()
    {
        torn = Some(format!(
            "{} at byte {}: {}",
            t.path.display(),
            t.offset,
            t.error
        ));
    }
    let first_file = walk.header.as_ref().map_or(0, |h| h.file_index);
    for file in [&mut events_file, &mut stacks_file, &mut samples_file] {
        file.note(
            "cachealloc.torn",
            torn.clone().unwrap_or_else(|| "no".to_string()),
        );
        file.note("cachealloc.first_file", first_file.to_string());
    }
    samples_file.note(
        "cachealloc.samples",
        if derived_samples {
            format!(
                "derived every {} ms of trace time",
                DERIVED_SAMPLE_NS / 1_000_000
            )
        } else {
            "recorded".to_string()
        },
    );
    Ok(Walked::Done(RankExport {
        events: events_file.close()?,
        frames: stacks_file.close()?,
        samples: samples_file.close()?,
        derived_samples,
        torn,
        ..RankExport::default()
    }))
}

/// The samples derived from the events, for a trace without stats samples: each device's
/// totals after its first event of each [`DERIVED_SAMPLE_NS`] of trace time.
struct DerivedSamples {
    samples: Samples,
    /// Per device ordinal: the trace time of its next sample.
    next: Vec<u64>,
}

impl DerivedSamples {
    fn new(wall: u64) -> Self {
        DerivedSamples {
            samples: Samples::new(wall),
            next: vec![],
        }
    }

    /// An event at `t_ns` left `device` with `totals`.
    #[inline(always)]
    fn observe(&mut self, t_ns: u64, device: u32, totals: DeviceTotals) {
        // (A device ordinal beyond any machine's gets no derived samples.)
        let d = device as usize;
        if d < 1024 && self.next.len() <= d {
            self.next.resize(d + 1, 0);
        }
        if let Some(next) = self.next.get_mut(d)
            && t_ns >= *next
        {
            (self.samples).push(t_ns, device, totals.allocated, totals.reserved, None);
            *next = (t_ns / DERIVED_SAMPLE_NS + 1) * DERIVED_SAMPLE_NS;
        }
    }
}

/// A block's `alloc`, `free` or `free_requested` row, `None` for other records.
#[inline(always)]
fn block_event(record: &Record) -> Option<BlockEvent> {
    Some(match record {
        Record::Alloc(a) => BlockEvent {
            kind: "alloc",
            t_ns: a.t,
            device: a.device,
            stream: a.stream,
            size: a.size,
            requested: Some(a.requested),
            address: a.address,
            stack: a.stack,
            thread: a.thread,
        },
        Record::Free(f) | Record::FreeRequested(f) => BlockEvent {
            kind: if matches!(record, Record::Free(_)) {
                "free"
            } else {
                "free_requested"
            },
            t_ns: f.t,
            device: f.device,
            stream: f.stream,
            size: f.size,
            requested: None,
            address: f.address,
            stack: f.stack,
            thread: f.thread,
        },
        _ => return None,
    })
}

/// The `events` row of a record other than a block's event ([`block_event`]), without its
/// ordinal and device totals; `None` for records that are not events (definitions,
/// checkpoints, samples, drop counts).
fn event_row(record: &Record) -> Option<EventRow<'_>> {
    let row = match record {
        Record::FreeCompleted(f) => EventRow {
            t_ns: f.t,
            kind: "free_completed",
            device: Some(f.device),
            size: Some(f.size),
            address: Some(f.address),
            ..EventRow::default()
        },
        Record::SegmentAlloc(s)
        | Record::SegmentFree(s)
        | Record::SegmentMap(s)
        | Record::SegmentUnmap(s) => EventRow {
            t_ns: s.t,
            kind: match record {
                Record::SegmentAlloc(_) => "segment_alloc",
                Record::SegmentFree(_) => "segment_free",
                Record::SegmentMap(_) => "segment_map",
                _ => "segment_unmap",
            },
            device: Some(s.device),
            pool: Some(pool_name(s.pool)),
            size: Some(s.size),
            address: Some(s.address),
            stack_id: Some(s.stack),
            ..EventRow::default()
        },
        Record::Oom(o) => EventRow {
            t_ns: o.t,
            kind: "oom",
            device: Some(o.device),
            size: Some(o.rounded),
            requested: Some(o.requested),
            stack_id: Some(o.stack),
            thread: Some(o.thread),
            ..EventRow::default()
        },
        Record::StreamCreated(s) | Record::StreamDestroyed(s) => EventRow {
            t_ns: s.t,
            kind: if matches!(record, Record::StreamCreated(_)) {
                "stream_created"
            } else {
                "stream_destroyed"
            },
            device: matches!(record, Record::StreamCreated(_)).then_some(s.device),
            stream: Some(s.stream),
            ..EventRow::default()
        },
        Record::Annotation(a) => EventRow {
            t_ns: a.t,
            kind: "annotation",
            thread: Some(a.thread),
            name: Some(&a.name),
            ..EventRow::default()
        },
        _ => return None,
    };
    Some(row)
}
