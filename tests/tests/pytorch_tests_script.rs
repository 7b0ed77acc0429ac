//! `scripts/gpu/pytorch_allocator_tests.sh`, the script whose table judges issue 22 (PyTorch's
//! own allocator tests, natively and under the shim), run here over a stand-in for PyTorch's
//! `test_cuda.py`: how it reads pytest's outcomes and where it runs each test decide the
//! table, and a mistake in either changes outcomes on both sides alike, where no comparison of
//! the sides can see it (the thirty-fourth session's one-process batch of the serial tests
//! changed ten outcomes on the GPU). Needs Python's pytest: `scripts/test` installs it and then
//! requires it (`CACHEALLOC_REQUIRE_PYTEST=1`); under a bare `cargo test` without it the test
//! says so and passes.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// PyTorch's file in miniature: tests the script's default selection takes (`TestCuda`'s
/// "memory" tests, `TestMemPool`), two serial ones where the second passes only in a process
/// the first did not run in, a serial one that kills its process under the shim only, an
/// expected failure, and a failure on both sides.
const STAND_IN: &str = r#"
import os
import pytest

LEFT_BEHIND = []


class TestCuda:
    def test_memory_plain(self):
        pass

    @pytest.mark.serial
    def test_memory_serial_first(self):
        LEFT_BEHIND.append("a memory fraction")

    @pytest.mark.serial
    def test_memory_serial_second(self):
        assert not LEFT_BEHIND, "ran after another test in its process"

    @pytest.mark.serial
    def test_memory_serial_abort_under_the_shim(self):
        if os.environ.get("LD_PRELOAD"):
            os.abort()

    @pytest.mark.xfail
    def test_memory_expected_failure(self):
        assert False


class TestMemPool:
    def test_mempool_fails_on_both_sides(self):
        assert False
"#;

fn pytest_available() -> bool {
    let ready = Command::new("python3")
        .args(["-c", "import pytest"])
        .status()
        .is_ok_and(|s| s.success());
    if !ready {
        assert!(
            std::env::var_os("CACHEALLOC_REQUIRE_PYTEST").is_none(),
            "Python's pytest is required (CACHEALLOC_REQUIRE_PYTEST) but cannot be imported"
        );
        eprintln!("skipped: Python's pytest is not installed");
    }
    ready
}

/// Run the script over `test_file` with the variable `SERIAL` set to `serial`; its table as test
/// name → (native, shim).
fn run_script(test_file: &Path, serial: &str) -> BTreeMap<String, (String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let lib = cachealloc_tests::shim_library();
    let out = test_file.parent().unwrap().join(format!("out_{serial}"));
    let output = Command::new("bash")
        .current_dir(&root)
        .arg("scripts/gpu/pytorch_allocator_tests.sh")
        .arg(test_file)
        .arg(lib.parent().unwrap())
        .arg("4")
        .env("OUT", &out)
        .env("SERIAL", serial)
        .env("GPUS", "1")
        .env("DEADLINE", "240")
        .env("TEST_TIMEOUT", "60")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .output()
        .expect("run bash");
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the script failed: {printed}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let table = std::fs::read_to_string(out.join("pytorch_tests.tsv"))
        .unwrap_or_else(|e| panic!("no table ({e}); the script printed: {printed}"));
    table
        .lines()
        .skip(1)
        .map(|line| {
            let cells: Vec<&str> = line.split('\t').collect();
            let name = cells[0].rsplit("::").next().unwrap().to_string();
            (name, (cells[1].to_string(), cells[2].to_string()))
        })
        .collect()
}

fn row(native: &str, shim: &str) -> (String, String) {
    (native.to_string(), shim.to_string())
}

#[test]
fn pytorch_test_script_runs_serial_tests_alone_and_reads_xfail_as_skip() {
    if !pytest_available() {
        return;
    }
    let dir = cachealloc_tests::fresh_dir();
    let test_file = dir.join("test_cuda.py");
    std::fs::write(&test_file, STAND_IN).unwrap();

    let others = run_script(&test_file, "skip");
    let expected_others = BTreeMap::from([
        ("test_memory_plain".to_string(), row("pass", "pass")),
        (
            "test_memory_expected_failure".to_string(),
            row("skip", "skip"),
        ),
        (
            "test_mempool_fails_on_both_sides".to_string(),
            row("fail", "fail"),
        ),
    ]);
    assert_eq!(
        others, expected_others,
        "SERIAL=skip: every test but the serial ones"
    );

    let serial = run_script(&test_file, "only");
    let expected_serial = BTreeMap::from([
        ("test_memory_serial_first".to_string(), row("pass", "pass")),
        // Passes only in a process of its own: run after the first in one process, it fails.
        ("test_memory_serial_second".to_string(), row("pass", "pass")),
        (
            "test_memory_serial_abort_under_the_shim".to_string(),
            row("pass", "abort"),
        ),
    ]);
    assert_eq!(
        serial, expected_serial,
        "SERIAL=only: the serial tests alone"
    );
}
