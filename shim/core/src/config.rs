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

/// When a freed block may be handed out again (see [Note [Reuse fences]](crate::pools)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReusePolicy {
    /// Immediate while the process has created no stream, fenced from the first stream on.
    Auto,
    /// Always behind a fence.
    Fenced,
    /// Immediately (the app promises all work is ordered on one stream).
    Immediate,
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
    /// `expandable_segments`.
    pub expandable_segments: bool,
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
    /// `stacks`.
    pub stacks: StackMode,
    /// `stack_depth`: frames captured per stack.
    pub stack_depth: u32,
    /// `compress`: zstd-compress trace chunks.
    pub compress: bool,
    /// `oom_checkpoint`: write a full state checkpoint to the trace at an OOM.
    pub oom_checkpoint: bool,
    /// `python:on|off`: in a Python process, put the shim's Python integration on
    /// `PYTHONPATH` (it adjusts what PyTorch cannot do on the `cudaMallocAsync` route).
    pub python: bool,
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
            expandable_segments: false,
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
            stacks: StackMode::Auto,
            stack_depth: 64,
            compress: true,
            oom_checkpoint: true,
            python: true,
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
    "graph_capture_record_stream_reuse",
];

/// Every key we accept, with its valid values, for error messages and `--help`.
pub const KEYS: &[(&str, &str)] = &[
    (
        "max_split_size_mb",
        "an integer number of MiB above 20, or 'unlimited'",
    ),
    (
        "roundup_power2_divisions",
        "a power of two, or a list like [256:1,512:2,>:8]",
    ),
    (
        "garbage_collection_threshold",
        "a number strictly between 0.0 and 1.0",
    ),
    ("per_process_memory_fraction", "a number in (0.0, 1.0]"),
    ("expandable_segments", "True or False"),
    ("reuse", "auto, fenced or immediate"),
    ("pool", "on or off"),
    ("torch_caching", "async (or off), uncached or keep"),
    ("report_cached_as_free", "true or false"),
    ("trace", "on or off"),
    ("trace_dir", "a directory path"),
    ("trace_file_mb", "an integer from 1 to 65536"),
    ("trace_files", "an integer from 1 to 10000"),
    ("stacks", "auto, none, python, native or all"),
    ("stack_depth", "an integer from 1 to 256"),
    ("compress", "on or off"),
    ("oom_checkpoint", "on or off"),
    ("python", "on or off"),
    ("driver_doors", "on or off"),
    ("unwinder", "auto or system"),
    ("log", "quiet, info or debug"),
];

