//! Helpers shared by the tools' test files: where the checked-in traces are, scratch
//! directories, and running the `cachealloc` binary.
#![allow(dead_code)] // each test file uses some of them

pub mod job;
pub mod program;
pub mod python;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The tools crate's directory.
pub fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The checked-in trace `trace` (`tests/data/<trace>/run`, made by `tests/data/make-traces.sh`).
pub fn data(trace: &str) -> PathBuf {
    manifest().join("tests/data").join(trace).join("run")
}

/// A fresh, empty scratch directory for the test `name`.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cachealloc-tools-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Run `cachealloc args` in `dir`; returns stdout (asserting success).
pub fn cachealloc(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_cachealloc"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run cachealloc");
    assert!(
        out.status.success(),
        "cachealloc {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}
