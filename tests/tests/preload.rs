//! End-to-end tests of `libcachealloc.so`: the C programs of `programs/` (and one Python
//! program) run under `LD_PRELOAD` over fakecuda, whose streams really run asynchronously.
//!
//! Each test names the behaviour it pins down; where a test could pass by accident, a control
//! run shows that it fails when the behaviour is switched off (e.g. the race under
//! `reuse:immediate`).

use cachealloc_tests::Run;

fn summary_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains("allocations served from the cache"))
        .collect()
}

#[test]
fn basic_allocations_are_pooled_and_reused() {
    let out = Run::c("basic", &[]).output();
    out.assert_ok("basic");
    assert!(out.stdout.contains("reused 1"), "{}", out.stdout);
    let summary = summary_lines(&out.stderr);
    assert_eq!(summary.len(), 1, "one exit summary line: {}", out.stderr);
    assert!(
        summary[0].contains("6 of 9 allocations served from the cache"),
        "{}",
        summary[0]
    );
}

#[test]
fn programs_also_pass_without_the_shim() {
    // Sanity of fakecuda itself: the programs are correct CUDA programs.
    for name in ["basic", "race", "badfree", "meminfo", "device_reset"] {
        Run::c(name, &[]).without_shim().output().assert_ok(name);
    }
}

#[test]
fn cross_stream_reuse_waits_for_the_old_work() {
    for args in [
        &["nonblocking"][..],
        &["blocking"],
        &["nonblocking", "late"],
    ] {
        let flavour = args.join(" ");
        let out = Run::c("race", args).output();
        out.assert_pooled("race");
        // The freed block was the only candidate: it was reused, after a fence wait, with the
        // right bytes.
        assert!(out.stdout.contains("reused 3"), "{flavour}: {}", out.stdout);
        assert!(
            !out.stderr.contains(" 0 fence waits"),
            "{flavour}: {}",
            out.stderr
        );
    }
}

#[test]
fn the_race_test_catches_unfenced_reuse() {
    // Control: with reuse:immediate the shim hands the block back at once, and the slow old
    // work overwrites the new data. The test must see it.
    for flavour in ["nonblocking", "blocking"] {
        let out = Run::c("race", &[flavour])
            .env("CACHEALLOC_CONF", "reuse:immediate")
            .output();
        out.assert_fails_with("overwritten by the old work");
    }
}

#[test]
fn many_threads_never_share_a_live_block() {
    Run::c("threads", &["8", "400"])
        .output()
        .assert_pooled("threads");
    // Control: an allocator that hands a live block out twice is caught by the program.
    let broken = Run::c("threads", &["8", "400"])
        .env("FAKECUDA_FAULT", "overlap")
        .without_shim()
        .output();
    broken.assert_fails_with("a live block was overwritten");
}

