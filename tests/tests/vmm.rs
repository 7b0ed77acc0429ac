//! fakecuda's virtual memory management API (`cuMemCreate`, `cuMemAddressReserve`,
//! `cuMemMap`, `cuMemSetAccess`, ...), through the `vmm` program (`programs/vmm.c`), which uses
//! it as XLA and expandable segments do and checks CUDA's semantics and error codes: over
//! fakecuda alone, in both runtime flavours, and under the shim, which does not wrap this API
//! and must let it through untouched. Controls show the program fails when fakecuda disagrees
//! with it (granularity, capacity, a refusing device) and that memory without access faults.

use cachealloc_tests::{Output, Run};

/// fakecuda's count of successful `cuMemCreate` and `cuMemRelease` calls (`FAKECUDA_REPORT`).
fn physical(out: &Output) -> (u64, u64) {
    (
        out.fakecuda_count("physical creates"),
        out.fakecuda_count("physical releases"),
    )
}

/// The program's successful creates (3 granules; 3 of 1; a spare of 2) and releases (those 5,
/// and one handle retained from an address).
const CREATES_RELEASES: (u64, u64) = (5, 6);

/// `name` with the granularity `kib` (2048: fakecuda's default, no override), and `more`
/// arguments.
fn vmm_with(name: &str, kib: &str, more: &[&str]) -> Run {
    let args: Vec<&str> = [kib].iter().chain(more).copied().collect();
    let run = Run::c(name, &args).env("FAKECUDA_REPORT", "1");
    if kib == "2048" {
        run
    } else {
        run.env("FAKECUDA_VMM_GRANULARITY_KB", kib)
    }
}

fn vmm(name: &str, kib: &str) -> Run {
    vmm_with(name, kib, &[])
}

#[test]
fn the_vmm_api_behaves_as_cuda_over_fakecuda() {
    for name in ["vmm", "vmm_static"] {
        for kib in ["2048", "64"] {
            let out = vmm(name, kib).without_shim().output();
            out.assert_ok("vmm");
            assert!(
                out.stdout.contains(&format!(
                    "granularity {}",
                    kib.parse::<u64>().unwrap() << 10
                )),
                "{name} {kib}: {}",
                out.stdout
            );
            assert_eq!(physical(&out), CREATES_RELEASES, "{name} {kib}");
        }
    }
}

#[test]
fn the_shim_lets_the_vmm_api_through_untouched() {
    for name in ["vmm", "vmm_static"] {
        for kib in ["2048", "64"] {
            let out = vmm(name, kib).output();
            out.assert_ok("vmm");
            // Every physical allocation is the program's own.
            assert_eq!(physical(&out), CREATES_RELEASES, "{name} {kib}");
        }
    }
}

#[test]
fn mapped_memory_faults_until_access_is_granted() {
    for name in ["vmm", "vmm_static"] {
        let shimless = vmm_with(name, "64", &["touch"]).without_shim();
        for run in [shimless, vmm_with(name, "64", &["touch"])] {
            let out = run.output();
            assert!(
                out.code.is_none() && out.stdout.contains("touching mapped memory without access"),
                "exit {:?}\n{}{}",
                out.code,
                out.stdout,
                out.stderr
            );
        }
    }
}

#[test]
fn controls_the_program_fails_when_fakecuda_disagrees() {
    // A granularity other than the one the program expects.
    let out = Run::c("vmm", &["64"])
        .env("FAKECUDA_VMM_GRANULARITY_KB", "128")
        .without_shim()
        .output();
    out.assert_fails_with("granularity 131072");
    // A device too small for its 3 granules of 2 MiB.
    let out = Run::c("vmm", &[])
        .env("FAKECUDA_CAPACITY_MB", "4")
        .without_shim()
        .output();
    out.assert_fails_with("returned 2");
    assert!(out.stdout.contains("p_create"), "{}", out.stdout);
    // A device that refuses every second request: cuMemCreate counts with cuMemAlloc_v2.
    let out = vmm("vmm_static", "64")
        .env("FAKECUDA_FAULT", "oom_every:2")
        .without_shim()
        .output();
    out.assert_fails_with("returned 2");
    assert!(
        out.stderr.contains("1 refused by FAKECUDA_FAULT"),
        "{}",
        out.stderr
    );
}
