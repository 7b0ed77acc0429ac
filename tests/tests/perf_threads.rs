//! `scripts/gpu/perf_threads.py`, which sorts a profile's samples by thread and library for
//! `scripts/gpu/thread_profile.sh`, over a hand-written `perf script` listing
//! (`programs/perf_threads.py` says what it checks).

use cachealloc_tests::Run;

#[test]
fn perf_samples_are_counted_by_thread_and_library_and_reported_per_step() {
    Run::python_script("perf_threads.py")
        .output()
        .assert_ok("perf_threads");
}
