//! `cachealloc snapshot` at the trace's end (what the Python integration asks for each
//! `torch.cuda.memory_snapshot()`) walks a trace with context once: its window rides on the
//! categories pass. These tests hold that walk to the two walks a snapshot at a time takes,
//! check the trace whose context comes too late for one walk, and hold `snapshot --serve`'s
//! snapshots of a growing trace (each walking only what is new) to the command's, with the
//! server's walk kept across the program's history changes and going on between requests.

mod common;

use std::io::{BufRead, Write};
use std::path::Path;

use cachealloc_recorder::schema::{PHASE_FORWARD, PHASE_NONE, TAG_PARAMETER};
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

/// A `snapshot --serve` process beside the program writing `trace`.
struct Server {
    child: std::process::Child,
    answers: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl Server {
    fn start(work: &Path) -> Server {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_cachealloc"))
            .current_dir(work)
            .args(["snapshot", "trace", "--serve"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let answers = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        Server { child, answers }
    }

    /// The answer to `request`.
    fn ask(&mut self, request: &str) -> String {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{request}").unwrap();
        stdin.flush().unwrap();
        self.answers.next().unwrap().unwrap()
    }

    /// Wait until the server has one of `files` open, or 60 s have passed. The walk reads a
    /// trace's files in order, each once, so a server holding one has read every one before it.
    fn wait_until_open(&self, files: &[std::path::PathBuf]) {
        let fds = format!("/proc/{}/fd", self.child.id());
        for _ in 0..600 {
            let open = std::fs::read_dir(&fds).unwrap().any(|fd| {
                let target = std::fs::read_link(fd.unwrap().path());
                target.is_ok_and(|t| files.contains(&t))
            });
            if open {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// The trace's files, oldest first.
fn trace_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = (std::fs::read_dir(dir).unwrap())
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

#[test]
fn a_served_snapshot_is_the_snapshot_of_the_trace_so_far() {
    let work = scratch("serve");
    // A new file at every flush: the served walk follows the trace into each.
    let mut p = Program::new(&work.join("trace"), true, 1000);
    let mut server = Server::start(&work);
    let mut live = vec![];
    for round in 0..6u64 {
        if round == 2 {
            let param = p.alloc(4 * MIB);
            p.tag(param, TAG_PARAMETER);
        }
        p.phase(PHASE_FORWARD);
        for _ in 0..(round + 1) * 50 {
            live.push(p.alloc(512));
        }
        for _ in 0..round * 40 {
            let a = live.remove(0);
            p.free(a, 512);
        }
        p.phase(PHASE_NONE);
        p.rotate();
        // As the Python integration asks: segments alone, then with the last events.
        for events in ["0", "7", "100000"] {
            let request = format!(r#"{{"output": "served.pickle", "events": {events}}}"#);
            assert_eq!(server.ask(&request), "ok", "round {round}");
            cachealloc(
                &work,
                &["snapshot", "trace", "--events", events, "-o", "once.pickle"],
            );
            let served = std::fs::read(work.join("served.pickle")).unwrap();
            let once = std::fs::read(work.join("once.pickle")).unwrap();
            assert!(served == once, "round {round}, events {events}");
        }
    }
    // Bad requests are answered, and the server goes on.
    assert!(
        server
            .ask("{}")
            .starts_with("error: not a snapshot request")
    );
    assert!(
        server
            .ask(r#"{"output": "/nonexistent/x.pickle", "events": 0}"#)
            .starts_with("error: /nonexistent/x.pickle")
    );
    assert_eq!(
        server.ask(r#"{"output": "served.pickle", "events": 3}"#),
        "ok"
    );
    p.finish();
    drop(server.child.stdin.take());
    assert!(
        server.child.wait().unwrap().success(),
        "it ends with its input"
    );
}

#[test]
fn a_served_walk_goes_on_between_requests_and_across_history_changes() {
    // The program's `trace` loses its files (as the recorder's rotation removes them) once
    // the server has read them; the command's answers come from `mirror`, a copy of every
    // file. Equal snapshots then say that the server read the files before they went, walking
    // between requests, and kept its walk when the program's history settings grew.
    let work = scratch("serve-follow");
    let mirror = work.join("mirror");
    std::fs::create_dir_all(&mirror).unwrap();
    let mut p = Program::new(&work.join("trace"), true, 1000);
    let mut server = Server::start(&work);
    let mut history = format!("{}:all:all:all", p.now());
    let follow = format!(r#"{{"events": 100000, "history": "{history}"}}"#);
    assert_eq!(server.ask(&follow), "ok", "a request without output");
    let param = p.alloc(4 * MIB);
    p.tag(param, TAG_PARAMETER);
    let pending = p.alloc(MIB);
    for round in 0..3 {
        if round == 1 {
            // The program changes its settings and says so at once, as the integration does:
            // the change comes after what the server has walked, and the walk takes it.
            history += &format!(",{}:all:state:python", p.now() + 1);
            let follow = format!(r#"{{"events": 100000, "history": "{history}"}}"#);
            assert_eq!(server.ask(&follow), "ok");
        }
        p.phase(PHASE_FORWARD);
        if round == 0 {
            // Pending past the window's first event: its category kept all the same.
            p.free_requested(pending, MIB);
        }
        for _ in 0..if round == 2 { 5_000 } else { 40_000 } {
            let a = p.alloc(512);
            p.free(a, 512);
        }
        if round == 2 {
            p.free_completed(pending, MIB);
        }
        p.phase(PHASE_NONE);
        p.rotate();
        // The file being written is copied again when finished (`.part` dropped from the name).
        for file in trace_files(&mirror) {
            if file.extension().is_some_and(|e| e == "part") {
                std::fs::remove_file(file).unwrap();
            }
        }
        let files = trace_files(&work.join("trace"));
        for file in &files {
            std::fs::copy(file, mirror.join(file.file_name().unwrap())).unwrap();
        }
        // Once the server holds one of the last two files, the ones before them can go.
        let canonical: Vec<_> = files.iter().map(|f| f.canonicalize().unwrap()).collect();
        server.wait_until_open(&canonical[canonical.len().saturating_sub(2)..]);
        for file in &files[..files.len() - 1] {
            std::fs::remove_file(file).unwrap();
        }
        for events in ["0", "100000"] {
            let request = format!(
                r#"{{"output": "served.pickle", "events": {events}, "history": "{history}"}}"#
            );
            assert_eq!(server.ask(&request), "ok", "round {round}");
            cachealloc(
                &work,
                &[
                    "snapshot",
                    "mirror",
                    "--events",
                    events,
                    "--history",
                    &history,
                    "-o",
                    "once.pickle",
                ],
            );
            let served = std::fs::read(work.join("served.pickle")).unwrap();
            let once = std::fs::read(work.join("once.pickle")).unwrap();
            assert!(served == once, "round {round}, events {events}");
        }
    }
    p.finish();
}
