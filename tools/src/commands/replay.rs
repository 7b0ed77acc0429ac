//! `cachealloc replay TRACE --backend raw,async,cachealloc [--conf K:V,…] [--touch|--verify]
//! [--device N] [--repeat K] [--json]`: replay a recorded run's allocation requests on a GPU
//! through several allocators, and compare them, without the workload.
//!
//! Unlike [`simulate`](super::simulate), which runs the allocator's logic on a simulated device,
//! `replay` makes real calls into the CUDA driver and times them.
//!
//! # Backends
//!
//! A *backend* is the allocator that serves the replayed requests:
//!
//! | backend | allocation | free |
//! |---|---|---|
//! | `raw` | `cuMemAlloc_v2` (what `cudaMalloc` does) | `cuMemFree_v2` |
//! | `async` | `cuMemAllocAsync` on the request's stream (CUDA's stream-ordered pool, what `cudaMallocAsync` is) | `cuMemFreeAsync` on the free's stream |
//! | `cachealloc` | as `raw` for stream 0, as `async` for other streams, served by `libcachealloc.so` | likewise |
//!
//! For `async`, the device's default memory pool keeps its freed memory
//! (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD` set to `u64::MAX`, as PyTorch's `cudaMallocAsync`
//! backend does); otherwise the driver would return it at every synchronization and the pool
//! would cache nothing. For `cachealloc` the command runs itself again with
//! `LD_PRELOAD=libcachealloc.so` and `CACHEALLOC_CONF=<--conf>` (plus `trace:off` and
//! `report_cached_as_free:false`, so that the replay is not traced and `cuMemGetInfo` reports
//! the memory really held): the shim's `dlsym` door serves the driver functions the replay
//! looks up (cudarc resolves them with `dlsym` on libcuda's handle). The library is `--lib`,
//! else `$CACHEALLOC_LIB`, else the `libcachealloc.so` next to this executable.
//!
//! Each replay runs in a child process of its own (so that backends never share memory or a
//! driver pool), on the first visible GPU (`CUDA_VISIBLE_DEVICES` chooses another). With
//! several backends and `--repeat K`, rounds alternate (`raw, async, cachealloc, raw, …`) so
//! that drift in the machine affects each alike; the table shows each backend's median.
//!
//! # What is replayed
//!
//! The trace's `Alloc` records (their requested sizes) and the frees that pair with them —
//! `Free` and `FreeRequested`, matched by address to the allocation live at that address in
//! recorded order (addresses are reused). Frees of blocks allocated before the trace began and
//! requests the run could not serve (OOM records) are left out and counted. See
//! [`workload`].
//!
//! **Threads.** One replay thread per recorded thread number issues that thread's requests in
//! recorded order, as fast as it can (the recorded times are not kept: this measures the
//! allocator, not the program). A free of a block that another thread allocated waits until
//! that allocation has been issued (a per-allocation slot that holds its pointer), so nothing is
//! freed before it exists; dependencies only point back in recorded order, so this never
//! deadlocks.
//!
//! **Streams.** One stream is created per distinct nonzero recorded stream handle (blocking or
//! not as recorded when the trace saw its creation, else non-blocking), on the first request
//! that needs it (untimed), and every request on that handle uses it; the special handles `0x1`
//! and `0x2` (legacy, per-thread) are passed as they are. Creating streams late matters to
//! `cachealloc`: under `reuse:auto` its synchronous frees are reused at once until the process
//! creates its first stream, as in the recorded run. `raw` calls need no stream (`--touch`
//! writes on the request's stream all the same).
//!
//! # What is measured
//!
//! * the latency of each allocation and each free call, with [`std::time::Instant`] around the
//!   driver call alone: p50, p99, p99.9, and their total ("in calls");
//! * the wall time of the whole replay (with the untimed work, and a final synchronization);
//! * peak device memory: `cuMemGetInfo` after every allocation (untimed), the most in use less
//!   what was in use before the replay;
//! * driver calls, the device allocations and releases made: for `raw` each request is one; for
//!   `cachealloc` the shim's own counters (`num_device_alloc`, `num_device_free` from its C API
//!   `cachealloc_stats_json`); for `async` "n/a": the driver's pool does not say.
//!
//! `--touch` writes each block after its allocation (`cuMemsetD8Async` on its stream, or
//! `cuMemsetD8_v2` for stream 0; untimed), so that the backend's memory is really used.
//! `--verify` also checks, before each free, that the block's first and last bytes still hold
//! its pattern: a block overwritten by another one means the allocator handed out overlapping
//! memory.

pub mod gpu;
pub mod worker;
pub mod workload;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde::Serialize;