#[test]
fn oom_releases_the_cache_and_retries_then_reports() {
    let out = Run::c("oom", &[])
        .env("FAKECUDA_CAPACITY_MB", "64")
        .output();
    out.assert_pooled("oom");
    assert!(
        out.stderr
            .contains("device 0: out of memory: tried to allocate 128.00 MiB"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("The device has 64.00 MiB in total"),
        "{}",
        out.stderr
    );
}

#[test]
fn bad_frees_are_refused_with_a_message() {
    let out = Run::c("badfree", &[]).output();
    out.assert_pooled("badfree");
    assert!(
        out.stderr
            .contains("is 512 bytes into a block of 8192 bytes"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("double free of"), "{}", out.stderr);
}

#[test]
fn mem_get_info_counts_cached_bytes_as_free() {
    Run::c("meminfo", &[]).output().assert_pooled("meminfo");
    // Control: without the option, the cached bytes are missing from "free".
    let out = Run::c("meminfo", &[])
        .env("CACHEALLOC_CONF", "report_cached_as_free:false")
        .output();
    out.assert_fails_with("cached bytes not reported as free");
}

#[test]
fn fork_while_another_thread_allocates_does_not_deadlock() {
    Run::c("fork", &[]).output().assert_pooled("fork");
}

#[test]
fn exit_without_freeing_ends_cleanly_with_a_summary() {
    let out = Run::c("exit_nofree", &[]).output();
    out.assert_pooled("exit_nofree");
    assert_eq!(summary_lines(&out.stderr).len(), 1, "{}", out.stderr);
}

#[test]
fn log_quiet_silences_the_summary() {
    let out = Run::c("exit_nofree", &[])
        .env("CACHEALLOC_CONF", "log:quiet")
        .output();
    out.assert_ok("exit_nofree");
    assert!(out.stderr.is_empty(), "{}", out.stderr);
}

#[test]
fn ipc_handles_name_the_right_bytes_and_none_is_given_for_a_freed_block() {
    let out = Run::c("ipc", &[]).output();
    out.assert_pooled("ipc");
    assert!(
        out.stderr.contains("cudaIpcGetMemHandle") && out.stderr.contains("not allocated"),
        "{}",
        out.stderr
    );
}

#[test]
fn each_device_has_its_own_pool() {
    let out = Run::c("multi_gpu", &[])
        .env("FAKECUDA_DEVICES", "2")
        .output();
    out.assert_pooled("multi_gpu");
    let summary = summary_lines(&out.stderr);
    assert_eq!(summary.len(), 2, "{}", out.stderr);
    assert!(summary[1].contains("device 1"), "{}", summary[1]);
}

#[test]
fn device_reset_forgets_the_pools() {
    Run::c("device_reset", &[])
        .output()
        .assert_pooled("device_reset");
}

#[test]
fn a_bad_config_passes_through_with_one_clear_message() {
    let out = Run::c("basic", &[])
        .env("CACHEALLOC_CONF", "reuse:sometimes")
        .output();
    out.assert_ok("basic");
    let messages: Vec<&str> = out.stderr.lines().collect();
    assert_eq!(messages.len(), 1, "{}", out.stderr);
    assert!(
        messages[0].contains("'reuse'")
            && messages[0].contains("expected auto, fenced or immediate"),
        "{}",
        messages[0]
    );
    assert!(
        messages[0].contains("passing every CUDA call through"),
        "{}",
        messages[0]
    );
}

#[test]
fn pool_off_passes_everything_through() {
    let out = Run::c("basic", &[])
        .env("CACHEALLOC_CONF", "pool:off")
        .output();
    out.assert_ok("basic");
    assert!(summary_lines(&out.stderr).is_empty(), "{}", out.stderr);
}

/// CACHEALLOC_CONF, the user's own variables, and the PYTORCH_CUDA_ALLOC_CONF and
/// PYTORCH_NO_CUDA_MEMORY_CACHING that PyTorch must then see.
type TorchEnvCase<'a> = (&'a str, &'a [(&'a str, &'a str)], [&'a str; 2]);

#[test]
fn python_host_through_ctypes() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/programs/ctypes_test.py");
    let out = Run::new(&python, &[script]).output();
    out.assert_ok("ctypes");
    let marker = out
        .stderr
        .lines()
        .find(|l| l.contains("annotation 'after the frees' at +"))
        .unwrap_or_default();
    assert!(
        marker.contains("device 0 allocated 0 B (peak 3."),
        "{}",
        out.stderr
    );
    // What the constructor tells PyTorch: (CACHEALLOC_CONF, the user's variables) → the
    // expected PYTORCH_CUDA_ALLOC_CONF and PYTORCH_NO_CUDA_MEMORY_CACHING.
    let cases: [TorchEnvCase; 5] = [
        // torch_caching:keep leaves PyTorch's own cache alone.
        ("torch_caching:keep", &[], ["unset", "unset"]),
        // The first route: PyTorch's uncached path.
        ("torch_caching:uncached", &[], ["unset", "1"]),
        // A user's own choices are kept, their other allocator settings too.
        (
            "",
            &[("PYTORCH_NO_CUDA_MEMORY_CACHING", "0")],
            ["unset", "0"],
        ),
        (
            "",
            &[("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")],
            ["max_split_size_mb:64,backend:cudaMallocAsync", "unset"],
        ),
        (
            "",
            &[("PYTORCH_CUDA_ALLOC_CONF", "backend:native")],
            ["backend:native", "unset"],
        ),
    ];
    for (conf, env, expected) in cases {
        let mut run = Run::new(&python, &[script, expected[0], expected[1]]);
        if !conf.is_empty() {
            run = run.env("CACHEALLOC_CONF", conf);
        }
        for &(key, value) in env {
            run = run.env(key, value);
        }
        run.output().assert_ok("ctypes");
    }
    // A child whose settings the shim refuses (it passes everything through) gets back
    // PyTorch's settings without the backend its parent's shim added: PyTorch's own allocator
    // then runs, and checks them itself.
    let child = Run::new(
        &python,
        &[
            script,
            "max_split_size_mb:64,per_process_memory_fraction:-0.1",
            "unset",
            "environment-only",
        ],
    )
    .env(
        "PYTORCH_CUDA_ALLOC_CONF",
        "max_split_size_mb:64,backend:cudaMallocAsync,per_process_memory_fraction:-0.1",
    )
    .env("CACHEALLOC_ADDED_TORCH_BACKEND", "PYTORCH_CUDA_ALLOC_CONF")
    .output();
    child.assert_ok("ctypes");
    assert!(
        child.stderr.contains("passing every CUDA call through"),
        "{}",
        child.stderr
    );
}

