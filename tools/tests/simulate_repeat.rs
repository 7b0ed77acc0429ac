//! `simulate --after T --repeat N`: the run's requests from `T` on repeat with a period (a
//! training step, or a cycle of its shapes); the simulation goes on past the recording for `N`
//! periods. A block a period inherits from the one before (allocated before the period starts
//! and freed in it: here a step's activations, for a period that starts at its gradients) must
//! be the block the previous repetition made, or the repeated run would leak one per
//! repetition.

mod common;

use std::path::Path;

use cachealloc_tools::commands::simulate::{SimulateArgs, run};
use common::program::Program;
use common::scratch;

const MIB: u64 = 1 << 20;

/// A training loop: parameters, then `steps` steps, each freeing the previous step's gradients,
/// allocating two activations (their sizes alternate between even and odd steps: a cycle of
/// two steps) and this step's gradients, and freeing the activations. With `growing`, every
/// step's activations are larger than the last (nothing repeats). Returns the time just before
/// step 2's gradients' allocation (ns): a period from there inherits the step's activations,
/// allocated before it and freed in it.
fn training_trace(dir: &Path, steps: u64, growing: bool) -> u64 {
    let mut p = Program::new(dir, false, 1);
    p.alloc(10 * MIB);
    let mut gradients: Option<u64> = None;
    let mut step_two = 0;
    for step in 0..steps {
        if let Some(g) = gradients.take() {
            p.free(g, 3 * MIB);
        }
        let (a, b) = if growing {
            ((4 + step) * MIB, (6 + step) * MIB)
        } else if step % 2 == 0 {
            (4 * MIB, 6 * MIB)
        } else {
            (6 * MIB, 2 * MIB)
        };
        let x = p.alloc(a);
        let y = p.alloc(b);
        if step == 2 {
            step_two = p.now() + 1;
        }
        gradients = Some(p.alloc(3 * MIB));
        p.free(y, b);
        p.free(x, a);
    }
    p.finish();
    step_two
}

fn simulate(dir: &Path, after: u64, times: u64) -> Result<String, String> {
    let args = SimulateArgs {
        trace: dir.to_path_buf(),
        conf: None,
        capacity: None,
        granularity: 2 * MIB,
        sweep: false,
        after: Some(after),
        repeat: Some(times),
    };
    let mut out = Vec::new();
    run(&args, &mut out).map_err(|e| format!("{e:?}"))?;
    Ok(String::from_utf8(out).unwrap())
}

/// The repetitions' rows: (repetition, reserved as printed, device calls).
fn rows(report: &str) -> Vec<(u64, String, u64)> {
    let table = report
        .split("repeated\n")
        .nth(1)
        .expect("a table of repetitions");
    table
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let n = f.first()?.parse().ok()?;
            Some((n, format!("{} {}", f[1], f[2]), f.last()?.parse().ok()?))
        })
        .collect()
}

#[test]
fn a_repeated_training_loop_keeps_its_blocks_lives() {
    let dir = scratch("repeat-loop");
    let after = training_trace(&dir, 8, false);
    let report = simulate(&dir, after, 40).unwrap();
    assert!(
        report.contains("one period of 6 allocations, 40 times"),
        "{report}"
    );
    let rows = rows(&report);
    assert_eq!(
        rows.iter().map(|r| r.0).collect::<Vec<_>>(),
        [1, 4, 8, 11, 15, 18, 22, 25, 29, 32, 36, 40],
        "twelve repetitions shown of 40"
    );
    // Each repetition frees what it inherits (the gradients of the repetition before): reserved
    // memory and the device calls stay where the first repetition left them.
    let (first, last) = (&rows[0], &rows[rows.len() - 1]);
    assert_eq!(first.1, last.1, "reserved memory is flat: {report}");
    assert_eq!(first.2, last.2, "served from the cache: {report}");
    assert!(
        report.contains("over the second half (repetitions 20 to 40): +0 B"),
        "{report}"
    );
}

#[test]
fn requests_that_do_not_repeat_are_refused_with_the_reason() {
    let dir = scratch("repeat-growing");
    let after = training_trace(&dir, 8, true);
    let e = simulate(&dir, after, 10).unwrap_err();
    assert!(e.contains("do not repeat"), "{e}");
    assert!(e.contains("--after"), "{e}");
}

/// Each step asks twice for the same size first: a period of one request would match the next
/// request, and replaying it alone would allocate without ever freeing. The period is checked
/// over what follows it, so the step is found.
#[test]
fn two_equal_requests_in_a_row_are_not_a_period() {
    let dir = scratch("repeat-twins");
    let mut p = Program::new(&dir, false, 1);
    let mut after = 0;
    for step in 0..10 {
        if step == 3 {
            after = p.now() + 1;
        }
        let blocks = [4 * MIB, 4 * MIB, 7 * MIB].map(|size| (p.alloc(size), size));
        for (address, size) in blocks {
            p.free(address, size);
        }
    }
    p.finish();
    let report = simulate(&dir, after, 30).unwrap();
    assert!(
        report.contains("one period of 3 allocations, 30 times"),
        "{report}"
    );
    assert!(
        report.contains("over the second half (repetitions 15 to 30): +0 B"),
        "{report}"
    );
}
