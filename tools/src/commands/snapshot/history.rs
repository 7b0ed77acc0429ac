//! The program's memory-history settings, applied to a snapshot (`cachealloc snapshot
//! --history`).
//!
//! The recorder keeps every event with its stack whatever the program asked. A program that
//! calls PyTorch's `torch.cuda.memory._record_memory_history(enabled, context, stacks)` expects
//! its `_snapshot()` to show what those settings keep, as PyTorch's native allocator does:
//!
//! * `enabled=None` stops the history and clears it (events before it are not shown);
//!   `"state"` keeps no events (none before it either: the snapshot then shows the state);
//!   `"all"` keeps them.
//! * `context`: `None` records no stacks; `"state"` the stacks of live blocks (and segments)
//!   only; `"alloc"` those and the events', a free showing its block's allocation stack;
//!   `"all"` a free its own stack (and `empty_cache`'s segment frees theirs), which the shim
//!   captures from the moment the program asks (`cachealloc_memory_history`).
//! * `stacks="python"` leaves native frames out; `"all"` keeps them (when the trace has any).
//! * `skip_actions` leaves the named actions (`alloc`, `free_requested`, …) out of the events
//!   recorded while it is in force.
//!
//! The Python integration passes each change with the trace's time at the call
//! (`T:ENABLED:CONTEXT:STACKS[:SKIP]`, comma-separated; SKIP the skipped actions joined by
//! `+`). Before the program's first change nothing shows, as natively, where no history was
//! recorded then (events, and the stacks of blocks allocated before it): a program that turns
//! its history on expects what came after. A program that never says anything gets the
//! recorder's whole history, as with `context="all"` (the beyond-PyTorch default).

use crate::Error;

/// A stack id with this bit set shows only its Python frames (`stacks="python"`).
pub const PYTHON_ONLY: u32 = 1 << 31;

/// `enabled` of `_record_memory_history`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Enabled {
    /// `None`: no history, and the history so far cleared.
    Off,
    /// `"state"`: live blocks only, no events.
    State,
    /// `"all"`: events too.
    All,
}

/// `context` of `_record_memory_history`: which stacks are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Context {
    /// `None`: no stacks.
    Off,
    /// `"state"`: live blocks' stacks.
    State,
    /// `"alloc"`: and the allocation events'.
    Alloc,
    /// `"all"`: and the frees'.
    All,
}

/// The settings from a change on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Trace time of the change (ns).
    pub t: u64,
    /// See [`Enabled`].
    pub enabled: Enabled,
    /// See [`Context`].
    pub context: Context,
    /// `stacks="python"`.
    pub python_only: bool,
    /// `skip_actions`: a bit per action of [`ACTIONS`].
    pub skip: u16,
}

/// The actions of `device_traces` entries, PyTorch's names; `skip_actions` may name any of
/// them (`snapshot` and `user_defined` are never recorded by cachealloc).
pub const ACTIONS: [&str; 10] = [
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
    "snapshot",
    "user_defined",
];

/// The bit of `action` in [`Settings::skip`] (0 for an action not in [`ACTIONS`]).
pub fn action_bit(action: &str) -> u16 {
    ACTIONS
        .iter()
        .position(|a| *a == action)
        .map_or(0, |i| 1 << i)
}

/// What a snapshot shows of a program that never changed its history settings: everything.
const EVERYTHING: Settings = Settings {
    t: 0,
    enabled: Enabled::All,
    context: Context::All,
    python_only: false,
    skip: 0,
};

/// Parse `--history`'s `T:ENABLED:CONTEXT:STACKS[:SKIP],…` (ENABLED `none|state|all`, CONTEXT
/// `none|state|alloc|all`, STACKS `python|all`, SKIP actions of [`ACTIONS`] joined by `+`), in
/// time order.
pub fn parse(spec: &str) -> Result<Vec<Settings>, Error> {
    let bad = |item: &str, why: &str| {
        Error::Message(format!(
            "--history: {why} in {item:?} (expected T:ENABLED:CONTEXT:STACKS[:SKIP] with \
             ENABLED none|state|all, CONTEXT none|state|alloc|all, STACKS python|all, SKIP \
             actions joined by '+' among {})",
            ACTIONS.join(", ")
        ))
    };
    let mut out: Vec<Settings> = Vec::new();
    for item in spec.split(',').filter(|i| !i.trim().is_empty()) {
        let parts: Vec<&str> = item.trim().split(':').collect();
        let (t, enabled, context, stacks, skipped) = match parts[..] {
            [t, e, c, s] => (t, e, c, s, ""),
            [t, e, c, s, k] => (t, e, c, s, k),
            _ => return Err(bad(item, "four or five fields needed")),
        };
        let mut skip = 0;
        for action in skipped.split('+').filter(|a| !a.is_empty()) {
            match action_bit(action) {
                0 => return Err(bad(item, "unknown action to skip")),
                bit => skip |= bit,
            }
        }
        let t = t
            .parse()
            .map_err(|_| bad(item, "the time is not a number"))?;
        let enabled = match enabled {
            "none" => Enabled::Off,
            "state" => Enabled::State,
            "all" => Enabled::All,
            _ => return Err(bad(item, "unknown ENABLED")),
        };
        let context = match context {
            "none" => Context::Off,
            "state" => Context::State,
            "alloc" => Context::Alloc,
            "all" => Context::All,
            _ => return Err(bad(item, "unknown CONTEXT")),
        };
        let python_only = match stacks {
            "python" => true,
            "all" => false,
            _ => return Err(bad(item, "unknown STACKS")),
        };
        if out.last().is_some_and(|last| last.t > t) {
            return Err(bad(item, "times must not go back"));
        }
        out.push(Settings {
            t,
            enabled,
            context,
            python_only,
            skip,
        });
    }
    Ok(out)
}