/// Keys that make sense in `PYTORCH_CUDA_ALLOC_CONF`.
const ALLOCATOR_KEYS: &[&str] = &[
    "max_split_size_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "per_process_memory_fraction",
    "expandable_segments",
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
                if ALLOCATOR_KEYS.contains(&key) {
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
        Ok(Resolved { config, ignored })
    }

    /// Set one key. The error text names the key, the bad value and the valid choices.
    fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let a = &mut self.allocator;
        match key {
            "max_split_size_mb" => {
                a.max_split_size =
                    parse_max_split(value).map_err(|e| bad_because(key, value, &e))?
            }
            "roundup_power2_divisions" => {
                a.roundup = parse_roundup(value).map_err(|e| bad_because(key, value, &e))?
            }
            "garbage_collection_threshold" => {
                a.garbage_collection_threshold = parse_fraction(key, value, false)?;
            }
            "per_process_memory_fraction" => {
                a.per_process_memory_fraction = parse_fraction(key, value, true)?;
            }
            "expandable_segments" => a.expandable_segments = parse_bool(key, value)?,
            "reuse" => {
                a.reuse = choose(
                    key,
                    value,
                    &[
                        ("auto", ReusePolicy::Auto),
                        ("fenced", ReusePolicy::Fenced),
                        ("immediate", ReusePolicy::Immediate),
                    ],
                )?;
            }
            "pool" => self.pool = parse_bool(key, value)?,
            "torch_caching" => {
                self.torch_caching = choose(
                    key,
                    value,
                    &[
                        ("async", TorchCaching::Async),
                        ("off", TorchCaching::Async),
                        ("uncached", TorchCaching::Uncached),
                        ("keep", TorchCaching::Keep),
                    ],
                )?;
            }
            "report_cached_as_free" => self.report_cached_as_free = parse_bool(key, value)?,
            "trace" => self.trace = parse_bool(key, value)?,
            "trace_dir" => {
                if value.is_empty() {
                    return Err(bad(key, value));
                }
                self.trace_dir = PathBuf::from(value);
            }
            "trace_file_mb" => self.trace_file_mb = parse_int(key, value, 1, 65536)?,
            "trace_files" => self.trace_files = parse_int(key, value, 1, 10000)? as u32,
            "stacks" => {
                self.stacks = choose(
                    key,
                    value,
                    &[
                        ("auto", StackMode::Auto),
                        ("none", StackMode::None),
                        ("python", StackMode::Python),
                        ("native", StackMode::Native),
                        ("all", StackMode::All),
                    ],
                )?;
            }
            "stack_depth" => self.stack_depth = parse_int(key, value, 1, 256)? as u32,
            "compress" => self.compress = parse_bool(key, value)?,
            "oom_checkpoint" => self.oom_checkpoint = parse_bool(key, value)?,
            "python" => self.python = parse_bool(key, value)?,
            "driver_doors" => self.driver_doors = parse_bool(key, value)?,
            "unwinder" => {
                self.system_unwinder = choose(key, value, &[("auto", false), ("system", true)])?;
            }
            "log" => {
                self.log = choose(
                    key,
                    value,
                    &[
                        ("quiet", LogLevel::Quiet),
                        ("info", LogLevel::Info),
                        ("debug", LogLevel::Debug),
                    ],
                )?;
            }
            _ => {
                let valid: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
                return Err(format!(
                    "unknown key '{key}'; valid keys: {}",
                    valid.join(", ")
                ));
            }
        }
        Ok(())
    }
}

/// The problem text for a bad value.
/// The valid values of `key`, as [`KEYS`] describes them.
fn expected(key: &str) -> &'static str {
    KEYS.iter()
        .find(|(k, _)| *k == key)
        .map_or("a valid value", |(_, e)| e)
}

/// The error for a bad value: it names the key, the value and the valid values.
fn bad(key: &str, value: &str) -> String {
    format!(
        "bad value '{value}' for key '{key}'; expected {}",
        expected(key)
    )
}

/// [`bad`], saying what in particular is wrong.
fn bad_because(key: &str, value: &str, reason: &str) -> String {
    format!(
        "bad value '{value}' for key '{key}' ({reason}); expected {}",
        expected(key)
    )
}

/// Split `k:v,k:v` into pairs; commas inside `[...]` belong to the value.
fn split_entries<'a>(
    text: &'a str,
    source_name: &str,
) -> Result<Vec<(&'a str, &'a str)>, ConfigError> {
    let err = |problem: String| ConfigError {
        source_name: source_name.to_string(),
        problem,
    };
    let mut entries = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    let bytes = text.as_bytes();
    for i in 0..=bytes.len() {
        let at_end = i == bytes.len();
        let c = if at_end { b',' } else { bytes[i] };
        match c {
            b'[' => depth += 1,
            b']' => {
                depth -= 1;
                if depth < 0 {
                    return Err(err(format!("unbalanced ']' at byte {i} of '{text}'")));
                }
            }
            b',' if depth == 0 => {
                let entry = text[start..i].trim();
                start = i + 1;
                if entry.is_empty() {
                    continue;
                }
                let Some((key, value)) = entry.split_once(':') else {
                    return Err(err(format!("entry '{entry}' is not of the form key:value")));
                };
                entries.push((key.trim(), value.trim()));
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(err(format!("unbalanced '[' in '{text}'")));
    }
    Ok(entries)
}

fn choose<T: Copy>(key: &str, value: &str, choices: &[(&str, T)]) -> Result<T, String> {
    choices
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(value))
        .map(|(_, v)| *v)
        .ok_or_else(|| bad(key, value))
}

fn parse_bool(key: &str, value: &str) -> Result<bool, String> {
    match value.to_ascii_lowercase().as_str() {
        "on" | "true" | "1" | "yes" => Ok(true),
        "off" | "false" | "0" | "no" => Ok(false),
        _ => Err(bad(key, value)),
    }
}

fn parse_int(key: &str, value: &str, min: u64, max: u64) -> Result<u64, String> {
    match value.parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(bad(key, value)),
    }
}

