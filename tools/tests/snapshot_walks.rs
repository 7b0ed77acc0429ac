//! `cachealloc snapshot` at the trace's end (what the Python integration asks for each
//! `torch.cuda.memory_snapshot()`) walks a trace with context once: its window rides on the
//! categories pass. These tests hold that walk to the two walks a snapshot at a time takes, and
//! check the trace whose context comes too late for one walk.

mod common;

use cachealloc_recorder::schema::{PHASE_FORWARD, TAG_PARAMETER};
use common::program::{MIB, Program, training_step};
use common::python::python_text;
use common::{cachealloc, scratch};

/// The snapshot at the end and at a time after the last record (the same moment, reached by
/// the window's own walk and then the categories pass) are the same bytes.
fn one_walk_equals_two(name: &str, rotate: bool, events: &str) {
    let work = scratch(name);
    training_step(&work.join("trace"), 2 * MIB, rotate);
    let end = cachealloc(
        &work,
        &["snapshot", "trace", "--events", events, "-o", "end.pickle"],
    );
    let at = cachealloc(
        &work,
        &[
            "snapshot",
            "trace",
            "--events",
            events,
            "--at",
            "100000",
            "-o",
            "at.pickle",
        ],
    );
    assert!(
        end.contains("at the end") && at.contains("at 100000"),
        "{end}{at}"
    );
    let end = std::fs::read(work.join("end.pickle")).unwrap();
    let at = std::fs::read(work.join("at.pickle")).unwrap();
    assert!(end.len() > 200, "a snapshot with blocks and entries");
    assert!(
        end == at,
        "the snapshot at the end differs from the one at its time"
    );
}

#[test]
fn the_window_on_the_categories_walk_is_the_window_of_its_own_walk() {
    one_walk_equals_two("one-walk", false, "100000");
    one_walk_equals_two("one-walk-rotated", true, "100000");
    one_walk_equals_two("one-walk-few", false, "3");
    one_walk_equals_two("one-walk-segments", true, "0");
}

#[test]
fn context_after_the_first_records_still_gives_categories() {
    let work = scratch("late-context");
    let mut p = Program::new(&work.join("trace"), false, 2);
    // More records than the snapshot reads for context before it chooses its walks (small
    // blocks: the program's one segment holds them all at their own addresses).
    for _ in 0..60_000 {
        let a = p.alloc(512);
        p.free(a, 512);
    }
    let param = p.alloc(4 * MIB);
    p.tag(param, TAG_PARAMETER);
    p.phase(PHASE_FORWARD);
    p.alloc(2 * MIB);
    p.finish();
    cachealloc(
        &work,
        &["snapshot", "trace", "--events", "4", "-o", "end.pickle"],
    );
    let script = r#"
import pickle, sys
s = pickle.load(open(sys.argv[1], "rb"))
blocks = sorted((b["size"], b["category"]) for seg in s["segments"] for b in seg["blocks"] if b["state"] == "active_allocated")
entries = [(e["action"], e.get("category")) for e in s["device_traces"][0]]
print(blocks, entries)
"#;
    let out = python_text(script, &[work.join("end.pickle").to_str().unwrap()]);
    assert_eq!(
        out.trim(),
        "[(2097152, 'temporary'), (4194304, 'parameter')] [('free_requested', None), \
         ('free_completed', None), ('alloc', 'parameter'), ('alloc', 'temporary')]",
        "{out}"
    );
}
