//! What the shim reports about itself: the exit summary, annotations (`cachealloc_annotate`)
//! and the stats JSON (`cachealloc_stats_json`).

use cachealloc_core::{Expandable, format_bytes};

use crate::log;
use crate::process::{ExitFacts, shim, started_shim};

/// At exit: print one summary line per device unless `log:quiet`, then flush and stop the
/// trace (saying so if its end may be missing).
pub fn exit_summary() {
    let Some(shim) = started_shim() else {
        return;
    };
    print_summary(shim.exit_facts());
    if shim.shut_down_trace() == Some(false) {
        log::info!(
            "pid {}: the trace's end may be missing: its writer did not finish in time",
            std::process::id()
        );
    }
}

fn print_summary(facts: ExitFacts) {
    if !log::enabled(cachealloc_core::config::LogLevel::Info) {
        return;
    }
    let pid = std::process::id();
    let trace_note = &facts.trace_note;
    if facts.unpooled {
        let passed = facts.passthrough_mallocs;
        log::info!("pid {pid}: pool:off: {passed} allocations passed through; {trace_note}");
        if let Some(doors) = doors_line() {
            log::info!("pid {pid}: allocations by door: {doors}");
        }
        return;
    }
    if facts.stats.is_empty() {
        log::info!("pid {pid}: no allocation reached the pool");
        if let Some(doors) = doors_line() {
            log::info!("pid {pid}: allocations by door: {doors}");
        }
        return;
    }
    for (device, s) in &facts.stats {
        let requests = s.num_cache_hits + s.num_device_alloc;
        let every_request_maps =
            crate::settings::get().config.allocator.expandable_segments == Expandable::On;
        let (allocs, frees) = if facts.expandable.contains(device) && every_request_maps {
            ("maps into expandable segments", "unmaps")
        } else if facts.expandable.contains(device) {
            // The default: stream-ordered requests map, `cudaMalloc`'s get fixed segments.
            ("maps and device allocations", "unmaps and device frees")
        } else {
            ("device allocations", "device frees")
        };
        log::info!(
            "pid {pid} device {device}: peak allocated {}, peak reserved {}; {} of {} allocations served from the \
             cache, {} {allocs}, {} {frees}, {} OOMs, {} fence waits; {trace_note}",
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
    let passed = facts.passthrough_mallocs;
    if passed > 0 {
        log::info!(
            "pid {pid}: {passed} allocations passed through unpooled after an internal failure"
        );
    }
    let uncached = facts.uncached_mallocs;
    if uncached > 0 {
        log::info!(
            "pid {pid}: {uncached} allocations passed to CUDA while the program had caching off"
        );
    }
    if let Some(doors) = doors_line() {
        log::info!("pid {pid}: allocations by door: {doors}");
    }
    if let Some(c) = facts.stacks.filter(|c| c.captures > 0) {
        log::info!(
            "pid {pid}: stacks: {} captures, {} cold ({:.1} %), warm keys forgotten {} times \
             (code objects died), {} found in the thread's recent stacks",
            c.captures,
            c.cold,
            100.0 * c.cold as f64 / c.captures as f64,
            c.forgotten,
            c.recent,
        );
    }
    let other_contexts = facts.unpooled_context_mallocs;
    if other_contexts > 0 {
        log::info!(
            "pid {pid}: {other_contexts} allocations in contexts made with cuCtxCreate passed through unpooled"
        );
    }
}

/// The doors allocation requests came through (see [`crate::symbols`]), those used only: "runtime
/// cudaMalloc* 12, driver entry points (cuGetProcAddress) 3".
fn doors_line() -> Option<String> {
    let used: Vec<String> = crate::symbols::counts()
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
    let at = shim.annotation(name);
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

/// `device`'s stats as PyTorch counts them (stream-ordered memory only: cachealloc-core's Note
/// [PyTorch's view of the statistics]) as one flat JSON object of PyTorch's `memory_stats()`
/// keys (zeros when the device has no pool yet).
pub fn device_stats_json(device: i32) -> String {
    let stats = shim()
        .and_then(|s| s.pytorch_device_stats(device))
        .unwrap_or_default();
    let fields: Vec<String> = stats
        .to_flat()
        .into_iter()
        .map(|(key, value)| format!("\"{key}\":{value}"))
        .collect();
    format!("{{{}}}", fields.join(","))
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
