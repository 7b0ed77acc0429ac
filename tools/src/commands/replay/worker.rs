//! One replay of a workload through one backend, in this process: the threads, the timing and
//! the measurements. The command runs it in a child process per backend (see the parent module).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Barrier, OnceLock};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::gpu::{self, Context, CudaError, Driver, Stream};
use super::workload::{Op, Skipped, Workload};
use super::{Backend, Options};
use crate::Error;

/// An allocation slot whose request failed (its frees are skipped).
const FAILED: u64 = u64::MAX;

/// Latencies of one kind of call, in nanoseconds.
#[derive(Debug, Default, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Latency {
    /// Calls timed.
    pub count: u64,
    /// Median.
    pub p50: u64,
    /// 99th percentile.
    pub p99: u64,
    /// 99.9th percentile.
    pub p999: u64,
    /// The slowest.
    pub max: u64,
    /// Sum of all.
    pub total: u64,
}

impl Latency {
    /// Nearest-rank percentiles of `ns` (sorted here).
    pub fn of(mut ns: Vec<u64>) -> Latency {
        ns.sort_unstable();
        let n = ns.len();
        let rank = |p: f64| -> u64 {
            if n == 0 {
                return 0;
            }
            let r = ((p * n as f64).ceil() as usize).clamp(1, n);
            ns[r - 1]
        };
        Latency {
            count: n as u64,
            p50: rank(0.50),
            p99: rank(0.99),
            p999: rank(0.999),
            max: ns.last().copied().unwrap_or(0),
            total: ns.iter().sum(),
        }
    }
}

/// Device allocations and releases made by the backend.
#[derive(Debug, Default, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct DriverCalls {
    /// Device allocations (`cuMemAlloc`; the shim's `num_device_alloc`).
    pub allocs: u64,
    /// Device releases (`cuMemFree`; the shim's `num_device_free`).
    pub frees: u64,
}

/// What one replay measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Measured {
    /// The backend.
    pub backend: String,
    /// Allocations issued.
    pub allocs: u64,
    /// Frees issued.
    pub frees: u64,
    /// Allocations the backend refused (out of memory or another error).
    pub failed_allocs: u64,
    /// Frees the backend refused.
    pub failed_frees: u64,
    /// The first refusal.
    pub first_failure: Option<String>,
    /// Latency of each allocation call.
    pub alloc_ns: Latency,
    /// Latency of each free call.
    pub free_ns: Latency,
    /// From the first request to the last, and a final synchronization, in ns (includes the
    /// untimed work between calls: memory polling, `--touch`).
    pub wall_ns: u64,
    /// Most device memory in use during the replay, less what was in use before it
    /// (`cuMemGetInfo` after every allocation).
    pub peak_device_bytes: u64,
    /// Device allocations and releases (`None` for `async`: the driver's pool is opaque).
    pub driver_calls: Option<DriverCalls>,
    /// `cachealloc`: allocations the shim's pools served (0 means it passed them through).
    pub pooled_allocs: Option<u64>,
    /// Replay threads (one per recorded thread).
    pub threads: u64,
    /// Streams created (one per recorded stream).
    pub streams: u64,
    /// Blocks written with `--touch`.
    pub touched: u64,
    /// Blocks whose pattern was checked before their free with `--verify`.
    pub verified: u64,
    /// Checked blocks found overwritten (an allocator handed out overlapping memory).
    pub overwritten: u64,
    /// What the workload left out of the trace.
    pub skipped: Skipped,
}

/// The byte `--touch` writes over allocation `slot`.
fn pattern(slot: u32) -> u8 {
    (slot % 251) as u8 + 1
}

/// What one replay thread saw.
#[derive(Default)]
struct ThreadResult {
    alloc_ns: Vec<u64>,
    free_ns: Vec<u64>,
    failed_allocs: u64,
    failed_frees: u64,
    first_failure: Option<String>,
    touched: u64,
    verified: u64,
    overwritten: u64,
    setup_error: Option<String>,
}

impl ThreadResult {
    fn failure(&mut self, what: String) {
        if self.first_failure.is_none() {
            self.first_failure = Some(what);
        }
    }
}

