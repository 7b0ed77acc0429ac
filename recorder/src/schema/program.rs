//! The record kinds that say what the program is doing rather than what the allocator did:
//! the module a thread is in ([`ScopeName`], [`ScopeEvent`]), the step's phase ([`PhaseEvent`]),
//! what a block holds ([`TagEvent`]), and a live block's context in a checkpoint
//! ([`BlockContext`]). The Python integration's category hooks tell them (issue 23); the tools
//! sort memory by category and module from them. Re-exported by `schema`.

use serde::{Deserialize, Serialize};

/// [`PhaseEvent::phase`]: outside the phases below (between steps, loading data, evaluation
/// outside modules).
pub const PHASE_NONE: u8 = 0;
/// [`PhaseEvent::phase`]: a module's forward (from the outermost module's entry to its exit).
pub const PHASE_FORWARD: u8 = 1;
/// [`PhaseEvent::phase`]: autograd's backward.
pub const PHASE_BACKWARD: u8 = 2;
/// [`PhaseEvent::phase`]: an optimizer's step.
pub const PHASE_OPTIMIZER: u8 = 3;

/// The name of a phase byte: `none`, `forward`, `backward`, `optimizer`.
pub fn phase_name(phase: u8) -> &'static str {
    match phase {
        PHASE_FORWARD => "forward",
        PHASE_BACKWARD => "backward",
        PHASE_OPTIMIZER => "optimizer",
        _ => "none",
    }
}

/// [`TagEvent::category`]: a module's parameter or buffer.
pub const TAG_PARAMETER: u8 = 1;
/// [`TagEvent::category`]: an optimizer's state (moments, step counts).
pub const TAG_OPTIMIZER_STATE: u8 = 2;
/// [`TagEvent::category`]: a parameter's gradient (`.grad`).
pub const TAG_GRADIENT: u8 = 3;
/// [`TagEvent::category`]: an input of the outermost module's forward.
pub const TAG_INPUT: u8 = 4;
/// [`TagEvent::category`]: a tensor autograd saved for backward.
pub const TAG_ACTIVATION: u8 = 5;

/// The name of a module path (`LlamaForCausalLM.model.layers.3.mlp`) that [`ScopeEvent`]s
/// refer to by id. Defined before its id is first used, and again in the checkpoint of each
/// file that needs it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScopeName {
    /// Scope id (≥ 1).
    pub id: u32,
    /// The module's path in the model, its root named by its class.
    pub name: String,
}

/// A thread's innermost module changed: its allocations from `t` on are made inside `scope`
/// (0: outside any module).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScopeEvent {
    /// Time.
    pub t: u64,
    /// Thread number (as [`Alloc::thread`](super::Alloc::thread)).
    pub thread: u32,
    /// Scope id ([`ScopeName`]), 0 for none.
    pub scope: u32,
}

/// The program's phase changed (for every thread: backward runs on autograd's threads). It
/// ends every thread's scope: a thread's [`ScopeEvent`]s after it say where it is now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseEvent {
    /// Time.
    pub t: u64,
    /// [`PHASE_NONE`], [`PHASE_FORWARD`], [`PHASE_BACKWARD`] or [`PHASE_OPTIMIZER`].
    pub phase: u8,
    /// The training step (optimizer steps taken before `t`).
    pub step: u64,
}

/// A fact about a block: the live block that holds `address` (its start or inside it) holds a
/// tensor of `category`. A tag names the block's whole life, from its allocation to its free.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TagEvent {
    /// Time.
    pub t: u64,
    /// Device.
    pub device: u32,
    /// An address inside the block.
    pub address: u64,
    /// [`TAG_PARAMETER`], [`TAG_OPTIMIZER_STATE`], [`TAG_GRADIENT`], [`TAG_INPUT`] or
    /// [`TAG_ACTIVATION`].
    pub category: u8,
}

/// Where a block live at a checkpoint was allocated: its scope and the phase, as the
/// [`ScopeEvent`]s and [`PhaseEvent`]s before it said, and its tag (0: none).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockContext {
    /// Device.
    pub device: u32,
    /// Address of the block.
    pub address: u64,
    /// Scope id, 0 for none.
    pub scope: u32,
    /// Phase at its allocation.
    pub phase: u8,
    /// Its tag's category, 0 for none.
    pub category: u8,
}
