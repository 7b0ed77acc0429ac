//! The files the tools write, opened by what their users open them with: the snapshot pickle by
//! Python's `pickle` (checked for the keys, types and block tiling PyTorch's memory tools rely
//! on), the HTML report by headless Chromium (it must draw the timeline and make no network
//! request).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{cachealloc, data, scratch};

/// Checks a snapshot the way PyTorch's `_memory_viz` reads one. Prints "OK <n segments>".
const CHECK_PICKLE: &str = r#"
import pickle, sys
with open(sys.argv[1], "rb") as f:
    s = pickle.load(f)
assert set(s) == {"segments", "device_traces", "allocator_settings"}, set(s)
assert isinstance(s["allocator_settings"], dict)
assert isinstance(s["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"], str)
def check_frames(frames):
    assert isinstance(frames, list)
    for fr in frames:
        assert set(fr) == {"filename", "line", "name"}, fr
        assert isinstance(fr["filename"], str) and isinstance(fr["name"], str)
        assert isinstance(fr["line"], int)
for seg in s["segments"]:
    for key, kind in [("device", int), ("address", int), ("total_size", int), ("allocated_size", int),
                      ("active_size", int), ("requested_size", int), ("stream", int),
                      ("segment_type", str), ("segment_pool_id", tuple), ("is_expandable", bool),
                      ("blocks", list)]:
        assert isinstance(seg[key], kind), (key, seg[key])
    assert seg["segment_type"] in ("small", "large")
    check_frames(seg["frames"])
    address = seg["address"]
    allocated = active = 0
    for b in seg["blocks"]:
        assert b["address"] == address, "blocks tile the segment in address order"
        assert b["state"] in ("active_allocated", "active_pending_free", "inactive"), b["state"]
        assert b["size"] > 0 and b["requested_size"] <= b["size"]
        check_frames(b["frames"])
        address += b["size"]
        if b["state"] == "active_allocated":
            allocated += b["size"]
        if b["state"] != "inactive":
            active += b["size"]
    assert address == seg["address"] + seg["total_size"], "block sizes sum to total_size"
    assert seg["allocated_size"] == allocated and seg["active_size"] == active
assert isinstance(s["device_traces"], list)
for trace in s["device_traces"]:
    for e in trace:
        assert e["action"] in ("alloc", "free_requested", "free_completed", "segment_alloc",
                               "segment_free", "oom"), e["action"]
        assert isinstance(e["addr" if e["action"] != "oom" else "device_free"], int)
        assert isinstance(e["size"], int) and isinstance(e["time_us"], int)
        check_frames(e["frames"])
        if "frees-have-frames" in sys.argv and e["action"] in ("free_requested", "free_completed"):
            assert e["frames"], "a free shows its block's allocation stack"
# A stack is one list wherever it appears, as in PyTorch's snapshots (a list per distinct
# traceback): the pickle stays small and loads fast however many events repeat a stack. In the
# Python trace, equal frames are the same stack (native frames at different addresses may read
# the same and are not).
if "frees-have-frames" in sys.argv:
    lists = [e["frames"] for t in s["device_traces"] for e in t if e["frames"]]
    lists += [b["frames"] for seg in s["segments"] for b in seg["blocks"] if b["frames"]]
    by_content = {}
    for frames in lists:
        key = tuple((f["filename"], f["line"], f["name"]) for f in frames)
        assert by_content.setdefault(key, frames) is frames, "a stack is one list"
    assert len(lists) > len(by_content), "the Python trace repeats stacks"
print("OK", len(s["segments"]), sum(len(t) for t in s["device_traces"]))
"#;

#[test]
fn snapshot_pickles_load_in_python_as_pytorch_lays_them_out() {
    let dir = scratch("pickle");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    for trace in ["python", "oom", "race"] {
        for when in [
            &["--at-peak"][..],
            &[][..],
            &["--at", "0.02", "--events", "3"][..],
        ] {
            let out = dir.join(format!("{trace}.pickle"));
            let trace_dir = data(trace);
            let mut args = vec!["snapshot", trace_dir.to_str().unwrap()];
            args.extend_from_slice(when);
            args.extend(["-o", out.to_str().unwrap()]);
            cachealloc(&dir, &args);
            // Every allocation of the Python trace has a stack, so every free shows one.
            let flag = if trace == "python" {
                "frees-have-frames"
            } else {
                ""
            };
            let checked = Command::new(&python)
                .args(["-c", CHECK_PICKLE, out.to_str().unwrap(), flag])
                .output()
                .expect("run python");
            let stdout = String::from_utf8_lossy(&checked.stdout);
            assert!(
                checked.status.success() && stdout.starts_with("OK"),
                "{trace} {when:?}: {}{}",
                stdout,
                String::from_utf8_lossy(&checked.stderr)
            );
            if when == ["--at-peak"] {
                let segments: usize = stdout.split_whitespace().nth(1).unwrap().parse().unwrap();
                assert!(segments > 0, "{trace}: segments at the peak");
            }
        }
    }
}

