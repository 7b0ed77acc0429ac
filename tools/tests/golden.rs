//! Golden outputs: every command on the checked-in traces (`tests/data/`, made by
//! `tests/data/make-traces.sh`) must print — and write — exactly what `tests/golden/` holds.
//! After an intended change, regenerate with `UPDATE_GOLDEN=1 cargo test -p cachealloc-tools
//! --test golden` and review the diff.
//!
//! Each command runs in a fresh directory holding a link to `tests/data` as `data`, so paths in
//! the output are the same on every machine.
//!
//! A `plot` page is its template (`src/commands/plot.html`) with a title and the data spliced
//! in: the test checks that, and only the data (`plot.json`) is golden.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{cachealloc, data, manifest, scratch};

/// A fresh working directory with `data` linked to the checked-in traces.
fn workdir(name: &str) -> PathBuf {
    let dir = scratch(name);
    std::os::unix::fs::symlink(manifest().join("tests/data"), dir.join("data")).unwrap();
    dir
}

/// Compare `actual` with the golden file `name` (or write it under UPDATE_GOLDEN=1).
fn check(name: &str, actual: &[u8]) {
    let path = manifest().join("tests/golden").join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 writes it)", path.display()));
    if expected != actual {
        let actual_path = std::env::temp_dir().join(name.replace('/', "-"));
        std::fs::write(&actual_path, actual).unwrap();
        panic!(
            "{name} differs from its golden file; this run's output is in {} (diff them; UPDATE_GOLDEN=1 accepts it)",
            actual_path.display()
        );
    }
}

/// The `plot` page's template, which the goldens do not repeat.
const PLOT_TEMPLATE: &str = include_str!("../src/commands/plot.html");

/// Check that the `plot` page `page` is [`PLOT_TEMPLATE`] with its title and data spliced in
/// (as `plot.rs` does), and compare the data, what varies, with the golden file `name.json`.
fn check_plot(name: &str, page: &[u8]) {
    let page = std::str::from_utf8(page).expect("a utf-8 page");
    const DATA: &str = "const DATA = ";
    let start = page.find(DATA).expect("the data") + DATA.len();
    let data = &page[start..][..page[start..].find(";\n").expect("the data's end")];
    let report: serde_json::Value = serde_json::from_str(data).expect("the data is JSON");
    let title = report["title"]
        .as_str()
        .expect("a title")
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    let expected = PLOT_TEMPLATE
        .replace("/*TITLE*/", &title)
        .replace("/*DATA*/null", data);
    assert!(
        page == expected,
        "{name}.html is not the template with its title and data spliced in"
    );
    check(&format!("{name}.json"), format!("{data}\n").as_bytes());
}

/// Commands whose report is their standard output.
const PRINTING: &[(&str, &[&str])] = &[
    ("summary", &["summary"]),
    ("stats", &["stats"]),
    ("stats-json", &["stats", "--json"]),
    ("stats-at", &["stats", "--at", "0.03"]),
    ("trace", &["trace"]),
    (
        "trace-stacks-window",
        &["trace", "--stacks", "--from", "0.01", "--to", "0.05"],
    ),
    ("leaks", &["leaks"]),
    ("peak", &["peak"]),
    ("simulate", &["simulate"]),
    (
        "simulate-conf",
        &[
            "simulate",
            "--conf",
            "roundup_power2_divisions:2",
            "--capacity",
            "33554432",
        ],
    ),
    ("simulate-sweep", &["simulate", "--sweep"]),
    (
        "simulate-expandable-after",
        &[
            "simulate",
            "--conf",
            "expandable_segments:True",
            "--after",
            "0.03",
        ],
    ),
];

/// Commands that write a file: (name, arguments, output file).
const WRITING: &[(&str, &[&str], &str)] = &[
    (
        "snapshot",
        &["snapshot", "--at-peak", "-o", "snap.pickle"],
        "snap.pickle",
    ),
    (
        "snapshot-end",
        &["snapshot", "--events", "5", "-o", "end.pickle"],
        "end.pickle",
    ),
    (
        "flamegraph-memory",
        &["flamegraph", "--at-peak", "-o", "m.svg"],
        "m.svg",
    ),
    (
        "flamegraph-segments",
        &["flamegraph", "--kind", "segments", "-o", "s.svg"],
        "s.svg",
    ),
    (
        "compare",
        &["compare", "--from", "0.01", "--to", "0.03", "-o", "c.svg"],
        "c.svg",
    ),
    (
        "plot",
        &["plot", "--points", "200", "-o", "r.html"],
        "r.html",
    ),
    ("perfetto", &["perfetto", "-o", "p.json"], "p.json"),
];

const TRACES: [&str; 3] = ["python", "oom", "race"];

