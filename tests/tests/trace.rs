//! End-to-end tests of the trace the shim writes: complete and in order for a normal run,
//! flushed at exit without frees, readable up to the tear after `kill -9`, bounded by rotation,
//! absent for a forked child, and a clear message (with the program unharmed) when the trace
//! directory cannot be written.

use cachealloc_recorder::schema::kinds;
use std::collections::HashMap;
use std::time::Duration;

use cachealloc_recorder::{LiveState, Record};
use cachealloc_tests::{Run, count, read_trace};

/// Replay `records` into a live state, asserting that every free (requested, completed or
/// immediate) names a block the trace made known: allocated earlier or listed in a checkpoint.
/// Returns the state at the end.
fn replay_checking_frees(records: &[Record]) -> LiveState {
    let mut state = LiveState::default();
    let mut frees = 0;
    for r in records {
        let freed = match r {
            Record::Free(f) | Record::FreeRequested(f) => Some((f.device, f.address)),
            Record::FreeCompleted(f) => Some((f.device, f.address)),
            _ => None,
        };
        if let Some(key) = freed {
            frees += 1;
            assert!(
                state.blocks.contains_key(&key),
                "free of a block the trace never made known: {r:?}"
            );
        }
        state.apply(r);
    }
    assert!(frees > 0, "the trace holds frees to check");
    state
}

#[test]
fn a_run_leaves_a_complete_ordered_trace() {
    let out = Run::c("basic", &[]).output();
    out.assert_ok("basic");
    let dir = out.one_trace();
    assert!(
        out.stderr.contains(&format!(
            "trace in cachealloc-trace/{}",
            dir.file_name().unwrap().to_string_lossy()
        )),
        "{}",
        out.stderr
    );
    let (records, tears) = read_trace(&dir);
    assert!(tears.is_empty(), "{tears:?}");
    let Record::Header(header) = &records[0] else {
        panic!("header first")
    };
    assert!(dir.ends_with(format!("{}-{}", header.host, header.pid)));
    assert_eq!(header.devices.len(), 1);
    assert_eq!(header.devices[0].name, "fakecuda device 0");
    assert!(header.cmdline[0].ends_with("basic"));
    // basic: 9 allocations, all freed at once (no stream: immediate reuse), 3 segments.
    assert_eq!(count(&records, kinds::ALLOC), 9, "allocs");
    assert_eq!(count(&records, kinds::FREE), 9, "immediate frees");
    assert_eq!(
        count(&records, kinds::FREE_REQUESTED) + count(&records, kinds::FREE_COMPLETED),
        0,
        "no fenced frees"
    );
    assert_eq!(
        count(&records, kinds::SEGMENT_ALLOC),
        3,
        "segment allocations"
    );
    // In order: replaying the events never frees a block that is not live.
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut last_t = 0;
    for r in &records {
        match r {
            Record::Alloc(a) => {
                assert!(live.insert(a.address, a.size).is_none(), "allocated twice");
                assert!(a.t >= last_t);
                last_t = a.t;
            }
            Record::Free(f) => assert_eq!(live.remove(&f.address), Some(f.size)),
            _ => {}
        }
    }
    assert!(live.is_empty());
}

#[test]
fn exit_without_freeing_still_flushes_everything() {
    let out = Run::c("exit_nofree", &[]).output();
    out.assert_ok("exit_nofree");
    let dir = out.one_trace();
    let (records, tears) = read_trace(&dir);
    assert!(tears.is_empty());
    assert_eq!(count(&records, kinds::ALLOC), 10);
    assert_eq!(
        count(&records, kinds::FREE_REQUESTED) + count(&records, kinds::FREE),
        0
    );
    let mut state = LiveState::default();
    records.iter().for_each(|r| state.apply(r));
    assert_eq!(state.blocks.len(), 10, "ten blocks live at the end");
    assert!(
        dir.join("trace-000000.cat").exists(),
        "the file was finished (renamed from .part)"
    );
}