/// What an event of the walk shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// An allocation (and an OOM, and a segment's allocation or mapping).
    Alloc,
    /// A free (and a segment's release or unmapping).
    Free,
}

/// The settings in force as a walk goes through the trace's time.
#[derive(Debug)]
pub struct Cursor {
    changes: Vec<Settings>,
    next: usize,
    now: Settings,
}

impl Cursor {
    /// A cursor over `changes` (empty: everything is shown, as without `--history`). Before
    /// the first change nothing is shown (see the module docs).
    pub fn new(changes: Vec<Settings>) -> Cursor {
        let now = if changes.is_empty() {
            EVERYTHING
        } else {
            Settings {
                enabled: Enabled::Off,
                context: Context::Off,
                ..EVERYTHING
            }
        };
        Cursor {
            changes,
            next: 0,
            now,
        }
    }

    /// Whether the program said anything (else the snapshot shows everything).
    pub fn given(&self) -> bool {
        !self.changes.is_empty()
    }

    /// Take `changes`, the program's changes so far, where they only add changes to the ones
    /// this cursor has and none of those added is before `t`, the time a walk has reached
    /// (else false: a walk must start over to apply them). The program passes only its last
    /// changes (the integration keeps 4 096): changes it no longer passes may be missing from
    /// the front, where the cursor has applied them. A program that said nothing before says
    /// something only by starting over, since before its first change nothing shows.
    pub fn extend(&mut self, changes: &[Settings], t: u64) -> bool {
        let Some(first) = changes.first() else {
            return self.changes.is_empty();
        };
        let dropped = if self.changes.is_empty() {
            0
        } else {
            match self.changes.iter().position(|c| c == first) {
                Some(dropped) if dropped <= self.next => dropped,
                _ => return false,
            }
        };
        let Some(added) = changes.strip_prefix(&self.changes[dropped..]) else {
            return false;
        };
        if added.is_empty() {
            return true;
        }
        if !self.given() || added.iter().any(|c| c.t < t) {
            return false;
        }
        self.changes.extend_from_slice(added);
        true
    }

    /// Move to time `t`; returns whether the history was cleared on the way (a change to
    /// `enabled=None` or `"state"`).
    pub fn advance(&mut self, t: u64) -> bool {
        let mut cleared = false;
        while let Some(change) = self.changes.get(self.next).filter(|c| c.t <= t) {
            cleared |= change.enabled != Enabled::All;
            self.now = *change;
            self.next += 1;
        }
        cleared
    }

    /// Whether events are kept now.
    pub fn keeps_events(&self) -> bool {
        self.now.enabled == Enabled::All
    }

    /// The actions skipped now (bits of [`action_bit`]).
    pub fn skipped_actions(&self) -> u16 {
        self.now.skip
    }

    /// The stack an event of `kind` shows now, or 0 for no frames. `stack` is the event's own
    /// (for a free, the freeing code's: 0 when none was captured), `alloc_stack` its block's
    /// (or segment's) allocation stack. As natively: events show stacks from `context="alloc"`
    /// on, a free its own only with `"all"` and its block's otherwise.
    pub fn event_stack(&self, kind: EventKind, stack: u32, alloc_stack: u32) -> u32 {
        if self.now.context < Context::Alloc {
            return 0;
        }
        let stack = match kind {
            EventKind::Alloc => stack,
            EventKind::Free if stack != 0 && self.now.context == Context::All => stack,
            EventKind::Free => alloc_stack,
        };
        self.with_python_only(stack)
    }

    /// The stack a block allocated now shows among the live blocks (`context` at least
    /// `"state"`).
    pub fn block_stack(&self, stack: u32) -> u32 {
        if self.now.context >= Context::State {
            self.with_python_only(stack)
        } else {
            0
        }
    }

