//! What the exit summary is told: [`ExitFacts`]; and the trace's shutdown, after it.

use std::sync::atomic::Ordering;

use cachealloc_core::Stats;

use super::Shim;
use crate::stacks::CaptureCounts;

/// What the exit summary says: a plain value for the reporter
/// ([`crate::report::exit_summary`]).
#[derive(Debug)]
pub struct ExitFacts {
    /// Where the trace is (or why there is none).
    pub trace_note: String,
    /// No pool was ever in use: `pool:off`, or no driver.
    pub unpooled: bool,
    /// Each pooled device's stats.
    pub stats: Vec<(usize, Stats)>,
    /// The pooled devices that grow expandable segments.
    pub expandable: Vec<usize>,
    /// Allocations that passed through (`pool:off`, or after an internal failure).
    pub passthrough_mallocs: u64,
    /// Allocations passed to CUDA while the program had caching off.
    pub uncached_mallocs: u64,
    /// Driver-level allocations in contexts other than the primary ones (not pooled).
    pub unpooled_context_mallocs: u64,
    /// How stack captures went (`None` without stacks).
    pub stacks: Option<CaptureCounts>,
}

impl Shim {
    /// At exit: what the summary needs. It is printed before the trace is shut down
    /// ([`Shim::shut_down_trace`]), so that it appears even when the process ends meanwhile
    /// (another thread's `exit`, say, while the writer drains).
    pub fn exit_facts(&self) -> ExitFacts {
        let trace_note = match &self.trace {
            Ok(trace) => format!("trace in {}", trace.dir.display()),
            Err(why) => format!("no trace ({why})"),
        };
        let stats = self.stats();
        let expandable = (self.devices.iter().enumerate())
            .filter(|(_, slot)| slot.get().is_some_and(|p| p.alloc.expandable()))
            .map(|(d, _)| d)
            .collect();
        ExitFacts {
            trace_note,
            unpooled: self.driver.is_none() || (stats.is_empty() && !self.healthy()),
            stats,
            expandable,
            passthrough_mallocs: self.passthrough_mallocs.load(Ordering::Relaxed),
            uncached_mallocs: self.uncached_mallocs.load(Ordering::Relaxed),
            unpooled_context_mallocs: self.unpooled_context_mallocs.load(Ordering::Relaxed),
            stacks: self.stacks.as_ref().map(|s| s.counts()),
        }
    }

    /// At exit, after the summary: flush and stop the trace. `Some(false)` when its writer did
    /// not finish in time (the trace's end may be missing); `None` without a trace.
    pub fn shut_down_trace(&self) -> Option<bool> {
        self.trace.as_ref().ok().map(|trace| trace.shutdown())
    }
}
