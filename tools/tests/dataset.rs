//! `cachealloc export --format parquet` and `cachealloc fleet`: the dataset read back with
//! DuckDB's and pyarrow's Python packages agrees with what `summary` reports for the same traces
//! (row counts, sums, peaks); a torn trace is exported up to the tear; a synthetic job of 1 000
//! ranks is exported, summarised and viewed as a fleet, its planted outliers found, in a peak
//! memory that does not grow from 100 to 1 000 ranks.
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
use cachealloc_tools::commands::fleet::read_fleet;
use cachealloc_tools::progress::Progress;
use common::job::{ALLOCS, STEPS, outlier, write_job};
use common::{cachealloc, data, scratch};
use serde_json::Value;

/// Whether Python's duckdb and pyarrow can be imported; without them (and not required) the
/// caller skips its Python checks.
fn python_ready() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import duckdb, pyarrow"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("CACHEALLOC_REQUIRE_PYARROW").is_none(),
            "Python's duckdb and pyarrow are required (scripts/test installs them with pip)"
        );
        eprintln!(
            "duckdb or pyarrow not installed: the dataset was not read back (scripts/test installs them)"
        );
    }
    ok
}

/// Run a Python script with `args`; its stdout as JSON.
fn python(script: &str, args: &[&str]) -> Value {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON from the script")
}

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
    let header = Header {
        version: FORMAT_VERSION,
        file_index: 0,
        pid: 7,
        host: "h".into(),
        rank: -1,
        local_rank: -1,
        world_size: -1,
        cmdline: vec![],
        wall_clock_base_ns: 0,
        monotonic_base_ns: 0,
        config: String::new(),
        devices: vec![],
        modules: vec![],
    };
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

