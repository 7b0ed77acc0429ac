//! What a memory fraction counts, end to end over fakecuda (Note [Whose memory a limit counts]
//! in the shim's `backend::budget`): PyTorch's fraction its own memory, cachealloc's
//! everything the pools hold. `mem_pools.c` and `python_integration.py` check the fraction
//! PyTorch sets at run time; this file the one given at start.

use cachealloc_tests::Run;

#[test]
fn a_fraction_from_pytorchs_variable_counts_pytorchs_memory_and_cachealloc_s_everything() {
    for (variable, which) in [
        ("PYTORCH_CUDA_ALLOC_CONF", "pytorch"),
        ("CACHEALLOC_CONF", "cachealloc"),
    ] {
        let out = Run::c("fraction_scope", &[which])
            .env(variable, "per_process_memory_fraction:0.25")
            .env("FAKECUDA_CAPACITY_MB", "100")
            .output();
        out.assert_pooled("fraction_scope");
        assert!(
            !out.stderr.contains("internal failure") && !out.stderr.contains("passing every"),
            "{variable}: the shim degraded:\n{}",
            out.stderr
        );
    }
}
