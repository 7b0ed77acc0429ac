//! Python stacks: the frame walker's layouts against CPython's headers, its line-table decoder
//! against CPython's own `co_lines()`, and the stacks recorded for a Python program against what
//! Python itself says — under every CPython 3.10–3.13 this machine has (`python3` at least).

use std::collections::HashMap;
use std::process::Command;

use cachealloc_recorder::Record;
use cachealloc_recorder::schema::FRAME_PYTHON;
use cachealloc_tests::{Python, Run, alloc_stacks, pythons, read_trace};

#[allow(dead_code)]
#[path = "../../shim/preload/src/stacks/python/layout.rs"]
mod layout;
#[allow(dead_code)]
#[path = "../../shim/preload/src/stacks/python/linetable.rs"]
mod linetable;

/// The installed Pythons the walker supports; fails if there is none.
fn supported_pythons() -> Vec<Python> {
    let all = pythons();
    let supported: Vec<Python> = all
        .into_iter()
        .filter(|p| (10..=13).contains(&p.version.1))
        .collect();
    assert!(!supported.is_empty(), "no CPython 3.10–3.13 found");
    eprintln!(
        "testing with {:?}",
        supported.iter().map(|p| p.version).collect::<Vec<_>>()
    );
    supported
}

#[test]
fn python_layouts_match_headers() {
    let source = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../shim/preload/src/stacks/python/offsets.c"
    );
    let dir = cachealloc_tests::fresh_dir();
    for python in supported_pythons() {
        let (major, minor) = python.version;
        let exe = dir.join(format!("offsets-{major}.{minor}"));
        let status = Command::new("cc")
            .arg(format!("-I{}", python.include.display()))
            .arg(source)
            .arg("-o")
            .arg(&exe)
            .status()
            .expect("run cc");
        assert!(status.success(), "compiling offsets.c for {major}.{minor}");
        let printed = Command::new(&exe).output().expect("run offsets");
        let table = layout::for_version(major, minor).expect("a supported version");
        assert_eq!(
            String::from_utf8_lossy(&printed.stdout),
            table.describe(),
            "layout of Python {major}.{minor}"
        );
    }
}

const DUMP_LINE_TABLES: &str = r#"
import argparse, collections, dis, inspect, json.decoder, types
def codes(c):
    yield c
    for k in c.co_consts:
        if isinstance(k, types.CodeType):
            yield from codes(k)
for m in (argparse, collections, dis, inspect, json.decoder):
    with open(m.__file__) as f:
        top = compile(f.read(), m.__file__, "exec")
    for c in codes(top):
        print("code", c.co_firstlineno, c.co_linetable.hex() or "-")
        for start, end, line in c.co_lines():
            print("range", start, end, -1 if line is None else line)
"#;

#[test]
fn line_tables_decode_like_cpython() {
    for python in supported_pythons() {
        let format = if python.version >= (3, 11) {
            linetable::Format::Locations
        } else {
            linetable::Format::Pairs
        };
        let out = Command::new(&python.path)
            .args(["-c", DUMP_LINE_TABLES])
            .output()
            .expect("run python");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).expect("utf-8");
        let mut table = linetable::LineTable::default();
        let (mut codes, mut offsets) = (0, 0);
        for line in text.lines() {
            let words: Vec<&str> = line.split(' ').collect();
            match words[0] {
                "code" => {
                    codes += 1;
                    let first: i32 = words[1].parse().unwrap();
                    let bytes: Vec<u8> = if words[2] == "-" {
                        vec![]
                    } else {
                        (0..words[2].len())
                            .step_by(2)
                            .map(|i| u8::from_str_radix(&words[2][i..i + 2], 16).unwrap())
                            .collect()
                    };
                    table = linetable::LineTable::decode(format, &bytes, first);
                }
                "range" => {
                    let [start, end, want]: [i64; 3] =
                        std::array::from_fn(|i| words[i + 1].parse().unwrap());
                    let want = (want >= 0).then_some(want as i32);
                    for offset in (start..end).step_by(2) {
                        offsets += 1;
                        assert_eq!(
                            table.line_at(offset as u32),
                            want,
                            "Python {:?}, code #{codes}, offset {offset}",
                            python.version
                        );
                    }
                }
                _ => unreachable!("{line}"),
            }
        }
        assert!(
            codes > 500 && offsets > 20_000,
            "{codes} codes, {offsets} offsets"
        );
    }
}