    fn with_python_only(&self, stack: u32) -> u32 {
        if stack != 0 && self.now.python_only {
            stack | PYTHON_ONLY
        } else {
            stack
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses() {
        let changes = parse("10:all:alloc:python,20:none:none:all").unwrap();
        assert_eq!(changes.len(), 2);
        assert_eq!(changes[0].context, Context::Alloc);
        assert!(changes[0].python_only);
        assert_eq!(changes[1].enabled, Enabled::Off);
        for bad in [
            "10:all:alloc",
            "x:all:all:all",
            "1:some:all:all",
            "1:all:cpp:all",
            "1:all:all:cpp",
            "5:all:all:all,4:all:all:all",
            "1:all:all:all:alloc+frees",
            "1:all:all:all:x:y",
        ] {
            match parse(bad) {
                Err(Error::Message(e)) => assert!(e.contains("--history"), "{bad}: {e}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn settings_in_force_decide_what_shows() {
        let mut c = Cursor::new(vec![]);
        // Nothing said: everything, and a free shows its block's allocation stack.
        assert_eq!(c.event_stack(EventKind::Free, 0, 7), 7);
        let mut c2 = Cursor::new(
            parse("10:all:alloc:python,20:all:all:all,30:none:none:all,40:state:state:all")
                .unwrap(),
        );
        assert!(!c2.advance(5));
        assert!(
            !c2.keeps_events(),
            "before the program's first change, nothing was recorded"
        );
        assert_eq!(c2.block_stack(3), 0);
        assert!(!c2.advance(10));
        assert_eq!(c2.event_stack(EventKind::Alloc, 3, 0), 3 | PYTHON_ONLY);
        assert_eq!(
            c2.event_stack(EventKind::Free, 4, 3),
            3 | PYTHON_ONLY,
            "with alloc context a free shows its block's stack"
        );
        assert!(!c2.advance(25));
        assert_eq!(c2.event_stack(EventKind::Free, 4, 3), 4);
        assert_eq!(c2.event_stack(EventKind::Free, 0, 3), 3);
        assert!(c2.keeps_events());
        assert!(c2.advance(35), "enabled=None clears");
        assert_eq!(c2.block_stack(9), 0);
        assert!(c2.advance(45), "enabled='state' keeps no events");
        assert!(!c2.keeps_events());
        assert_eq!(c2.block_stack(9), 9);
        assert_eq!(c2.event_stack(EventKind::Alloc, 9, 0), 0);
        c.advance(1);
        assert!(c.keeps_events());
    }

    #[test]
    fn a_cursor_takes_changes_after_where_its_walk_is() {
        let first = parse("10:all:alloc:python").unwrap();
        let both = parse("10:all:alloc:python,30:none:none:all").unwrap();
        let mut c = Cursor::new(first.clone());
        c.advance(20);
        assert!(c.extend(&first, 25), "nothing new");
        assert!(!c.extend(&both, 31), "a change before the walk's time");
        assert!(
            !c.extend(&parse("11:all:alloc:python").unwrap(), 0),
            "not an extension"
        );
        assert!(
            !Cursor::new(vec![]).extend(&first, 0),
            "the first change starts over"
        );
        assert!(
            !c.extend(&[], 25),
            "saying nothing after something starts over"
        );
        assert!(c.extend(&both, 25));
        assert!(c.keeps_events());
        assert!(
            c.advance(30),
            "the change added applies when the walk reaches it"
        );
        assert!(!c.keeps_events());
    }

    #[test]
    fn a_cursor_takes_the_program_s_last_changes_without_its_oldest() {
        let three = parse("10:all:all:all,20:all:alloc:all,30:all:all:all").unwrap();
        let mut c = Cursor::new(three.clone());
        c.advance(35);
        let later = parse("20:all:alloc:all,30:all:all:all,40:none:none:all").unwrap();
        assert!(c.extend(&later, 35), "the oldest change dropped, one added");
        assert!(c.advance(45), "the added change applies");
        let unknown = parse("50:all:all:all,60:all:all:all").unwrap();
        assert!(!c.extend(&unknown, 45), "nothing in common: start over");
        let mut behind = Cursor::new(three);
        behind.advance(15);
        let skipped = parse("30:all:all:all,40:all:all:all").unwrap();
        assert!(
            !behind.extend(&skipped, 15),
            "a dropped change not yet applied"
        );
    }

    #[test]
    fn skipped_actions_apply_while_in_force() {
        let mut c =
            Cursor::new(parse("10:all:all:all:free_requested+segment_map,20:all:all:all").unwrap());
        c.advance(15);
        assert_eq!(
            c.skipped_actions(),
            action_bit("free_requested") | action_bit("segment_map")
        );
        assert_ne!(c.skipped_actions() & action_bit("free_requested"), 0);
        assert_eq!(c.skipped_actions() & action_bit("alloc"), 0);
        c.advance(25);
        assert_eq!(c.skipped_actions(), 0);
    }
}
