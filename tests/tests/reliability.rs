//! Reliability under load and faults, end to end over fakecuda (RELIABILITY.md lists every
//! scenario and what it promises). Each test checks the program's own result, that the shim
//! served it (not a silent passthrough), and that the trace tells the truth; each scenario that
//! could pass without the shim has a control that shows it can fail.

use cachealloc_recorder::schema::kinds;
use cachealloc_tests::{Output, Run, count, read_trace};

/// `key`'s value in the `stats` JSON line the load program prints (device 0).
fn stat(out: &Output, key: &str) -> u64 {
    let line = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("stats "))
        .unwrap_or_else(|| panic!("no stats line: {}", out.stdout));
    let json: serde_json::Value = serde_json::from_str(line).expect("stats JSON");
    json["devices"]["0"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} in {line}"))
}

fn load(seed: &str) -> Run {
    Run::c("load", &["4", "500", seed])
        .env("FAKECUDA_CAPACITY_MB", "4096")
        .timeout(std::time::Duration::from_secs(120))
}

#[test]
fn load_threads_streams_and_sizes_keep_every_byte_and_every_record() {
    for seed in ["1", "2"] {
        let out = load(seed).output();
        out.assert_pooled("load");
        let allocations = out.number_after("allocations");
        assert!(allocations > 500, "{allocations}");
        // The shim's stats equal the program's own count, and everything came back.
        assert_eq!(stat(&out, "allocation.all.allocated"), allocations);
        assert_eq!(stat(&out, "allocation.all.current"), 0);
        assert_eq!(stat(&out, "allocated_bytes.all.current"), 0);
        // The trace holds every allocation and every free, with nothing dropped.
        let (records, tears) = read_trace(&out.one_trace());
        assert!(tears.is_empty(), "{tears:?}");
        let allocations = allocations as usize;
        assert_eq!(count(&records, kinds::ALLOC), allocations, "seed {seed}");
        assert_eq!(
            count(&records, kinds::FREE) + count(&records, kinds::FREE_REQUESTED),
            allocations,
            "seed {seed}: allocs = frees + live (0) at the end"
        );
        assert_eq!(
            count(&records, kinds::DROPPED),
            0,
            "seed {seed}: nothing dropped"
        );
    }
}

#[test]
fn the_load_program_catches_a_broken_allocator() {
    // Control: the same load straight over fakecuda is correct, and over an allocator that
    // hands a live block out twice it sees the foreign bytes.
    load("1").without_shim().output().assert_ok("load");
    let broken = load("1")
        .without_shim()
        .env("FAKECUDA_FAULT", "overlap")
        .output();
    broken.assert_fails_with("not its pattern");
}

#[test]
fn a_file_size_limit_ends_the_trace_not_the_program() {
    // `ulimit -f` makes a write past the limit raise SIGXFSZ, which kills by default: the
    // trace's writes must fail instead (regression: the shim's recorder killed the program).
    let churn = cachealloc_tests::program("churn");
    let script = format!("ulimit -f 64; exec {} 200000", churn.display());
    let out = Run::new("sh", &["-c", &script])
        .env("CACHEALLOC_CONF", "compress:off")
        .output();
    out.assert_pooled("churn");
    let reports = out.stderr.matches("writing the trace failed").count();
    assert_eq!(reports, 1, "reported once: {}", out.stderr);
    assert!(out.stderr.contains("File too large"), "{}", out.stderr);
    // What was written before the limit is readable, up to the tear.
    let (records, _tears) = read_trace(&out.one_trace());
    assert!(
        matches!(
            records.first(),
            Some(cachealloc_recorder::Record::Header(_))
        ),
        "the trace so far starts with its header"
    );
}

#[test]
fn the_trace_directory_deleted_mid_run_is_reported_once_and_harms_nothing() {
    let churn = cachealloc_tests::program("churn");
    // churn runs while the shell deletes its trace directory; rotating to a new file in the
    // deleted directory then fails.
    let script = format!(
        "{} 2000000 & sleep 0.2; rm -rf cachealloc-trace; wait $!",
        churn.display()
    );
    let out = Run::new("sh", &["-c", &script])
        .env("CACHEALLOC_CONF", "trace_file_mb:1,compress:off")
        .output();
    out.assert_pooled("churn");
    assert_eq!(
        out.stderr.matches("writing the trace failed").count(),
        1,
        "{}",
        out.stderr
    );
}

