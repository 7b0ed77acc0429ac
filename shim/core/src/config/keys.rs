//! The configuration's keys: one table ([`KEYS`]) of each key's name, valid values, whether
//! `PYTORCH_CUDA_ALLOC_CONF` may set it, and how its value is read.

use std::fmt;
use std::path::PathBuf;

use super::values::{
    bad, bad_because, choose, parse_bool, parse_file_mode, parse_fraction, parse_int,
    parse_max_split, parse_memory_fraction, parse_roundup,
};
use super::{ClockChoice, Config, Expandable, LogLevel, ReusePolicy, StackMode, TorchCaching};

/// One configuration key: its name, its valid values (for error messages and `--help`), whether
/// `PYTORCH_CUDA_ALLOC_CONF` may set it (the allocator's keys), and how its value is read into
/// the configuration. [`KEYS`] holds every key; a new key is one row there and its default in
/// [`Config`]'s `Default` (and, for an allocator key, its part of
/// [`AllocatorConfig::to_conf_string`](super::AllocatorConfig::to_conf_string)).
pub struct Key {
    /// The key, as written in `key:value`.
    pub name: &'static str,
    /// Its valid values, in words.
    pub valid: &'static str,
    /// Whether `PYTORCH_CUDA_ALLOC_CONF` may set it (else that variable's value is ignored,
    /// with a message).
    pub from_pytorch: bool,
    /// Read `value` into the configuration; the error names the key, the value and `valid`.
    pub(super) set: fn(&mut Config, key: &str, value: &str) -> Result<(), String>,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.name, self.valid)
    }
}

/// The key called `name`.
pub fn key_named(name: &str) -> Option<&'static Key> {
    KEYS.iter().find(|k| k.name == name)
}

