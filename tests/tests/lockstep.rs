//! `scripts/gpu/lockstep.py`, the benchmark that compares configurations which cannot share a
//! process, without a GPU: its processes take their turns in the rotating order and its ratios
//! come out (`programs/lockstep.py` says what it checks).

use std::process::Command;

#[test]
fn lockstep_processes_take_turns_and_their_ratios_come_out() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/programs/lockstep.py");
    let out = Command::new(&python)
        .arg(script)
        .env_remove("LD_PRELOAD")
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("OK lockstep"),
        "lockstep.py failed:\n{stdout}\n{stderr}"
    );
}
