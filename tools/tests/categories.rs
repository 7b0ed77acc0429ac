//! Categories and modules (`cachealloc_tools::categories`, *Note [Categories by lifetime]*) on
//! hand-built traces whose every block's category is known: one test per lifetime rule (each
//! fails if its rule is broken), traces rotated into many files and with their first files
//! rotated away, a trace without context records, and the commands that show categories
//! (`summary`, `snapshot`, `memory-timeline`, `compare`, `plot`).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use cachealloc_recorder::schema::*;
use cachealloc_tools::categories::Category::{self, *};
use cachealloc_tools::categories::pass::{Outcome, Plan, run};
use cachealloc_tools::progress::Progress;
use common::program::{MIB, Program, training_step};
use common::python::python_text;
use common::{cachealloc, scratch};

/// The categories pass over `dir` with `plan`.
fn categories(dir: &Path, plan: &Plan) -> Outcome {
    run(dir, plan, &Progress::hidden(), |_, _| {}).unwrap()
}

/// Each block of a fresh [`training_step`] trace with its category.
fn classified(name: &str) -> (HashMap<&'static str, Category>, PathBuf) {
    let dir = scratch(name).join("trace");
    let blocks = training_step(&dir, 2 * MIB, false);
    let plan = Plan {
        every_allocation: true,
        ..Plan::default()
    };
    let outcome = categories(&dir, &plan);
    assert!(outcome.has_context);
    let by_name = blocks
        .iter()
        .map(|(name, (ordinal, _, _))| (*name, outcome.every_allocation.get(*ordinal).unwrap()))
        .collect();
    (by_name, dir)
}

#[test]
fn a_tag_names_the_whole_life() {
    let (c, _) = classified("tag");
    assert_eq!(c["parameter"], Parameter);
    assert_eq!(c["gradient"], Gradient, "a tag on a backward block wins");
    assert_eq!(
        c["forward tagged input"], Input,
        "a tag after the allocation wins"
    );
}

#[test]
fn forward_blocks_by_lifetime() {
    let (c, _) = classified("forward");
    assert_eq!(c["forward temporary"], Temporary, "freed in its forward");
    assert_eq!(
        c["activation"], Activation,
        "freed by the backward that followed"
    );
    assert_eq!(
        c["forward kept past backward"], Unknown,
        "alive past that backward"
    );
    assert_eq!(
        c["inference output"], Temporary,
        "freed before any backward began"
    );
}

#[test]
fn the_loss_between_forward_and_backward_is_an_activation() {
    let (c, _) = classified("loss");
    assert_eq!(c["loss saved for backward"], Activation);
}

#[test]
fn backward_blocks_are_autograd_detail() {
    let (c, _) = classified("backward");
    assert_eq!(c["backward temporary"], AutogradDetail);
    assert_eq!(c["backward kept"], AutogradDetail);
}

#[test]
fn optimizer_blocks_by_lifetime() {
    let (c, _) = classified("optimizer");
    assert_eq!(c["optimizer temporary"], Temporary, "freed within the step");
    assert_eq!(c["optimizer state"], OptimizerState, "alive after it");
}

#[test]
fn blocks_made_outside_phases() {
    let (c, _) = classified("none");
    assert_eq!(c["input"], Input, "alive at the next forward's start");
    assert_eq!(c["none freed before forward"], Temporary);
}

