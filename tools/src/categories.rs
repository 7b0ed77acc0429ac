//! Memory by category and by module: every allocation sorted into PyTorch's memory profiler's
//! categories (PARAMETER, OPTIMIZER_STATE, INPUT, TEMPORARY, ACTIVATION, GRADIENT,
//! AUTOGRAD_DETAIL, or UNKNOWN) and attributed to the module it was made in, from the context
//! records the Python integration writes (`Phase`, `Scope`, `Tag`; `cachealloc-recorder`'s
//! `schema`). `summary`, `plot`, `snapshot`, `memory-timeline` and `compare` show what this
//! module computes; a trace without context records (a plain C program) has no categories, and
//! those commands then show none.
//!
//! | module | what |
//! |---|---|
//! | [`rules`] | the rules: a category from a tag and two [`rules::Clock`]s (allocation, free) |
//! | [`pass`] | one walk of a trace that classifies each allocation when it is freed and adds it to what was asked for ([`pass::Plan`]) |
//! | [`slices`] | the composition of memory at each time slice's peak (or the whole trace's), by difference arrays |
//! | [`annotations`] | memory by category at each annotation (two walks) |
//!
//! # Note [Categories by lifetime]
//!
//! **What is known.** The Python integration says three things: the program's phase (none,
//! forward, backward, optimizer step; process-wide), each thread's innermost module, and *tags*:
//! "the block holding this address holds a parameter" (or optimizer state, a gradient, an input,
//! a tensor autograd saved). What a hook cannot tell, a block's lifetime can, and the lifetime is
//! known when the block is freed. So each allocation is classified once, at its free (or at the
//! end of the trace, as if freed then), from its tag, the phase clock at its allocation and the
//! clock at its free ([`rules::classify`]):
//!
//! * **A tag wins**, for the block's whole life, whenever during its life it came.
//! * **Made in a forward**: freed before any backward began → TEMPORARY (an op's scratch, or an
//!   inference output dropped); freed during the backward that followed → ACTIVATION (what
//!   autograd saved, released as its nodes run); alive past the end of that backward → UNKNOWN
//!   (a forward result the program keeps: logits, a loss held into the next step).
//! * **Made in a backward** → AUTOGRAD_DETAIL (gradients flowing between autograd's nodes and
//!   their temporaries); parameters' `.grad`s arrive tagged GRADIENT.
//! * **Made in an optimizer step**: freed within the step → TEMPORARY; alive after it →
//!   OPTIMIZER_STATE (state created lazily at the first step, or kept by a fused optimizer).
//! * **Made with phase none**, before the loop or after an optimizer step: alive at the start of
//!   the next forward → INPUT (the batch moved to the device); freed before it → TEMPORARY;
//!   alive through more than two forwards → UNKNOWN. A batch lives through the forward it feeds
//!   (and, loaded ahead by a prefetcher, the one before); an untagged block made outside the loop
//!   and kept for the run (DDP's gradient buckets, a library's cache) is state, which the
//!   brief's first rule called INPUT for the whole run. Inputs a program keeps for good (one
//!   batch reused by a benchmark) are tagged INPUT by the integration, and the tag wins.
//! * **Made with phase none between a forward and its backward** — the loss computed outside any
//!   module, which the brief's first rules would have called INPUT or TEMPORARY — is judged as a
//!   forward's block: its intermediates are saved for the backward exactly as a module's are, so
//!   freed during the backward → ACTIVATION, alive past it → UNKNOWN (the loss the program
//!   keeps), freed before → TEMPORARY; and in an inference loop, a block made between two
//!   forwards and alive at the second is that forward's INPUT.
//!
//! * **Recomputed in a backward** (activation checkpointing: a forward begun while a backward
//!   runs, the backward resuming after it; neither counts as a new pass): freed by the backward
//!   it was recomputed for → ACTIVATION, within the recomputation → TEMPORARY, else UNKNOWN.
//!   Without this rule every activation saved before a checkpointed segment would have looked
//!   alive past "its" backward (a second backward seemed to begin) and been called UNKNOWN.
//!
//! "Began" counts phase changes (a [`rules::Clock`] counts forwards, backwards and optimizer
//! steps begun): several forwards before one backward (gradient accumulation in one graph) keep
//! their blocks ACTIVATION, and a block alive through two backwards is never one.
//!
//! **Modules.** A block belongs to the innermost module its allocating thread was in
//! (`BlockContext::scope`); bytes roll up to every prefix of the module's path
//! (`Model.layers.3.mlp` counts in `Model.layers.3`, `Model.layers` and `Model`).
//!
//! **Rotated files.** A block whose allocation was rotated away comes from a checkpoint with its
//! scope, the phase at its allocation and its tag (`CheckpointBlockContext`) but not its clock;
//! [`rules::Clock::guess_birth`] places it in the latest pass of that phase (a forward block seen
//! during a backward was made in the forward that backward follows). Blocks whose allocation was
//! walked keep their exact clock across files.
//!
//! **Cost.** Nothing is stored per allocation beyond the live ones: a live block's record is
//! dropped when it is classified. Memory at an instant is added up as blocks alive then are
//! classified. The instant need not be known in advance when it is a peak: while a peak is only
//! a candidate (the most allocated so far), the blocks freed since it are added to it, and when
//! a later moment takes over, those bytes are dropped, for every block freed before that moment
//! was not alive at it; blocks freed after the last candidate are added when classified. Time
//! slices do the same within each slice and use difference arrays over the slices already
//! closed (`+size` at the first slice a block was alive at, `-size` after its last); slices over
//! a span not known in advance start at 1 µs and double, merging neighbouring rows
//! ([`slices`]). So `summary` is one walk (its scan and this pass together), in memory that
//! does not grow with the trace.
//!
//! **Limits.** Categories are those of blocks, not tensors: a block holding views of several
//! tensors has one category. A block tagged after its free is not tagged. Blocks made by
//! threads the integration does not know (a library's own pool) follow the process-wide phase.