/// One allocation the program made, and its stack as Python saw it.
#[derive(Debug)]
struct Expected {
    size: u64,
    gil: bool,
    frames: Vec<(String, String, u32)>,
}

fn expected_stacks(path: &std::path::Path) -> Vec<Expected> {
    let text = std::fs::read_to_string(path).expect("the program's expectations");
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json.as_array()
        .unwrap()
        .iter()
        .map(|e| Expected {
            size: e["size"].as_u64().unwrap(),
            gil: e["gil"].as_bool().unwrap(),
            frames: e["frames"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| {
                    (
                        f[0].as_str().unwrap().to_string(),
                        f[1].as_str().unwrap().to_string(),
                        f[2].as_u64().unwrap() as u32,
                    )
                })
                .collect(),
        })
        .collect()
}

/// Each allocation's recorded stack by requested size: (kind, name, file, line) per frame.
fn recorded_stacks(records: &[Record]) -> HashMap<u64, Vec<(u8, String, String, u32)>> {
    alloc_stacks(records)
        .into_iter()
        .map(|(size, frames)| {
            let frames = frames
                .into_iter()
                .map(|f| (f.kind, f.name, f.file, f.line))
                .collect();
            (size, frames)
        })
        .collect()
}

/// The exit summary's account of the captures (`stacks: N captures, C cold (…), warm keys
/// forgotten F times (…), R found in the thread's recent stacks`): every recorded allocation
/// was captured, the first of each stack cold; on 3.12+, where code objects' deaths are heard,
/// the program's dying code objects made the cache forget its keys, which never happens before
/// 3.12; the program's repeated stacks (`two_lines`: six repeats) were found in the thread's
/// recent stacks.
fn check_capture_counts(stderr: &str, version: (u32, u32), allocations: usize) {
    let line = stderr
        .lines()
        .find(|l| l.contains(" captures, "))
        .unwrap_or_else(|| panic!("no stacks line in the exit summary:\n{stderr}"));
    let numbers: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    // pid, captures, cold, the percentage's two parts, forgotten, recent.
    let [_, captures, cold, _, _, forgotten, recent] = numbers[..] else {
        panic!("unexpected stacks line: {line}");
    };
    assert!(captures >= allocations as u64, "{line}");
    assert!(recent >= 6 && recent < captures, "{line}");
    assert!(cold >= 1 && cold <= captures, "{line}");
    if version >= (3, 12) {
        assert!(
            forgotten >= 1,
            "code objects died, the keys must be forgotten: {line}"
        );
    } else {
        assert_eq!(forgotten, 0, "no watcher before 3.12: {line}");
    }
}

#[test]
fn python_stacks_show_functions_and_lines_with_and_without_the_gil() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/programs/python_stacks.py");
    // Runs in which a code object was made at a freed one's address (Note [Code objects'
    // deaths]): the check of their stacks below must have had something to catch.
    let mut reused_addresses = 0;
    for python in supported_pythons() {
        for conf in ["", "stacks:python", "stacks:all"] {
            let run =
                Run::new(&python.path, &[script, "expected.json"]).env("CACHEALLOC_CONF", conf);
            let out = run.output();
            out.assert_ok("python_stacks");
            reused_addresses += usize::from(
                !out.stdout
                    .contains("code objects made at a freed one's address: 0"),
            );
            let expected = expected_stacks(&out.dir.join("expected.json"));
            check_capture_counts(&out.stderr, python.version, expected.len());
            let dirs = out.trace_dirs();
            let (records, tears) = read_trace(&dirs[0]);
            assert!(tears.is_empty());
            let recorded = recorded_stacks(&records);
            assert_eq!(expected.len(), 9 + 24 + 8);
            assert!(expected.iter().any(|e| e.gil) && expected.iter().any(|e| !e.gil));
            for e in &expected {
                let got = &recorded[&e.size];
                let python_frames: Vec<(String, String, u32)> = got
                    .iter()
                    .filter(|f| f.0 == FRAME_PYTHON)
                    .map(|f| (f.1.clone(), f.2.clone(), f.3))
                    .collect();
                assert_eq!(
                    python_frames, e.frames,
                    "Python {:?}, {conf:?}, GIL held: {}",
                    python.version, e.gil
                );
                if conf == "stacks:all" {
                    assert!(got[0].0 != FRAME_PYTHON, "native frames come first");
                    assert!(got.last().unwrap().0 == FRAME_PYTHON, "Python frames last");
                } else {
                    assert_eq!(got.len(), python_frames.len(), "Python frames only");
                }
            }
        }
        // stacks:none records allocations without stacks.
        let out = Run::new(&python.path, &[script, "expected.json"])
            .env("CACHEALLOC_CONF", "stacks:none")
            .output();
        out.assert_ok("python_stacks");
        let (records, _) = read_trace(&out.trace_dirs()[0]);
        assert!(recorded_stacks(&records).values().all(|s| s.is_empty()));
    }
    assert!(
        reused_addresses > 0,
        "no run made a code object at a freed one's address"
    );
}