#[test]
fn bytes_at_an_instant_add_up_by_category_and_module() {
    let dir = scratch("instant").join("trace");
    training_step(&dir, 2 * MIB, false);
    // The peak: the summary's scan finds it; the composition there must add up to it.
    let scan = cachealloc_tools::analysis::scan(&dir, &Progress::hidden()).unwrap();
    let peak = scan.devices[&0].peak_allocated;
    let plan = Plan {
        instants: [(0, peak.index)].into(),
        ..Plan::default()
    };
    let outcome = categories(&dir, &plan);
    let at = &outcome.at_instant[&0];
    assert_eq!(at.by_category.iter().sum::<u64>(), peak.bytes);
    // The same peak, found in the pass itself (what `summary` uses, in one walk).
    let found = categories(
        &dir,
        &Plan {
            peaks: true,
            ..Plan::default()
        },
    );
    let row = &found.peaks[&0];
    assert_eq!((row.index, row.allocated), (peak.index, peak.bytes));
    assert_eq!(found.at_instant[&0].by_category, at.by_category);
    assert_eq!(found.at_instant[&0].by_scope, at.by_scope);
    assert_eq!(at.by_scope.values().sum::<u64>(), peak.bytes);
    // The peak is after the optimizer state's allocation: 4 (param) + 1 (input) + 5 (kept) +
    // 4 (grad) + 0.75 (kept backward) + 8 (state) + 1.5 (its temporary) MiB.
    assert_eq!(peak.bytes, (24 * MIB) + (MIB / 4));
    assert_eq!(at.by_category[OptimizerState.index()], 8 * MIB);
    assert_eq!(at.by_category[Temporary.index()], 1536 << 10);
    assert_eq!(at.by_category[Unknown.index()], 5 * MIB);
    let head = outcome
        .scope_names
        .iter()
        .find(|(_, n)| n.as_str() == "Net.head")
        .map(|(id, _)| *id)
        .unwrap();
    assert_eq!(at.by_scope[&head], 5 * MIB);
}

#[test]
fn rotated_files_keep_categories() {
    let plan = Plan {
        every_allocation: true,
        ..Plan::default()
    };
    let one = scratch("one-file").join("trace");
    training_step(&one, 2 * MIB, false);
    let many = scratch("many-files").join("trace");
    training_step(&many, 2 * MIB, true);
    let files = cachealloc_recorder::reader::trace_files(&many)
        .unwrap()
        .len();
    assert!(files >= 8, "a file per phase: {files}");
    let (a, b) = (categories(&one, &plan), categories(&many, &plan));
    assert_eq!(a.every_allocation.to_vec(), b.every_allocation.to_vec());
    assert!(b.every_allocation.to_vec().contains(&Activation));
}

#[test]
fn blocks_whose_allocation_was_rotated_away() {
    let dir = scratch("rotated-away").join("trace");
    let mut p = Program::new(&dir, true, 3);
    let param = p.alloc(4 * MIB);
    p.tag(param, TAG_PARAMETER);
    p.phase(PHASE_FORWARD);
    let act = p.alloc(2 * MIB);
    let kept = p.alloc(3 * MIB);
    p.rotate();
    p.phase(PHASE_BACKWARD);
    p.rotate();
    p.free(act, 2 * MIB);
    p.rotate();
    p.phase(PHASE_NONE);
    p.free(kept, 3 * MIB);
    p.finish();
    let files = cachealloc_recorder::reader::trace_files(&dir).unwrap();
    // Files 2 to 4 (the last one empty): the allocations' files are gone, file 2 opens in the
    // backward.
    assert_eq!(files.len(), 3, "the first files are gone: {files:?}");
    let outcome = categories(
        &dir,
        &Plan {
            blocks_at: Some(u64::MAX - 1),
            ..Plan::default()
        },
    );
    // Known only from checkpoints: the tag, and the phase of the allocation.
    assert_eq!(outcome.blocks_at[&(0, param)], Parameter);
    assert_eq!(outcome.blocks_at[&(0, act)], Activation);
    assert_eq!(outcome.blocks_at[&(0, kept)], Unknown);
}

#[test]
fn a_trace_without_context_has_no_categories() {
    let dir = scratch("plain").join("trace");
    let mut p = Program::new(&dir, false, 10);
    let a = p.alloc(MIB);
    p.alloc(2 * MIB);
    p.free(a, MIB);
    p.finish();
    let outcome = categories(
        &dir,
        &Plan {
            every_allocation: true,
            ..Plan::default()
        },
    );
    assert!(!outcome.has_context);
    assert_eq!(outcome.every_allocation.to_vec(), [Unknown, Unknown]);
    let summary = cachealloc(dir.parent().unwrap(), &["summary", "trace"]);
    assert!(summary.contains("top allocation sites"), "{summary}");
    for absent in ["by category", "top modules", "UNKNOWN", "←"] {
        assert!(!summary.contains(absent), "{absent:?} in {summary}");
    }
}

