//! What the Python integration tells the library about the program it runs, for memory by
//! category and module: the module each thread is inside (its *scope*), the phase of the
//! training step (forward, backward, the optimizer's step), and what some blocks hold
//! (parameters, gradients, optimizer state, inputs). Each fact becomes one trace record
//! (`ScopeName`, `Scope`, `Phase`, `Tag`); the tools sort every allocation into a category from
//! them and from lifetimes. The library keeps nothing but the module names it has interned, and
//! serves no allocation differently: without a trace these calls do nothing.
//!
//! A thread's scope reaches the trace lazily, before its next allocation: see
//! [`crate::trace::scopes`].

use cachealloc_recorder::Record;
use cachealloc_recorder::schema::{
    PHASE_OPTIMIZER, PhaseEvent, TAG_ACTIVATION, TAG_PARAMETER, TagEvent,
};

use super::Shim;
use crate::trace::scopes;

pub use scopes::{
    define as define_scope, is_known as scope_known, set as scope_set, slot as scope_slot,
};

/// Why a fact was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum BadFact {
    /// A phase byte that is not one of the schema's.
    UnknownPhase,
    /// A category byte that is not one of the schema's.
    UnknownCategory,
}

impl Shim {
    /// The program changed its memory-history settings (PyTorch's `_record_memory_history`):
    /// stacks at frees when it keeps free context, native frames when it asks for C++ frames.
    pub fn memory_history(&self, free_stacks: bool, native_frames: bool) {
        crate::stacks::frees::set_free_stacks(free_stacks);
        if let Some(stacks) = &self.stacks {
            stacks.set_native(native_frames);
        }
    }

    /// Pause the trace's allocation records (or resume them); returns whether they were paused
    /// (Note [A paused trace stays consistent] in `trace::pause`). The trace says when.
    pub fn pause_trace(&self, paused: bool) -> bool {
        let was = crate::trace::pause::set_paused(paused);
        if was != paused
            && let Ok(trace) = &self.trace
        {
            trace.annotation(if paused {
                "cachealloc: recording paused"
            } else {
                "cachealloc: recording resumed"
            });
        }
        was
    }

    /// The program's phase is now `phase` (a `PHASE_*` byte of the schema), in training step
    /// `step`. Every thread's scope ends with the phase it was set in.
    pub fn set_phase(&self, phase: u8, step: u64) -> Result<(), BadFact> {
        if phase > PHASE_OPTIMIZER {
            return Err(BadFact::UnknownPhase);
        }
        if let Ok(trace) = &self.trace {
            trace.send(Record::Phase(PhaseEvent {
                t: trace.now(),
                phase,
                step,
            }));
            // After the record: a thread that allocates in between says its scope again after
            // the phase (at worst one allocation goes unnamed); before it, the phase could
            // erase a scope said too early, for good.
            trace.phase_changed();
        }
        Ok(())
    }

    /// The blocks of `device` holding `addresses` hold tensors of `category` (a `TAG_*` byte of
    /// the schema).
    pub fn tag(&self, device: u32, category: u8, addresses: &[u64]) -> Result<(), BadFact> {
        if !(TAG_PARAMETER..=TAG_ACTIVATION).contains(&category) {
            return Err(BadFact::UnknownCategory);
        }
        if let Ok(trace) = &self.trace {
            let t = trace.now();
            for &address in addresses {
                trace.send(Record::Tag(TagEvent {
                    t,
                    device,
                    address,
                    category,
                }));
            }
        }
        Ok(())
    }
}
