//! `scripts/gpu/lockstep.py`, the benchmark that compares configurations which cannot share a
//! process, without a GPU: its processes take their turns in the rotating order and its ratios
//! come out (`programs/lockstep.py` says what it checks).

use std::time::Duration;

use cachealloc_tests::Run;

#[test]
fn lockstep_processes_take_turns_and_their_ratios_come_out() {
    Run::python_script("lockstep.py")
        .timeout(Duration::from_secs(180))
        .output()
        .assert_ok("lockstep");
}