#[test]
fn summary_shows_categories_modules_and_user_lines() {
    let (_, dir) = classified("summary");
    let out = cachealloc(dir.parent().unwrap(), &["summary", "trace"]);
    let section = |title: &str| -> Vec<String> {
        out.lines()
            .skip_while(|l| !l.contains(title))
            .skip(1)
            .take_while(|l| l.starts_with("    "))
            .map(str::to_string)
            .collect()
    };
    let at_peak = section("by category at peak allocated");
    let line = |name: &str| {
        at_peak
            .iter()
            .find(|l| l.trim_start().starts_with(name))
            .cloned()
    };
    assert!(
        line("OPTIMIZER_STATE").unwrap().contains("8.00 MiB"),
        "{out}"
    );
    assert!(line("PARAMETER").unwrap().contains("4.00 MiB"), "{out}");
    assert!(line("ACTIVATION").is_none(), "none at the peak: {out}");
    assert!(!section("by category over time").is_empty(), "{out}");
    let modules = section("top modules at peak allocated");
    assert!(
        modules
            .iter()
            .any(|l| l.contains("5.00 MiB") && l.ends_with("  Net.head")),
        "{out}"
    );
    assert!(modules.iter().any(|l| l.ends_with("(no module)")), "{out}");
    let sites = section("top allocation sites live at peak allocated");
    assert!(
        sites
            .iter()
            .any(|l| l.contains("linear (") && l.ends_with("← forward (/home/me/model.py:42)")),
        "the user's line beside the innermost frame: {out}"
    );
}

#[test]
fn snapshot_blocks_carry_their_category() {
    let (_, dir) = classified("snapshot");
    let work = dir.parent().unwrap();
    cachealloc(
        work,
        &["snapshot", "trace", "--at-peak", "-o", "snap.pickle"],
    );
    let script = r#"
import pickle, sys, collections
s = pickle.load(open(sys.argv[1], "rb"))
by = collections.Counter()
for seg in s["segments"]:
    for b in seg["blocks"]:
        if b["state"] == "active_allocated":
            by[b["category"]] += b["size"]
allocs = collections.Counter(e["category"] for t in s["device_traces"] for e in t if e["action"] == "alloc")
print(sorted(by.items()), sorted(allocs.items()))
"#;
    let out = python_text(script, &[work.join("snap.pickle").to_str().unwrap()]);
    // At the peak (in the optimizer step): what `bytes_at_an_instant…` adds up, and before it
    // three temporaries and two activations were allocated.
    assert!(out.contains("('optimizer_state', 8388608)"), "{out}");
    assert!(out.contains("('parameter', 4194304)"), "{out}");
    assert!(out.contains("('temporary', 1572864)"), "{out}");
    assert!(out.contains("('unknown', 5242880)"), "{out}");
    assert!(out.contains("('temporary', 3)"), "{out}");
    assert!(out.contains("('activation', 2)"), "{out}");
}

/// The data of a `plot` page.
fn plot_data(page: &Path) -> serde_json::Value {
    let page = std::fs::read_to_string(page).unwrap();
    const DATA: &str = "const DATA = ";
    let start = page.find(DATA).unwrap() + DATA.len();
    let end = start + page[start..].find(";\n").unwrap();
    serde_json::from_str(&page[start..end]).unwrap()
}

/// A JSON array of integers.
fn numbers(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect()
}