#[test]
fn every_command_matches_its_golden_output() {
    for trace in TRACES {
        let dir = workdir(trace);
        let path = format!("data/{trace}/run");
        for (name, args) in PRINTING {
            let mut full: Vec<&str> = args.to_vec();
            full.insert(1, &path);
            let out = cachealloc(&dir, &full);
            check(&format!("{trace}/{name}.txt"), out.as_bytes());
        }
        for (name, args, file) in WRITING {
            let mut full: Vec<&str> = args.to_vec();
            full.insert(1, &path);
            let out = cachealloc(&dir, &full);
            check(&format!("{trace}/{name}.txt"), out.as_bytes());
            let written = std::fs::read(dir.join(file)).expect("the output file");
            let ext = Path::new(file).extension().unwrap().to_str().unwrap();
            if ext == "html" {
                check_plot(&format!("{trace}/{name}"), &written);
            } else {
                check(&format!("{trace}/{name}.{ext}"), &written);
            }
        }
    }
}

#[test]
fn compare_of_two_traces_and_summary_of_several() {
    let dir = workdir("two");
    let out = cachealloc(
        &dir,
        &["compare", "data/oom/run", "data/race/run", "-o", "two.svg"],
    );
    check("two/compare.txt", out.as_bytes());
    check(
        "two/compare.svg",
        &std::fs::read(dir.join("two.svg")).unwrap(),
    );
    // A directory of traces stands for all of them: the side-by-side table.
    let out = cachealloc(
        &dir,
        &["summary", "data/oom", "data/race/run", "data/python"],
    );
    check("two/summary.txt", out.as_bytes());
    let out = cachealloc(&dir, &["plot", "data/oom", "data/race", "-o", "two.html"]);
    check("two/plot.txt", out.as_bytes());
}

#[test]
fn bad_input_gets_a_clear_message_and_a_failure_code() {
    let dir = workdir("bad");
    for (args, message) in [
        (&["summary", "nowhere"][..], "not a directory"),
        (&["summary", "."][..], "no trace here"),
        (
            &["stats", "data/oom/run", "--at", "soon"][..],
            "is not a time",
        ),
        (
            &["simulate", "data/oom/run", "--conf", "max_split_size_mb:1"][..],
            "max_split_size_mb",
        ),
        (
            &["compare", "data/oom/run", "-o", "x.svg"][..],
            "--from and --to",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_cachealloc"))
            .current_dir(&dir)
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}

#[test]
fn a_closed_pipe_is_not_an_error() {
    use std::io::Read;
    let dir = workdir("pipe");
    let mut child = Command::new(env!("CARGO_BIN_EXE_cachealloc"))
        .current_dir(&dir)
        .args(["trace", "--stacks", "data/oom/run"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 16];
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    drop(child.stdout.take());
    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "exit status {status:?} after the reader went away"
    );
}

#[test]
fn a_torn_trace_is_read_up_to_the_tear() {
    let dir = workdir("torn");
    let torn = dir.join("torn/run");
    std::fs::create_dir_all(&torn).unwrap();
    let original = std::fs::read(data("oom").join("trace-000000.cat")).unwrap();
    // Cut the file inside its last chunk, as `kill -9` in the middle of a write would.
    std::fs::write(
        torn.join("trace-000000.cat"),
        &original[..original.len() - 7],
    )
    .unwrap();
    let summary = cachealloc(&dir, &["summary", "torn/run"]);
    assert!(
        summary.contains("tear      torn/run/trace-000000.cat at byte"),
        "{summary}"
    );
    assert!(summary.contains("(read up to there)"), "{summary}");
    // Everything before the tear is there: the peak came before it.
    assert!(summary.contains("peak allocated  54.00 MiB"), "{summary}");
    let listing = cachealloc(&dir, &["trace", "torn/run"]);
    assert!(listing.contains("(torn: "), "{listing}");
}

/// A program that says what it does (phases, module scopes, tags; `common::program`), built by
/// the test rather than checked in: the commands that show categories and modules print what
/// `tests/golden/context/` holds.
#[test]
fn commands_with_categories_match_their_golden_output() {
    let dir = scratch("context");
    common::program::training_step(&dir.join("trace"), 2 << 20, false);
    for (name, args) in [
        ("summary", &["summary", "trace"][..]),
        ("trace", &["trace", "trace"][..]),
        (
            "compare",
            &["compare", "trace", "trace", "--categories"][..],
        ),
    ] {
        check(
            &format!("context/{name}.txt"),
            cachealloc(&dir, args).as_bytes(),
        );
    }
    cachealloc(&dir, &["memory-timeline", "trace", "-o", "t.json"]);
    check(
        "context/memory-timeline.json",
        &std::fs::read(dir.join("t.json")).unwrap(),
    );
    cachealloc(&dir, &["plot", "trace", "--points", "50", "-o", "r.html"]);
    check_plot("context/plot", &std::fs::read(dir.join("r.html")).unwrap());
}
