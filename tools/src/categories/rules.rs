//! The lifetime rules of *Note [Categories by lifetime]* as one pure function: a block's
//! category from its tag, the program's [`Clock`] when it was allocated and the clock when it
//! was freed. No trace, no state: the rules are tested here on clocks alone.

use cachealloc_recorder::schema::{
    PHASE_BACKWARD, PHASE_FORWARD, PHASE_NONE, PHASE_OPTIMIZER, TAG_ACTIVATION, TAG_GRADIENT,
    TAG_INPUT, TAG_OPTIMIZER_STATE, TAG_PARAMETER,
};

use super::Category;

/// Where the program was in its loop: its phase, the last phase other than none, and how many
/// forward passes, backward passes and optimizer steps had begun.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Clock {
    /// The phase now (`PHASE_*`).
    pub phase: u8,
    /// The last phase other than none (none before the first).
    pub last_active: u8,
    /// Forward passes begun.
    pub forwards: u64,
    /// Backward passes begun.
    pub backwards: u64,
    /// Optimizer steps begun.
    pub optimizer_steps: u64,
    /// In a forward begun during a backward: activation checkpointing recomputing what it did
    /// not save. The backward it interrupted resumes when the phase returns to backward.
    pub recomputing: bool,
}

impl Clock {
    /// The program entered `phase` (a phase record that repeats the current phase changes
    /// nothing: a checkpoint restates the phase).
    pub fn enter(&mut self, phase: u8) {
        if phase == self.phase {
            return;
        }
        let was_recomputing = std::mem::take(&mut self.recomputing);
        match phase {
            PHASE_FORWARD if self.phase == PHASE_BACKWARD => self.recomputing = true,
            PHASE_FORWARD => self.forwards += 1,
            PHASE_BACKWARD if was_recomputing => {}
            PHASE_BACKWARD => self.backwards += 1,
            PHASE_OPTIMIZER => self.optimizer_steps += 1,
            _ => {}
        }
        self.phase = phase;
        if phase != PHASE_NONE {
            self.last_active = phase;
        }
    }

    /// The clock at the allocation of a block allocated in `phase` that is still live now, when
    /// the allocation itself was not seen (its file was rotated away): the latest such moment,
    /// except that a forward block seen during a backward is one the running backward follows,
    /// and an optimizer or none block seen in another phase was allocated before it began.
    pub fn guess_birth(&self, phase: u8) -> Clock {
        let mut born = Clock {
            phase,
            last_active: if phase == PHASE_NONE {
                self.last_active
            } else {
                phase
            },
            ..*self
        };
        match phase {
            PHASE_FORWARD if self.phase == PHASE_BACKWARD => {
                born.backwards = self.backwards.saturating_sub(1);
            }
            PHASE_OPTIMIZER if self.phase != PHASE_OPTIMIZER => {
                born.optimizer_steps = self.optimizer_steps.saturating_sub(1);
            }
            PHASE_NONE if self.phase != PHASE_NONE => {
                born.forwards = self.forwards.saturating_sub(1);
                born.last_active = PHASE_NONE;
            }
            _ => {}
        }
        born
    }
}

/// The category a tag names (`None` for 0 or a tag this reader does not know).
pub fn tagged(tag: u8) -> Option<Category> {
    Some(match tag {
        TAG_PARAMETER => Category::Parameter,
        TAG_OPTIMIZER_STATE => Category::OptimizerState,
        TAG_GRADIENT => Category::Gradient,
        TAG_INPUT => Category::Input,
        TAG_ACTIVATION => Category::Activation,
        _ => return None,
    })
}

/// The category of a block with `tag` (0: none), allocated at `born` and freed at `died` (a
/// block live at the end of the trace: `died` is the clock at the end).
pub fn classify(tag: u8, born: &Clock, died: &Clock) -> Category {
    if let Some(category) = tagged(tag) {
        return category;
    }
    match born.phase {
        PHASE_FORWARD if born.recomputing => recomputed(born, died),
        PHASE_FORWARD => after_forward(born, died, false),
        PHASE_BACKWARD => Category::AutogradDetail,
        PHASE_OPTIMIZER => {
            if died.phase == PHASE_OPTIMIZER && died.optimizer_steps == born.optimizer_steps {
                Category::Temporary
            } else {
                Category::OptimizerState
            }
        }
        // Between a forward and its backward (a loss computed outside any module): part of the
        // autograd graph, judged as the forward's own blocks are.
        _ if born.last_active == PHASE_FORWARD => after_forward(born, died, true),
        _ => outside_phases(born, died),
    }
}

/// Forwards an input may live through: the one it feeds, and the one before it when the
/// program loads a batch ahead (a prefetcher).
const INPUT_FORWARDS: u64 = 2;

/// A block made outside any phase (before the loop, or loading a batch): an input if alive at
/// the start of the next forward, but only for the one or two forwards a batch lives through;
/// alive through more, it is state the program keeps (a bucket, a cache): UNKNOWN. Inputs the
/// program keeps for its whole run are tagged INPUT by the integration (the outermost forward's
/// arguments).
fn outside_phases(born: &Clock, died: &Clock) -> Category {
    match died.forwards.saturating_sub(born.forwards) {
        0 => Category::Temporary,
        1..=INPUT_FORWARDS => Category::Input,
        _ => Category::Unknown,
    }
}

