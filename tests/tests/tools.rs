//! The offline tools on traces the shim wrote over fakecuda: `simulate` with the recorded config
//! makes the run's decisions again (its peak reserved is the recorded one, exactly; every request
//! gets a block of the recorded size), and a different config changes them.
//!
//! Exactness covers single-threaded runs with any reuse policy (blocks held for `record_stream`
//! included) and multi-threaded runs with immediate reuse. A multi-threaded run with fenced reuse can interleave fence waits in ways a
//! sequential replay does not reproduce; `simulate` then says where it diverged.

use cachealloc_tests::{cachealloc_binary, trace_dirs, traced};
use cachealloc_tools::analysis::scan;
use cachealloc_tools::commands::simulate::simulate_dir;
use cachealloc_tools::progress::Progress;

/// A program, its arguments, the shim's config and extra environment.
type Case = (
    &'static str,
    &'static [&'static str],
    &'static str,
    &'static [(&'static str, &'static str)],
);

#[test]
fn simulate_with_the_recorded_config_reproduces_the_recorded_peak_reserved() {
    let cases: [Case; 12] = [
        ("churn", &["20000"], "", &[]),
        // A block held from reuse while another stream's recorded work uses it.
        ("held_free", &[], "", &[]),
        ("held_free", &[], "expandable_segments:False", &[]),
        ("churn", &["20000"], "expandable_segments:True", &[]),
        ("race", &["nonblocking"], "expandable_segments:True", &[]),
        (
            "oom",
            &[],
            "expandable_segments:True",
            &[("FAKECUDA_CAPACITY_MB", "64")],
        ),
        ("churn", &["20000"], "roundup_power2_divisions:4", &[]),
        ("threads", &["4", "300"], "", &[]),
        (
            "churn",
            &["20000"],
            "roundup_power2_divisions:2,reuse:fenced",
            &[],
        ),
        ("race", &["nonblocking"], "", &[]),
        ("race", &["blocking", "late"], "", &[]),
        ("oom", &[], "", &[("FAKECUDA_CAPACITY_MB", "64")]),
    ];
    for (program, args, conf, env) in cases {
        let dir = traced(program, args, conf, env);
        let recorded = scan(&dir, &Progress::new("test")).expect("scan");
        let simulated = simulate_dir(&dir, None, None).expect("simulate");
        assert!(!recorded.devices.is_empty());
        assert_eq!(
            (simulated.diverged_at, simulated.mapped_differently_at),
            (None, None),
            "{program} {args:?} with {conf:?}"
        );
        for (device, d) in &recorded.devices {
            let sim = &simulated.devices[device];
            assert_eq!(
                (sim.peak_reserved, sim.peak_allocated),
                (d.peak_reserved.bytes, d.peak_allocated.bytes),
                "{program} {args:?} with {conf:?}: simulated against recorded peak reserved, allocated"
            );
            assert_eq!(
                sim.device_allocs, d.segment_allocs,
                "{program} {args:?} with {conf:?}: device allocations"
            );
        }
    }
}

/// With threads racing around maps (one maps outside the lock while another frees the block
/// the new memory was to join), a replay one request at a time may map another amount: then
/// it says so, and otherwise it reproduces the run.
#[test]
fn simulate_says_when_threads_mapped_differently() {
    for _ in 0..3 {
        let dir = traced("threads", &["4", "300"], "expandable_segments:True", &[]);
        let recorded = scan(&dir, &Progress::new("test")).expect("scan");
        let simulated = simulate_dir(&dir, None, None).expect("simulate");
        let exact = recorded.devices.iter().all(|(device, d)| {
            simulated.devices[device].peak_reserved == d.peak_reserved.bytes
                && simulated.devices[device].device_allocs == d.segment_allocs
        });
        assert!(
            exact || simulated.mapped_differently_at.is_some() || simulated.diverged_at.is_some(),
            "a replay that differs from the run without saying so: {simulated:?}"
        );
    }
}

#[test]
fn simulate_with_another_config_changes_the_outcome() {
    let dir = traced("threads", &["4", "300"], "", &[]);
    let recorded = simulate_dir(&dir, None, None).expect("simulate");
    // Rounding every request up to a power of two allocates more.
    let rounded = simulate_dir(&dir, Some("roundup_power2_divisions:2"), None).expect("simulate");
    assert!(rounded.devices[&0].peak_allocated > recorded.devices[&0].peak_allocated);
    // A device too small for the run: the first failing request is named.
    let small = simulate_dir(&dir, None, Some(8 << 20)).expect("simulate");
    assert!(small.failures > 0);
    let failure = small.first_failure.expect("a failure");
    assert!(failure.size > 0 && failure.device == 0);
    assert!(!failure.site.is_empty());
}

#[test]
fn cachealloc_run_preloads_the_shim_forwards_the_exit_code_and_summarizes() {
    let dir = cachealloc_tests::fresh_dir();
    let out = std::process::Command::new(cachealloc_binary())
        .current_dir(&dir)
        .env("LD_LIBRARY_PATH", cachealloc_tests::fakecuda_dir())
        .env_remove("LD_PRELOAD")
        .args(["run", "--conf", "stacks:native,log:quiet", "--"])
        .arg(cachealloc_tests::program("basic"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("OK basic"), "{stdout}");
    assert!(
        stdout.contains("peak allocated"),
        "the summary follows: {stdout}"
    );
    assert!(
        stdout.contains("main"),
        "with native stacks, main is a site: {stdout}"
    );
    assert_eq!(trace_dirs(&dir.join("cachealloc-trace")).len(), 1);

    // A command that fails: its exit code comes back; it made no CUDA call, so no trace.
    let out = std::process::Command::new(cachealloc_binary())
        .current_dir(&dir)
        .args([
            "run",
            "--trace-dir",
            "elsewhere",
            "--",
            "sh",
            "-c",
            "exit 3",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stdout).contains("no trace was written"));
}

#[test]
fn the_tools_read_a_trace_across_rotated_files() {
    // Every file kept: the scan must count every event once, though each file repeats the live
    // state in its opening checkpoint.
    let dir = traced(
        "churn",
        &["150000"],
        "trace_file_mb:1,trace_files:1000,compress:off,stacks:native",
        &[],
    );
    let whole = scan(&dir, &Progress::new("test")).expect("scan");
    assert!(whole.files >= 3, "{} files", whole.files);
    assert_eq!(whole.devices[&0].allocs, 150_000);
    assert_eq!(whole.devices[&0].frees, 150_000);
    let simulated = simulate_dir(&dir, None, None).expect("simulate");
    assert_eq!(simulated.diverged_at, None);
    assert_eq!(
        simulated.devices[&0].peak_reserved,
        whole.devices[&0].peak_reserved.bytes
    );

    // With the first files rotated away, what is left still reads alone: its first checkpoint
    // holds the blocks live then, and stacks are defined before use.
    let dir = traced(
        "churn",
        &["150000"],
        "trace_file_mb:1,trace_files:2,compress:off,stacks:native",
        &[],
    );
    let tail = scan(&dir, &Progress::new("test")).expect("scan");
    assert_eq!(tail.files, 2);
    assert!(tail.devices[&0].allocs < 150_000);
    assert!(tail.tears.is_empty());
    let mut walk = cachealloc_tools::walk::TraceWalk::open(&dir).expect("open");
    walk.run_through(u64::MAX).expect("walk");
    assert!(walk.state.blocks.is_empty(), "churn frees everything");
    let simulated = simulate_dir(&dir, None, None).expect("simulate");
    assert!(simulated.failures == 0);
}
