//! Configuration: `CACHEALLOC_CONF="key:value,key:value"`, the syntax of
//! `PYTORCH_CUDA_ALLOC_CONF`, parsed once into [`Config`]; every default is in
//! [`Config::default`].
//!
//! The whole product's configuration lives here, not only the allocator's: it is pure data, and
//! the shim, the recorder and the offline tools (`cachealloc simulate --conf …`) must all read
//! the same syntax with the same defaults and the same error messages.
//!
//! PyTorch's allocator keys in `PYTORCH_CUDA_ALLOC_CONF` are honoured too
//! ([`Config::from_sources`]); a key given in both places takes the `CACHEALLOC_CONF` value. Keys
//! of `PYTORCH_CUDA_ALLOC_CONF` that concern only PyTorch (`backend`, `pinned_*`, …) are
//! reported back as ignored, never silently dropped. In `CACHEALLOC_CONF` an unknown key or a bad
//! value is an error that names the key and lists the valid choices.

use std::fmt;
use std::path::PathBuf;

use crate::sizes::Roundup;

/// Number of power-of-two intervals of `roundup_power2_divisions` (1 MiB … 64 GiB), as in
/// PyTorch.
pub const ROUNDUP_INTERVALS: usize = 16;

/// When a freed block may be handed out again (see
/// [Note [Reuse fences]](crate::pools#note-reuse-fences)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReusePolicy {
    /// Immediate while the process has created no stream, fenced from the first stream on.
    Auto,
    /// Always behind a fence.
    Fenced,
    /// Immediately (the app promises all work is ordered on one stream).
    Immediate,
}

/// Which allocations grow the pools by mapping memory into expandable segments (CUDA's virtual
/// memory), `expandable_segments`; where the device cannot map, every kind is fixed segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expandable {
    /// `False`: fixed segments (`cudaMalloc`'s) for everything.
    Off,
    /// The default (`stream_ordered`): stream-ordered allocations (`cudaMallocAsync`,
    /// `cuMemAllocAsync`: PyTorch's route) map into expandable segments; the synchronous API
    /// (`cudaMalloc`, `cuMemAlloc`) keeps fixed segments, whose pointers answer the driver as a
    /// `cudaMalloc`'s do (`cudaIpcGetMemHandle`, their context, their allocation's range).
    /// Natively stream-ordered memory comes from the driver's pools, which never answered so.
    StreamOrdered,
    /// `True`: expandable segments for every allocation, as PyTorch's `expandable_segments:True`.
    On,
}

impl Expandable {
    /// Whether the pools may map at all.
    pub fn any(self) -> bool {
        self != Expandable::Off
    }

    /// The value as the configuration writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Expandable::Off => "False",
            Expandable::StreamOrdered => "stream_ordered",
            Expandable::On => "True",
        }
    }
}

/// Which stacks the recorder captures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StackMode {
    /// Python stacks when the host is CPython, else none.
    Auto,
    /// No stacks.
    None,
    /// Python frames only.
    Python,
    /// Native frames only.
    Native,
    /// Python and native frames.
    All,
}

/// How records are timed (`clock`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClockChoice {
    /// The CPU's tick counter where the kernel's own clock is built on it (an invariant
    /// counter, `tsc` clock source), else the system's monotonic clock.
    Auto,
    /// The tick counter wherever the CPU says it is invariant.
    Tsc,
    /// The system's monotonic clock (`clock_gettime`).
    Os,
}

/// How much the shim says on stderr.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    /// Errors only; no exit summary.
    Quiet,
    /// Errors, warnings, the OOM report and the exit summary.
    Info,
    /// Everything, including each configuration decision.
    Debug,
}

/// How PyTorch's tensors reach the pools when the shim pools memory (the measured choice is in
/// the README's "PyTorch" section).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TorchCaching {
    /// `async` (or `off`): select PyTorch's `backend:cudaMallocAsync` (unless the user chose a
    /// backend), so every tensor reaches our pools through `cudaMallocAsync(size, stream)` and
    /// `cudaFreeAsync(ptr, stream)`, with its stream; PyTorch's memory API and OOM handling
    /// read our pools through the default memory pool's attributes.
    Async,
    /// `uncached`: set `PYTORCH_NO_CUDA_MEMORY_CACHING=1` (unless the user set it): every tensor
    /// reaches our pools through `cudaMalloc`/`cudaFree`, without its stream (frees are fenced
    /// against every stream), and PyTorch keeps no statistics and refuses graph capture.
    Uncached,
    /// `keep`: leave PyTorch's cache on; only its segment-sized requests reach us.
    Keep,
}

