//! Traces are private by default, over fakecuda: the trace directories the shim creates are
//! `0700` and its files `0600` whatever the umask; `trace_mode` widens both; an existing trace
//! directory that is a symbolic link, another user's, or writable by others is refused with one
//! message, and the program runs on untraced.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use cachealloc_tests::{Output, Run};

fn mode(path: &Path) -> u32 {
    fs::symlink_metadata(path).unwrap().mode() & 0o7777
}

/// The run's trace root and its one process directory have `dir_mode`, every file `file_mode`.
fn assert_modes(out: &Output, dir_mode: u32, file_mode: u32) {
    out.assert_ok("basic");
    let root = out.dir.join("cachealloc-trace");
    assert_eq!(mode(&root), dir_mode, "{}", root.display());
    let trace = out.one_trace();
    assert_eq!(mode(&trace), dir_mode, "{}", trace.display());
    let files: Vec<_> = fs::read_dir(&trace)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(!files.is_empty());
    for file in files {
        assert_eq!(mode(&file), file_mode, "{}", file.display());
    }
}

#[test]
fn trace_directories_are_0700_and_files_0600_whatever_the_umask() {
    // A permissive umask would leave 0755/0644 (0777/0666 with umask 0) without the shim's care.
    for umask in ["022", "000"] {
        let basic = cachealloc_tests::program("basic");
        let script = format!("umask {umask}; exec \"$0\"");
        let out = Run::new("sh", &["-c", &script, basic.to_str().unwrap()]).output();
        assert_modes(&out, 0o700, 0o600);
    }
}

#[test]
fn trace_mode_widens_files_and_directories() {
    let out = Run::c("basic", &[])
        .env("CACHEALLOC_CONF", "trace_mode:0640")
        .output();
    assert_modes(&out, 0o750, 0o640);
    let out = Run::c("basic", &[])
        .env("CACHEALLOC_CONF", "trace_mode:0660")
        .output();
    assert_modes(&out, 0o770, 0o660);
}

/// A run of `basic` with `trace_dir` set to `dir`: it passes, says once why it has no trace, and
/// wrote nothing there.
fn assert_refused(dir: &Path, conf_extra: &str, why: &str) -> Output {
    let out = Run::c("basic", &[])
        .env(
            "CACHEALLOC_CONF",
            &format!("trace_dir:{}{conf_extra}", dir.display()),
        )
        .output();
    out.assert_ok("basic");
    let refusals: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.starts_with("cachealloc: refusing the trace directory"))
        .collect();
    // One message (the exit summary's line then says "no trace" and why).
    assert_eq!(refusals.len(), 1, "one message: {}", out.stderr);
    assert!(
        refusals[0].starts_with("cachealloc: ")
            && refusals[0].contains(&dir.display().to_string())
            && refusals[0].contains(why)
            && refusals[0].contains("running without a trace"),
        "{}",
        out.stderr
    );
    out
}

fn entries(dir: &Path) -> usize {
    fs::read_dir(dir).map_or(0, |d| d.count())
}

#[test]
fn a_trace_directory_others_may_write_is_refused_and_the_program_runs_on() {
    let dir = cachealloc_tests::fresh_dir().join("shared");
    fs::create_dir(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
    assert_refused(
        &dir,
        "",
        "its group and others may write into it (mode 0777)",
    );
    assert_eq!(entries(&dir), 0);
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o770)).unwrap();
    assert_refused(&dir, "", "its group may write into it (mode 0770)");
    assert_eq!(entries(&dir), 0);
    // Control: the same directory is accepted when trace_mode lets the group write.
    let out = Run::c("basic", &[])
        .env(
            "CACHEALLOC_CONF",
            &format!("trace_dir:{},trace_mode:0660", dir.display()),
        )
        .output();
    out.assert_ok("basic");
    assert_eq!(entries(&dir), 1, "{}", out.stderr);
}

#[test]
fn a_trace_directory_that_is_a_symbolic_link_is_refused() {
    let base = cachealloc_tests::fresh_dir();
    fs::create_dir(base.join("real")).unwrap();
    std::os::unix::fs::symlink(base.join("real"), base.join("link")).unwrap();
    assert_refused(&base.join("link"), "", "it is a symbolic link");
    assert_eq!(entries(&base.join("real")), 0);
}

#[test]
fn another_users_trace_directory_is_refused() {
    let base = cachealloc_tests::fresh_dir();
    // As root, a directory of `nobody`'s; otherwise `/` (root's).
    let dir = if fs::metadata(&base).unwrap().uid() == 0 {
        let dir = base.join("nobodys");
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
        dir
    } else {
        Path::new("/").to_path_buf()
    };
    assert_refused(&dir, "", "it belongs to user ");
}
