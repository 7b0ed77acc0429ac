//! CUDA's own IPC calls on pooled memory (`programs/cuda_ipc_handles.c`): a program that shares
//! its blocks by `cudaIpcGetMemHandle` of the base `cuPointerGetAttribute(RANGE_START_ADDR)`
//! names, as vLLM's and SGLang's custom all-reduce do with PyTorch's tensors, and a receiving
//! process that opens the handles with `cudaIpcOpenMemHandle`; both under the shim, over
//! fakecuda (Note [CUDA's IPC handles for pooled blocks] in the shim's `process::ipc::handles`).

use cachealloc_tests::Run;

#[test]
fn cuda_ipc_handles_of_pooled_blocks_open_in_another_process_and_go_with_the_blocks_free() {
    let runs = [
        ("", None),
        ("expandable_segments:True", None),
        ("expandable_segments:False", None),
        // Each rank of a custom all-reduce opens its peers' buffers on its own GPU: the opens
        // and copies must work from device 1 (fakecuda's copies and memsets, like a GPU's,
        // reach mapped memory only from the devices `cuMemSetAccess` named: a receiver that
        // granted the sender's device instead of its own fails here).
        ("", Some("1")),
        ("expandable_segments:False", Some("1")),
    ];
    for (conf, receiver_device) in runs {
        let mut run = Run::c("cuda_ipc_handles", &[]).env("CACHEALLOC_CONF", conf);
        if let Some(device) = receiver_device {
            run = run
                .env("FAKECUDA_DEVICES", "2")
                .env("RECEIVER_DEVICE", device);
        }
        let out = run.output();
        out.assert_pooled("cuda_ipc_handles");
        assert!(
            out.stdout.contains("OK cuda_ipc_handles receiver"),
            "CACHEALLOC_CONF={conf}: the receiver did not finish\n{}\n{}",
            out.stdout,
            out.stderr
        );
        assert!(
            out.stdout.contains("OK cuda_ipc_handles stale"),
            "CACHEALLOC_CONF={conf}: a freed block's handle was not refused\n{}\n{}",
            out.stdout,
            out.stderr
        );
        assert!(
            !out.stderr.contains("internal failure") && !out.stderr.contains("refused"),
            "CACHEALLOC_CONF={conf}: {}",
            out.stderr
        );
    }
}