#[test]
fn backward_allocations_get_the_stack_that_called_backward() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/programs/python_backward.py");
    let programs = cachealloc_tests::program("basic");
    let libdir = programs.parent().unwrap().to_str().unwrap().to_string();
    for (conf, attributed) in [("", true), ("python:off", false)] {
        let out = Run::new("python3", &[script, &libdir])
            .env("CACHEALLOC_CONF", conf)
            .output();
        out.assert_ok("python_backward");
        let dirs = out.trace_dirs();
        let (records, _) = read_trace(&dirs[0]);
        let stacks = alloc_stacks(&records);
        let stack = &stacks[&777_216];
        let names: Vec<&str> = stack.iter().map(|f| f.name.as_str()).collect();
        // Attributed: the stack of the code that called backward(), the integration's own
        // wrapper left out.
        assert_eq!(
            names.first() == Some(&"train_step"),
            attributed,
            "{conf}: the native thread's allocation has the stack {names:?}"
        );
    }
}

/// What the Python integration tells the trace about a training loop (a stand-in torch, two
/// steps; `python_categories.py` gives each kind of allocation its own size): every allocation
/// in the module, phase and category the program's structure says, read from the live state
/// just before each block is freed; and with `categories:off`, none of it.
#[test]
fn the_integration_tells_each_allocations_module_phase_and_category() {
    use cachealloc_recorder::LiveState;
    use cachealloc_recorder::schema::{
        PHASE_BACKWARD, PHASE_FORWARD, PHASE_OPTIMIZER, TAG_GRADIENT, TAG_INPUT,
        TAG_OPTIMIZER_STATE, TAG_PARAMETER, kinds,
    };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/programs/python_categories.py");
    let out = Run::new("python3", &[script]).output();
    out.assert_ok("python_categories");
    let (records, _) = read_trace(&out.trace_dirs()[0]);
    // The integration's wrapper of `_call_impl` is left out of the stacks (Note [The walk's
    // loop]), the program's own frames are not.
    let block = &alloc_stacks(&records)[&1024];
    let frames: Vec<(&str, &str)> = block
        .iter()
        .map(|f| (f.name.as_str(), f.file.rsplit('/').next().unwrap_or("")))
        .collect();
    assert!(
        frames.contains(&("Block.forward", "python_categories.py")),
        "{frames:?}"
    );
    assert!(
        !frames.iter().any(|f| f.1 == "cachealloc_categories.py"),
        "the wrapper is hidden: {frames:?}"
    );
    let mut state = LiveState::default();
    // requested size -> every (scope, phase, tag) seen for it at its frees (or at the end).
    let mut seen: HashMap<u64, Vec<(String, u8, u8)>> = HashMap::new();
    let mut note = |state: &LiveState, device: u32, address: u64| {
        let Some(block) = state.blocks.get(&(device, address)) else {
            return;
        };
        let c = state.context.blocks.get(&(device, address)).copied();
        let scope = c
            .and_then(|c| state.context.scope_names.get(&c.scope))
            .map_or(String::new(), |n| n.name.clone());
        let (phase, tag) = c.map_or((0, 0), |c| (c.phase, c.category));
        seen.entry(block.requested)
            .or_default()
            .push((scope, phase, tag));
    };
    for r in &records {
        if let Record::Free(f) | Record::FreeRequested(f) = r {
            note(&state, f.device, f.address);
        }
        state.apply(r);
    }
    let live: Vec<_> = state
        .blocks
        .values()
        .map(|b| (b.device, b.address))
        .collect();
    for (device, address) in live {
        note(&state, device, address);
    }
    let only = |size: u64| -> (String, u8, u8) {
        let all = &seen[&size];
        assert!(
            all.iter().all(|c| c == &all[0]),
            "size {size}: one context for all: {all:?}"
        );
        all[0].clone()
    };
    let s = |x: &str| x.to_string();
    assert_eq!(only(3072), (s(""), 0, TAG_INPUT), "the input");
    // Weights (three, alive at the end) and gradients (three a step, made in backward after
    // the head's node named Net), by their tags.
    let mut weights_and_grads = seen[&65536].clone();
    weights_and_grads.sort();
    let mut expected = vec![(s(""), 0, TAG_PARAMETER); 3];
    expected.extend(vec![(s("Net"), PHASE_BACKWARD, TAG_GRADIENT); 9]);
    assert_eq!(weights_and_grads, expected);
    // Leaves are named by the module with children they run in.
    let outputs = &seen[&32768];
    assert!(
        outputs.contains(&(s("Net.layer0"), PHASE_FORWARD, 0)),
        "{outputs:?}"
    );
    assert!(
        outputs.contains(&(s("Net"), PHASE_FORWARD, 0)),
        "the head's: {outputs:?}"
    );
    assert_eq!(
        only(1024),
        (s("Net.layer0"), PHASE_FORWARD, 0),
        "the Block's temporary"
    );
    // Backward: named by the module whose children have children (Net), from its node on.
    assert_eq!(
        only(5120),
        (s("Net"), PHASE_BACKWARD, 0),
        "backward's temporaries"
    );
    assert_eq!(
        only(131072),
        (s(""), PHASE_OPTIMIZER, TAG_OPTIMIZER_STATE),
        "optimizer state"
    );
    assert_eq!(
        only(2048),
        (s(""), PHASE_OPTIMIZER, 0),
        "the optimizer's temporary"
    );
    // The recomputation's input: made in backward after the head's node named Net (its
    // outputs, in the recomputed forward, are among the Linears' above).
    assert_eq!(
        only(3584),
        (s("Net"), PHASE_BACKWARD, 0),
        "the recomputation's input"
    );
    let phases: Vec<u8> = records
        .iter()
        .filter_map(|r| match r {
            Record::Phase(p) => Some(p.phase),
            _ => None,
        })
        .collect();
    let step = [PHASE_FORWARD, 0, PHASE_BACKWARD, 0, PHASE_OPTIMIZER, 0];
    let recomputed = [
        PHASE_FORWARD,
        0,
        PHASE_BACKWARD,
        PHASE_FORWARD,
        PHASE_BACKWARD,
        0,
        PHASE_OPTIMIZER,
        0,
    ];
    // Then the Stack's forward alone, and the Traced model's run; its call under a tracing
    // dispatch mode begins no phase.
    let forward = [PHASE_FORWARD, 0];
    assert_eq!(
        phases,
        [
            &step[..],
            &step[..],
            &recomputed[..],
            &forward[..],
            &forward[..]
        ]
        .concat()
    );
    // The Stack's outputs are named by the Layer each was made in.
    let mut stack_outputs: Vec<String> = seen[&4608].iter().map(|c| c.0.clone()).collect();
    stack_outputs.sort();
    assert_eq!(
        stack_outputs,
        ["Stack.a.inner", "Stack.b.inner"],
        "the Stack's outputs"
    );

    let out = Run::new("python3", &[script])
        .env("CACHEALLOC_CONF", "categories:off")
        .output();
    out.assert_ok("python_categories");
    let (records, _) = read_trace(&out.trace_dirs()[0]);
    let context = [kinds::SCOPE, kinds::SCOPE_NAME, kinds::PHASE, kinds::TAG];
    assert!(
        !records.iter().any(|r| context.contains(&r.kind())),
        "categories:off: no scope, phase or tag"
    );
}