/// A block allocated by a forward recomputed during a backward (activation checkpointing).
fn recomputed(born: &Clock, died: &Clock) -> Category {
    let same_backward = died.backwards == born.backwards;
    match died.phase {
        // Freed within the recomputation.
        PHASE_FORWARD if same_backward && died.recomputing => Category::Temporary,
        // Used and freed by the backward it was recomputed for: saved for it.
        PHASE_BACKWARD if same_backward => Category::Activation,
        _ => Category::Unknown,
    }
}

/// A block allocated in a forward pass, or (`between`) after one and before any backward.
fn after_forward(born: &Clock, died: &Clock, between: bool) -> Category {
    match died.backwards.saturating_sub(born.backwards) {
        // No backward began: a temporary (inference; outputs dropped), or, when made between
        // two forwards and alive at the second, its input.
        0 if between => outside_phases(born, died),
        0 => Category::Temporary,
        // Freed by the backward that followed: what autograd saved.
        1 if died.phase == PHASE_BACKWARD => Category::Activation,
        // Alive past the backward that followed: a result the program keeps.
        _ => Category::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clock driven through `phases` from the start.
    fn after(phases: &[u8]) -> Clock {
        let mut c = Clock::default();
        for &p in phases {
            c.enter(p);
        }
        c
    }

    const F: u8 = PHASE_FORWARD;
    const B: u8 = PHASE_BACKWARD;
    const O: u8 = PHASE_OPTIMIZER;
    const N: u8 = PHASE_NONE;

    #[test]
    fn counting() {
        let c = after(&[F, F, N, B, O, N, F]);
        assert_eq!((c.forwards, c.backwards, c.optimizer_steps), (2, 1, 1));
        assert_eq!((c.phase, c.last_active), (F, F));
    }

    #[test]
    fn forward_blocks() {
        let born = after(&[F]);
        assert_eq!(classify(0, &born, &after(&[F])), Category::Temporary);
        assert_eq!(classify(0, &born, &after(&[F, N, B])), Category::Activation);
        assert_eq!(classify(0, &born, &after(&[F, N, F])), Category::Temporary);
        assert_eq!(classify(0, &born, &after(&[F, N, B, O])), Category::Unknown);
        assert_eq!(
            classify(0, &born, &after(&[F, B, N, F, B])),
            Category::Unknown
        );
    }

    #[test]
    fn other_phases() {
        let in_backward = after(&[F, B]);
        assert_eq!(
            classify(0, &in_backward, &after(&[F, B, O])),
            Category::AutogradDetail
        );
        let in_step = after(&[F, B, O]);
        assert_eq!(classify(0, &in_step, &in_step), Category::Temporary);
        assert_eq!(
            classify(0, &in_step, &after(&[F, B, O, N])),
            Category::OptimizerState
        );
        let loading = after(&[F, B, O, N]);
        assert_eq!(classify(0, &loading, &loading), Category::Temporary);
        assert_eq!(
            classify(0, &loading, &after(&[F, B, O, N, F])),
            Category::Input
        );
        // Alive through three forwards: not a batch.
        let kept = after(&[F, B, O, N, F, B, O, N, F, B, O, N, F]);
        assert_eq!(classify(0, &loading, &kept), Category::Unknown);
        let loss = after(&[F, N]);
        assert_eq!(classify(0, &loss, &after(&[F, N, B])), Category::Activation);
        assert_eq!(classify(0, &loss, &loss), Category::Temporary);
    }

    #[test]
    fn recomputation_in_a_backward() {
        // Activation checkpointing: a forward inside the backward, then the backward resumes.
        let c = after(&[F, B, F, B]);
        assert_eq!((c.forwards, c.backwards, c.recomputing), (1, 1, false));
        let saved = after(&[F]);
        assert_eq!(classify(0, &saved, &c), Category::Activation);
        let recomputed = after(&[F, B, F]);
        assert!(recomputed.recomputing);
        assert_eq!(classify(0, &recomputed, &c), Category::Activation);
        assert_eq!(classify(0, &recomputed, &recomputed), Category::Temporary);
        assert_eq!(
            classify(0, &recomputed, &after(&[F, B, F, B, O])),
            Category::Unknown
        );
    }

    #[test]
    fn a_tag_wins() {
        let born = after(&[F]);
        assert_eq!(
            classify(TAG_GRADIENT, &born, &after(&[F, B])),
            Category::Gradient
        );
        assert_eq!(classify(99, &born, &born), Category::Temporary);
    }

    #[test]
    fn guessed_births() {
        let now = after(&[F, N, B]);
        let born = now.guess_birth(F);
        assert_eq!(classify(0, &born, &now), Category::Activation);
        let now = after(&[F, B, O, N, F]);
        assert_eq!(classify(0, &now.guess_birth(N), &now), Category::Input);
        assert_eq!(
            classify(0, &now.guess_birth(O), &now),
            Category::OptimizerState
        );
    }
}
