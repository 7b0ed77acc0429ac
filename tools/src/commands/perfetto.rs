//! `cachealloc perfetto TRACE -o trace.json`: Chrome trace-event JSON for ui.perfetto.dev or
//! chrome://tracing: counter tracks of allocated, active and reserved bytes per device, and
//! instant events for segment allocations and releases, OOMs and annotations; the program's
//! phases (forward, backward, optimizer step), where the trace has them, as slices on a track.
//!
//! Counters are written when a value changes, at most once per resolution window of trace time
//! per device (the last value of each window is kept): 10 µs, or the trace's duration / 100 000
//! if longer, so that a long trace still loads.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use cachealloc_recorder::Record;
use cachealloc_recorder::schema::{PHASE_NONE, phase_name};
use serde_json::json;

use crate::format::bytes;
use crate::progress::Progress;
use crate::walk::TraceWalk;
use crate::{Error, one_trace};

/// `cachealloc perfetto`'s arguments.
#[derive(clap::Args, Debug)]
pub struct PerfettoArgs {
    /// Trace directory.
    pub trace: PathBuf,
    /// Output JSON.
    #[arg(short, required = true)]
    pub output: PathBuf,
}

/// A counter point: time, and allocated, active and reserved bytes.
type CounterPoint = (u64, [u64; 3]);

/// Finest time between two counter points of one device, in ns.
const COUNTER_RESOLUTION_NS: u64 = 10_000;
/// Most counter points per device.
const COUNTER_POINTS: u64 = 100_000;

/// The track (`tid`) of the program's phases: past any thread number.
const PHASE_TRACK: u64 = 1 << 32;

/// Run the command.
pub fn run(args: &PerfettoArgs, out: &mut dyn Write) -> Result<(), Error> {
    let output = &args.output;
    let dir = one_trace(&args.trace)?;
    let duration = crate::analysis::scan(&dir, &Progress::new("scanning"))?.duration();
    let resolution = COUNTER_RESOLUTION_NS.max(duration / COUNTER_POINTS);
    let file = std::fs::File::create(output)
        .map_err(|e| Error::Message(format!("{}: {e}", output.display())))?;
    let mut w = std::io::BufWriter::new(file);
    let mut walk = TraceWalk::open(&dir)?;
    let progress = Progress::new("converting");
    let mut events = 0u64;
    let mut first = true;
    let mut emit = |w: &mut std::io::BufWriter<std::fs::File>, v: serde_json::Value| {
        let sep = if first { "" } else { ",\n" };
        first = false;
        events += 1;
        write!(w, "{sep}")?;
        serde_json::to_writer(&mut *w, &v).map_err(std::io::Error::other)
    };
    writeln!(w, "{{\"displayTimeUnit\":\"ms\",\"traceEvents\":[")?;
    // Per device: when a counter point was last written, and the latest one not yet written.
    let mut last: BTreeMap<u32, (u64, Option<CounterPoint>)> = BTreeMap::new();
    let mut pid = 0;
    let us = |t: u64| t as f64 / 1000.0;
    let counter = |pid: u32, device: u32, t: u64, v: [u64; 3]| {
        json!({"name": format!("device {device} memory"), "ph": "C", "ts": us(t), "pid": pid,
               "args": {"allocated": v[0], "active": v[1], "reserved": v[2]}})
    };
    // The phase slice open on the phases' track (`Some(None)`: the track exists, no slice open).
    let mut open_phase: Option<Option<u8>> = None;
    while let Some(step) = walk.step() {
        let step = step?;
        if step.index % 65536 == 0 {
            progress.tick(step.index);
        }
        if let Record::Header(h) = &step.record
            && pid == 0
        {
            pid = h.pid;
            let name = format!("{} (pid {} on {})", h.cmdline.join(" "), h.pid, h.host);
            emit(
                &mut w,
                json!({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}),
            )?;
        }
        if step.in_checkpoint {
            continue;
        }
        let Some(t) = step.record.time() else {
            continue;
        };
        match &step.record {
            Record::SegmentAlloc(s)
            | Record::SegmentFree(s)
            | Record::SegmentMap(s)
            | Record::SegmentUnmap(s) => {
                let what = match step.record {
                    Record::SegmentAlloc(_) => "segment_alloc",
                    Record::SegmentFree(_) => "segment_free",
                    Record::SegmentMap(_) => "segment_map",
                    _ => "segment_unmap",
                };
                emit(
                    &mut w,
                    json!({"name": format!("{what} {}", bytes(s.size)), "ph": "i", "s": "p",
                           "ts": us(t), "pid": pid, "tid": s.device,
                           "args": {"address": format!("{:#x}", s.address), "size": s.size}}),
                )?;
            }
            Record::Oom(o) => emit(
                &mut w,
                json!({"name": format!("OOM: {} requested", bytes(o.requested)), "ph": "i",
                       "s": "g", "ts": us(t), "pid": pid, "tid": o.device,
                       "args": {"requested": o.requested, "allocated": o.allocated,
                                "reserved": o.reserved, "device_free": o.device_free}}),
            )?,
            Record::Annotation(a) => emit(
                &mut w,
                json!({"name": a.name, "ph": "i", "s": "g", "ts": us(t), "pid": pid,
                       "tid": a.thread}),
            )?,
            // The program's phases as slices on a track of their own.
            Record::Phase(p) => {
                if open_phase.is_none() {
                    emit(
                        &mut w,
                        json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": PHASE_TRACK,
                               "args": {"name": "phases"}}),
                    )?;
                }
                if let Some(Some(_)) = open_phase {
                    emit(
                        &mut w,
                        json!({"ph": "E", "ts": us(t), "pid": pid, "tid": PHASE_TRACK}),
                    )?;
                }
                open_phase = Some((p.phase != PHASE_NONE).then_some(p.phase));
                if p.phase != PHASE_NONE {
                    emit(
                        &mut w,
                        json!({"name": format!("{} (step {})", phase_name(p.phase), p.step),
                               "ph": "B", "ts": us(t), "pid": pid, "tid": PHASE_TRACK}),
                    )?;
                }
            }
            _ => {}
        }
        let Some(device) = step.record.device() else {
            continue;
        };
        let totals = walk.state.device_totals(device);
        let values = [totals.allocated, totals.active, totals.reserved];
        let entry = last.entry(device).or_insert((0, None));
        if t >= entry.0 + resolution || entry.0 == 0 {
            if let Some((pt, pv)) = entry.1.take() {
                emit(&mut w, counter(pid, device, pt, pv))?;
            }
            emit(&mut w, counter(pid, device, t, values))?;
            entry.0 = t.max(1);
        } else {
            entry.1 = Some((t, values));
        }
    }
    for (device, (_, pending)) in last {
        if let Some((t, v)) = pending {
            emit(&mut w, counter(pid, device, t, v))?;
        }
    }
    if let Some(Some(_)) = open_phase {
        emit(
            &mut w,
            json!({"ph": "E", "ts": us(walk.t), "pid": pid, "tid": PHASE_TRACK}),
        )?;
    }
    write!(w, "\n]}}\n")?;
    w.flush()?;
    writeln!(out, "wrote {} ({events} trace events)", output.display())?;
    Ok(())
}