fn assert_no_shim_failure(stderr: &str) {
    assert!(
        !stderr.contains("internal failure") && !stderr.contains("passing every"),
        "the shim degraded:\n{stderr}"
    );
}

#[test]
fn stream_ordered_frees_are_reused_on_their_stream_and_never_across() {
    let out = Run::c("stream_ordered", &[]).output();
    out.assert_pooled("stream_ordered");
    assert_no_shim_failure(&out.stderr);
    assert_eq!(out.numbers_after("same_stream_reuse"), [1]);
    assert_eq!(out.numbers_after("cross_stream_reuse"), [0]);
    assert_eq!(
        out.numbers_after("adopted"),
        [1],
        "the block freed on the other stream was reused behind a device-side wait"
    );
    assert!(out.stderr.contains(" 0 fence waits"), "{}", out.stderr);
    // Control: with every free fenced, the same-stream block is not reused at once.
    let fenced = Run::c("stream_ordered", &[])
        .env("CACHEALLOC_CONF", "reuse:fenced")
        .output();
    fenced.assert_pooled("stream_ordered");
    assert_eq!(fenced.numbers_after("same_stream_reuse"), [0]);
}

#[test]
fn the_default_pools_attributes_report_our_pools() {
    let out = Run::c("stream_ordered", &[]).output();
    out.assert_pooled("stream_ordered");
    // used before, with 3 MiB live, after the free; peak; peak after reset; reserved.
    let [used0, used1, used2, peak, reset, reserved] = out.numbers_after("used")[..] else {
        panic!("{}", out.stdout)
    };
    assert_eq!(used1 - used0, 3 << 20, "{}", out.stdout);
    assert_eq!(used2, used0);
    assert!(peak >= 3 << 20, "the peak remembers the 3 MiB: {peak}");
    assert_eq!(
        reset, used2,
        "resetting the peak brings it to the current value"
    );
    assert!(reserved >= used1, "reserved {reserved} < used {used1}");
    assert_eq!(
        out.numbers_after("reserved_after_trim"),
        [0],
        "cudaMemPoolTrimTo (PyTorch's empty_cache) released the cache"
    );
    // An impossible request: the OOM paragraph, and the program went on.
    assert!(out.stderr.contains("out of memory"), "{}", out.stderr);
}

#[test]
fn graph_capture_with_allocations_on_other_threads() {
    for _ in 0..3 {
        let out = Run::c("graph_capture", &[]).output();
        out.assert_pooled("graph_capture");
        assert_no_shim_failure(&out.stderr);
        assert!(
            out.stderr.contains("allocations served from the cache"),
            "the shim pooled: {}",
            out.stderr
        );
    }
}

#[test]
fn a_graphs_memory_comes_from_a_private_pool_kept_until_empty_cache_after_the_graph_goes() {
    let out = Run::c("capture_pools", &[]).env("EXACT_FREE", "1").output();
    out.assert_pooled("capture_pools");
    assert_no_shim_failure(&out.stderr);
}

#[test]
fn a_graph_pool_the_program_references_goes_when_it_lets_go_whatever_its_graph_objects() {
    // Only captures allocate (the program fails without the shim's entry points): no
    // allocation reaches the ordinary pool, and empty_cache still releases the graph pools.
    let out = Run::c("graph_pool_refs", &[]).output();
    out.assert_ok("graph_pool_refs");
    assert_no_shim_failure(&out.stderr);
}