/// Shared by the replay threads.
struct Shared<'a> {
    backend: Backend,
    options: Options,
    ctx: &'a Context,
    workload: &'a Workload,
    /// Per recorded stream handle, its replay stream, created on first use (so that, as in
    /// the run, the process has no stream before its first stream-ordered request).
    streams: &'a HashMap<u64, OnceLock<Result<Stream, String>>>,
    /// Per allocation: its pointer once issued (0 before, [`FAILED`] if refused).
    slots: Vec<AtomicU64>,
    /// Most device memory in use seen.
    peak_used: AtomicU64,
    /// A thread could not start: the others stop waiting.
    abort: AtomicBool,
    start: Barrier,
}

impl Shared<'_> {
    /// The replay stream of recorded stream `handle`, created on first use (untimed).
    fn stream(&self, handle: u64) -> Result<&Stream, String> {
        let cell = &self.streams[&handle];
        cell.get_or_init(|| {
            if handle == 0 {
                return Ok(Stream::null());
            }
            match Stream::special(handle) {
                Some(s) => Ok(s),
                None => {
                    let flags = self.workload.streams.get(&handle).copied().unwrap_or(1);
                    Stream::create(self.ctx, flags).map_err(|e| e.to_string())
                }
            }
        })
        .as_ref()
        .map_err(|e| format!("creating the stream of recorded stream {handle:#x}: {e}"))
    }

    /// The stream a request's call is ordered on (`None`: the synchronous call): `raw` never
    /// uses one, `cachealloc` for nonzero streams, `async` always.
    fn call_stream(&self, handle: u64) -> Result<Option<&Stream>, String> {
        match self.backend {
            Backend::Raw => Ok(None),
            Backend::Cachealloc if handle == 0 => Ok(None),
            Backend::Async | Backend::Cachealloc => self.stream(handle).map(Some),
        }
    }

    fn poll_memory(&self) {
        if let Ok((free, total)) = self.ctx.mem_info() {
            self.peak_used
                .fetch_max(total.saturating_sub(free), Ordering::Relaxed);
        }
    }

    /// Run one recorded thread's requests.
    fn run_thread(&self, ops: &[Op]) -> ThreadResult {
        let mut r = ThreadResult::default();
        if let Err(e) = self.ctx.make_current() {
            r.setup_error = Some(e.to_string());
            self.abort.store(true, Ordering::Release);
        }
        self.start.wait();
        if r.setup_error.is_some() || self.abort.load(Ordering::Acquire) {
            return r;
        }
        for op in ops {
            match *op {
                Op::Alloc { slot, size, stream } => {
                    let on = match self.call_stream(stream) {
                        Ok(on) => on,
                        Err(e) => {
                            r.failed_allocs += 1;
                            r.failure(e);
                            self.slots[slot as usize].store(FAILED, Ordering::Release);
                            continue;
                        }
                    };
                    let start = Instant::now();
                    let result = match on {
                        None => gpu::alloc(size),
                        Some(s) => s.alloc_async(size),
                    };
                    let ns = start.elapsed().as_nanos() as u64;
                    match result {
                        Ok(ptr) => {
                            r.alloc_ns.push(ns);
                            if self.options.touch {
                                let touched = self.stream(stream).and_then(|s| {
                                    s.memset(ptr, pattern(slot), size)
                                        .map_err(|e| e.to_string())
                                });
                                match touched {
                                    Ok(()) => r.touched += 1,
                                    Err(e) => r.failure(format!("touching allocation {slot}: {e}")),
                                }
                            }
                            self.poll_memory();
                            self.slots[slot as usize].store(ptr, Ordering::Release);
                        }
                        Err(e) => {
                            r.failed_allocs += 1;
                            r.failure(format!("allocation {slot} of {size} bytes: {e}"));
                            self.slots[slot as usize].store(FAILED, Ordering::Release);
                        }
                    }
                }
                Op::Free { slot, stream } => {
                    // Wait until the allocation was issued (by another thread, perhaps).
                    let ptr = loop {
                        let p = self.slots[slot as usize].load(Ordering::Acquire);
                        if p != 0 {
                            break p;
                        }
                        if self.abort.load(Ordering::Acquire) {
                            return r;
                        }
                        std::thread::yield_now();
                    };
                    if ptr == FAILED {
                        continue;
                    }
                    if self.options.verify {
                        self.verify(slot, ptr, &mut r);
                    } else if self.options.touch {
                        // The write is stream-ordered on the allocation's stream: a free on
                        // another stream must come after it, as the program's own
                        // synchronization ensured for its kernels.
                        let alloc_stream = self.workload.allocs[slot as usize].stream;
                        if alloc_stream != stream
                            && let Err(e) = self
                                .stream(alloc_stream)
                                .and_then(|s| s.synchronize().map_err(|e| e.to_string()))
                        {
                            r.failure(format!("waiting for allocation {slot}'s stream: {e}"));
                        }
                    }
                    let on = match self.call_stream(stream) {
                        Ok(on) => on,
                        Err(e) => {
                            r.failed_frees += 1;
                            r.failure(e);
                            continue;
                        }
                    };
                    let start = Instant::now();
                    let result = match on {
                        None => gpu::free(ptr),
                        Some(s) => s.free_async(ptr),
                    };
                    let ns = start.elapsed().as_nanos() as u64;
                    match result {
                        Ok(()) => r.free_ns.push(ns),
                        Err(e) => {
                            r.failed_frees += 1;
                            r.failure(format!("free of allocation {slot}: {e}"));
                        }
                    }
                }
            }
        }
        r
    }

    /// Check that the first and last byte of allocation `slot` still hold its pattern.
    fn verify(&self, slot: u32, ptr: u64, r: &mut ThreadResult) {
        let info = self.workload.allocs[slot as usize];
        let check = || -> Result<Option<(u64, u8)>, String> {
            let err = |e: CudaError| e.to_string();
            self.stream(info.stream)?.synchronize().map_err(err)?;
            for offset in [0, info.size - 1] {
                let byte = gpu::read_byte(ptr + offset).map_err(err)?;
                if byte != pattern(slot) {
                    return Ok(Some((offset, byte)));
                }
            }
            Ok(None)
        };
        match check() {
            Ok(None) => r.verified += 1,
            Ok(Some((offset, byte))) => {
                r.overwritten += 1;
                r.failure(format!(
                    "allocation {slot} ({} bytes at {ptr:#x}) was overwritten: byte {offset} is \
                     {byte:#04x}, not {:#04x} (another block overlaps it)",
                    info.size,
                    pattern(slot)
                ));
            }
            Err(e) => r.failure(format!("checking allocation {slot}: {e}")),
        }
    }
}

