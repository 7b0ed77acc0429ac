//! `cachealloc export --format parquet`: the dataset read back with DuckDB's and pyarrow's
//! Python packages agrees with what `summary` reports for the same traces (row counts, sums,
//! peaks); a torn trace is exported up to the tear, a rotated one from its oldest file; blocks
//! carry their category and module. (A job of many ranks and `cachealloc fleet`: `job.rs`.)
//!
//! The Python packages: `scripts/test` installs them when missing and then requires them
//! (`CACHEALLOC_REQUIRE_PYARROW=1`); under a bare `cargo test` the checks that need them are
//! skipped, with a note, where they are not installed.

mod common;

use std::path::Path;
use std::process::Command;

use cachealloc_recorder::schema::*;
use cachealloc_recorder::{MonotonicClock, Record, TraceWriter, WriterConfig};
use cachealloc_tools::analysis::scan;
use cachealloc_tools::progress::Progress;
use common::python::{python, python_ready};
use common::{cachealloc, data, scratch};
use serde_json::Value;

/// Per device of one rank's events: allocs, requested, frees, segment allocs (maps included),
/// segment frees (unmaps included), peak allocated, peak reserved; DuckDB's view, checked
/// against pyarrow's row counts and the files' metadata.
const READ_BACK: &str = r#"
import json, sys, glob
import duckdb, pyarrow.parquet as pq
root = sys.argv[1]
con = duckdb.connect()
rows = con.execute(f"""
SELECT rank, device,
       count(*) FILTER (WHERE kind = 'alloc'),
       coalesce(sum(requested) FILTER (WHERE kind = 'alloc'), 0),
       count(*) FILTER (WHERE kind IN ('free', 'free_requested')),
       count(*) FILTER (WHERE kind IN ('segment_alloc', 'segment_map')),
       count(*) FILTER (WHERE kind IN ('segment_free', 'segment_unmap')),
       max(allocated), max(reserved)
FROM read_parquet('{root}/*/*/events.parquet', hive_partitioning = true)
WHERE device IS NOT NULL GROUP BY ALL ORDER BY ALL""").fetchall()
counts = {}
for table in ["events", "stacks", "samples"]:
    duck = con.execute(f"SELECT count(*) FROM read_parquet('{root}/*/*/{table}.parquet')").fetchone()[0]
    files = glob.glob(f"{root}/*/*/{table}.parquet")
    arrow = sum(pq.read_table(f).num_rows for f in files)
    meta = [pq.read_metadata(f).metadata for f in files]
    assert all(m[b"cachealloc.schema_version"] == b"1" for m in meta), meta
    assert all(m[b"cachealloc.table"] == table.encode() for m in meta), meta
    counts[table] = [duck, arrow]
print(json.dumps({"devices": [[int(x) for x in r] for r in rows], "counts": counts}))
"#;

/// What `summary` reports per device of a trace, in [`READ_BACK`]'s order.
fn summary_of(dir: &Path, rank: i64) -> Vec<Vec<i64>> {
    let s = scan(dir, &Progress::hidden()).unwrap();
    s.devices
        .iter()
        .map(|(device, d)| {
            vec![
                rank,
                i64::from(*device),
                d.allocs as i64,
                d.requested_bytes as i64,
                d.frees as i64,
                d.segment_allocs as i64,
                d.segment_frees as i64,
                d.peak_allocated.bytes as i64,
                d.peak_reserved.bytes as i64,
            ]
        })
        .collect()
}

