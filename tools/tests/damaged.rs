//! Every command that reads a trace, on damaged traces: an empty directory, an empty file, a
//! file cut at every few bytes, a newer format version, a flipped byte, random bytes after a
//! valid prefix and random bytes alone. Each must give a clear error (exit 1, one line naming
//! the trace) or read up to the damage (exit 0) — never panic, never hang.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{data, scratch};

/// The bytes of the checked-in `oom` trace's file.
fn original() -> Vec<u8> {
    std::fs::read(data("oom").join("trace-000000.cat")).expect("test trace")
}

/// A trace directory holding one file with `bytes`.
fn trace_with(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let trace = dir.join(name);
    std::fs::create_dir_all(&trace).unwrap();
    std::fs::write(trace.join("trace-000000.cat"), bytes).unwrap();
    trace
}

/// Every trace-reading command on `trace`, writing any output file into `out`.
fn commands(trace: &Path, out: &Path) -> Vec<Vec<String>> {
    let t = trace.display().to_string();
    let o = |name: &str| out.join(name).display().to_string();
    // `replay` refuses a damaged trace before it needs a GPU, or replays what is readable (over
    // a GPU's driver; without one it fails naming the trace).
    let plain = [
        "summary", "stats", "trace", "leaks", "peak", "simulate", "replay", "fleet",
    ];
    let mut all: Vec<Vec<String>> = plain
        .iter()
        .map(|c| vec![c.to_string(), t.clone()])
        .collect();
    for (command, file) in [
        ("snapshot", "s.pickle"),
        ("flamegraph", "f.svg"),
        ("plot", "p.html"),
        ("perfetto", "p.json"),
        ("export", "dataset"),
    ] {
        all.push(vec![command.into(), "-o".into(), o(file), t.clone()]);
    }
    // The peaks of two traces (here the same one twice).
    all.push(vec![
        "compare".into(),
        "-o".into(),
        o("c.svg"),
        t.clone(),
        t,
    ]);
    all
}

/// Run `cachealloc args`; (exit code, stderr). Fails the test on a panic, a signal or a hang.
fn run(args: &[String]) -> (i32, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cachealloc"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run cachealloc");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("cachealloc {args:?} hung");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(
        !stderr.contains("panicked"),
        "cachealloc {args:?} panicked:\n{stderr}"
    );
    let code = status
        .code()
        .unwrap_or_else(|| panic!("cachealloc {args:?} died by a signal: {status:?}"));
    (code, stderr)
}

/// Every command on `trace` ends cleanly: exit 0, or exit 1 with one clear line naming `names`.
fn every_command_copes(trace: &Path, names: &str, out: &Path) {
    for args in commands(trace, out) {
        let (code, stderr) = run(&args);
        match code {
            0 => {}
            1 => assert!(
                stderr.starts_with("cachealloc: ") && stderr.contains(names),
                "{args:?}: an error must name {names}: {stderr}"
            ),
            other => panic!("{args:?}: exit {other}: {stderr}"),
        }
    }
}

#[test]
fn no_trace_and_foreign_bytes_are_clear_errors() {
    let dir = scratch("errors");
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let mut newer = original();
    newer[8..12].copy_from_slice(&9u32.to_le_bytes());
    let newer = trace_with(&dir, "newer", &newer);
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let noise: Vec<u8> = (0..5000)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect();
    let noise = trace_with(&dir, "noise", &noise);
    for (trace, why) in [
        (&empty, "no trace here"),
        (&newer, "format version 9 is newer"),
        (&noise, "not a cachealloc trace file"),
    ] {
        for args in commands(trace, &dir) {
            let (code, stderr) = run(&args);
            assert_eq!(code, 1, "{args:?}: {stderr}");
            assert!(stderr.contains(why), "{args:?}: {stderr}");
        }
    }
}

#[test]
fn a_trace_cut_anywhere_is_read_up_to_the_cut() {
    let dir = scratch("cut");
    let original = original();
    // Every 37th byte, and each of the last few: inside the prefix, the header chunk, the
    // records.
    let cuts: Vec<usize> = (0..original.len())
        .step_by(37)
        .chain(original.len() - 5..original.len())
        .collect();
    for cut in cuts {
        let trace = trace_with(&dir, &format!("cut{cut}"), &original[..cut]);
        every_command_copes(&trace, &format!("cut{cut}"), &dir);
        if cut > 12 {
            let (code, _) = run(&["summary".to_string(), trace.display().to_string()]);
            assert_eq!(code, 0, "a file cut at byte {cut} is read up to the cut");
        }
    }
}

#[test]
fn flipped_bytes_and_noise_after_the_prefix_are_tears() {
    let dir = scratch("flipped");
    let original = original();
    for at in (12..original.len()).step_by(53) {
        let mut bytes = original.clone();
        bytes[at] ^= 0x5a;
        let trace = trace_with(&dir, &format!("flip{at}"), &bytes);
        every_command_copes(&trace, &format!("flip{at}"), &dir);
    }
    let mut seed = 7u64;
    for len in [1usize, 9, 100, 4096] {
        let mut bytes = original[..12].to_vec();
        bytes.extend((0..len).map(|_| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u8
        }));
        let trace = trace_with(&dir, &format!("noise{len}"), &bytes);
        every_command_copes(&trace, &format!("noise{len}"), &dir);
        let summary = Command::new(env!("CARGO_BIN_EXE_cachealloc"))
            .args(["summary", &trace.display().to_string()])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&summary.stdout);
        assert!(
            summary.status.success() && text.contains("(read up to there)"),
            "noise after the prefix is reported as a tear: {text}"
        );
    }
}
