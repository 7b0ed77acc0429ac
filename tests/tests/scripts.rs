//! The project's scripts against the test build: what `scripts/demo` (the README's main job
//! on a machine without a GPU) builds must run under the shim as the tests' own build does.

use cachealloc_tests::Run;

#[test]
fn the_scripts_build_of_fakecuda_runs_the_programs_under_the_shim() {
    // scripts/demo (the README's main job without a GPU) builds fakecuda with
    // scripts/lib/fakecuda.sh, not with tests/build.rs: the two must agree (regression: the
    // script lost track of fakecuda's driver header and the demo failed to build).
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = cachealloc_tests::fresh_dir().join("fakecuda");
    let status = std::process::Command::new("bash")
        .current_dir(&root)
        .arg("-c")
        .arg(format!(
            "source scripts/lib/fakecuda.sh && build_fakecuda '{}' race",
            out.display()
        ))
        .status()
        .expect("run bash");
    assert!(status.success(), "build_fakecuda failed");
    let run = Run::new(out.join("race"), &["nonblocking"])
        .env("LD_LIBRARY_PATH", out.to_str().unwrap())
        .output();
    run.assert_pooled("race");
}