/// Allocator policy: the part of [`Config`] that `cachealloc-core` itself uses.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatorConfig {
    /// Blocks of at least this many bytes are never split (`max_split_size_mb`; `u64::MAX` =
    /// unlimited).
    pub max_split_size: u64,
    /// `roundup_power2_divisions`.
    pub roundup: Roundup,
    /// Fraction of the memory limit above which cached blocks are garbage-collected
    /// (`garbage_collection_threshold`; 0 = off).
    pub garbage_collection_threshold: f64,
    /// Fraction of device memory this process may reserve (`per_process_memory_fraction`).
    pub per_process_memory_fraction: f64,
    /// Whether that fraction counts the memory of synchronous requests
    /// ([`NO_STREAM`](crate::NO_STREAM)) too: cachealloc's own setting does; a fraction from
    /// `PYTORCH_CUDA_ALLOC_CONF` limits what PyTorch's allocator would hold, the stream-ordered
    /// memory, and never refuses the synchronous API's (the libraries' own: Note [PyTorch's
    /// view of the statistics]).
    pub fraction_counts_synchronous: bool,
    /// `expandable_segments`.
    pub expandable_segments: Expandable,
    /// `reuse`.
    pub reuse: ReusePolicy,
}

/// The whole configuration of the shim, recorder and tools.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Allocator policy.
    pub allocator: AllocatorConfig,
    /// `pool:on|off`: serve allocations from our pools, or pure passthrough (trace only).
    pub pool: bool,
    /// `torch_caching:async|uncached|keep`.
    pub torch_caching: TorchCaching,
    /// `report_cached_as_free`: `cudaMemGetInfo` counts our cached free bytes as free.
    pub report_cached_as_free: bool,
    /// `trace:on|off`.
    pub trace: bool,
    /// `trace_dir`: where per-process trace directories are created.
    pub trace_dir: PathBuf,
    /// `trace_file_mb`: size at which a trace file is rotated.
    pub trace_file_mb: u64,
    /// `trace_files`: trace files kept per process (older ones are deleted).
    pub trace_files: u32,
    /// `trace_mode`: the trace files' mode (`0600`: the user's alone); trace directories get an
    /// `x` bit wherever it gives an `r` bit.
    pub trace_mode: u32,
    /// `stacks`.
    pub stacks: StackMode,
    /// `stack_depth`: frames captured per stack.
    pub stack_depth: u32,
    /// `compress`: zstd-compress trace chunks.
    pub compress: bool,
    /// `clock`: what times the records (the recorder writes nanoseconds either way).
    pub clock: ClockChoice,
    /// `oom_checkpoint`: write a full state checkpoint to the trace at an OOM.
    pub oom_checkpoint: bool,
    /// `graph_capture_record_stream_reuse` (PyTorch's key): a block freed during a graph
    /// capture after `record_stream` on streams that joined the capture may be reused within
    /// the capture once the capture's graph has joined those streams back; off, only after the
    /// capture (Note [Recorded streams] in the shim).
    pub graph_capture_record_stream_reuse: bool,
    /// `python:on|off`: in a Python process, put the shim's Python integration on
    /// `PYTHONPATH` (it adjusts what PyTorch cannot do on the `cudaMallocAsync` route).
    pub python: bool,
    /// `categories:on|off`: in a Python process, the integration's hooks that tell the trace
    /// each thread's module, the phase of the step and what blocks hold (memory by category and
    /// module); off, the trace has none of it.
    pub categories: bool,
    /// `torch_allocator:on|off`: in a Python process with PyTorch, the integration builds
    /// cachealloc's C++ allocator for PyTorch against its headers and installs it in the place
    /// of PyTorch's `cudaMallocAsync` backend, which serves CUDA graph trees (Note [Graph trees
    /// under the shim], `shim/python/cachealloc_torch_allocator.cpp`); off, the backend stays
    /// and graph trees are turned off.
    pub torch_allocator: bool,
    /// `unwinder:auto|system`: how native stacks are unwound — `auto` is a caching DWARF
    /// unwinder on x86-64 Linux (the system unwinder elsewhere); `system` always uses the
    /// system unwinder (a diagnostic).
    pub system_unwinder: bool,
    /// `driver_doors:on|off`: serve the driver's allocation functions too (reached through
    /// libcuda's symbols, `dlsym` and `cuGetProcAddress`); off, only the runtime's `cudaMalloc*`
    /// symbols lead to the pools and every driver call passes through.
    pub driver_doors: bool,
    /// `log`.
    pub log: LogLevel,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            max_split_size: u64::MAX,
            roundup: Roundup::None,
            garbage_collection_threshold: 0.0,
            per_process_memory_fraction: 1.0,
            fraction_counts_synchronous: true,
            expandable_segments: Expandable::StreamOrdered,
            reuse: ReusePolicy::Auto,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            allocator: AllocatorConfig::default(),
            pool: true,
            torch_caching: TorchCaching::Async,
            report_cached_as_free: true,
            trace: true,
            trace_dir: PathBuf::from("cachealloc-trace"),
            trace_file_mb: 64,
            trace_files: 8,
            trace_mode: 0o600,
            stacks: StackMode::Auto,
            stack_depth: 64,
            compress: true,
            clock: ClockChoice::Auto,
            oom_checkpoint: true,
            graph_capture_record_stream_reuse: false,
            python: true,
            categories: true,
            torch_allocator: true,
            driver_doors: true,
            system_unwinder: false,
            log: LogLevel::Info,
        }
    }
}

