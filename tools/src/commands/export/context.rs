//! The events table's `category` and `module` columns, for traces with the program's context
//! (the Python integration's phases, scopes and tags): an allocation's category
//! (`crate::categories`, PyTorch's names: `PARAMETER`, …, `UNKNOWN`) and the module it was made
//! in (`LlamaForCausalLM.model.layers.3.mlp`), on its `alloc` row and on the rows that free it.
//!
//! A category needs the block's whole life, so the categories pass walks the trace first. That
//! walk is taken only for a trace with context records: the export starts without it and, at the
//! first context record it meets (the integration's first phase comes with the program's first
//! forward), starts again with it (`export::export_rank`). A trace without context (a C
//! program's) is walked once, and both columns are null.

use std::path::Path;

use cachealloc_recorder::{LiveState, Record};
use rustc_hash::FxHashMap;

use crate::categories::Category;
use crate::categories::pass::{Outcome, Plan, run};
use crate::progress::Progress;

/// What fills the two columns while the export walks.
pub struct RowContext {
    outcome: Outcome,
    /// `Alloc` records seen so far (the ordinal of the next one).
    allocs: u64,
    /// Live blocks: their category and scope id.
    live: FxHashMap<(u32, u64), (Category, u32)>,
}

impl RowContext {
    /// For the trace in `dir`, which has context records: the categories pass over the whole
    /// trace.
    pub fn for_trace(dir: &Path) -> Result<RowContext, String> {
        let plan = Plan {
            every_allocation: true,
            ..Plan::default()
        };
        let outcome = run(dir, &plan, &Progress::new("categories"), |_, _| {})?;
        Ok(RowContext {
            outcome,
            allocs: 0,
            live: FxHashMap::default(),
        })
    }

    /// The `category` and `module` of the event `record` (after it was applied to `state`),
    /// the `index`-th record: an allocation's own, or a freed block's.
    pub fn of<'s>(
        &mut self,
        record: &Record,
        index: u64,
        state: &'s LiveState,
    ) -> (Option<&'static str>, Option<&'s str>) {
        let (category, scope) = match record {
            Record::Alloc(a) => {
                let category =
                    self.outcome
                        .category_of(a.device, a.address, Some(self.allocs), index);
                self.allocs += 1;
                let scope = state
                    .context
                    .blocks
                    .get(&(a.device, a.address))
                    .map_or(0, |c| c.scope);
                self.live.insert((a.device, a.address), (category, scope));
                (category, scope)
            }
            Record::Free(f) | Record::FreeRequested(f) => {
                let key = (f.device, f.address);
                match self.live.remove(&key) {
                    Some(found) => found,
                    // Allocated in a file rotated away: its category from the checkpoints.
                    None => (
                        self.outcome.category_of(f.device, f.address, None, index),
                        0,
                    ),
                }
            }
            _ => return (None, None),
        };
        let module = (scope != 0)
            .then(|| state.context.scope_names.get(&scope))
            .flatten()
            .map(|n| n.name.as_str());
        (Some(category.name()), module)
    }
}