#[test]
fn a_driver_without_a_function_we_need_means_passthrough_with_one_message() {
    let fake = cachealloc_tests::fakecuda_dir();
    let path = format!(
        "{}:{}",
        fake.join("without_primary_ctx_state").display(),
        fake.display()
    );
    let out = Run::c("basic", &[]).env("LD_LIBRARY_PATH", &path).output();
    out.assert_ok("basic");
    let messages: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("cuDevicePrimaryCtxGetState"))
        .collect();
    assert_eq!(messages.len(), 1, "{}", out.stderr);
    assert!(
        messages[0].contains("the CUDA driver lacks cuDevicePrimaryCtxGetState")
            && messages[0].contains("pass through unpooled"),
        "{}",
        messages[0]
    );
    assert!(
        !out.stderr.contains("served from the cache"),
        "{}",
        out.stderr
    );
}

#[test]
fn exit_from_another_thread_and_underscore_exit_end_cleanly_with_a_readable_trace() {
    // exit() from a thread while the main thread allocates: the summary and the whole trace.
    let out = Run::c("exit_paths", &["thread"]).output();
    out.assert_pooled("exit_paths");
    let (records, tears) = read_trace(&out.one_trace());
    assert!(tears.is_empty(), "{tears:?}");
    assert!(records.iter().any(|r| r.kind() == kinds::ALLOC));
    // _exit(): no atexit handler runs, so no summary; what was written is readable, with at
    // most a tear at the very end.
    let out = Run::c("exit_paths", &["_exit"]).output();
    out.assert_ok("exit_paths");
    read_up_to_a_tear_at_the_end(&out);
}

/// The one trace of a process that ended without its atexit handlers: readable, starting with
/// its header, with at most one tear (at the very end). Its records.
fn read_up_to_a_tear_at_the_end(out: &Output) -> Vec<cachealloc_recorder::Record> {
    let (records, tears) = read_trace(&out.one_trace());
    assert!(tears.len() <= 1, "{tears:?}");
    assert!(matches!(
        records.first(),
        Some(cachealloc_recorder::Record::Header(_))
    ));
    records
}

/// Python's `os._exit` with blocks live: the program's own exit code, no atexit handler (no
/// summary), and a trace readable up to at most one tear at its end that tells the allocations
/// the shim counted (up to what the writer had written when the process ended).
#[test]
fn python_os_exit_keeps_its_exit_code_and_a_readable_trace() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/programs/os_exit.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    for code in ["0", "3"] {
        let out = Run::new(&python, &[script, code]).output();
        assert_eq!(out.code, Some(code.parse().unwrap()), "{}", out.stderr);
        assert!(out.stdout.contains("OK os_exit"), "{}", out.stdout);
        assert!(
            !out.stderr.contains("served from the cache"),
            "no atexit: no summary"
        );
        let counted = out.number_after("allocations");
        assert_eq!(counted, 1000, "every allocation reached the pool");
        let records = read_up_to_a_tear_at_the_end(&out);
        let allocs = count(&records, kinds::ALLOC) as u64;
        assert!(
            allocs <= counted,
            "{allocs} allocation records for {counted}"
        );
    }
}

#[test]
fn signals_during_allocation_change_nothing() {
    let out = Run::c("exit_paths", &["signals"]).output();
    out.assert_pooled("exit_paths");
}

#[test]
fn a_device_that_refuses_now_and_then_is_retried_by_the_ladder() {
    // Every third device allocation fails although the memory is there: the ladder releases
    // the cache and retries, and the program never sees an error. One thread, so that the
    // retry is never itself a third attempt (with several, two refusals in a row are a real
    // out-of-memory to the ladder, as to PyTorch's).
    let out = Run::c("threads", &["1", "600"])
        .env("FAKECUDA_FAULT", "oom_every:3")
        .env("FAKECUDA_REPORT", "1")
        .output();
    out.assert_pooled("threads");
    // (The report may come twice: from each copy of fakecuda's driver the process loaded.)
    let refused: u64 = out
        .stderr
        .lines()
        .filter_map(|l| {
            let (_, tail) = l.strip_prefix("fakecuda:")?.split_once("frees, ")?;
            tail.split_whitespace().next()?.parse::<u64>().ok()
        })
        .max()
        .unwrap_or_else(|| panic!("no fakecuda report: {}", out.stderr));
    assert!(refused >= 1, "the fault never struck: {}", out.stderr);
    // Control: without the shim, the same device fails the program.
    let native = Run::c("threads", &["1", "600"])
        .env("FAKECUDA_FAULT", "oom_every:3")
        .without_shim()
        .output();
    native.assert_fails_with("returned 2");
}