use crate::Error;
use crate::format::bytes;
use worker::{DriverCalls, Latency, Measured};

/// An allocator that serves the replayed requests.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `cuMemAlloc_v2`/`cuMemFree_v2`: cudaMalloc and cudaFree.
    Raw,
    /// `cuMemAllocAsync`/`cuMemFreeAsync`: CUDA's stream-ordered pool (cudaMallocAsync).
    Async,
    /// libcachealloc.so, preloaded.
    Cachealloc,
}

impl Backend {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Raw => "raw",
            Backend::Async => "async",
            Backend::Cachealloc => "cachealloc",
        }
    }
}

/// What a replay does besides the requests.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Write each block after its allocation.
    pub touch: bool,
    /// Check each block's pattern before its free (implies `touch`).
    pub verify: bool,
}

/// The arguments of `cachealloc replay`.
#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// Trace directory (or a directory holding one, or one trace-NNNNNN.cat file).
    pub trace: PathBuf,
    /// Allocators to compare, in turn: raw (cudaMalloc), async (cudaMallocAsync),
    /// cachealloc (libcachealloc.so).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "raw,async,cachealloc"
    )]
    pub backend: Vec<Backend>,
    /// cachealloc's settings (CACHEALLOC_CONF), e.g. max_split_size_mb:256.
    #[arg(long)]
    pub conf: Option<String>,
    /// libcachealloc.so (default: $CACHEALLOC_LIB, else the one next to this binary).
    #[arg(long)]
    pub lib: Option<PathBuf>,
    /// Write each block after its allocation (untimed).
    #[arg(long)]
    pub touch: bool,
    /// Write each block and check it before its free: catches overlapping blocks.
    #[arg(long)]
    pub verify: bool,
    /// The recorded device whose requests are replayed (default: the trace's only device).
    /// The replay runs on the first visible GPU; CUDA_VISIBLE_DEVICES chooses it.
    #[arg(long)]
    pub device: Option<u32>,
    /// Replay each backend this many times, in alternating rounds; the table shows medians.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeat: u32,
    /// Replay a trace whose first files were rotated away (its early requests are missing).
    #[arg(long)]
    pub partial: bool,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Internal: run one replay in this process and print its measurements as JSON.
    #[arg(long, hide = true)]
    pub worker: bool,
}

/// The whole comparison, as `--json` prints it.
#[derive(Debug, Serialize)]
struct Report {
    trace: String,
    device: u32,
    requests: u64,
    allocs: u64,
    frees: u64,
    threads: u64,
    streams: u64,
    rounds: u32,
    touch: bool,
    verify: bool,
    conf: Option<String>,
    /// Per backend, the median of its rounds.
    medians: Vec<Median>,
    /// Every round of every backend, in the order run.
    runs: Vec<Measured>,
}

/// A backend's medians over its rounds.
#[derive(Debug, Serialize)]
struct Median {
    backend: String,
    alloc_ns: Latency,
    free_ns: Latency,
    calls_ns: u64,
    wall_ns: u64,
    peak_device_bytes: u64,
    driver_calls: Option<DriverCalls>,
}

/// Run the command.
pub fn run(args: &ReplayArgs, out: &mut dyn Write) -> Result<(), Error> {
    let options = Options {
        touch: args.touch || args.verify,
        verify: args.verify,
    };
    let workload = workload::read(&args.trace, args.device, args.partial)?;
    if args.worker {
        let [backend] = args.backend[..] else {
            return Err(Error::Message("--worker takes one backend".into()));
        };
        let measured = worker::replay(&workload, backend, options)?;
        let json = serde_json::to_string(&measured).map_err(|e| e.to_string())?;
        writeln!(out, "{json}")?;
        return Ok(());
    }
    if args.backend.is_empty() {
        return Err(Error::Message("--backend: name at least one".into()));
    }
    if let Some(conf) = &args.conf {
        cachealloc_core::config::Config::parse(conf, "--conf")
            .map_err(|e| Error::Message(e.to_string()))?;
    }
    let lib = if args.backend.contains(&Backend::Cachealloc) {
        Some(library(args.lib.clone())?)
    } else {
        None
    };
    let mut runs: Vec<Measured> = vec![];
    for round in 0..args.repeat {
        for &backend in &args.backend {
            if !args.json && std::io::stderr().is_terminal() {
                eprintln!(
                    "cachealloc replay: {} (round {} of {})",
                    backend.name(),
                    round + 1,
                    args.repeat
                );
            }
            runs.push(child(args, backend, lib.as_deref())?);
        }
    }
    let mut medians = vec![];
    for &backend in &args.backend {
        let mine: Vec<&Measured> = runs
            .iter()
            .filter(|m| m.backend == backend.name())
            .collect();
        if medians.iter().any(|m: &Median| m.backend == backend.name()) {
            continue;
        }
        medians.push(median(backend, &mine));
    }
    let report = Report {
        trace: args.trace.display().to_string(),
        device: workload.device,
        requests: workload.requests(),
        allocs: workload.allocs.len() as u64,
        frees: workload.frees,
        threads: workload.threads.len() as u64,
        streams: workload.streams.len() as u64,
        rounds: args.repeat,
        touch: options.touch,
        verify: options.verify,
        conf: args.conf.clone(),
        medians,
        runs,
    };
    if args.json {
        serde_json::to_writer_pretty(&mut *out, &report).map_err(|e| e.to_string())?;
        writeln!(out)?;
    } else {
        table(&report, out)?;
    }
    let failed: Vec<String> = report
        .runs
        .iter()
        .filter(|m| m.failed_allocs + m.failed_frees + m.overwritten > 0)
        .map(|m| {
            format!(
                "{}: {} allocation(s) and {} free(s) refused, {} block(s) overwritten; first: {}",
                m.backend,
                m.failed_allocs,
                m.failed_frees,
                m.overwritten,
                m.first_failure.as_deref().unwrap_or("?")
            )
        })
        .collect();
    if report
        .runs
        .iter()
        .any(|m| m.overwritten > 0 || m.failed_frees > 0)
    {
        return Err(Error::Message(format!(
            "{}: {}",
            report.trace,
            failed.join("\n")
        )));
    }
    for f in failed {
        eprintln!("cachealloc replay: {f}");
    }
    Ok(())
}