/// Headless Chromium, or `None` (with a note) when it is not installed and not required.
fn chromium() -> Option<PathBuf> {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if let Ok(out) = Command::new("which").arg(name).output()
            && out.status.success()
        {
            return Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
        }
    }
    assert!(
        std::env::var_os("CACHEALLOC_REQUIRE_CHROMIUM").is_none(),
        "chromium is required (scripts/test installs Debian's chromium)"
    );
    eprintln!("chromium not found: the HTML report was not opened (scripts/test installs it)");
    None
}

/// Load `page` in headless Chromium: its DOM after scripts ran, a screenshot, and the URLs of
/// network requests the page itself made (Chromium's own background requests are not the
/// page's: they are not keyed to the page's file:// site).
fn open_in_chromium(browser: &Path, page: &Path, dir: &Path) -> (String, PathBuf, Vec<String>) {
    let shot = dir.join("shot.png");
    let netlog = dir.join("net.json");
    let common = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1200,800",
        "--net-log-capture-mode=Everything",
    ];
    let url = format!("file://{}", page.display());
    let dom = Command::new(browser)
        .args(common)
        .arg(format!("--log-net-log={}", netlog.display()))
        .arg("--dump-dom")
        .arg(&url)
        .output()
        .expect("run chromium");
    let dom = String::from_utf8_lossy(&dom.stdout).into_owned();
    let log: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&netlog).expect("net log")).expect("net log JSON");
    let status = Command::new(browser)
        .args(common)
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&url)
        .output()
        .expect("run chromium");
    assert!(status.status.success(), "screenshot failed");
    let start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"].clone();
    let requests = log["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == start_job)
        .filter(|e| {
            e["params"]["network_isolation_key"]
                .as_str()
                .is_some_and(|k| k.contains("file://"))
        })
        .filter_map(|e| e["params"]["url"].as_str().map(str::to_string))
        .filter(|u| !u.starts_with("file:") && !u.starts_with("data:"))
        .collect();
    (dom, shot, requests)
}

/// Pixels of `png` within a small distance of `color`.
fn pixels_near(png: &Path, color: [u8; 3]) -> usize {
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(png).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    buf[..info.buffer_size()]
        .chunks(channels)
        .filter(|p| (0..3).all(|i| p[i].abs_diff(color[i]) <= 8))
        .count()
}

#[test]
fn the_html_report_renders_offline_in_chromium() {
    let Some(browser) = chromium() else { return };
    let dir = scratch("html");
    let page = dir.join("report.html");
    cachealloc(
        &dir,
        &[
            "plot",
            data("python").to_str().unwrap(),
            data("oom").to_str().unwrap(),
            "-o",
            page.to_str().unwrap(),
        ],
    );
    let (dom, shot, requests) = open_in_chromium(&browser, &page, &dir);
    let rendered: usize = dom
        .split("data-rendered=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "the script did not finish rendering: {}",
                &dom[..dom.len().min(500)]
            )
        });
    assert!(rendered > 10, "{rendered} points drawn");
    assert!(
        requests.is_empty(),
        "the report made network requests: {requests:?}"
    );
    // The first site's color (#4e79a7) fills the stacked area of the timeline.
    let filled = pixels_near(&shot, [0x4e, 0x79, 0xa7]);
    assert!(
        filled > 2000,
        "only {filled} pixels of the timeline's first site"
    );

    // Control: a page that does reach out is caught, and a blank page has no such pixels.
    let bad = dir.join("bad.html");
    std::fs::write(
        &bad,
        "<html><body><img src=\"https://example.com/x.png\"></body></html>",
    )
    .unwrap();
    let (_, shot, requests) = open_in_chromium(&browser, &bad, &dir);
    assert!(
        requests.iter().any(|u| u.contains("example.com")),
        "{requests:?}"
    );
    assert_eq!(pixels_near(&shot, [0x4e, 0x79, 0xa7]), 0);
}