#[test]
fn plot_stacks_by_category_and_by_module() {
    let (_, dir) = classified("plot");
    let work = dir.parent().unwrap();
    cachealloc(work, &["plot", "trace", "--points", "1000", "-o", "c.html"]);
    let panel = &plot_data(&work.join("c.html"))["panels"][0];
    let names: Vec<&str> = panel["series"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert_eq!(names[0], "PARAMETER");
    assert_eq!(names.len(), 8);
    assert_eq!(
        panel["series_colors"][4], "red",
        "ACTIVATION in PyTorch's colour"
    );
    let allocated = numbers(&panel["allocated"]);
    let rows: Vec<Vec<u64>> = panel["by_series"]
        .as_array()
        .unwrap()
        .iter()
        .map(numbers)
        .collect();
    assert!(rows.len() > 10);
    for (row, total) in rows.iter().zip(&allocated) {
        assert_eq!(row.iter().sum::<u64>(), *total, "each point adds up");
    }
    let peak = allocated
        .iter()
        .enumerate()
        .max_by_key(|(_, b)| **b)
        .unwrap()
        .0;
    assert_eq!(rows[peak][Category::OptimizerState.index()], 8 * MIB);
    assert!(
        rows.iter()
            .any(|r| r[Category::Activation.index()] == 2 * MIB + (256 << 10))
    );

    cachealloc(work, &["plot", "trace", "--by", "module", "-o", "m.html"]);
    let panel = &plot_data(&work.join("m.html"))["panels"][0];
    let names: Vec<&str> = panel["series"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"Net.head") && names.contains(&"(no module)"),
        "{names:?}"
    );
    cachealloc(work, &["plot", "trace", "--by", "site", "-o", "s.html"]);
    assert!(plot_data(&work.join("s.html"))["panels"][0]["series"].is_null());
}

#[test]
fn memory_timeline_in_pytorchs_form() {
    let (_, dir) = classified("timeline");
    let work = dir.parent().unwrap();
    cachealloc(
        work,
        &[
            "memory-timeline",
            "trace",
            "--points",
            "100000",
            "-o",
            "t.json",
        ],
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(work.join("t.json")).unwrap()).unwrap();
    let [times, sizes] = json.as_array().unwrap().as_slice() else {
        panic!("[times, sizes]: {json}")
    };
    let times = numbers(times);
    let sizes: Vec<Vec<u64>> = sizes.as_array().unwrap().iter().map(numbers).collect();
    assert_eq!(times.len(), sizes.len());
    assert!(times.windows(2).all(|w| w[0] < w[1]), "times increase");
    // Microseconds since the epoch: the header's base (1.79e18 ns) plus a few µs.
    assert!(times[0] >= 1_790_000_000_000_000 && times[0] < 1_790_000_000_001_000);
    for row in &sizes {
        assert_eq!(row.len(), 9, "a leading 0, then PyTorch's eight columns");
        assert_eq!(row[0], 0);
    }
    let peak = sizes.iter().max_by_key(|r| r.iter().sum::<u64>()).unwrap();
    assert_eq!(peak.iter().sum::<u64>(), 24 * MIB + MIB / 4);
    assert_eq!(peak[1 + Category::Parameter.index()], 4 * MIB);
    assert_eq!(peak[1 + Category::OptimizerState.index()], 8 * MIB);
    assert_eq!(peak[1 + Category::Unknown.index()], 5 * MIB);
    // Every event is its own slice here: the activations appear.
    assert!(
        sizes
            .iter()
            .any(|r| r[1 + Category::Activation.index()] > 0)
    );
}

#[test]
fn compare_by_category() {
    let work = scratch("compare");
    training_step(&work.join("a"), 2 * MIB, false);
    training_step(&work.join("b"), 20 * MIB, false);
    let out = cachealloc(&work, &["compare", "a", "b", "--categories"]);
    // A's peak is in the optimizer step (24.25 MiB); B's 20 MiB activation moves its peak to
    // the loss, before the backward (33.25 MiB), with the activations live.
    let row = |name: &str| -> Vec<String> {
        let line = out.lines().find(|l| l.starts_with(name));
        let line = line.unwrap_or_else(|| panic!("{name}: {out}"));
        line.split("  ")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    };
    assert_eq!(
        row("ACTIVATION"),
        [
            "ACTIVATION",
            "0 B",
            "0.0%",
            "20.25 MiB",
            "60.9%",
            "+20.25 MiB"
        ],
        "{out}"
    );
    assert_eq!(row("OPTIMIZER_STATE")[5], "-8.00 MiB", "{out}");
    assert_eq!(
        row("total"),
        [
            "total",
            "24.25 MiB",
            "100.0%",
            "33.25 MiB",
            "100.0%",
            "+9.00 MiB"
        ],
        "{out}"
    );
}

