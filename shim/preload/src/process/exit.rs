//! What the exit summary is told: [`ExitFacts`], gathered once the trace is shut down.

use std::sync::atomic::Ordering;

use cachealloc_core::Stats;

use super::Shim;

/// What the exit summary says, gathered once the trace is shut down: a plain value for the
/// reporter ([`crate::report::exit_summary`]).
#[derive(Debug)]
pub struct ExitFacts {
    /// Where the trace is (or why there is none), and whether its end was written.
    pub trace_note: String,
    /// No pool was ever in use: `pool:off`, or no driver.
    pub unpooled: bool,
    /// Each pooled device's stats.
    pub stats: Vec<(usize, Stats)>,
    /// The pooled devices that grow expandable segments.
    pub expandable: Vec<usize>,
    /// Allocations that passed through (`pool:off`, or after an internal failure).
    pub passthrough_mallocs: u64,
    /// Driver-level allocations in contexts other than the primary ones (not pooled).
    pub unpooled_context_mallocs: u64,
}

impl Shim {
    /// At exit: flush and stop the trace, and say what the summary needs.
    pub fn finish(&self) -> ExitFacts {
        let trace_note = match &self.trace {
            Ok(trace) if trace.shutdown() => format!("trace in {}", trace.dir.display()),
            Ok(trace) => format!(
                "trace in {} (its end may be missing: the writer did not finish in time)",
                trace.dir.display()
            ),
            Err(why) => format!("no trace ({why})"),
        };
        let stats = self.stats();
        let expandable = (self.devices.iter().enumerate())
            .filter(|(_, slot)| slot.get().is_some_and(|p| p.alloc.expandable()))
            .map(|(d, _)| d)
            .collect();
        ExitFacts {
            trace_note,
            unpooled: self.driver.is_none() || (stats.is_empty() && !self.pooling()),
            stats,
            expandable,
            passthrough_mallocs: self.passthrough_mallocs.load(Ordering::Relaxed),
            unpooled_context_mallocs: self.unpooled_context_mallocs.load(Ordering::Relaxed),
        }
    }
}
