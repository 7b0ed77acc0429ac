//! The builder of the Python integration's C++ pieces for PyTorch
//! (`shim/python/cachealloc_torch_build.py`), without PyTorch: a detached build outlives the
//! process that started it and its library loads; a failed build is remembered with the
//! compiler's output and not tried again (`programs/torch_build.py` says what it checks).

use std::time::Duration;

use cachealloc_tests::Run;

#[test]
fn detached_builds_finish_after_their_starter_and_failed_builds_are_not_retried() {
    Run::python_script("torch_build.py")
        .timeout(Duration::from_secs(300))
        .output()
        .assert_ok("torch_build");
}