#[test]
fn a_stream_that_joins_a_capture_allocates_from_its_pool_and_is_never_fenced() {
    let out = Run::c("capture_streams", &[]).output();
    out.assert_pooled("capture_streams");
    assert_no_shim_failure(&out.stderr);
}

#[test]
fn a_block_freed_in_a_capture_after_record_stream_is_reused_once_the_graph_joins_its_streams() {
    let out = Run::c("capture_reclaim", &[]).output();
    out.assert_pooled("capture_reclaim");
    assert_no_shim_failure(&out.stderr);
}

#[test]
fn allocator_settings_changed_at_run_time_apply_to_pools_made_later() {
    let out = Run::c("allocator_settings", &[]).output();
    out.assert_pooled("allocator_settings");
    assert!(
        out.stderr.contains("max_split_size_mb"),
        "the refusal names the key: {}",
        out.stderr
    );
}

#[test]
fn pool_checkpoints_put_a_pool_back_to_its_layout() {
    let out = Run::c("pool_checkpoints", &[]).output();
    out.assert_pooled("pool_checkpoints");
    assert_no_shim_failure(&out.stderr);
}

#[test]
fn segment_trackers_hear_each_segment_made_and_given_back_but_none_made_inside_them() {
    let out = Run::c("segment_trackers", &[]).output();
    out.assert_pooled("segment_trackers");
    assert_no_shim_failure(&out.stderr);
}

#[test]
fn mem_pools_route_their_threads_allocations_keep_their_memory_and_lend_it_on_oom() {
    let out = Run::c("mem_pools", &[])
        .env("FAKECUDA_CAPACITY_MB", "100")
        .output();
    out.assert_pooled("mem_pools");
    assert_no_shim_failure(&out.stderr);
    assert!(
        out.stderr
            .contains("of which its other pools (graphs, MemPools) hold 40.00 MiB"),
        "the out-of-memory report under a memory fraction names what the MemPools hold: {}",
        out.stderr
    );
}

#[test]
fn a_pooled_block_shared_with_another_process_is_kept_until_it_lets_go() {
    let out = Run::c("ipc_share", &[]).output();
    out.assert_pooled("ipc_share");
    assert_no_shim_failure(&out.stderr);
    assert!(
        out.stdout.contains("OK ipc_share receiver"),
        "the receiving process did not finish: {}",
        out.stdout
    );
}

#[test]
fn a_pooled_block_shared_by_its_description_is_kept_until_the_receiver_lets_go() {
    let out = Run::c("ipc_share", &["desc"]).output();
    out.assert_pooled("ipc_share");
    assert_no_shim_failure(&out.stderr);
    assert!(
        out.stdout.contains("OK ipc_share receiver"),
        "the receiving process did not finish: {}",
        out.stdout
    );
}

#[test]
fn a_block_of_an_expandable_segment_is_shared_by_file_descriptors_until_the_receiver_lets_go() {
    // A small block (one chunk of memory), and a big one mapped in several.
    for args in [&["desc"][..], &["desc", "big"][..]] {
        let out = Run::c("ipc_share", args)
            .env("CACHEALLOC_CONF", "expandable_segments:True")
            .env("EXACT_FDS", "1")
            .output();
        out.assert_pooled("ipc_share");
        assert_no_shim_failure(&out.stderr);
        assert!(
            out.stdout.contains("OK ipc_share receiver"),
            "{args:?}: the receiving process did not finish: {}",
            out.stdout
        );
    }
}