pub mod annotations;
pub mod pass;
pub mod rules;
pub mod slices;

use cachealloc_recorder::LiveState;
use cachealloc_recorder::schema::FRAME_PYTHON;

use crate::walk::{frame_label, stack_frames};

/// A block's category, in the order of PyTorch's `_CATEGORY_TO_INDEX` (the columns of
/// `export_memory_timeline`), UNKNOWN last (PyTorch's `None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Category {
    /// A module's parameter or buffer.
    Parameter,
    /// An optimizer's state.
    OptimizerState,
    /// An input of the model.
    Input,
    /// Freed within the phase that made it.
    Temporary,
    /// Saved by autograd in a forward, freed by the backward.
    Activation,
    /// A parameter's gradient.
    Gradient,
    /// Made by the backward pass, not a parameter's gradient.
    AutogradDetail,
    /// None of the above.
    Unknown,
}

/// How many categories there are.
pub const CATEGORY_COUNT: usize = 8;

impl Category {
    /// Every category, in PyTorch's order.
    pub const ALL: [Category; CATEGORY_COUNT] = [
        Category::Parameter,
        Category::OptimizerState,
        Category::Input,
        Category::Temporary,
        Category::Activation,
        Category::Gradient,
        Category::AutogradDetail,
        Category::Unknown,
    ];