fn parse_fraction(key: &str, value: &str, one_allowed: bool) -> Result<f64, String> {
    let ok = |f: f64| f > 0.0 && (f < 1.0 || (one_allowed && f == 1.0));
    match value.parse::<f64>() {
        Ok(f) if ok(f) => Ok(f),
        _ => Err(bad(key, value)),
    }
}

fn parse_max_split(value: &str) -> Result<u64, String> {
    if value.eq_ignore_ascii_case("unlimited") {
        return Ok(u64::MAX);
    }
    let mib: u64 = value
        .parse()
        .map_err(|_| "an integer number of MiB above 20, or 'unlimited'".to_string())?;
    // PyTorch refuses values not above kLargeBuffer (20 MiB): smaller limits would make every
    // 20 MiB segment of the large pool unsplittable.
    if mib <= 20 {
        return Err(
            "an integer number of MiB above 20 (PyTorch's minimum), or 'unlimited'".to_string(),
        );
    }
    mib.checked_mul(1 << 20)
        .ok_or_else(|| "a number of MiB that fits in 64 bits".to_string())
}

fn parse_divisions(text: &str) -> Result<u32, String> {
    match text.trim().parse::<u32>() {
        Ok(n) if n == 0 || n.is_power_of_two() => Ok(n),
        _ => Err("divisions that are powers of two (1, 2, 4, 8, …)".to_string()),
    }
}

/// Parse `roundup_power2_divisions`: one number, or `[size_mb:divisions,…,>:divisions]`, where
/// each size is a power of two in MiB; the first entry also covers every smaller size, `>`
/// covers every larger one (PyTorch's rules).
fn parse_roundup(value: &str) -> Result<Roundup, String> {
    let Some(list) = value.strip_prefix('[') else {
        let n = parse_divisions(value)?;
        return Ok(if n <= 1 {
            Roundup::None
        } else {
            Roundup::Uniform(n)
        });
    };
    let list = list.strip_suffix(']').ok_or("a list closed by ']'")?;
    let mut table = [0u32; ROUNDUP_INTERVALS];
    let mut last_index: Option<usize> = None;
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (size, divisions) = entry
            .split_once(':')
            .ok_or("list entries of the form size_mb:divisions")?;
        let divisions = parse_divisions(divisions)?;
        if size.trim() == ">" {
            let from = last_index.map_or(0, |i| i + 1);
            table[from.min(ROUNDUP_INTERVALS)..].fill(divisions);
            continue;
        }
        let mib: u64 = size
            .trim()
            .parse()
            .map_err(|_| "interval sizes in MiB that are powers of two")?;
        if !mib.is_power_of_two() {
            return Err("interval sizes in MiB that are powers of two".to_string());
        }
        let index = (mib.trailing_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
        if last_index.is_none() {
            table[..index].fill(divisions);
        } else if last_index.is_some_and(|l| index <= l) {
            return Err("interval sizes in increasing order".to_string());
        }
        table[index] = divisions;
        last_index = Some(index);
    }
    if table.iter().all(|&d| d <= 1) {
        return Ok(Roundup::None);
    }
    Ok(Roundup::PerInterval(table.to_vec()))
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
        if self.expandable_segments {
            parts.push("expandable_segments:True".to_string());
        }
        parts.push(format!("reuse:{}", self.reuse));
        parts.join(",")
    }
}

#[cfg(test)]
mod tests;