#[test]
fn the_report_by_category_renders_in_pytorchs_colours() {
    let Some(browser) = chromium() else { return };
    let dir = scratch("html-categories");
    common::program::training_step(&dir.join("trace"), 2 << 20, false);
    let page = dir.join("report.html");
    cachealloc(&dir, &["plot", "trace", "-o", page.to_str().unwrap()]);
    let (dom, shot, requests) = open_in_chromium(&browser, &page, &dir);
    assert!(
        dom.contains("PARAMETER") && dom.contains("AUTOGRAD_DETAIL"),
        "the legend"
    );
    assert!(requests.is_empty(), "{requests:?}");
    // PARAMETER (darkgreen) is the bottom of the stack all along; OPTIMIZER_STATE (goldenrod)
    // fills the step's end.
    let green = pixels_near(&shot, [0x00, 0x64, 0x00]);
    let gold = pixels_near(&shot, [0xda, 0xa5, 0x20]);
    assert!(green > 2000, "only {green} PARAMETER pixels");
    assert!(gold > 500, "only {gold} OPTIMIZER_STATE pixels");
}

/// Under the default (`expandable_segments:stream_ordered`) a process has fixed segments
/// (`cudaMalloc`'s) beside mapped runs of expandable segments: the snapshot marks each as it
/// is, and a run without expandable segments marks none.
#[test]
fn snapshot_marks_fixed_and_mapped_segments_apart() {
    use cachealloc_recorder::schema::*;
    use cachealloc_recorder::{MonotonicClock, Record, TraceWriter, WriterConfig};

    const FIXED: u64 = 0x7f00_0000_0000;
    const MAPPED: u64 = 0x7e00_0000_0000;
    let kinds = |config: &str| {
        let work = scratch(&format!("segment-kinds-{}", config.len()));
        let header = common::program::header(config);
        let trace = work.join("trace");
        let writer = WriterConfig::new(&trace, 1 << 30, 4, false);
        let mut w = TraceWriter::create(writer, header, MonotonicClock).unwrap();
        let segment = |t, address| SegmentEvent {
            t,
            device: 0,
            address,
            size: 2 << 20,
            pool: POOL_SMALL,
            stack: 0,
        };
        let alloc = |t, address, stream| Alloc {
            t,
            device: 0,
            stream,
            address,
            requested: 4096,
            size: 4096,
            stack: 0,
            thread: 1,
        };
        for r in [
            Record::SegmentAlloc(segment(1000, FIXED)),
            Record::Alloc(alloc(2000, FIXED, 0)),
            Record::SegmentMap(segment(3000, MAPPED)),
            Record::Alloc(alloc(4000, MAPPED, 7)),
        ] {
            w.write(&r).unwrap();
        }
        w.finish().unwrap();
        cachealloc(&work, &["snapshot", "trace", "-o", "snap.pickle"]);
        let script = "import pickle, sys\n\
            s = pickle.load(open(sys.argv[1], 'rb'))\n\
            print(sorted((seg['address'], seg['is_expandable']) for seg in s['segments']))";
        let out = Command::new("python3")
            .args(["-c", script, work.join("snap.pickle").to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(
        kinds("expandable_segments:stream_ordered,reuse:auto"),
        format!("[({MAPPED}, True), ({FIXED}, False)]")
    );
    assert_eq!(
        kinds("expandable_segments:False,reuse:auto"),
        format!("[({MAPPED}, False), ({FIXED}, False)]")
    );
}

/// The snapshot's pickle writer (`cachealloc_tools::pickle`), read back by Python's own
/// unpickler: every kind of value it writes, at the edges of each opcode's range, and shared
/// values loading as one object.
#[test]
fn the_pickle_writer_is_read_back_by_python_as_written() {
    use cachealloc_tools::pickle::{Shared, to_writer};
    use serde::Serialize;

    #[derive(Serialize)]
    struct Frame {
        filename: String,
        line: u64,
    }
    #[derive(Serialize)]
    struct Entry<'a> {
        action: &'static str,
        frames: Shared<'a, Frame>,
        skipped: Option<u32>,
    }
    #[derive(Serialize)]
    struct Everything<'a> {
        ints: Vec<i64>,
        big: (u64, i128, i128),
        floats: (f64, f64),
        flags: (bool, bool, ()),
        texts: (String, String, char),
        bytes: serde_bytes_like::Bytes,
        empty: (Vec<u8>, (), std::collections::BTreeMap<String, i32>),
        entries: Vec<Entry<'a>>,
    }
    mod serde_bytes_like {
        /// Bytes serialized as bytes (serde's `Vec<u8>` is a list of integers).
        pub struct Bytes(pub Vec<u8>);
        impl serde::Serialize for Bytes {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(&self.0)
            }
        }
    }
    let frames = vec![
        Frame {
            filename: "a.py".into(),
            line: 3,
        },
        Frame {
            filename: "b.py".into(),
            line: 70_000,
        },
    ];
    let value = Everything {
        ints: vec![
            0,
            255,
            256,
            65_535,
            65_536,
            -1,
            -129,
            i32::MAX.into(),
            i32::MIN.into(),
        ],
        big: (u64::MAX, -(1i128 << 100), 1i128 << 63),
        floats: (1.5, -0.0),
        flags: (true, false, ()),
        texts: ("é".repeat(200), "x".repeat(300), 'ß'),
        bytes: serde_bytes_like::Bytes(vec![0, 1, 2, 255]),
        empty: (vec![], (), Default::default()),
        entries: vec![
            Entry {
                action: "alloc",
                frames: Shared(&frames),
                skipped: None,
            },
            Entry {
                action: "free",
                frames: Shared(&frames),
                skipped: Some(7),
            },
            Entry {
                action: "oom",
                frames: Shared(&frames[..1]),
                skipped: None,
            },
        ],
    };
    let dir = scratch("pickle-writer");
    let path = dir.join("v.pickle");
    to_writer(std::fs::File::create(&path).unwrap(), &value).unwrap();
    let script = r#"
import pickle, sys
v = pickle.load(open(sys.argv[1], "rb"))
fr = [{"filename": "a.py", "line": 3}, {"filename": "b.py", "line": 70000}]
expected = {
    "ints": [0, 255, 256, 65535, 65536, -1, -129, 2**31 - 1, -2**31],
    "big": (2**64 - 1, -2**100, 2**63),
    "floats": (1.5, -0.0),
    "flags": (True, False, None),
    "texts": ("é" * 200, "x" * 300, "ß"),
    "bytes": b"\x00\x01\x02\xff",
    "empty": ([], None, {}),
    "entries": [
        {"action": "alloc", "frames": fr, "skipped": None},
        {"action": "free", "frames": fr, "skipped": 7},
        {"action": "oom", "frames": fr[:1], "skipped": None},
    ],
}
assert v == expected, v
e = v["entries"]
assert e[0]["frames"] is e[1]["frames"], "one slice, one list"
assert e[2]["frames"] is not e[0]["frames"], "a shorter slice of it is another"
assert str(v["floats"][1]) == "-0.0"
print("OK")
"#;
    let out = Command::new("python3")
        .args(["-c", script, path.to_str().unwrap()])
        .output()
        .expect("run python");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).starts_with("OK"),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An unmap of an expandable segment's memory that has no stack of its own (the recycling of
