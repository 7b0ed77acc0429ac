//! Integration tests of `cachealloc-core`, one binary:
//!
//! * `common`      — presets (the configs every suite runs over) and a checked allocator
//!   wrapper that runs `check_invariants()` after every operation;
//! * `rules`       — size classes, pool choice, split and merge at their edges;
//! * `fences`      — reuse fences: no reuse before the fence, gating at the first stream;
//! * `oom`         — the out-of-memory ladder and the report's figures;
//! * `conformance` — one scenario suite instantiated for every preset;
//! * `streams`     — stream-ordered reuse: blocks per stream, fences only where needed;
//! * `expandable`  — expandable segments: mapping, unmapping, ranges per stream;
//! * `expandable_waits` — when expandable segments wait for the device (unmaps, recycling);
//! * `kept_maps`   — a private pool's expandable segments: PyTorch's pages, nothing given
//!   back until `empty_cache`, checkpoints of mapped runs;
//! * `properties`  — proptest: random sequences against a naive model.

mod checkpoints;
mod common;
mod conformance;
mod expandable;
mod expandable_waits;
mod fences;
mod kept_maps;
mod oom;
mod properties;
mod rules;
mod streams;