#[test]
fn kill_9_loses_at_most_the_last_chunk() {
    let out = Run::c("forever", &[])
        .kill_after("started", Duration::from_millis(400))
        .output();
    assert_eq!(out.code, None, "killed by a signal: {}", out.stderr);
    let (records, tears) = read_trace(&out.one_trace());
    assert!(tears.len() <= 1, "{tears:?}");
    let allocs = count(&records, kinds::ALLOC);
    assert!(
        allocs > 1000,
        "the records written before the kill are there ({allocs})"
    );
    // Every complete pair is consistent: frees follow their allocations.
    let mut live = HashMap::new();
    for r in &records {
        match r {
            Record::Alloc(a) => assert!(live.insert(a.address, ()).is_none()),
            Record::Free(f) => assert!(live.remove(&f.address).is_some()),
            _ => {}
        }
    }
    assert!(
        live.len() <= 1,
        "at most the block being used at the kill is live"
    );
}

#[test]
fn rotation_bounds_the_files_of_a_long_run() {
    let out = Run::c("churn", &["200000"])
        .env(
            "CACHEALLOC_CONF",
            "trace_file_mb:1,trace_files:2,compress:off",
        )
        .output();
    out.assert_ok("churn");
    let dir = out.one_trace();
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 2, "{files:?}");
    let (records, tears) = read_trace(&dir);
    assert!(tears.is_empty());
    let headers: Vec<u32> = records
        .iter()
        .filter_map(|r| {
            if let Record::Header(h) = r {
                Some(h.file_index)
            } else {
                None
            }
        })
        .collect();
    assert_eq!(headers.len(), 2);
    assert!(
        headers[0] >= 1,
        "older files were rotated away: {headers:?}"
    );
    // Each remaining file starts with a checkpoint: the blocks live then are known, so every
    // completion in the trace matches a block the reader knows.
    let state = replay_checking_frees(&records);
    // churn frees everything before it exits; the blocks its kept files free include those
    // allocated in the rotated-away files (known from the checkpoint).
    assert!(
        state.blocks.is_empty(),
        "{} blocks left live",
        state.blocks.len()
    );
    assert!(
        count(&records, kinds::FREE) >= count(&records, kinds::ALLOC),
        "frees {} < allocs {}",
        count(&records, kinds::FREE),
        count(&records, kinds::ALLOC)
    );
}

#[test]
fn a_forked_child_writes_no_trace() {
    let out = Run::c("fork", &[]).output();
    out.assert_ok("fork");
    assert_eq!(out.trace_dirs().len(), 1, "only the parent's");
}

#[test]
fn an_unwritable_trace_dir_is_reported_once_and_harms_nothing() {
    let out = Run::c("basic", &[])
        .env("CACHEALLOC_CONF", "trace_dir:/proc/cachealloc-cannot")
        .output();
    out.assert_ok("basic");
    let errors: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.starts_with("cachealloc: cannot write the trace"))
        .collect();
    assert_eq!(errors.len(), 1, "{}", out.stderr);
    assert!(
        out.stderr.contains("no trace (cannot write the trace"),
        "{}",
        out.stderr
    );
}

#[test]
fn trace_off_writes_nothing() {
    let out = Run::c("basic", &[])
        .env("CACHEALLOC_CONF", "trace:off")
        .output();
    out.assert_ok("basic");
    assert!(!out.dir.join("cachealloc-trace").exists());
    assert!(
        out.stderr.contains("no trace (trace:off)"),
        "{}",
        out.stderr
    );
}

#[test]
fn annotations_and_streams_are_recorded() {
    let out = Run::c("race", &["nonblocking"]).output();
    out.assert_ok("race");
    let (records, _) = read_trace(&out.one_trace());
    assert_eq!(
        count(&records, kinds::STREAM_CREATED),
        2,
        "two streams created"
    );
    assert_eq!(count(&records, kinds::STREAM_DESTROYED), 2, "and destroyed");
    // The race program's frees wait for fences: completions come after requests.
    let first_request = records
        .iter()
        .position(|r| r.kind() == kinds::FREE_REQUESTED)
        .unwrap();
    let first_completion = records
        .iter()
        .position(|r| r.kind() == kinds::FREE_COMPLETED)
        .unwrap();
    assert!(first_completion > first_request);
}

