//! `cachealloc replay` over fakecuda: traces recorded under the shim are replayed through each
//! backend (raw `cuMemAlloc`, the stream-ordered pool, the preloaded shim), every request of the
//! trace is issued, the shim makes fewer device calls than raw allocation on a workload with
//! reuse, `--verify` catches an allocator that hands out overlapping memory, and traces that
//! lack what a replay needs are refused with a message naming what is missing.
//!
//! Needs the `cachealloc` binary and `libcachealloc.so` built next to the test binaries
//! (`cargo build -p cachealloc -p cachealloc-tools`; `scripts/test` and `cargo test --workspace`
//! do).

use std::path::Path;
use std::process::{Command, Output};

use cachealloc_recorder::Record;
use cachealloc_recorder::schema::kinds;
use cachealloc_tests::{cachealloc_binary, count, fakecuda_dir, fresh_dir, read_trace, traced};
use serde_json::Value;

/// `cachealloc replay ARGS` over fakecuda (the library found next to the binary), with extra
/// environment.
fn replay(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(cachealloc_binary());
    command
        .arg("replay")
        .args(args)
        .env("LD_LIBRARY_PATH", fakecuda_dir())
        .env_remove("LD_PRELOAD")
        .env_remove("CACHEALLOC_LIB")
        .env_remove("CACHEALLOC_CONF")
        .env_remove("FAKECUDA_FAULT");
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect("run cachealloc replay")
}

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `replay --json`: the report.
fn replay_json(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Value {
    let mut args = vec![dir.to_str().unwrap(), "--json"];
    args.extend_from_slice(extra);
    let out = replay(&args, env);
    assert!(out.status.success(), "{}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)))
}

/// The run of `backend` in a report (the first, with one round).
fn run_of<'a>(report: &'a Value, backend: &str) -> &'a Value {
    report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["backend"] == backend)
        .unwrap_or_else(|| panic!("no {backend} run in {report:#}"))
}

fn driver_calls(run: &Value) -> u64 {
    run["driver_calls"]["allocs"].as_u64().unwrap() + run["driver_calls"]["frees"].as_u64().unwrap()
}

#[test]
fn every_backend_replays_every_request_and_the_shim_makes_fewer_device_calls() {
    // Four threads allocating and freeing blocks of seven sizes: reuse everywhere.
    let dir = traced("threads", &["4", "300"], "", &[]);
    let (records, _) = read_trace(&dir);
    let allocs = count(&records, kinds::ALLOC) as u64;
    let frees = (count(&records, kinds::FREE) + count(&records, kinds::FREE_REQUESTED)) as u64;
    assert!(allocs > 100 && frees == allocs, "{allocs} {frees}");
    let report = replay_json(&dir, &["--verify"], &[]);
    assert_eq!(report["allocs"], allocs);
    assert_eq!(report["frees"], frees);
    assert_eq!(report["requests"], allocs + frees);
    assert_eq!(
        report["threads"], 4,
        "one replay thread per recorded thread"
    );
    for backend in ["raw", "async", "cachealloc"] {
        let run = run_of(&report, backend);
        assert_eq!(run["allocs"], allocs, "{backend}: {run:#}");
        assert_eq!(run["frees"], frees, "{backend}: {run:#}");
        assert_eq!(run["alloc_ns"]["count"], allocs, "{backend}");
        assert_eq!(run["failed_allocs"], 0, "{backend}: {run:#}");
        assert_eq!(run["failed_frees"], 0, "{backend}: {run:#}");
        assert_eq!(run["touched"], allocs, "{backend}: every block written");
        assert_eq!(run["verified"], frees, "{backend}: every block checked");
        assert_eq!(run["overwritten"], 0, "{backend}: {run:#}");
        assert!(
            run["peak_device_bytes"].as_u64().unwrap() > 0,
            "{backend}: {run:#}"
        );
        let p50 = run["alloc_ns"]["p50"].as_u64().unwrap();
        let p99 = run["alloc_ns"]["p99"].as_u64().unwrap();
        assert!(p50 > 0 && p50 <= p99, "{backend}: {run:#}");
    }
    let raw = run_of(&report, "raw");
    assert_eq!(
        driver_calls(raw),
        allocs + frees,
        "raw: one call per request"
    );
    assert!(
        run_of(&report, "async")["driver_calls"].is_null(),
        "async: the driver pool's calls are not known"
    );
    let shim = run_of(&report, "cachealloc");
    assert_eq!(
        shim["pooled_allocs"], allocs,
        "the shim's pools served every allocation (through the dlsym door): {shim:#}"
    );
    let shim_calls = driver_calls(shim);
    assert!(
        shim_calls > 0 && shim_calls * 10 < allocs + frees,
        "cachealloc reuses: {shim_calls} device calls against raw's {}",
        allocs + frees
    );
}

