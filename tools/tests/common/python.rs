//! Python for the tests: whether the dataset's duckdb and pyarrow can be imported, and a
//! script's output (as text, or JSON).

use std::process::Command;

use serde_json::Value;

/// Whether Python's duckdb and pyarrow can be imported; without them (and not required) the
/// caller skips its Python checks.
pub fn python_ready() -> bool {
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

/// Run a Python script with `args`; its stdout as text.
pub fn python_text(script: &str, args: &[&str]) -> String {
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
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Run a Python script with `args`; its stdout as JSON.
pub fn python(script: &str, args: &[&str]) -> Value {
    serde_json::from_str(&python_text(script, args)).expect("JSON from the script")
}
