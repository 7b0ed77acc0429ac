//! Memory by category at each annotation: what the program held, sorted, at the moments it
//! named (`cachealloc_annotate("after_forward 3")`). The categories need each block's whole
//! life, so this takes two walks: the categories pass for every allocation's category
//! ([`Plan::every_allocation`]), then a walk that keeps the live blocks' bytes by category and
//! reads them at each annotation. What `memory-timeline --at-annotations` writes, and what the
//! GPU check compares with the program's own count of its parameters, gradients, optimizer
//! state and saved tensors (`scripts/gpu/categories.py`).

use std::collections::BTreeMap;
use std::path::Path;

use cachealloc_recorder::Record;
use rustc_hash::FxHashMap;

use super::pass::{Plan, run};
use super::{ByCategory, CATEGORY_COUNT, Category};
use crate::progress::Progress;
use crate::walk::TraceWalk;

/// The memory of one device at one annotation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AtAnnotation {
    /// The annotation's name.
    pub name: String,
    /// Its time, ns since the trace's base.
    pub t: u64,
    /// The device.
    pub device: u32,
    /// Allocated bytes by category (the blocks' sizes; pending frees not counted).
    pub by_category: ByCategory,
    /// The requests' bytes by category (what the program asked for: its tensors' bytes,
    /// without the allocator's rounding).
    pub requested: ByCategory,
}

/// A live block's bytes and category.
#[derive(Clone, Copy)]
struct LiveBlock {
    size: u64,
    requested: u64,
    category: Category,
}

/// Per device, allocated and requested bytes by category.
type Totals = BTreeMap<u32, (ByCategory, ByCategory)>;

/// Each annotation of the trace in `dir`, with every device's allocated bytes by category
/// then (devices with nothing allocated left out).
pub fn at_annotations(dir: &Path, progress: &Progress) -> Result<Vec<AtAnnotation>, String> {
    let plan = Plan {
        every_allocation: true,
        ..Plan::default()
    };
    let outcome = run(dir, &plan, progress, |_, _| {})?;
    let mut walk = TraceWalk::open(dir)?;
    let mut live: FxHashMap<(u32, u64), LiveBlock> = FxHashMap::default();
    let mut totals: Totals = BTreeMap::new();
    let mut allocs = 0u64;
    // At a later file's checkpoint: the blocks live before it, whose categories the blocks it
    // restates keep (they were allocated, and classified, in an earlier file).
    let mut before_checkpoint = None;
    let mut out = Vec::new();
    while let Some(step) = walk.step() {
        let step = step?;
        let (device, address, size, requested, ordinal) = match &step.record {
            Record::Alloc(a) => {
                allocs += 1;
                (a.device, a.address, a.size, a.requested, Some(allocs - 1))
            }
            Record::CheckpointBlock(b) if b.pending == 0 => {
                (b.device, b.address, b.size, b.requested, None)
            }
            Record::Free(f) | Record::FreeRequested(f) => {
                take(&mut live, &mut totals, (f.device, f.address));
                continue;
            }
            Record::CheckpointEnd(_) => {
                before_checkpoint = None;
                continue;
            }
            Record::Header(h) => {
                // A new file's checkpoint restates what is live.
                if h.file_index > 0 || !live.is_empty() {
                    before_checkpoint = Some(std::mem::take(&mut live));
                }
                totals.clear();
                continue;
            }
            Record::Annotation(a) => {
                for (&device, (by_category, requested)) in &totals {
                    if by_category.iter().any(|&b| b > 0) {
                        out.push(AtAnnotation {
                            name: a.name.clone(),
                            t: a.t,
                            device,
                            by_category: *by_category,
                            requested: *requested,
                        });
                    }
                }
                continue;
            }
            _ => continue,
        };
        take(&mut live, &mut totals, (device, address));
        let restated = before_checkpoint
            .as_ref()
            .and_then(|b: &FxHashMap<(u32, u64), LiveBlock>| b.get(&(device, address)))
            .filter(|b| b.size == size && ordinal.is_none());
        let category = match restated {
            Some(b) => b.category,
            None => outcome.category_of(device, address, ordinal, step.index),
        };
        live.insert(
            (device, address),
            LiveBlock {
                size,
                requested,
                category,
            },
        );
        let t = totals
            .entry(device)
            .or_insert(([0; CATEGORY_COUNT], [0; CATEGORY_COUNT]));
        t.0[category.index()] += size;
        t.1[category.index()] += requested;
    }
    Ok(out)
}

/// Forget the live block at `key`, taking its bytes off its device's totals.
fn take(live: &mut FxHashMap<(u32, u64), LiveBlock>, totals: &mut Totals, key: (u32, u64)) {
    if let Some(b) = live.remove(&key)
        && let Some(t) = totals.get_mut(&key.0)
    {
        let i = b.category.index();
        t.0[i] = t.0[i].saturating_sub(b.size);
        t.1[i] = t.1[i].saturating_sub(b.requested);
    }
}
