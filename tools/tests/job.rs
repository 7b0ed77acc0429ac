//! A job of many ranks: a synthetic job of 1 000 ranks exported, summarised and viewed as a
//! fleet, its planted outliers found, in a peak memory that does not grow from 100 to 1 000
//! ranks; the README's query over it; ranks exported by several threads as by one; two traces of
//! one rank refused before anything is written. (The dataset of one trace: `dataset.rs`.)

mod common;

use std::path::Path;
use std::process::Command;

use cachealloc_tools::commands::fleet::read_fleet;
use common::job::{ALLOCS, STEPS, outlier, write_job};
use common::python::{python, python_ready};
use common::{cachealloc, scratch};

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
