//! One pass over a trace: per-device peaks (with when they happened), counts, OOMs, drops and
//! annotations — what `summary`, `peak`, `plot` and `simulate` start from.

use std::collections::BTreeMap;
use std::path::Path;

use cachealloc_recorder::Record;
use cachealloc_recorder::schema::{Annotation, Header, Oom};

use crate::progress::Progress;
use crate::walk::{Step, TraceWalk};

/// A maximum and when it was reached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Peak {
    /// Bytes.
    pub bytes: u64,
    /// Time, ns since the trace's base.
    pub t: u64,
    /// Ordinal of the record after which it was reached.
    pub index: u64,
}

/// What one device went through.
#[derive(Debug, Clone, Default)]
pub struct DeviceScan {
    /// Peak allocated bytes.
    pub peak_allocated: Peak,
    /// Peak reserved bytes.
    pub peak_reserved: Peak,
    /// The most bytes allocated while reserved was at its peak.
    pub allocated_at_peak_reserved: u64,
    /// Allocations.
    pub allocs: u64,
    /// Frees requested (immediate or fenced).
    pub frees: u64,
    /// Segments allocated on the device.
    pub segment_allocs: u64,
    /// Segments released.
    pub segment_frees: u64,
    /// Bytes requested over the run.
    pub requested_bytes: u64,
    /// Allocated bytes at the end.
    pub allocated_at_end: u64,
    /// Reserved bytes at the end.
    pub reserved_at_end: u64,
}

/// A whole-trace scan.
#[derive(Debug, Clone, Default)]
pub struct Scan {
    /// The first header.
    pub header: Option<Header>,
    /// Number of trace files.
    pub files: usize,
    /// Per device.
    pub devices: BTreeMap<u32, DeviceScan>,
    /// Out-of-memory events, in order.
    pub ooms: Vec<Oom>,
    /// Annotations, in order.
    pub annotations: Vec<Annotation>,
    /// Stacks shed under overload (latest cumulative count).
    pub stacks_shed: u64,
    /// Sends that blocked on a full channel, and for how long (ns).
    pub blocked_sends: (u64, u64),
    /// Time of the first and last event.
    pub span: (u64, u64),
    /// Records read.
    pub records: u64,
    /// Where files stopped being readable.
    pub tears: Vec<String>,
    /// Whether the trace has context records (phases, module scopes, category tags): what
    /// `cachealloc_tools::categories` needs.
    pub has_context: bool,
}

impl Scan {
    /// Duration between the first and the last event, in ns.
    pub fn duration(&self) -> u64 {
        self.span.1.saturating_sub(self.span.0)
    }
}

/// Scan `dir` from start to end.
pub fn scan(dir: &Path, progress: &Progress) -> Result<Scan, String> {
    let mut walk = TraceWalk::open(dir)?;
    let mut scanner = Scanner::new(&walk);
    while let Some(step) = walk.step() {
        let step = step?;
        scanner.step(&walk, &step);
        if scanner.out.records.is_multiple_of(65536) {
            progress.tick(scanner.out.records);
        }
    }
    Ok(scanner.finish(&walk))
}

/// A scan being made, one record at a time: for a pass that does more in the same walk
/// (`crate::categories::pass`), [`scan`] otherwise.
#[derive(Debug)]
pub struct Scanner {
    out: Scan,
}

impl Scanner {
    /// A scan of the trace `walk` is about to walk.
    pub fn new(walk: &TraceWalk) -> Scanner {
        Scanner {
            out: Scan {
                files: walk.file_count(),
                span: (u64::MAX, 0),
                ..Scan::default()
            },
        }
    }

    /// Records scanned so far.
    pub fn records(&self) -> u64 {
        self.out.records
    }

    /// Scan the record `step` (already applied to `walk.state`).
    pub fn step(&mut self, walk: &TraceWalk, step: &Step) {
        let out = &mut self.out;
        out.records += 1;
        if step.record.is_context() {
            out.has_context = true;
        }
        if step.in_checkpoint {
            return;
        }
        if let Some(t) = step.record.time() {
            out.span.0 = out.span.0.min(t);
            out.span.1 = out.span.1.max(t);
        }
        let Some(device) = step.record.device() else {
            match &step.record {
                Record::Annotation(a) => out.annotations.push((**a).clone()),
                Record::Dropped(d) => {
                    out.stacks_shed = out.stacks_shed.max(d.stacks_shed);
                    out.blocked_sends = (
                        out.blocked_sends.0.max(d.blocked_sends),
                        out.blocked_sends.1.max(d.blocked_ns),
                    );
                }
                _ => {}
            }
            return;
        };
        let d = out.devices.entry(device).or_default();
        match &step.record {
            Record::Alloc(a) => {
                d.allocs += 1;
                d.requested_bytes += a.requested;
            }
            Record::FreeRequested(_) | Record::Free(_) => d.frees += 1,
            // A map into an expandable segment is a device allocation too (PyTorch counts it
            // in `num_device_alloc`), an unmap a release.
            Record::SegmentAlloc(_) | Record::SegmentMap(_) => d.segment_allocs += 1,
            Record::SegmentFree(_) | Record::SegmentUnmap(_) => d.segment_frees += 1,
            Record::Oom(o) => out.ooms.push(**o),
            _ => {}
        }
        let totals = walk.state.device_totals(device);
        let here = |bytes| Peak {
            bytes,
            t: walk.t,
            index: step.index,
        };
        if totals.allocated > d.peak_allocated.bytes {
            d.peak_allocated = here(totals.allocated);
        }
        if totals.reserved > d.peak_reserved.bytes {
            d.peak_reserved = here(totals.reserved);
            d.allocated_at_peak_reserved = totals.allocated;
        } else if totals.reserved == d.peak_reserved.bytes {
            // Fragmentation at the peak is judged by the fullest moment at that reservation.
            d.allocated_at_peak_reserved = d.allocated_at_peak_reserved.max(totals.allocated);
        }
    }

    /// The scan, once `walk` has ended.
    pub fn finish(self, walk: &TraceWalk) -> Scan {
        let mut out = self.out;
        for (device, d) in out.devices.iter_mut() {
            let totals = walk.state.device_totals(*device);
            d.allocated_at_end = totals.allocated;
            d.reserved_at_end = totals.reserved;
        }
        if out.span.0 == u64::MAX {
            out.span = (0, 0);
        }
        out.header = walk.header.clone();
        out.tears = walk
            .tears()
            .iter()
            .map(|t| format!("{} at byte {}: {}", t.path.display(), t.offset, t.error))
            .collect();
        out
    }
}