#[test]
fn activation_checkpointing_recomputes_inside_the_backward() {
    let dir = scratch("recompute").join("trace");
    let mut p = Program::new(&dir, false, 10);
    p.phase(PHASE_FORWARD);
    let saved = p.alloc(2 * MIB);
    p.phase(PHASE_BACKWARD);
    // A checkpointed segment's forward runs again inside the backward.
    p.phase(PHASE_FORWARD);
    let recomputed = p.alloc(3 * MIB);
    let scratchpad = p.alloc(MIB);
    p.free(scratchpad, MIB);
    p.phase(PHASE_BACKWARD);
    p.free(recomputed, 3 * MIB);
    p.free(saved, 2 * MIB);
    p.phase(PHASE_NONE);
    p.finish();
    let outcome = categories(
        &dir,
        &Plan {
            every_allocation: true,
            ..Plan::default()
        },
    );
    assert_eq!(
        outcome.every_allocation.to_vec(),
        [Activation, Activation, Temporary],
        "saved before the segment, recomputed in it, scratch of the recomputation"
    );
}

#[test]
fn blocks_kept_from_before_the_loop_are_not_inputs() {
    let dir = scratch("kept-state").join("trace");
    let mut p = Program::new(&dir, false, 10);
    let bucket = p.alloc(4 * MIB);
    let mut batch = p.alloc(MIB);
    for _ in 0..4 {
        p.phase(PHASE_FORWARD);
        p.phase(PHASE_BACKWARD);
        p.phase(PHASE_OPTIMIZER);
        p.phase(PHASE_NONE);
        p.free(batch, MIB);
        batch = p.alloc(MIB);
    }
    p.phase(PHASE_FORWARD);
    p.finish();
    let outcome = categories(
        &dir,
        &Plan {
            every_allocation: true,
            ..Plan::default()
        },
    );
    assert_eq!(outcome.every_allocation.len(), 6);
    assert_eq!(
        outcome.every_allocation.get(0).unwrap(),
        Unknown,
        "the bucket, kept for the run"
    );
    assert!(
        outcome.every_allocation.to_vec()[1..]
            .iter()
            .all(|c| *c == Input),
        "each batch: {:?} ({bucket:#x})",
        outcome.every_allocation
    );
}

#[test]
fn perfetto_shows_phases_as_slices() {
    let (_, dir) = classified("perfetto");
    let work = dir.parent().unwrap();
    cachealloc(work, &["perfetto", "trace", "-o", "p.json"]);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(work.join("p.json")).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    let on_track = |ph: &str| -> Vec<&serde_json::Value> {
        events
            .iter()
            .filter(|e| e["ph"] == ph && e["tid"] == 1u64 << 32)
            .collect()
    };
    let begins: Vec<&str> = on_track("B")
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        begins,
        [
            "forward (step 0)",
            "backward (step 0)",
            "optimizer (step 0)",
            "forward (step 0)"
        ]
    );
    assert_eq!(on_track("E").len(), begins.len(), "every slice ends");
}

#[test]
fn snapshot_at_the_end_names_blocks_seen_only_in_checkpoints() {
    let work = scratch("snapshot-rotated");
    let mut p = Program::new(&work.join("trace"), true, 2);
    let param = p.alloc(4 * MIB);
    p.tag(param, TAG_PARAMETER);
    p.phase(PHASE_FORWARD);
    p.alloc(2 * MIB);
    p.rotate();
    p.phase(PHASE_NONE);
    p.rotate();
    p.phase(PHASE_FORWARD);
    p.alloc(3 * MIB);
    p.finish();
    cachealloc(&work, &["snapshot", "trace", "-o", "end.pickle"]);
    let script = r#"
import pickle, sys
s = pickle.load(open(sys.argv[1], "rb"))
print(sorted((b["size"], b["category"]) for seg in s["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"))
"#;
    let out = python_text(script, &[work.join("end.pickle").to_str().unwrap()]);
    // The parameter's and the first forward's allocations were rotated away: their categories
    // come from the checkpoints (a tag; a forward block alive past no backward: temporary).
    assert_eq!(
        out.trim(),
        "[(2097152, 'temporary'), (3145728, 'temporary'), (4194304, 'parameter')]",
        "{out}"
    );
}