/// a later allocation) shows the stack that mapped it, as PyTorch's `segment_unmap` entries
/// show the context their segment was allocated in; a run unmapped whole is forgotten.
#[test]
fn an_unmap_without_a_stack_shows_the_stack_that_mapped_it() {
    use common::program::{MIB, Program};

    const RUN: u64 = 0x7e00_0000_0000;
    let work = scratch("unmap-frames");
    let mut p = Program::new(&work.join("trace"), false, 2);
    p.map(RUN, 4 * MIB, true);
    p.map(RUN + 2 * MIB, 2 * MIB, false);
    p.map(RUN, 2 * MIB, false);
    // Unmapped again: no part of the first map is left.
    p.map(RUN, 2 * MIB, false);
    p.map(RUN + 2 * MIB, MIB, false);
    p.finish();
    cachealloc(&work, &["snapshot", "trace", "-o", "snap.pickle"]);
    let script = "import pickle, sys\n\
        s = pickle.load(open(sys.argv[1], 'rb'))\n\
        print([(e['action'], [f['name'] for f in e['frames']]) for e in s['device_traces'][0]\n\
               if e['action'].startswith('segment_') and e['addr'] < 0x7f0000000000])";
    let out = common::python::python_text(script, &[work.join("snap.pickle").to_str().unwrap()]);
    let mapped = "['linear', 'forward', '_call_impl']";
    assert_eq!(
        out.trim(),
        format!(
            "[('segment_map', {mapped}), ('segment_unmap', {mapped}), ('segment_unmap', \
             {mapped}), ('segment_unmap', []), ('segment_unmap', [])]"
        )
    );
}