#[test]
fn native_stacks_name_the_callers_and_are_defined_before_use() {
    let out = Run::c("basic", &[])
        .env("CACHEALLOC_CONF", "stacks:native,stack_depth:32")
        .output();
    out.assert_ok("basic");
    let (records, tears) = read_trace(&out.one_trace());
    assert!(tears.is_empty());
    let mut frames = HashMap::new();
    let mut stacks = HashMap::new();
    let mut allocs = 0;
    for r in &records {
        match r {
            Record::FrameDef(f) => {
                frames.insert(f.id, f.name.clone());
            }
            Record::StackDef(s) => {
                assert!(
                    s.frames.iter().all(|f| frames.contains_key(f)),
                    "frames defined before their stack"
                );
                assert!(s.frames.len() <= 32);
                stacks.insert(s.id, s.frames.clone());
            }
            Record::Alloc(a) => {
                allocs += 1;
                assert!(
                    stacks.contains_key(&a.stack),
                    "stack {} used before its definition",
                    a.stack
                );
            }
            _ => {}
        }
    }
    assert_eq!(allocs, 9);
    let names: Vec<&String> = frames.values().collect();
    assert!(
        names.iter().any(|n| n.as_str() == "main"),
        "the program's main is named: {names:?}"
    );
    assert!(
        !names.iter().any(|n| n.starts_with("cachealloc::")),
        "the shim's own frames are skipped: {names:?}"
    );
}

#[test]
fn an_oom_is_followed_by_a_checkpoint_of_the_state() {
    let checkpoints_after_ooms = |conf: Option<&str>| {
        let mut run = Run::c("oom", &[]).env("FAKECUDA_CAPACITY_MB", "64");
        if let Some(conf) = conf {
            run = run.env("CACHEALLOC_CONF", conf);
        }
        let out = run.output();
        out.assert_ok("oom");
        let (records, _) = read_trace(&out.one_trace());
        let ooms = count(&records, kinds::OOM);
        assert_eq!(ooms, 2, "the fill's last request and the impossible one");
        // Checkpoints after the file's opening one.
        let ends: Vec<usize> = records
            .iter()
            .enumerate()
            .filter(|(_, r)| r.kind() == kinds::CHECKPOINT_END)
            .map(|(i, _)| i)
            .collect();
        let first_oom = records.iter().position(|r| r.kind() == kinds::OOM).unwrap();
        (ends.len() - 1, ends.last().is_some_and(|&e| e > first_oom))
    };
    assert_eq!(checkpoints_after_ooms(None), (2, true));
    assert_eq!(
        checkpoints_after_ooms(Some("oom_checkpoint:off")),
        (0, false)
    );
}

#[test]
fn stats_are_sampled_during_a_long_run() {
    let out = Run::c("churn", &["300000"]).output();
    out.assert_ok("churn");
    let (records, _) = read_trace(&out.one_trace());
    let samples: Vec<_> = records
        .iter()
        .filter_map(|r| {
            if let Record::StatsSample(s) = r {
                Some(*s)
            } else {
                None
            }
        })
        .collect();
    assert!(
        !samples.is_empty(),
        "at least one sample in a run of several hundred ms"
    );
    for s in &samples {
        assert!(
            s.allocated <= s.active && s.active <= s.reserved && s.requested <= s.active,
            "{s:?}"
        );
    }
    // At most one per 100 ms, but for the final sample the worker writes at shutdown.
    let periodic = &samples[..samples.len() - 1];
    assert!(
        periodic.windows(2).all(|w| w[1].t >= w[0].t + 100_000_000),
        "at most one per 100 ms"
    );
}

