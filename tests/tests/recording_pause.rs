//! `cachealloc_trace_pause`: while paused, allocations and the frees of blocks allocated
//! meanwhile go unrecorded, a block allocated before the pause has its free recorded, and the
//! trace stays consistent (Note [A paused trace stays consistent] in the shim's `trace::pause`).

use std::collections::HashSet;

use cachealloc_recorder::Record;
use cachealloc_tests::{Run, read_trace};

#[test]
fn a_paused_trace_records_no_allocation_made_meanwhile_and_stays_consistent() {
    let out = Run::c("trace_pause", &[]).output();
    out.assert_ok("trace_pause");
    let (records, tears) = read_trace(&out.one_trace());
    assert!(tears.is_empty(), "{tears:?}");
    let block = |name: &str| out.number_after(&format!("block {name}"));
    let (before, during, kept, after) = (
        block("before"),
        block("during"),
        block("kept"),
        block("after"),
    );
    // What happened to each address, in order: ("alloc" | "free", address), and the annotations.
    let mut seen = Vec::new();
    let mut live = HashSet::new();
    for r in &records {
        match r {
            Record::Alloc(a) => {
                assert!(live.insert(a.address), "allocated twice: {a:?}");
                seen.push(("alloc", a.address));
            }
            Record::Free(f) | Record::FreeRequested(f) => {
                assert!(
                    live.remove(&f.address),
                    "a free without its allocation recorded: {f:?}"
                );
                seen.push(("free", f.address));
            }
            Record::Annotation(a) => seen.push((
                if a.name.ends_with("paused") {
                    "paused"
                } else {
                    "resumed"
                },
                0,
            )),
            _ => {}
        }
    }
    assert!(live.is_empty(), "blocks left live in the trace: {live:?}");
    let expected = vec![
        ("alloc", before),
        ("paused", 0),
        ("free", before),
        ("resumed", 0),
        ("alloc", after),
        ("free", after),
    ];
    assert_eq!(seen, expected, "during {during:#x}, kept {kept:#x}");
}