/// Run `cachealloc args` under GNU time: stdout and peak RSS in KiB (`None` without GNU time).
fn measured(dir: &Path, args: &[&str]) -> (String, Option<u64>) {
    let time = Path::new("/usr/bin/time");
    if !time.exists() {
        return (cachealloc(dir, args), None);
    }
    let rss = dir.join("rss");
    let out = Command::new(time)
        .current_dir(dir)
        .arg("-f")
        .arg("%M")
        .arg("-o")
        .arg(&rss)
        .arg(env!("CARGO_BIN_EXE_cachealloc"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cachealloc {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let kib = std::fs::read_to_string(&rss)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (String::from_utf8(out.stdout).unwrap(), Some(kib))
}

#[test]
fn a_job_of_1000_ranks_is_exported_and_summarised_in_memory_that_does_not_grow() {
    let dir = scratch("dataset-job");
    let mut rss: Vec<(u32, &str, u64)> = vec![];
    for ranks in [100u32, 1000] {
        let job = write_job(&dir.join(format!("job{ranks}")), ranks);
        let job_arg = job.display().to_string();
        let root = dir.join(format!("ds{ranks}"));
        let root_arg = root.display().to_string();
        let (out, export_rss) =
            measured(&dir, &["export", &job_arg, "-o", &root_arg, "--job", "big"]);
        assert_eq!(
            out.lines().filter(|l| l.contains(": rank ")).count(),
            ranks as usize
        );
        assert!(out.contains(&format!("exported {ranks} traces")), "{out}");
        let (summary, summary_rss) = measured(&dir, &["summary", &job_arg]);
        let allocs: u64 = summary
            .lines()
            .filter_map(|l| l.trim().strip_prefix("events"))
            .map(|l| l.split_whitespace().next().unwrap().parse::<u64>().unwrap())
            .sum();
        assert_eq!(allocs, u64::from(ranks) * ALLOCS * STEPS);
        let (fleet, fleet_rss) = measured(&dir, &["fleet", &job_arg, "--above", "300MiB"]);
        let planted: Vec<u32> = (0..ranks).filter(|&r| outlier(r)).collect();
        assert!(
            fleet.contains(&format!("outliers  {} by peak reserved", planted.len())),
            "{fleet}"
        );
        // Ordinary ranks reserve about 212 MiB, the planted ones about 422 MiB.
        assert!(
            fleet.contains(&format!(
                "above     {} rank-devices peaked above 300.00 MiB",
                planted.len()
            )),
            "{fleet}"
        );
        // The library's view: each planted rank is above the others, with its step and site.
        let f = read_fleet(std::slice::from_ref(&job)).unwrap();
        assert_eq!(f.rows.len(), ranks as usize);
        let (found, _, _) = cachealloc_tools::commands::fleet::outliers(&f.rows, 3.0);
        let mut found: Vec<u32> = found.iter().map(|(i, _)| f.rows[*i].rank as u32).collect();
        found.sort();
        assert_eq!(found, planted);
        for row in &f.rows {
            assert_eq!(row.step.as_deref(), Some("step 0"), "the first step's peak");
            assert_eq!(row.top_site.as_ref().unwrap().0, "backward (model.py:20)");
        }
        for (what, kib) in [
            ("export", export_rss),
            ("summary", summary_rss),
            ("fleet", fleet_rss),
        ] {
            if let Some(kib) = kib {
                assert!(
                    kib < 200 << 10,
                    "{what} of {ranks} ranks: {kib} KiB peak RSS"
                );
                rss.push((ranks, what, kib));
            }
        }
        if python_ready() {
            let v = python(
                r#"
import sys, json, duckdb
root = sys.argv[1]
con = duckdb.connect()
top = con.execute(f"""SELECT rank, max(reserved) AS peak FROM read_parquet('{root}/*/*/events.parquet', hive_partitioning = true)
                  WHERE job = 'big' GROUP BY rank ORDER BY peak DESC, rank LIMIT 10""").fetchall()
n = con.execute(f"SELECT count(*), count(DISTINCT rank) FROM read_parquet('{root}/*/*/events.parquet', hive_partitioning = true)").fetchone()
print(json.dumps({"top": [r[0] for r in top], "events": n[0], "ranks": n[1]}))
"#,
                &[&root_arg],
            );
            let top: Vec<u32> = serde_json::from_value(v["top"].clone()).unwrap();
            let n = planted.len().min(10);
            let mut first = top[..n].to_vec();
            first.sort();
            assert_eq!(first, planted[..n], "the planted outliers peak highest");
            let per_rank = 1 + STEPS * (1 + 2 * ALLOCS);
            assert_eq!(v["events"], u64::from(ranks) * per_rank);
            assert_eq!(v["ranks"], ranks);
        }
    }
    // Flat: the 1 000-rank job's peak memory within 20 % (and 8 MiB) of the 100-rank job's.
    for what in ["export", "summary", "fleet"] {
        let of = |n| rss.iter().find(|r| r.0 == n && r.1 == what).map(|r| r.2);
        if let (Some(small), Some(big)) = (of(100), of(1000)) {
            assert!(
                big <= small + small / 5 + (8 << 10),
                "{what}: {small} KiB for 100 ranks, {big} KiB for 1 000"
            );
        }
    }
}

#[test]
fn the_readmes_top_stacks_query_agrees_with_fleet() {
    if !python_ready() {
        return;
    }
    let dir = scratch("dataset-readme");
    let job = write_job(&dir.join("job"), 30);
    let root = dir.join("ds");
    cachealloc(
        &dir,
        &[
            "export",
            &job.display().to_string(),
            "-o",
            &root.display().to_string(),
            "--job",
            "NAME",
        ],
    );
    // The README's query, with its DIR.
    let readme = std::fs::read_to_string(common::manifest().join("../README.md")).unwrap();
    let start = readme
        .find("-- top stacks live at each rank's peak allocated")
        .expect("the query in README");
    let query = &readme[start..];
    let query = &query[..query.find("```").unwrap()];
    let query = query.replace("DIR", &root.display().to_string());
    let v = python(
        "import sys, json, duckdb; print(json.dumps([[r[0], int(r[1]), r[2]] for r in duckdb.connect().execute(sys.argv[1]).fetchall()]))",
        &[&query],
    );
    let rows: Vec<(String, u64, u64)> = serde_json::from_value(v).unwrap();
    let f = read_fleet(&[job]).unwrap();
    let mut sites: Vec<(String, u64, u64)> =
        f.sites.into_iter().map(|(s, (b, n))| (s, b, n)).collect();
    sites.sort_by_key(|s| std::cmp::Reverse(s.1));
    assert_eq!(rows, sites);
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

/// Every file under `root`, by its path relative to `root`, with its bytes.
fn files_under(root: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files = vec![];
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                let name = path.strip_prefix(root).unwrap().display().to_string();
                files.push((name, std::fs::read(&path).unwrap()));
            }
        }
    }
    files.sort();
    files
}

#[test]
fn ranks_exported_by_several_threads_are_written_and_reported_as_by_one() {
    let dir = scratch("dataset-jobs");
    let job = write_job(&dir.join("job"), 12);
    let job_arg = job.display().to_string();
    let export = |jobs: &str| {
        let root = dir.join(format!("ds-j{jobs}"));
        let out = cachealloc(
            &dir,
            &[
                "export",
                &job_arg,
                "-o",
                &root.display().to_string(),
                "--job",
                "big",
                "--jobs",
                jobs,
            ],
        );
        // The last line names the output directory, which differs.
        let report: Vec<String> = out.lines().map(str::to_string).collect();
        (report[..report.len() - 1].to_vec(), files_under(&root))
    };
    let (one_report, one_files) = export("1");
    assert_eq!(one_report.len(), 12, "{one_report:?}");
    assert_eq!(one_files.len(), 36, "three tables for each of 12 ranks");
    for jobs in ["4", "0"] {
        let (report, files) = export(jobs);
        assert_eq!(
            report, one_report,
            "--jobs {jobs}: the ranks reported in order"
        );
        assert!(
            files == one_files,
            "--jobs {jobs}: the same files, byte for byte"
        );
    }
}

#[test]
fn two_traces_of_one_rank_are_refused_before_anything_is_written() {
    let dir = scratch("dataset-twice");
    let job = write_job(&dir.join("job"), 3);
    // A second copy of rank 1's trace, under another directory name.
    let copy = job.join("node-b-2001-rank1");
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(job.join("node-a-1001-rank1")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, copy.join(path.file_name().unwrap())).unwrap();
    }
    let root = dir.join("ds");
    let out = Command::new(env!("CARGO_BIN_EXE_cachealloc"))
        .args(["export", &job.display().to_string(), "-o"])
        .arg(&root)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("a second trace of rank 1"),
        "{stderr}"
    );
    assert!(!root.exists(), "nothing written: {:?}", files_under(&root));
}