/// A configuration string that could not be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{source_name}: {problem}")]
pub struct ConfigError {
    /// Which setting the text came from (`CACHEALLOC_CONF`, `--conf`, …).
    pub source_name: String,
    /// What is wrong, naming the key and the valid choices.
    pub problem: String,
}

/// Keys of `PYTORCH_CUDA_ALLOC_CONF` that concern only PyTorch itself.
const TORCH_ONLY_KEYS: &[&str] = &[
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
];

/// The outcome of reading all configuration sources.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    /// The configuration in force.
    pub config: Config,
    /// Keys found but not used (PyTorch-only keys of `PYTORCH_CUDA_ALLOC_CONF`), for a message.
    pub ignored: Vec<String>,
}

impl Config {
    /// Parse a `key:value,key:value` string on top of the defaults.
    pub fn parse(text: &str, source_name: &str) -> Result<Config, ConfigError> {
        let mut config = Config::default();
        config.apply(text, source_name)?;
        Ok(config)
    }

    /// Parse the allocator configuration a trace header recorded
    /// ([`AllocatorConfig::to_conf_string`]). Traces of cachealloc 0.6 and before were written
    /// when fixed segments were the default and named `expandable_segments` only when it was on:
    /// there its absence means `False`.
    pub fn parse_recorded(text: &str, source_name: &str) -> Result<Config, ConfigError> {
        let mut config = Config::parse(text, source_name)?;
        let named = split_entries(text, source_name)?
            .iter()
            .any(|(key, _)| *key == "expandable_segments");
        if !named {
            config.allocator.expandable_segments = Expandable::Off;
        }
        Ok(config)
    }

    /// Apply a `key:value,key:value` string on top of this configuration.
    pub fn apply(&mut self, text: &str, source_name: &str) -> Result<(), ConfigError> {
        for (key, value) in split_entries(text, source_name)? {
            self.set(key, value).map_err(|problem| ConfigError {
                source_name: source_name.to_string(),
                problem,
            })?;
        }
        Ok(())
    }

    /// Build the configuration from `PYTORCH_CUDA_ALLOC_CONF` (allocator keys only) and then
    /// `CACHEALLOC_CONF` (which wins), as the shim reads its environment.
    pub fn from_sources(
        cachealloc: Option<&str>,
        pytorch: Option<&str>,
    ) -> Result<Resolved, ConfigError> {
        let mut config = Config::default();
        let mut ignored = Vec::new();
        if let Some(text) = pytorch {
            let source = "PYTORCH_CUDA_ALLOC_CONF";
            for (key, value) in split_entries(text, source)? {
                if key_named(key).is_some_and(|k| k.from_pytorch) {
                    config.set(key, value).map_err(|problem| ConfigError {
                        source_name: source.to_string(),
                        problem,
                    })?;
                } else {
                    let why = if TORCH_ONLY_KEYS.contains(&key) {
                        "concerns PyTorch only"
                    } else {
                        "unknown to cachealloc"
                    };
                    ignored.push(format!(
                        "PYTORCH_CUDA_ALLOC_CONF key '{key}' ignored ({why})"
                    ));
                }
            }
        }
        if let Some(text) = cachealloc {
            config.apply(text, "CACHEALLOC_CONF")?;
        }
        // PyTorch's fraction counts PyTorch's memory, unless cachealloc's own setting rules.
        let names_fraction = |text: Option<&str>, source| {
            text.and_then(|t| split_entries(t, source).ok())
                .is_some_and(|entries| {
                    entries
                        .iter()
                        .any(|(k, _)| *k == "per_process_memory_fraction")
                })
        };
        if names_fraction(pytorch, "PYTORCH_CUDA_ALLOC_CONF")
            && !names_fraction(cachealloc, "CACHEALLOC_CONF")
        {
            config.allocator.fraction_counts_synchronous = false;
        }
        Ok(Resolved { config, ignored })
    }