#[test]
fn stream_ordered_requests_replay_on_one_stream_per_recorded_stream() {
    let dir = traced("stream_ordered", &[], "", &[]);
    let (records, _) = read_trace(&dir);
    let streams: std::collections::BTreeSet<u64> = records
        .iter()
        .filter_map(|r| match r {
            Record::Alloc(a) if a.stream != 0 => Some(a.stream),
            Record::Free(f) | Record::FreeRequested(f) if f.stream != 0 => Some(f.stream),
            _ => None,
        })
        .collect();
    assert!(streams.len() >= 2, "the program uses streams: {streams:?}");
    let allocs = count(&records, kinds::ALLOC) as u64;
    let report = replay_json(&dir, &["--touch", "--repeat", "2"], &[]);
    assert_eq!(report["streams"], streams.len() as u64);
    assert_eq!(report["rounds"], 2);
    assert_eq!(
        report["runs"].as_array().unwrap().len(),
        6,
        "3 backends × 2"
    );
    assert_eq!(report["medians"].as_array().unwrap().len(), 3);
    let ooms = count(&records, kinds::OOM) as u64;
    for run in report["runs"].as_array().unwrap() {
        assert_eq!(run["allocs"], allocs, "{run:#}");
        assert_eq!(run["touched"], allocs, "{run:#}");
        assert_eq!(run["failed_allocs"], 0, "{run:#}");
        assert_eq!(
            run["skipped"]["ooms"], ooms,
            "requests the run could not serve are left out"
        );
        if run["backend"] == "async" {
            assert_eq!(
                run["streams"],
                streams.len() as u64,
                "one stream created per recorded stream: {run:#}"
            );
        }
    }
}

#[test]
fn the_table_has_one_row_per_backend_named() {
    let dir = traced("churn", &["2000"], "", &[]);
    let out = replay(&[dir.to_str().unwrap(), "--backend", "raw,cachealloc"], &[]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| {
            ["raw ", "async ", "cachealloc "]
                .iter()
                .any(|b| l.starts_with(b))
        })
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert!(rows[0].starts_with("raw ") && rows[1].starts_with("cachealloc "));
    assert!(stdout.contains("alloc p50") && stdout.contains("driver calls"));
}

#[test]
fn verify_catches_an_allocator_that_hands_out_overlapping_memory() {
    // fakecuda's broken allocator hands every second cuMemAlloc the previous block again.
    let dir = traced("threads", &["2", "200"], "", &[]);
    let fault = [("FAKECUDA_FAULT", "overlap")];
    let out = replay(
        &[dir.to_str().unwrap(), "--backend", "raw", "--verify"],
        &fault,
    );
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("was overwritten") && stderr.contains("another block overlaps it"),
        "{stderr}"
    );
    // The control: the same broken allocator without the check passes unnoticed.
    let out = replay(&[dir.to_str().unwrap(), "--backend", "raw"], &fault);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn traces_that_lack_what_a_replay_needs_are_refused_with_a_clear_message() {
    let refused = |args: &[&str], wanted: &str| {
        let out = replay(args, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(wanted),
            "{args:?}: wanted a refusal saying {wanted:?}\n{}",
            text(&out)
        );
    };
    let empty = fresh_dir();
    refused(&[empty.to_str().unwrap()], "no trace here");
    let garbage = fresh_dir().join("trace-000000.cat");
    let bytes: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&garbage, &bytes).unwrap();
    refused(&[garbage.to_str().unwrap()], "not a cachealloc trace");
    refused(
        &[garbage.parent().unwrap().to_str().unwrap()],
        "not a cachealloc trace",
    );
    let dir = traced("basic", &[], "", &[]);
    refused(
        &[dir.to_str().unwrap(), "--device", "3"],
        "no allocations on device 3",
    );
    refused(
        &[
            dir.to_str().unwrap(),
            "--backend",
            "cachealloc",
            "--lib",
            "/nonexistent/libcachealloc.so",
        ],
        "no such library",
    );
    refused(
        &[dir.to_str().unwrap(), "--conf", "max_split_size_mb:lots"],
        "max_split_size_mb",
    );
}

#[test]
fn a_rotated_trace_is_refused_unless_partial() {
    let dir = traced(
        "churn",
        &["200000"],
        "trace_file_mb:1,trace_files:2,compress:off",
        &[],
    );
    let out = replay(&[dir.to_str().unwrap(), "--backend", "cachealloc"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("rotated away") && stderr.contains("--partial"),
        "{}",
        text(&out)
    );
    let report = replay_json(&dir, &["--partial", "--backend", "cachealloc"], &[]);
    let run = run_of(&report, "cachealloc");
    assert!(run["allocs"].as_u64().unwrap() > 0, "{run:#}");
    assert_eq!(run["failed_frees"], 0, "{run:#}");
}