/// Every key we accept: the one table of their facts (see [`Key`]).
pub const KEYS: &[Key] = &[
    Key {
        name: "max_split_size_mb",
        valid: "an integer number of MiB above 20, or 'unlimited'",
        from_pytorch: true,
        set: |c, k, v| {
            c.allocator.max_split_size = parse_max_split(v).map_err(|e| bad_because(k, v, &e))?;
            Ok(())
        },
    },
    Key {
        name: "roundup_power2_divisions",
        valid: "a power of two, or a list like [256:1,512:2,>:8]",
        from_pytorch: true,
        set: |c, k, v| {
            c.allocator.roundup = parse_roundup(v).map_err(|e| bad_because(k, v, &e))?;
            Ok(())
        },
    },
    Key {
        name: "garbage_collection_threshold",
        valid: "a number strictly between 0.0 and 1.0",
        from_pytorch: true,
        set: |c, k, v| {
            c.allocator.garbage_collection_threshold = parse_fraction(k, v)?;
            Ok(())
        },
    },
    Key {
        name: "per_process_memory_fraction",
        valid: "a number in [0.0, 1.0]",
        from_pytorch: true,
        set: |c, k, v| {
            c.allocator.per_process_memory_fraction = parse_memory_fraction(k, v)?;
            Ok(())
        },
    },
    Key {
        name: "expandable_segments",
        valid: "True, False or stream_ordered",
        from_pytorch: true,
        set: |c, k, v| {
            c.allocator.expandable_segments = if v.eq_ignore_ascii_case("stream_ordered") {
                Expandable::StreamOrdered
            } else if parse_bool(k, v)? {
                Expandable::On
            } else {
                Expandable::Off
            };
            Ok(())
        },
    },
    Key {
        name: "reuse",
        valid: "auto, fenced or immediate",
        from_pytorch: false,
        set: |c, k, v| {
            c.allocator.reuse = choose(
                k,
                v,
                &[
                    ("auto", ReusePolicy::Auto),
                    ("fenced", ReusePolicy::Fenced),
                    ("immediate", ReusePolicy::Immediate),
                ],
            )?;
            Ok(())
        },
    },
    Key {
        name: "graph_capture_record_stream_reuse",
        valid: "True or False",
        from_pytorch: true,
        set: |c, k, v| {
            c.graph_capture_record_stream_reuse = parse_bool(k, v)?;
            Ok(())
        },
    },
    Key {
        name: "pool",
        valid: "on or off",
        from_pytorch: false,
        set: |c, k, v| {
            c.pool = parse_bool(k, v)?;
            Ok(())
        },
    },
    Key {
        name: "torch_caching",
        valid: "async (or off), uncached or keep",
        from_pytorch: false,
        set: |c, k, v| {
            c.torch_caching = choose(
                k,
                v,
                &[
                    ("async", TorchCaching::Async),
                    ("off", TorchCaching::Async),
                    ("uncached", TorchCaching::Uncached),
                    ("keep", TorchCaching::Keep),
                ],
            )?;
            Ok(())
        },
    },
    Key {
        name: "report_cached_as_free",
        valid: "true or false",
        from_pytorch: false,
        set: |c, k, v| {
            c.report_cached_as_free = parse_bool(k, v)?;
            Ok(())
        },
    },
    Key {
        name: "trace",
        valid: "on or off",
        from_pytorch: false,
        set: |c, k, v| {
            c.trace = parse_bool(k, v)?;
            Ok(())
        },
    },
    Key {
        name: "trace_dir",
        valid: "a directory path",
        from_pytorch: false,
        set: |c, k, v| {
            if v.is_empty() {
                return Err(bad(k, v));
            }
            c.trace_dir = PathBuf::from(v);
            Ok(())
        },
    },
    Key {
        name: "trace_file_mb",
        valid: "an integer from 1 to 65536",
        from_pytorch: false,
        set: |c, k, v| {
            c.trace_file_mb = parse_int(k, v, 1, 65536)?;
            Ok(())
        },
    },
    Key {
        name: "trace_files",
        valid: "an integer from 1 to 10000",
        from_pytorch: false,
        set: |c, k, v| {
            c.trace_files = parse_int(k, v, 1, 10000)? as u32;
            Ok(())
        },
    },
    Key {
        name: "trace_mode",
        valid: "an octal file mode from 0600 to 0666, e.g. 0640 (directories get x where r is given)",
        from_pytorch: false,
        set: |c, k, v| {
            c.trace_mode = parse_file_mode(v).ok_or_else(|| bad(k, v))?;
            Ok(())
        },
    },
    Key {
        name: "stacks",
        valid: "auto, none, python, native or all",
        from_pytorch: false,
        set: |c, k, v| {
            c.stacks = choose(
                k,
                v,
                &[
                    ("auto", StackMode::Auto),
                    ("none", StackMode::None),
                    ("python", StackMode::Python),
                    ("native", StackMode::Native),
                    ("all", StackMode::All),
                ],
            )?;
            Ok(())
        },
    },
    Key {
        name: "stack_depth",
        valid: "an integer from 1 to 256",
        from_pytorch: false,
        set: |c, k, v| {
            c.stack_depth = parse_int(k, v, 1, 256)? as u32;
            Ok(())
        },
    },
    Key {
        name: "compress",
        valid: "on or off",
        from_pytorch: false,
        set: |c, k, v| {
            c.compress = parse_bool(k, v)?;
            Ok(())
        },
    },
    Key {
        name: "clock",
        valid: "auto, tsc or os",
        from_pytorch: false,
        set: |c, k, v| {
            c.clock = choose(
                k,
                v,
                &[
                    ("auto", ClockChoice::Auto),
                    ("tsc", ClockChoice::Tsc),
                    ("os", ClockChoice::Os),
                ],
            )?;
            Ok(())
        },
    },
    Key {
        name: "oom_checkpoint",
        valid: "on or off",
        from_pytorch: false,
        set: |c, k, v| {
            c.oom_checkpoint = parse_bool(k, v)?;
            Ok(())
        },
    },
    Key {
        name: "python",
        valid: "on or off",
        from_pytorch: false,
        set: |c, k, v| {
            c.python = parse_bool(k, v)?;
            Ok(())
        },
    },
    Key {
        name: "categories",
        valid: "on or off",
        from_pytorch: false,
        set: |c, k, v| {
            c.categories = parse_bool(k, v)?;
            Ok(())
        },
    },
    Key {
        name: "torch_allocator",
        valid: "on or off",
        from_pytorch: false,
        set: |c, k, v| {
            c.torch_allocator = parse_bool(k, v)?;
            Ok(())
        },
    },
    Key {
        name: "driver_doors",
        valid: "on or off",
        from_pytorch: false,
        set: |c, k, v| {
            c.driver_doors = parse_bool(k, v)?;
            Ok(())
        },
    },
    Key {
        name: "unwinder",
        valid: "auto or system",
        from_pytorch: false,
        set: |c, k, v| {
            c.system_unwinder = choose(k, v, &[("auto", false), ("system", true)])?;
            Ok(())
        },
    },
    Key {
        name: "log",
        valid: "quiet, info or debug",
        from_pytorch: false,
        set: |c, k, v| {
            c.log = choose(
                k,
                v,
                &[
                    ("quiet", LogLevel::Quiet),
                    ("info", LogLevel::Info),
                    ("debug", LogLevel::Debug),
                ],
            )?;
            Ok(())
        },
    },
];