/// The number before `label` in an export's first line (`…: rank 0: 33 events, …`).
fn exported(stdout: &str, label: &str) -> u64 {
    stdout
        .lines()
        .next()
        .unwrap_or_default()
        .split(',')
        .flat_map(|part| part.split(':'))
        .find_map(|part| part.trim().strip_suffix(label)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no '{label}' in {stdout}"))
}

#[test]
fn the_dataset_read_back_equals_what_summary_reports() {
    let dir = scratch("dataset-read-back");
    for trace in ["oom", "race", "python"] {
        let root = dir.join(trace);
        let out = cachealloc(
            &dir,
            &[
                "export",
                &data(trace).display().to_string(),
                "-o",
                &root.display().to_string(),
                "--job",
                "j",
            ],
        );
        assert!(out.contains("(schema version 1)"), "{out}");
        let part = root.join("job=j/rank=0");
        for table in ["events", "stacks", "samples"] {
            assert!(
                part.join(format!("{table}.parquet")).is_file(),
                "{trace}: {table}"
            );
        }
        if !python_ready() {
            continue;
        }
        let v = python(READ_BACK, &[&root.display().to_string()]);
        let devices: Vec<Vec<i64>> = serde_json::from_value(v["devices"].clone()).unwrap();
        assert_eq!(devices, summary_of(&data(trace), 0), "{trace}");
        for (table, label) in [
            ("events", "events"),
            ("stacks", "stack frames"),
            ("samples", "samples"),
        ] {
            let n = exported(&out, label) as i64;
            assert_eq!(
                v["counts"][table],
                serde_json::json!([n, n]),
                "{trace} {table}: {out}"
            );
        }
        assert!(
            exported(&out, "stack frames") > 0,
            "{trace}: stacks exported"
        );
    }
}

#[test]
fn a_torn_trace_is_exported_up_to_the_tear_and_says_so() {
    let dir = scratch("dataset-torn");
    let trace = dir.join("torn");
    std::fs::create_dir_all(&trace).unwrap();
    let bytes = std::fs::read(data("race").join("trace-000000.cat")).unwrap();
    // Cut inside the last chunk: what precedes it stays readable.
    std::fs::write(trace.join("trace-000000.cat"), &bytes[..bytes.len() - 7]).unwrap();
    let root = dir.join("ds");
    let out = cachealloc(
        &dir,
        &[
            "export",
            &trace.display().to_string(),
            "-o",
            &root.display().to_string(),
        ],
    );
    assert!(
        out.contains("  torn: ") && out.contains("exported up to the tear"),
        "{out}"
    );
    let whole = cachealloc(
        &dir,
        &[
            "export",
            &data("race").display().to_string(),
            "-o",
            &dir.join("whole").display().to_string(),
        ],
    );
    assert!(!whole.contains("  torn: "), "{whole}");
    assert!(
        exported(&out, "events") < exported(&whole, "events"),
        "{out}\n{whole}"
    );
    if python_ready() {
        let v = python(READ_BACK, &[&root.display().to_string()]);
        let devices: Vec<Vec<i64>> = serde_json::from_value(v["devices"].clone()).unwrap();
        assert_eq!(devices, summary_of(&trace, 0));
        let meta = python(
            "import sys, json, glob, pyarrow.parquet as pq; f = glob.glob(sys.argv[1] + '/*/*/events.parquet')[0]; print(json.dumps(pq.read_metadata(f).metadata[b'cachealloc.torn'].decode()))",
            &[&root.display().to_string()],
        );
        assert!(
            meta.as_str().unwrap().contains("trace-000000.cat at byte"),
            "{meta}"
        );
    }
}

#[test]
fn a_rotated_trace_is_exported_from_its_oldest_file_and_says_so() {
    let dir = scratch("dataset-rotated");
    let trace = dir.join("rotated");
    // Small files, two kept: the first ones are deleted as the run goes on.
    let mut config = WriterConfig::new(&trace, 4096, 2, false);
    config.flush_bytes = 512;
    let header = Header::new(7, "h");
    let mut w = TraceWriter::create(config, header, MonotonicClock).unwrap();
    let base = 1u64 << 40;
    w.write(&Record::SegmentAlloc(SegmentEvent {
        t: 1,
        device: 0,
        address: base,
        size: 1 << 30,
        pool: POOL_LARGE,
        stack: 0,
    }))
    .unwrap();
    for i in 0..2000u64 {
        let (t, address, size) = (10 + i, base + (i % 50) * 4096, 4096);
        if i >= 50 {
            w.write(&Record::Free(FreeRequested {
                t,
                device: 0,
                stream: 0,
                address,
                size,
                stack: 0,
                thread: 1,
            }))
            .unwrap();
        }
        w.write(&Record::Alloc(Alloc {
            t,
            device: 0,
            stream: 0,
            address,
            requested: size,
            size,
            stack: 0,
            thread: 1,
        }))
        .unwrap();
    }
    w.finish().unwrap();
    assert!(
        !trace.join("trace-000000.cat").exists(),
        "the first file was rotated away"
    );
    let root = dir.join("ds");
    let out = cachealloc(
        &dir,
        &[
            "export",
            &trace.display().to_string(),
            "-o",
            &root.display().to_string(),
        ],
    );
    assert!(out.contains("  rotated: files before trace-0000"), "{out}");
    assert!(!out.contains("  torn: "), "{out}");
    if python_ready() {
        let v = python(READ_BACK, &[&root.display().to_string()]);
        let devices: Vec<Vec<i64>> = serde_json::from_value(v["devices"].clone()).unwrap();
        assert_eq!(devices, summary_of(&trace, 0));
    }
}

#[test]
fn bad_arguments_are_clear_errors() {
    let dir = scratch("dataset-args");
    let trace = data("oom").display().to_string();
    for (args, expected) in [
        (
            vec!["export", &trace, "-o", "x", "--format", "csv"],
            "invalid value 'csv'",
        ),
        (
            vec!["export", &trace, "-o", "x", "--job", "a/b"],
            "not a job name",
        ),
        (vec!["export", &trace], "--output"),
        (vec!["fleet", &trace, "--k", "0"], "not a positive number"),
        (vec!["fleet", &trace, "--above", "lots"], "is not a size"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_cachealloc"))
            .current_dir(&dir)
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(expected),
            "{args:?}: {stderr}"
        );
    }
}

/// A trace with the program's context exports each allocation's category and module, on its
/// `alloc` row and on the row that frees it (`common::program::training_step`: one block per
/// lifetime rule).
#[test]
fn allocations_carry_their_category_and_module() {
    if !python_ready() {
        return;
    }
    let root = scratch("dataset-context");
    let trace = root.join("trace");
    let blocks = common::program::training_step(&trace, 2 << 20, false);
    let out = root.join("out");
    cachealloc(
        &root,
        &[
            "export",
            trace.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--job",
            "ctx",
        ],
    );
    let rows = python(
        r#"
import json, sys, duckdb
rows = duckdb.sql(f"""SELECT kind, address, category, module FROM
    read_parquet('{sys.argv[1]}/*/*/events.parquet', hive_partitioning = true)
    WHERE kind IN ('alloc', 'free', 'free_requested') ORDER BY seq""").fetchall()
print(json.dumps(rows))
"#,
        &[out.to_str().unwrap()],
    );
    let rows = rows.as_array().unwrap();
    // The alloc rows in order: the ordinal of each block of `training_step`.
    let allocs: Vec<&Value> = rows.iter().filter(|r| r[0] == "alloc").collect();
    let expected = [
        ("parameter", "PARAMETER", None),
        ("input", "INPUT", None),
        ("activation", "ACTIVATION", Some("Net.encoder")),
        ("forward temporary", "TEMPORARY", Some("Net.encoder.attn")),
        ("forward kept past backward", "UNKNOWN", Some("Net.head")),
        ("gradient", "GRADIENT", None),
        ("backward temporary", "AUTOGRAD_DETAIL", None),
        ("optimizer state", "OPTIMIZER_STATE", None),
        ("optimizer temporary", "TEMPORARY", None),
    ];
    for (name, category, module) in expected {
        let (ordinal, address, _) = blocks[name];
        let row = allocs[ordinal as usize];
        assert_eq!(
            row[1].as_u64(),
            Some(address),
            "{name}: the row of its block"
        );
        assert_eq!(row[2], category, "{name}: {row:?}");
        assert_eq!(row[3].as_str(), module, "{name}: {row:?}");
        // Its free, if any, says the same.
        if let Some(free) = rows
            .iter()
            .find(|r| r[0] != "alloc" && r[1].as_u64() == Some(address) && r[2] == category)
        {
            assert_eq!(free[3].as_str(), module, "{name}'s free: {free:?}");
        }
    }
    assert!(
        rows.iter()
            .filter(|r| r[0] != "alloc")
            .all(|r| r[2].is_string()),
        "every free has a category"
    );
}