#[test]
fn pool_off_still_traces_every_allocation() {
    let out = Run::c("basic", &[])
        .env("CACHEALLOC_CONF", "pool:off")
        .output();
    out.assert_ok("basic");
    assert!(
        out.stderr
            .contains("pool:off: 9 allocations passed through; trace in"),
        "{}",
        out.stderr
    );
    let (records, tears) = read_trace(&out.one_trace());
    assert!(tears.is_empty());
    // basic makes 9 requests; cudaMalloc(0) returns no memory: 8 are recorded, each a segment of
    // its own, and all are freed.
    assert_eq!(count(&records, kinds::ALLOC), 8);
    assert_eq!(count(&records, kinds::SEGMENT_ALLOC), 8);
    assert_eq!(count(&records, kinds::FREE), 8);
    assert_eq!(count(&records, kinds::SEGMENT_FREE), 8);
    let state = replay_checking_frees(&records);
    assert!(state.blocks.is_empty() && state.segments.is_empty());
}

/// Each allocation's native frame names, by requested size.
fn native_stack_names(records: &[Record]) -> HashMap<u64, Vec<String>> {
    cachealloc_tests::alloc_stacks(records)
        .into_iter()
        .map(|(size, frames)| {
            let names = frames
                .into_iter()
                .map(|f| {
                    // Unsymbolized frames (named by address) differ between runs by ASLR.
                    if f.name.is_empty() || f.name.starts_with("0x") {
                        "?".to_string()
                    } else {
                        f.name
                    }
                })
                .collect();
            (size, names)
        })
        .collect()
}

#[test]
fn native_stacks_match_the_system_unwinder() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/programs/python_stacks.py");
    let runs: [(&str, Vec<&str>, &str); 2] = [
        ("basic", vec![], "basic"),
        (
            python.as_str(),
            vec![script, "expected.json"],
            "python_stacks",
        ),
    ];
    for (program, args, name) in runs {
        let stacks = |unwinder: Option<&str>| {
            let mut run = if name == "basic" {
                Run::c(program, &args)
            } else {
                Run::new(program, &args)
            };
            let conf = match unwinder {
                Some(u) => format!("stacks:native,stack_depth:64,unwinder:{u}"),
                None => "stacks:native,stack_depth:64".to_string(),
            };
            run = run.env("CACHEALLOC_CONF", &conf);
            let out = run.output();
            out.assert_ok(name);
            native_stack_names(&read_trace(&out.one_trace()).0)
        };
        let fast = stacks(None);
        let system = stacks(Some("system"));
        assert!(!fast.is_empty());
        for (size, names) in &system {
            assert!(names.len() >= 3, "{name}: a real stack: {names:?}");
            assert_eq!(
                fast.get(size),
                Some(names),
                "{name}: the allocation of {size} bytes"
            );
        }
    }
}

#[test]
fn native_frames_of_cpp_code_are_demangled() {
    let out = Run::c("cpp_names", &[])
        .env("CACHEALLOC_CONF", "stacks:native")
        .output();
    out.assert_ok("cpp_names");
    let names = native_stack_names(&read_trace(&out.one_trace()).0);
    let stack = &names[&4000];
    assert_eq!(
        stack.first().map(String::as_str),
        Some("model::Buffer<float>::allocate(unsigned long)"),
        "{stack:?}"
    );
    assert!(stack.iter().any(|n| n == "main"), "{stack:?}");
}

#[test]
fn stream_ordered_records_carry_their_stream() {
    let out = Run::c("stream_ordered", &[]).output();
    out.assert_ok("stream_ordered");
    let (records, tears) = read_trace(&out.one_trace());
    assert!(tears.is_empty(), "{tears:?}");
    let alloc_streams: Vec<u64> = records
        .iter()
        .filter_map(|r| match r {
            Record::Alloc(a) => Some(a.stream),
            _ => None,
        })
        .collect();
    assert!(
        alloc_streams.iter().filter(|&&s| s != 0).count() >= 6,
        "cudaMallocAsync allocations name their stream: {alloc_streams:?}"
    );
    // The same-stream frees are immediate (kind 23) and name the stream too.
    assert!(
        records
            .iter()
            .any(|r| matches!(r, Record::Free(f) if f.stream != 0))
    );
    // The free on another stream waited for a fence (kinds 11 and 12).
    assert!(
        records
            .iter()
            .any(|r| matches!(r, Record::FreeRequested(f) if f.stream != 0))
    );
    replay_checking_frees(&records);
}

