//! The events table's `category` and `module` columns, for traces with the program's context
//! (the Python integration's phases, scopes and tags): an allocation's category
//! (`crate::categories`, PyTorch's names: `PARAMETER`, …, `UNKNOWN`) and the module it was made
//! in (`LlamaForCausalLM.model.layers.3.mlp`), on its `alloc` row and on the rows that free it.
//!
//! A category needs the block's whole life, so the categories pass walks the trace first; that
//! walk is taken only when the trace has context records, looked for among its first
//! [`LOOK_AHEAD`] records (the integration's first phase comes with the program's first forward).
//! Without them both columns are null, as before.

use std::path::Path;

use cachealloc_recorder::{LiveState, Record};
use rustc_hash::FxHashMap;

use crate::categories::Category;
use crate::categories::pass::{Outcome, Plan, run};
use crate::progress::Progress;
use crate::walk::TraceWalk;

/// Records looked at for a context record before a trace is taken to have none.
pub const LOOK_AHEAD: u64 = 1 << 20;

/// What fills the two columns while the export walks.
pub struct RowContext {
    outcome: Outcome,
    /// `Alloc` records seen so far (the ordinal of the next one).
    allocs: u64,
    /// Live blocks: their category and scope id.
    live: FxHashMap<(u32, u64), (Category, u32)>,
}

impl RowContext {
    /// For the trace in `dir`: `None` when it has no context records (among the first
    /// [`LOOK_AHEAD`]).
    pub fn for_trace(dir: &Path) -> Result<Option<RowContext>, String> {
        if !has_context(dir)? {
            return Ok(None);
        }
        let plan = Plan {
            every_allocation: true,
            ..Plan::default()
        };
        let outcome = run(dir, &plan, &Progress::new("categories"), |_, _| {})?;
        Ok(Some(RowContext {
            outcome,
            allocs: 0,
            live: FxHashMap::default(),
        }))
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

/// Whether the trace in `dir` has a context record among its first [`LOOK_AHEAD`] records.
fn has_context(dir: &Path) -> Result<bool, String> {
    let mut walk = TraceWalk::open(dir)?;
    while let Some(step) = walk.step_ref() {
        let Ok(step) = step else { return Ok(false) };
        if step.record.is_context() {
            return Ok(true);
        }
        if step.index >= LOOK_AHEAD {
            break;
        }
    }
    Ok(false)
}