#[test]
fn a_block_of_an_expandable_segment_is_refused_where_it_cannot_be_shared() {
    // The 64-byte handle functions cannot name mapped memory: refused, pointing at the others.
    let out = Run::c("ipc_share", &[])
        .env("CACHEALLOC_CONF", "expandable_segments:True")
        .output();
    out.assert_pooled("ipc_share");
    assert!(
        out.stdout.contains("OK ipc_share (refused)")
            && out.stderr.contains("cachealloc_ipc_share_desc"),
        "the refusal names the function that shares it: {} {}",
        out.stdout,
        out.stderr
    );
    // A device without POSIX file descriptor handles, and one that refuses to make memory
    // with them: its memory is still pooled, and a share says why it cannot be made.
    for (no_fd, why) in [
        ("1", "cannot export its memory as POSIX file descriptors"),
        ("create", "made without a shareable handle"),
    ] {
        let out = Run::c("ipc_share", &["desc"])
            .env("CACHEALLOC_CONF", "expandable_segments:True")
            .env("FAKECUDA_NO_POSIX_FD", no_fd)
            .env("EXPECT_REFUSAL", "1")
            .output();
        out.assert_pooled("ipc_share");
        assert!(
            out.stdout.contains("OK ipc_share (refused)") && out.stderr.contains(why),
            "FAKECUDA_NO_POSIX_FD={no_fd}: the refusal says {why:?}: {} {}",
            out.stdout,
            out.stderr
        );
    }
}

#[test]
fn graph_and_stream_programs_pass_without_the_shim() {
    for name in [
        "stream_ordered",
        "graph_capture",
        "capture_pools",
        "capture_streams",
        "capture_reclaim",
    ] {
        Run::c(name, &[]).without_shim().output().assert_ok(name);
    }
}

#[test]
fn python_integration_keeps_the_users_sitecustomize_and_serves_graph_trees_stats_and_snapshots() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/programs/python_integration.py"
    );
    let user_site = cachealloc_tests::fresh_dir();
    std::fs::write(
        user_site.join("sitecustomize.py"),
        "import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = '1'\n",
    )
    .unwrap();
    let user_path = user_site.to_str().unwrap();
    // (CACHEALLOC_CONF, PyTorch's own setting, whether graph trees stay on)
    let cases = [
        ("", "", "False"),
        ("python:off", "", "True"),
        ("", "backend:native", "True"),
        ("torch_caching:keep", "", "True"),
        ("torch_allocator:off", "", "False"),
        // No trace: snapshots come from the pools (python_history.py's check_pool_snapshot).
        ("trace:off", "", "False"),
    ];
    for (conf, torch_conf, trees) in cases {
        let programs = cachealloc_tests::program("");
        let mut run = Run::new(&python, &[script, trees])
            .env("PYTHONPATH", user_path)
            .env("CACHEALLOC_TEST_PROGRAMS", programs.to_str().unwrap());
        let conf = if conf.is_empty() {
            "log:debug".to_string()
        } else {
            format!("{conf},log:debug")
        };
        run = run.env("CACHEALLOC_CONF", &conf);
        if !torch_conf.is_empty() {
            run = run.env("PYTORCH_CUDA_ALLOC_CONF", torch_conf);
        }
        let out = run.output();
        out.assert_ok("python_integration");
        assert_eq!(
            out.stderr
                .matches("memory snapshots show the pools now, without history or stacks")
                .count(),
            usize::from(conf.contains("trace:off")),
            "one message when snapshots come from the pools ({conf}): {}",
            out.stderr
        );
        let said = out.stderr.matches("cudagraph_trees = False").count();
        assert_eq!(
            said,
            usize::from(trees == "False"),
            "one message (log:debug) when trees are turned off ({conf}): {}",
            out.stderr
        );
        // Where the shim chose PyTorch's backend, the integration tried to build its allocator
        // for PyTorch (unless `torch_allocator:off`); without CUDA's headers the backend
        // stays, with one message saying why.
        let fallback = out
            .stderr
            .matches("backend stays, without CUDA graph trees: no CUDA runtime headers")
            .count();
        let tried = trees == "False" && !conf.contains("torch_allocator:off");
        assert_eq!(
            fallback,
            usize::from(tried),
            "one message when the allocator cannot be built ({conf}): {}",
            out.stderr
        );
    }
}

#[test]
fn python_integration_shares_cuda_tensors_of_both_kinds_of_segment_with_another_process() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/programs/python_ipc.py");
    // A small block and a big one (several chunks of mapped memory), in either kind.
    for conf in ["", "expandable_segments:True"] {
        for size in ["4096", "50331648"] {
            let out = Run::new(&python, &[script, size])
                .env("CACHEALLOC_CONF", conf)
                .output();
            out.assert_ok("python_ipc");
            assert_no_shim_failure(&out.stderr);
        }
    }
}
