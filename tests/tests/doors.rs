//! End-to-end tests of the four doors into CUDA's allocation functions (see the shim's
//! `doors` module): the runtime's symbols (programs over the shared fakecuda runtime), the
//! driver's symbols (`driver_api`, linked with libcuda), `dlsym` on a handle of libcuda
//! (`driver_dlsym`, as cuBLAS and XLA do), and the driver entry points (`*_static`: the same
//! programs over the static fakecuda runtime, which reaches the driver only through
//! `cuGetProcAddress_v2`; `entry_point`: `cudaGetDriverEntryPoint*`).
//!
//! Each test checks the program's own result *and* that the pools served it, by the exit
//! summary's door line and by fakecuda's count of device allocations (`FAKECUDA_REPORT`), so
//! that a shim that passed through would fail.

use cachealloc_recorder::schema::kinds;
use cachealloc_tests::{Output, Run, count, read_trace};

/// The requests counted for `door` on the exit summary's door line (0 when absent).
fn door_count(stderr: &str, door: &str) -> u64 {
    let Some(line) = stderr.lines().find(|l| l.contains("allocations by door:")) else {
        return 0;
    };
    let Some(at) = line.find(door) else { return 0 };
    line[at + door.len()..]
        .trim_start()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

const RUNTIME: &str = "runtime cudaMalloc*";
const DRIVER_SYMBOLS: &str = "driver symbols cuMemAlloc*";
const DLSYM: &str = "dlsym";
const ENTRY_POINTS: &str = "driver entry points (cuGetProcAddress)";

/// fakecuda's count of device allocations (`FAKECUDA_REPORT=1`).
fn device_allocations(out: &Output) -> u64 {
    out.fakecuda_count("device allocations")
}

fn run(name: &str, args: &[&str]) -> Output {
    Run::c(name, args).env("FAKECUDA_REPORT", "1").output()
}

#[test]
fn a_static_runtime_reaches_the_pools_through_the_driver_entry_points() {
    let out = run("basic_static", &[]);
    out.assert_pooled("basic");
    assert!(out.stdout.contains("reused 1"), "{}", out.stdout);
    // The static runtime answers cudaMalloc(0) itself, as the real one does: 8 requests of the
    // program's 9 reach the driver, pooled as over the shared runtime (5 from the cache).
    assert!(
        out.stderr
            .contains("5 of 8 allocations served from the cache"),
        "{}",
        out.stderr
    );
    assert_eq!(door_count(&out.stderr, ENTRY_POINTS), 8, "{}", out.stderr);
    assert_eq!(door_count(&out.stderr, RUNTIME), 0, "{}", out.stderr);
    // Control: with the driver's doors shut, a static runtime never reaches the pools.
    let shut = Run::c("basic_static", &[])
        .env("CACHEALLOC_CONF", "driver_doors:off")
        .output();
    shut.assert_ok("basic");
    assert!(
        !shut.stderr.contains("served from the cache")
            && door_count(&shut.stderr, ENTRY_POINTS) == 0,
        "{}",
        shut.stderr
    );
    // Control: without the shim every request is a device allocation.
    let native = Run::c("basic_static", &[])
        .env("FAKECUDA_REPORT", "1")
        .without_shim()
        .output();
    native.assert_ok("basic");
    assert!(
        device_allocations(&out) < device_allocations(&native),
        "pooled {} vs native {}",
        device_allocations(&out),
        device_allocations(&native)
    );
}

#[test]
fn a_static_runtime_keeps_reuse_safe_across_streams() {
    for args in [
        &["nonblocking"][..],
        &["blocking"],
        &["nonblocking", "late"],
    ] {
        let out = run("race_static", args);
        out.assert_ok("race");
        assert!(out.stdout.contains("reused 3"), "{args:?}: {}", out.stdout);
        assert!(door_count(&out.stderr, ENTRY_POINTS) > 0, "{}", out.stderr);
    }
    // Control: streams created through the driver are seen, so the fences cover them; with
    // reuse:immediate the old work overwrites the new data, and the test sees it.
    let out = Run::c("race_static", &["nonblocking"])
        .env("CACHEALLOC_CONF", "reuse:immediate")
        .output();
    out.assert_fails_with("overwritten by the old work");
}

#[test]
fn a_static_runtime_under_threads_oom_and_stream_ordered_use() {
    let out = run("threads_static", &["8", "300"]);
    out.assert_pooled("threads");
    // Each of the 2400 steps allocates or frees: about half are allocations.
    assert!(
        door_count(&out.stderr, ENTRY_POINTS) >= 1000,
        "{}",
        out.stderr
    );

    let out = Run::c("oom_static", &[])
        .env("FAKECUDA_CAPACITY_MB", "64")
        .output();
    out.assert_ok("oom");
    assert!(
        out.stderr
            .contains("device 0: out of memory: tried to allocate 128.00 MiB"),
        "{}",
        out.stderr
    );

    let out = run("stream_ordered_static", &[]);
    out.assert_pooled("stream_ordered");

    let out = run("graph_capture_static", &[]);
    out.assert_pooled("graph_capture");
}

#[test]
fn a_static_runtime_run_leaves_a_complete_trace() {
    let out = Run::c("basic_static", &[]).output();
    out.assert_ok("basic");
    let (records, tears) = read_trace(&out.one_trace());
    assert!(tears.is_empty(), "{tears:?}");
    let allocs = count(&records, kinds::ALLOC);
    let frees = count(&records, kinds::FREE);
    assert_eq!((allocs, frees), (8, 8), "every request recorded once");
}

#[test]
fn a_program_linked_with_libcuda_is_served_through_the_driver_symbols() {
    let out = run("driver_api", &[]);
    out.assert_pooled("driver_api");
    let requests = door_count(&out.stderr, DRIVER_SYMBOLS);
    assert!(requests >= 1000, "{}", out.stderr);
    assert!(
        device_allocations(&out) * 10 < requests,
        "{} device allocations for {requests} requests",
        device_allocations(&out)
    );
}

#[test]
fn a_program_that_looks_the_driver_up_with_dlsym_is_served_through_dlsym() {
    let out = run("driver_dlsym", &[]);
    out.assert_pooled("driver_dlsym");
    let requests = door_count(&out.stderr, DLSYM);
    assert!(requests >= 1000, "{}", out.stderr);
    // Its own cuGetProcAddress_v2 lookups are substituted too.
    assert!(door_count(&out.stderr, ENTRY_POINTS) > 0, "{}", out.stderr);
    assert!(
        device_allocations(&out) * 10 < requests,
        "{} device allocations for {requests} requests",
        device_allocations(&out)
    );
}

#[test]
fn driver_entry_points_from_the_runtime_are_served_in_both_runtimes() {
    for name in ["entry_point", "entry_point_static"] {
        let out = run(name, &[]);
        out.assert_pooled("entry_point");
        assert!(
            door_count(&out.stderr, ENTRY_POINTS) > 0,
            "{name}: {}",
            out.stderr
        );
    }
}

#[test]
fn one_request_through_a_shared_runtime_enters_once() {
    // The shared runtime's own driver calls come back to our entry-point wrappers while the
    // shim passes a request through (pool:off traces every one): each must be counted and
    // recorded once.
    let out = Run::c("basic", &[])
        .env("CACHEALLOC_CONF", "pool:off")
        .output();
    out.assert_ok("basic");
    assert_eq!(door_count(&out.stderr, RUNTIME), 9, "{}", out.stderr);
    assert_eq!(door_count(&out.stderr, ENTRY_POINTS), 0, "{}", out.stderr);
    let (records, _) = read_trace(&out.one_trace());
    assert_eq!(count(&records, kinds::SEGMENT_ALLOC), 8);
    // And pooled: the pools' segments come from the driver, never back through a door.
    let out = run("basic", &[]);
    out.assert_ok("basic");
    assert_eq!(door_count(&out.stderr, RUNTIME), 9, "{}", out.stderr);
    assert_eq!(door_count(&out.stderr, ENTRY_POINTS), 0, "{}", out.stderr);
}

#[test]
fn every_door_program_is_correct_without_the_shim() {
    for (name, ok) in [
        ("driver_api", "driver_api"),
        ("driver_dlsym", "driver_dlsym"),
        ("entry_point", "entry_point"),
        ("entry_point_static", "entry_point"),
        ("race_static", "race"),
        ("threads_static", "threads"),
    ] {
        Run::c(name, &[]).without_shim().output().assert_ok(ok);
    }
}

#[test]
fn dlsym_keeps_rtld_next_and_rtld_default_relative_to_their_caller() {
    // A second interposer preloaded after ours, as a user may stack them.
    let helpers = |dir: &std::path::Path| {
        ["libnext_a.so", "libnext_b.so"].map(|l| dir.join(l).display().to_string())
    };
    let programs = cachealloc_tests::program("");
    let [a, b] = helpers(&programs);
    let shim = cachealloc_tests::shim_library().display().to_string();
    for name in ["dlsym_next", "dlsym_next_static"] {
        Run::c(name, &[])
            .env("LD_PRELOAD", &format!("{shim} {a} {b}"))
            .output()
            .assert_ok("dlsym_next");
        Run::c(name, &[])
            .env("LD_PRELOAD", &format!("{a} {b}"))
            .output()
            .assert_ok("dlsym_next");
    }
}
