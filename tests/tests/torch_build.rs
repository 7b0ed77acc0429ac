//! The builder of the Python integration's C++ pieces for PyTorch
//! (`shim/python/cachealloc_torch_build.py`), without PyTorch: a detached build outlives the
//! process that started it and its library loads; a failed build is remembered with the
//! compiler's output and not tried again (`programs/torch_build.py` says what it checks).

use std::process::Command;

#[test]
fn detached_builds_finish_after_their_starter_and_failed_builds_are_not_retried() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/programs/torch_build.py");
    let out = Command::new(&python)
        .arg(script)
        .env_remove("LD_PRELOAD")
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("OK torch_build"),
        "torch_build.py failed:\n{stdout}\n{stderr}"
    );
}