/// The program-context C API (module scopes, phases, tags) becomes trace records that give each
/// block the scope and phase it was allocated in and its tag: replayed into the live state just
/// before each block is freed.
#[test]
fn scopes_phases_and_tags_reach_the_trace() {
    use cachealloc_recorder::schema::{
        PHASE_BACKWARD, PHASE_FORWARD, PHASE_OPTIMIZER, TAG_GRADIENT, TAG_INPUT, TAG_PARAMETER,
    };
    let out = Run::c("program_context", &[]).output();
    out.assert_ok("program_context");
    let (records, _) = read_trace(&out.one_trace());
    let block = |name: &str| out.number_after(&format!("block {name}"));
    // Nothing from before the first CUDA call: the first scope record follows an allocation.
    let first_alloc = records.iter().position(|r| r.kind() == kinds::ALLOC);
    let first_scope = records.iter().position(|r| r.kind() == kinds::SCOPE);
    assert!(
        first_scope > first_alloc,
        "scopes only once the trace exists"
    );
    let mut state = LiveState::default();
    // (address, scope name, phase and category) of each block, read just before its free (an
    // address may be reused).
    let mut at_free = Vec::new();
    for r in &records {
        if let Record::ScopeName(n) = r {
            assert!(
                !state.context.scope_names.contains_key(&n.id),
                "each name defined once: {n:?}"
            );
        }
        if let Record::Scope(s) = r {
            assert!(
                s.scope == 0 || state.context.scope_names.contains_key(&s.scope),
                "a scope's name is defined before its use: {s:?}"
            );
        }
        if let Record::Free(f) | Record::FreeRequested(f) = r {
            let c = state.context.blocks.get(&(f.device, f.address)).copied();
            let name = c.and_then(|c| {
                state
                    .context
                    .scope_names
                    .get(&c.scope)
                    .map(|n| n.name.clone())
            });
            at_free.push((f.address, (name, c.map(|c| (c.phase, c.category)))));
        }
        state.apply(r);
    }
    let last_of = |address: u64| {
        let found = at_free.iter().rev().find(|(a, _)| *a == address);
        found.map(|(_, c)| c.clone()).expect("freed")
    };
    let weights = last_of(block("weights"));
    assert_eq!(
        weights,
        (None, Some((0, TAG_PARAMETER))),
        "weights: tagged inside"
    );
    assert_eq!(
        last_of(block("input")),
        (None, Some((0, TAG_INPUT))),
        "input"
    );
    assert_eq!(
        last_of(block("grad")),
        (
            Some("Net.layers.0".into()),
            Some((PHASE_BACKWARD, TAG_GRADIENT))
        ),
        "the second thread's block: its own scope, the program's phase"
    );
    let in_forward: Vec<_> = at_free
        .iter()
        .filter(|(_, (_, c))| matches!(c, Some((PHASE_FORWARD, 0))))
        .map(|(_, (name, _))| name.clone().unwrap_or_default())
        .collect();
    assert_eq!(in_forward.len(), 2, "hidden and temporary: {at_free:?}");
    assert!(in_forward.contains(&"Net".to_string()), "{in_forward:?}");
    assert!(
        in_forward.contains(&"Net.layers.0".to_string()),
        "{in_forward:?}"
    );
    assert_eq!(count(&records, kinds::TAG), 3, "refused tags write nothing");
    assert_eq!(
        last_of(block("after_phase")),
        (Some("Net".into()), Some((PHASE_OPTIMIZER, 0))),
        "the scope set before a phase change, said again after it"
    );
    assert_eq!(
        count(&records, kinds::PHASE),
        4,
        "forward, backward, none, optimizer"
    );
    assert!(state.context.blocks.is_empty(), "every block freed");
}