/// The sum over devices of the shim's counter `key` in its stats JSON.
fn shim_counter(json: &str, key: &str) -> Result<u64, Error> {
    let value: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| format!("the shim's cachealloc_stats_json is not JSON: {e}"))?;
    Ok(value["devices"]
        .as_object()
        .map(|devices| {
            devices
                .values()
                .filter_map(|d| d[key].as_u64())
                .sum::<u64>()
        })
        .unwrap_or(0))
}

/// Replay `workload` through `backend` in this process.
pub fn replay(workload: &Workload, backend: Backend, options: Options) -> Result<Measured, Error> {
    let driver = Driver::load()?;
    if backend != Backend::Raw && !driver.stream_ordered {
        return Err(Error::Message(format!(
            "--backend {}: the CUDA driver lacks the stream-ordered allocator (cuMemAllocAsync, \
             CUDA 11.2+); use --backend raw",
            backend.name()
        )));
    }
    if driver.device_count().map_err(|e| e.to_string())? < 1 {
        return Err(Error::Message("the CUDA driver sees no device".into()));
    }
    let ctx = driver.primary_context(0).map_err(|e| e.to_string())?;
    ctx.make_current().map_err(|e| e.to_string())?;
    let shim_before = match backend {
        Backend::Cachealloc => Some(gpu::shim_stats_json().ok_or_else(|| {
            "--backend cachealloc: libcachealloc.so is not loaded in the replay process (its \
             cachealloc_stats_json is not found)"
                .to_string()
        })?),
        _ => None,
    };
    if backend == Backend::Async {
        ctx.keep_default_pool_memory().map_err(|e| e.to_string())?;
    }
    let streams: HashMap<u64, OnceLock<Result<Stream, String>>> = std::iter::once(0)
        .chain(workload.streams.keys().copied())
        .map(|handle| (handle, OnceLock::new()))
        .collect();
    ctx.synchronize().map_err(|e| e.to_string())?;
    let (free, total) = ctx.mem_info().map_err(|e| e.to_string())?;
    let baseline = total.saturating_sub(free);
    let shared = Shared {
        backend,
        options,
        ctx: &ctx,
        workload,
        streams: &streams,
        slots: (0..workload.allocs.len())
            .map(|_| AtomicU64::new(0))
            .collect(),
        peak_used: AtomicU64::new(baseline),
        abort: AtomicBool::new(false),
        start: Barrier::new(workload.threads.len() + 1),
    };
    let (results, wall_ns) = std::thread::scope(|scope| {
        let handles: Vec<_> = workload
            .threads
            .values()
            .map(|ops| {
                let shared = &shared;
                scope.spawn(move || shared.run_thread(ops))
            })
            .collect();
        shared.start.wait();
        let start = Instant::now();
        let results: Vec<ThreadResult> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect();
        let _ = ctx.synchronize();
        (results, start.elapsed().as_nanos() as u64)
    });
    if let Some(e) = results.iter().find_map(|r| r.setup_error.clone()) {
        return Err(Error::Message(format!(
            "a replay thread could not start: {e}"
        )));
    }
    let sum = |f: fn(&ThreadResult) -> u64| results.iter().map(f).sum::<u64>();
    let alloc_ns = Latency::of(results.iter().flat_map(|r| r.alloc_ns.clone()).collect());
    let free_ns = Latency::of(results.iter().flat_map(|r| r.free_ns.clone()).collect());
    let (driver_calls, pooled_allocs) = match (backend, shim_before) {
        (Backend::Raw, _) => (
            Some(DriverCalls {
                allocs: alloc_ns.count,
                frees: free_ns.count,
            }),
            None,
        ),
        (Backend::Cachealloc, Some(before)) => {
            let after = gpu::shim_stats_json().unwrap_or_default();
            let delta = |key: &str| -> Result<u64, Error> {
                Ok(shim_counter(&after, key)?.saturating_sub(shim_counter(&before, key)?))
            };
            (
                Some(DriverCalls {
                    allocs: delta("num_device_alloc")?,
                    frees: delta("num_device_free")?,
                }),
                Some(delta("allocation.all.allocated")?),
            )
        }
        _ => (None, None),
    };
    Ok(Measured {
        backend: backend.name().into(),
        allocs: alloc_ns.count,
        frees: free_ns.count,
        failed_allocs: sum(|r| r.failed_allocs),
        failed_frees: sum(|r| r.failed_frees),
        first_failure: results.iter().find_map(|r| r.first_failure.clone()),
        alloc_ns,
        free_ns,
        wall_ns,
        peak_device_bytes: shared
            .peak_used
            .load(Ordering::Relaxed)
            .saturating_sub(baseline),
        driver_calls,
        pooled_allocs,
        threads: workload.threads.len() as u64,
        streams: streams
            .values()
            .filter(|s| {
                s.get()
                    .is_some_and(|s| s.as_ref().is_ok_and(|s| !s.is_null()))
            })
            .count() as u64,
        touched: sum(|r| r.touched),
        verified: sum(|r| r.verified),
        overwritten: sum(|r| r.overwritten),
        skipped: workload.skipped.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let l = Latency::of((1..=1000).rev().collect());
        assert_eq!(
            (l.count, l.p50, l.p99, l.p999, l.max),
            (1000, 500, 990, 999, 1000)
        );
        assert_eq!(l.total, 500_500);
        let one = Latency::of(vec![7]);
        assert_eq!((one.p50, one.p999), (7, 7));
        assert_eq!(Latency::of(vec![]).p50, 0);
    }

    #[test]
    fn shim_counters_sum_over_devices() {
        let json = r#"{"version":"0.1.0","pid":1,"devices":{"0":{"num_device_alloc":3},"1":{"num_device_alloc":4}}}"#;
        assert_eq!(shim_counter(json, "num_device_alloc").unwrap(), 7);
        assert_eq!(shim_counter(json, "num_device_free").unwrap(), 0);
    }
}
