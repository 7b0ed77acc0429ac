//! What the shim reports about itself: the exit summary, annotations (`cachealloc_annotate`)
//! and the stats JSON (`cachealloc_stats_json`).

use std::sync::atomic::Ordering;

use cachealloc_core::format_bytes;
use cachealloc_recorder::Record;
use cachealloc_recorder::schema::Annotation;

use crate::log;
use crate::process::{shim, started_shim};

/// Register the exit summary (at first CUDA use: an `atexit` registered in the constructor would
/// run after the destructors of libraries loaded later, CUDA's among them).
pub fn register_exit_summary() {
    extern "C" fn at_exit() {
        // No panic may cross this C callback.
        let _ = std::panic::catch_unwind(exit_summary);
    }
    // SAFETY: registers a plain `extern "C" fn()` that never unwinds.
    unsafe { libc::atexit(at_exit) };
}

/// At exit: flush and stop the trace, then print one summary line per device unless
/// `log:quiet`.
pub fn exit_summary() {
    let Some(shim) = started_shim() else {
        return;
    };
    let trace_note = match &shim.trace {
        Ok(trace) if trace.shutdown() => format!("trace in {}", trace.dir.display()),
        Ok(trace) => format!(
            "trace in {} (its end may be missing: the writer did not finish in time)",
            trace.dir.display()
        ),
        Err(why) => format!("no trace ({why})"),
    };
    if !log::enabled(cachealloc_core::config::LogLevel::Info) {
        return;
    }
    let pid = std::process::id();
    let stats = shim.stats();
    if shim.driver.is_none() || (stats.is_empty() && !shim.pooling()) {
        let passed = shim.passthrough_mallocs.load(Ordering::Relaxed);
        log::info!("pid {pid}: pool:off: {passed} allocations passed through; {trace_note}");
        if let Some(doors) = doors_line() {
            log::info!("pid {pid}: allocations by door: {doors}");
        }
        return;
    }
    if stats.is_empty() {
        log::info!("pid {pid}: no allocation reached the pool");
        if let Some(doors) = doors_line() {
            log::info!("pid {pid}: allocations by door: {doors}");
        }
        return;
    }
    for (device, s) in stats {
        let requests = s.num_cache_hits + s.num_device_alloc;
        log::info!(
            "pid {pid} device {device}: peak allocated {}, peak reserved {}; {} of {} allocations served from the \
             cache, {} device allocations, {} device frees, {} OOMs, {} fence waits; {trace_note}",
            format_bytes(s.allocated_bytes.all.peak as u64),
            format_bytes(s.reserved_bytes.all.peak as u64),
            s.num_cache_hits,
            requests,
            s.num_device_alloc,
            s.num_device_free,
            s.num_ooms,
            s.num_fence_waits,
        );
    }
    let passed = shim.passthrough_mallocs.load(Ordering::Relaxed);
    if passed > 0 {
        log::info!(
            "pid {pid}: {passed} allocations passed through unpooled after an internal failure"
        );
    }
    if let Some(doors) = doors_line() {
        log::info!("pid {pid}: allocations by door: {doors}");
    }
    let other_contexts = shim.unpooled_context_mallocs.load(Ordering::Relaxed);
    if other_contexts > 0 {
        log::info!(
            "pid {pid}: {other_contexts} allocations in contexts made with cuCtxCreate passed through unpooled"
        );
    }
}

/// The doors allocation requests came through (see [`crate::doors`]), those used only: "runtime
/// cudaMalloc* 12, driver entry points (cuGetProcAddress) 3".
fn doors_line() -> Option<String> {
    let used: Vec<String> = crate::doors::counts()
        .into_iter()
        .filter(|&(_, n)| n > 0)
        .map(|(door, n)| format!("{} {n}", door.name()))
        .collect();
    (!used.is_empty()).then(|| used.join(", "))
}

/// `cachealloc_annotate`: a named marker, written to the trace and, with the memory state of
/// every pooled device, to stderr.
pub fn annotate(name: &str) {
    let Some(shim) = shim() else {
        log::info!("annotation '{name}' (passthrough: no pool)");
        return;
    };
    if let Ok(trace) = &shim.trace {
        let t = crate::trace::now();
        trace.send(Record::Annotation(Box::new(Annotation {
            t,
            name: name.to_string(),
            thread: crate::trace::thread_number(),
        })));
    }
    let at = shim.started.elapsed().as_secs_f64();
    let mut line = format!("annotation '{name}' at +{at:.3} s:");
    for (device, s) in shim.stats() {
        line.push_str(&format!(
            " device {device} allocated {} (peak {}), reserved {} (peak {});",
            format_bytes(s.allocated_bytes.all.current as u64),
            format_bytes(s.allocated_bytes.all.peak as u64),
            format_bytes(s.reserved_bytes.all.current as u64),
            format_bytes(s.reserved_bytes.all.peak as u64),
        ));
    }
    log::info!("{}", line.trim_end_matches(';'));
}

/// The stats of every pooled device as JSON: `{"version": …, "devices": {"0": {key: value}}}`
/// with PyTorch's `memory_stats()` keys.
pub fn stats_json() -> String {
    let mut out = format!(
        "{{\"version\":\"{}\",\"pid\":{},\"devices\":{{",
        env!("CARGO_PKG_VERSION"),
        std::process::id()
    );
    if let Some(shim) = shim() {
        for (i, (device, stats)) in shim.stats().into_iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&format!("\"{device}\":{{"));
            for (j, (key, value)) in stats.to_flat().into_iter().enumerate() {
                if j > 0 {
                    out.push(',');
                }
                out.push_str(&format!("\"{key}\":{value}"));
            }
            out.push('}');
        }
    }
    out.push_str("}}");
    out
}