    /// Keep PyTorch's memory in fixed segments when NCCL registers every segment of PyTorch's
    /// allocator (`TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK`, `registers_all`): a
    /// registration covers the memory a segment had when NCCL was told of it, and mapped memory
    /// moves and goes under it, which is why PyTorch turns that registration off itself when its
    /// own `expandable_segments` is on. With the shim's default (expandable segments PyTorch does
    /// not know of) its segments become fixed ones, as PyTorch's default is; where
    /// `CACHEALLOC_CONF` asks for expandable segments and PyTorch's settings do not, the two
    /// cannot both be served, and the message says so. Returns what to log, if anything
    /// (`cachealloc`, `pytorch`: the two sources, as for [`Config::from_sources`]).
    pub fn for_nccl_registration(
        &mut self,
        registers_all: bool,
        cachealloc: Option<&str>,
        pytorch: Option<&str>,
    ) -> Option<String> {
        if !registers_all || self.allocator.expandable_segments == Expandable::Off {
            return None;
        }
        let value = |text: Option<&str>, source| {
            text.and_then(|t| split_entries(t, source).ok())
                .and_then(|entries| {
                    (entries.into_iter().rev())
                        .find(|(k, _)| *k == "expandable_segments")
                        .map(|(_, v)| v.to_string())
                })
        };
        let pytorchs = value(pytorch, "PYTORCH_CUDA_ALLOC_CONF");
        if pytorchs.is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            return None; // PyTorch turns NCCL's registration of every segment off itself
        }
        if value(cachealloc, "CACHEALLOC_CONF").is_some() {
            return Some(
                "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK makes NCCL register every segment, \
                 but CACHEALLOC_CONF asks for expandable segments, whose memory moves under a \
                 registration: set expandable_segments:False, or set expandable_segments:True in \
                 PYTORCH_CUDA_ALLOC_CONF so that PyTorch turns the registration off"
                    .to_string(),
            );
        }
        self.allocator.expandable_segments = Expandable::Off;
        Some(
            "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK: PyTorch's memory in fixed segments, \
             which NCCL can register (expandable segments cannot be)"
                .to_string(),
        )
    }

    /// Set one key. The error text names the key, the bad value and the valid choices.
    fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        match key_named(key) {
            Some(k) => (k.set)(self, key, value),
            None => {
                let valid: Vec<&str> = KEYS.iter().map(|k| k.name).collect();
                Err(format!(
                    "unknown key '{key}'; valid keys: {}",
                    valid.join(", ")
                ))
            }
        }
    }
}

impl fmt::Display for ReusePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReusePolicy::Auto => "auto",
            ReusePolicy::Fenced => "fenced",
            ReusePolicy::Immediate => "immediate",
        })
    }
}

impl AllocatorConfig {
    /// The allocator keys in `key:value` form, for trace headers and snapshot settings.
    pub fn to_conf_string(&self) -> String {
        let mut parts = Vec::new();
        if self.max_split_size != u64::MAX {
            parts.push(format!("max_split_size_mb:{}", self.max_split_size >> 20));
        }
        match &self.roundup {
            Roundup::None => {}
            Roundup::Uniform(n) => parts.push(format!("roundup_power2_divisions:{n}")),
            Roundup::PerInterval(table) => {
                let items: Vec<String> = table
                    .iter()
                    .enumerate()
                    .map(|(i, d)| format!("{}:{d}", 1u64 << i))
                    .collect();
                parts.push(format!("roundup_power2_divisions:[{}]", items.join(",")));
            }
        }
        if self.garbage_collection_threshold > 0.0 {
            parts.push(format!(
                "garbage_collection_threshold:{}",
                self.garbage_collection_threshold
            ));
        }
        if self.per_process_memory_fraction < 1.0 {
            parts.push(format!(
                "per_process_memory_fraction:{}",
                self.per_process_memory_fraction
            ));
        }
        // Always written: traces before 0.7 (fixed segments by default) wrote it only when on,
        // and a reader tells them apart by its absence (`Config::parse_recorded`).
        parts.push(format!(
            "expandable_segments:{}",
            self.expandable_segments.as_str()
        ));
        parts.push(format!("reuse:{}", self.reuse));
        parts.join(",")
    }
}

mod keys;
#[cfg(test)]
mod tests;
mod values;

pub use keys::{KEYS, Key, key_named};

use values::split_entries;