    /// Its position in [`Category::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// PyTorch's name: `PARAMETER`, …, `UNKNOWN`.
    pub fn name(self) -> &'static str {
        match self {
            Category::Parameter => "PARAMETER",
            Category::OptimizerState => "OPTIMIZER_STATE",
            Category::Input => "INPUT",
            Category::Temporary => "TEMPORARY",
            Category::Activation => "ACTIVATION",
            Category::Gradient => "GRADIENT",
            Category::AutogradDetail => "AUTOGRAD_DETAIL",
            Category::Unknown => "UNKNOWN",
        }
    }

    /// The name as PyTorch's snapshots spell a block's `category` (lower case; `unknown`).
    pub fn snapshot_name(self) -> &'static str {
        match self {
            Category::Parameter => "parameter",
            Category::OptimizerState => "optimizer_state",
            Category::Input => "input",
            Category::Temporary => "temporary",
            Category::Activation => "activation",
            Category::Gradient => "gradient",
            Category::AutogradDetail => "autograd_detail",
            Category::Unknown => "unknown",
        }
    }

    /// PyTorch's colour for it (`_CATEGORY_TO_COLORS`), as CSS.
    pub fn color(self) -> &'static str {
        match self {
            Category::Parameter => "darkgreen",
            Category::OptimizerState => "goldenrod",
            Category::Input => "black",
            Category::Temporary => "mediumpurple",
            Category::Activation => "red",
            Category::Gradient => "mediumblue",
            Category::AutogradDetail => "royalblue",
            Category::Unknown => "grey",
        }
    }
}

/// Bytes by category, indexed by [`Category::index`].
pub type ByCategory = [u64; CATEGORY_COUNT];

/// Whether a Python file is library code rather than the user's: PyTorch (a path with
/// `/torch/`), Python's standard library (under `lib/pythonX.Y/` but not in `site-packages` or
/// `dist-packages`), frozen and generated code (`<frozen …>`, `<string>`), or cachealloc's own
/// Python integration (`cachealloc_hooks.py`, `cachealloc_categories.py` and the
/// `sitecustomize.py` beside them, written to a `cachealloc-python-…` directory), whose wrapper
/// of `backward()` is on the stack of every backward allocation.
pub fn is_library_file(file: &str) -> bool {
    if file.contains("/torch/") || file.starts_with('<') || file.contains("/cachealloc-python") {
        return true;
    }
    let name = file.rsplit('/').next().unwrap_or(file);
    if name.starts_with("cachealloc_") && name.ends_with(".py") {
        return true;
    }
    let in_packages = file.contains("/site-packages/") || file.contains("/dist-packages/");
    !in_packages && file.contains("/lib/python3")
}

/// The user's line of stack `id`: its first (innermost) Python frame outside PyTorch and the
/// standard library, as `name (file:line)`; `None` when it has none.
pub fn user_line(state: &LiveState, id: u32) -> Option<String> {
    stack_frames(state, id)
        .into_iter()
        .find(|f| f.kind == FRAME_PYTHON && !is_library_file(&f.file))
        .map(frame_label)
}

/// The prefixes of a module path, longest first, the path itself included:
/// `a.b.c` → `a.b.c`, `a.b`, `a`.
pub fn module_prefixes(path: &str) -> impl Iterator<Item = &str> {
    std::iter::once(path).chain(path.rmatch_indices('.').map(move |(i, _)| &path[..i]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_files() {
        assert!(is_library_file(
            "/usr/lib/python3/dist-packages/torch/nn/modules/linear.py"
        ));
        assert!(is_library_file("/usr/lib/python3.12/contextlib.py"));
        assert!(is_library_file("<frozen runpy>"));
        assert!(!is_library_file(
            "/usr/lib/python3.12/site-packages/transformers/models/llama.py"
        ));
        assert!(!is_library_file("/home/me/train.py"));
        assert!(is_library_file(
            "/tmp/cachealloc-python-0-07b23b6d10630eca/cachealloc_hooks.py"
        ));
        assert!(is_library_file("/opt/x/cachealloc_categories.py"));
    }

    #[test]
    fn prefixes() {
        let p: Vec<&str> = module_prefixes("Model.layers.3").collect();
        assert_eq!(p, ["Model.layers.3", "Model.layers", "Model"]);
        assert_eq!(module_prefixes("Model").count(), 1);
    }

    #[test]
    fn order_is_pytorchs() {
        for (i, c) in Category::ALL.iter().enumerate() {
            assert_eq!(c.index(), i);
        }
        assert_eq!(Category::Unknown.index(), CATEGORY_COUNT - 1);
    }
}