/// Where `libcachealloc.so` is: `--lib`, else `$CACHEALLOC_LIB`, else next to this binary.
fn library(lib: Option<PathBuf>) -> Result<PathBuf, Error> {
    let lib = lib.or_else(|| {
        std::env::var_os("CACHEALLOC_LIB")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    });
    if let Some(lib) = &lib
        && !lib.is_file()
    {
        return Err(Error::Message(format!(
            "{}: no such library (--lib or CACHEALLOC_LIB)",
            lib.display()
        )));
    }
    let lib = super::run::library(lib)?;
    Ok(std::path::absolute(&lib).unwrap_or(lib))
}

/// Replay through `backend` in a child process (this executable with `--worker`).
fn child(args: &ReplayArgs, backend: Backend, lib: Option<&Path>) -> Result<Measured, Error> {
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let mut command = std::process::Command::new(exe);
    command
        .arg("replay")
        .arg(&args.trace)
        .args(["--worker", "--backend", backend.name()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if args.touch {
        command.arg("--touch");
    }
    if args.verify {
        command.arg("--verify");
    }
    if args.partial {
        command.arg("--partial");
    }
    if let Some(d) = args.device {
        command.args(["--device", &d.to_string()]);
    }
    command
        .env_remove("LD_PRELOAD")
        .env_remove("CACHEALLOC_CONF");
    if backend == Backend::Cachealloc {
        let lib = lib.expect("found before the first round");
        let mut conf = String::from("log:quiet");
        if let Some(c) = args.conf.as_deref().filter(|c| !c.is_empty()) {
            conf.push(',');
            conf.push_str(c);
        }
        conf.push_str(",trace:off,report_cached_as_free:false");
        command.env("LD_PRELOAD", lib).env("CACHEALLOC_CONF", conf);
    }
    let output = command
        .output()
        .map_err(|e| format!("cannot run the replay: {e}"))?;
    if !output.status.success() {
        return Err(Error::Message(format!(
            "{}: --backend {}: the replay failed ({}; its message is above)",
            args.trace.display(),
            backend.name(),
            output.status
        )));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| format!("--backend {}: the replay printed no result", backend.name()))?;
    serde_json::from_str(line)
        .map_err(|e| Error::Message(format!("--backend {}: {e}", backend.name())))
}

fn median_of<T: Copy + Ord>(mut values: Vec<T>) -> T {
    values.sort_unstable();
    values[(values.len() - 1) / 2]
}

/// The median of each measure over `runs` (not all from one run).
fn median(backend: Backend, runs: &[&Measured]) -> Median {
    let lat = |f: fn(&Measured) -> Latency| {
        let all: Vec<Latency> = runs.iter().map(|m| f(m)).collect();
        Latency {
            count: median_of(all.iter().map(|l| l.count).collect()),
            p50: median_of(all.iter().map(|l| l.p50).collect()),
            p99: median_of(all.iter().map(|l| l.p99).collect()),
            p999: median_of(all.iter().map(|l| l.p999).collect()),
            max: median_of(all.iter().map(|l| l.max).collect()),
            total: median_of(all.iter().map(|l| l.total).collect()),
        }
    };
    let driver_calls = runs[0].driver_calls.map(|_| DriverCalls {
        allocs: median_of(
            runs.iter()
                .map(|m| m.driver_calls.map_or(0, |d| d.allocs))
                .collect(),
        ),
        frees: median_of(
            runs.iter()
                .map(|m| m.driver_calls.map_or(0, |d| d.frees))
                .collect(),
        ),
    });
    Median {
        backend: backend.name().into(),
        alloc_ns: lat(|m| m.alloc_ns),
        free_ns: lat(|m| m.free_ns),
        calls_ns: median_of(
            runs.iter()
                .map(|m| m.alloc_ns.total + m.free_ns.total)
                .collect(),
        ),
        wall_ns: median_of(runs.iter().map(|m| m.wall_ns).collect()),
        peak_device_bytes: median_of(runs.iter().map(|m| m.peak_device_bytes).collect()),
        driver_calls,
    }
}

/// Nanoseconds as microseconds: `12.34 µs`.
fn micros(ns: u64) -> String {
    format!("{:.2} µs", ns as f64 / 1e3)
}

/// Nanoseconds as milliseconds: `12.3 ms`.
fn millis(ns: u64) -> String {
    format!("{:.1} ms", ns as f64 / 1e6)
}

fn table(r: &Report, out: &mut dyn Write) -> Result<(), Error> {
    let first = &r.runs[0];
    writeln!(
        out,
        "replay of {} (device {}): {} requests ({} allocations, {} frees) on {} thread(s), {} recorded stream(s){}{}",
        r.trace,
        r.device,
        r.requests,
        r.allocs,
        r.frees,
        r.threads,
        r.streams,
        if r.verify {
            ", blocks written and checked"
        } else if r.touch {
            ", blocks written"
        } else {
            ""
        },
        if r.rounds > 1 {
            format!("; medians of {} rounds", r.rounds)
        } else {
            String::new()
        }
    )?;
    let s = &first.skipped;
    let left_out: Vec<String> = [
        (
            s.unpaired_frees,
            "free(s) of blocks allocated before the trace began",
        ),
        (s.ooms, "request(s) the run could not serve (OOM)"),
        (s.other_devices, "request(s) of other devices"),
        (s.tears, "torn file tail(s), read up to the tear"),
    ]
    .iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, what)| format!("{n} {what}"))
    .collect();
    if !left_out.is_empty() {
        writeln!(out, "left out: {}", left_out.join(", "))?;
    }
    if let Some(conf) = &r.conf {
        writeln!(out, "cachealloc config: {conf}")?;
    }
    writeln!(out)?;
    let header = [
        "backend",
        "alloc p50",
        "p99",
        "p99.9",
        "free p50",
        "p99",
        "p99.9",
        "in calls",
        "wall",
        "peak device",
        "driver calls",
    ];
    let rows: Vec<[String; 11]> = r
        .medians
        .iter()
        .map(|m| {
            [
                m.backend.clone(),
                micros(m.alloc_ns.p50),
                micros(m.alloc_ns.p99),
                micros(m.alloc_ns.p999),
                micros(m.free_ns.p50),
                micros(m.free_ns.p99),
                micros(m.free_ns.p999),
                millis(m.calls_ns),
                millis(m.wall_ns),
                bytes(m.peak_device_bytes),
                m.driver_calls
                    .map_or("n/a".to_string(), |d| (d.allocs + d.frees).to_string()),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        cells
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (c, w))| {
                let pad = w - c.chars().count();
                if i == 0 {
                    format!("{c}{}", " ".repeat(pad))
                } else {
                    format!("{}{c}", " ".repeat(pad))
                }
            })
            .collect::<Vec<_>>()
            .join("  ")
    };
    writeln!(out, "{}", line(&header.map(String::from)))?;
    for row in &rows {
        writeln!(out, "{}", line(row))?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "latencies: the driver call alone; in calls: their sum; wall: the whole replay (with polling{}); peak device: cuMemGetInfo after each allocation, less the memory in use before",
        if r.touch { " and writes" } else { "" }
    )?;
    writeln!(
        out,
        "driver calls: device allocations + releases (raw: one per request; cachealloc: the shim's num_device_alloc + num_device_free; async: n/a, the driver's pool does not say)"
    )?;
    for m in &r.runs {
        if m.backend == "cachealloc" && m.pooled_allocs == Some(0) && m.allocs > 0 {
            writeln!(
                out,
                "note: the shim's pools served none of cachealloc's allocations (it passed them through: see its message, or the --conf given)"
            )?;
            break;
        }
    }
    Ok(())
}
