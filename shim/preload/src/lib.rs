//! `libcachealloc.so`: preload it and every `cudaMalloc`/`cudaFree` of the process is served from
//! cachealloc's caching pools, with no code change:
//!
//! ```text
//! LD_PRELOAD=/path/libcachealloc.so python train.py
//! CACHEALLOC_CONF="max_split_size_mb:256" LD_PRELOAD=/path/libcachealloc.so ./my_cuda_app
//! ```
//!
//! # Where things are
//!
//! A call from the application comes in at [`ffi`], is decided in [`hooks`], served by
//! [`process`], and reaches CUDA through [`real`] (the real functions) or [`gpu`] (the shim's
//! own driver calls). [`symbols`] decides which function a caller gets in the first place.
//!
//! | module | what |
//! |---|---|
//! | [`ffi`] | the C ABI: every exported symbol — `ffi::runtime` (`cudaMalloc` …), `ffi::driver` (`cuMemAlloc_v2` …), `ffi::entry_points` (`dlsym`, `cuGetProcAddress*`, the table of wrapped driver functions), `ffi::c_api` (`cachealloc_*`) — and the constructor, fork and exit callbacks |
//! | [`symbols`] | symbol resolution: the four doors into CUDA's allocation functions, substitution of our wrappers, the real `dlsym`, our handle of libcuda, and whether a driver call goes to our hooks or straight to the driver |
//! | [`hooks`] | what each interposed call does, pool or pass through: `hooks::runtime`, `hooks::driver` |
//! | [`process`] | the process state machine (loaded, pooling, passthrough, degraded, forked child), per-device allocators, and the operations behind the hooks |
//! | [`report`] | the exit summary, annotations, the stats JSON |
//! | [`settings`] | the configuration, read once by the constructor; how PyTorch's tensors reach the pools |
//! | [`python_integration`] | in a Python process, `shim/python/` first on `PYTHONPATH` |
//! | [`backend`] | the real device behind `cachealloc-core`'s `Device` trait (segments, fences, virtual memory) |
//! | [`gpu`] | the shim's own driver calls through cudarc: `gpu::contexts` (the primary-context table), `gpu::fences` (reuse fences), `gpu::capture_mode` (relaxed capture), `gpu::device_facts` |
//! | [`ipc_counters`] | reference counters in shared memory for blocks shared with other processes |
//! | [`streams`] | the application's streams, for fences and `reuse:auto` |
//! | [`trace`] | the trace: directory, header, allocator events as records |
//! | [`stacks`] | stack capture (native and Python) and interning |
//! | [`real`] | the real functions, found at first use: `real::runtime` (libcudart's), `real::driver` (libcuda's) |
//! | [`cuda`] | CUDA ABI constants and types, and the two error spaces |
//! | [`log`] | stderr messages |
//!
//! "Driver" alone always means the CUDA driver API (`cu*`), as against the runtime (`cuda*`).
//!
//! The allocator itself — size classes, split and merge, reuse fences, the OOM ladder — is
//! `cachealloc-core`, pure Rust and tested without a GPU; this crate is the thin, unsafe layer
//! between it and the CUDA ABI.
//!
//! # Guarantees
//!
//! * Nothing CUDA happens at load time; the constructor only reads the configuration and, in pool
//!   mode, selects PyTorch's `backend:cudaMallocAsync` (unless the user chose a backend, or
//!   `torch_caching` says otherwise) and, in a Python process, puts the Python integration on
//!   `PYTHONPATH` (unless `python:off`).
//! * A freed block is not handed out again before GPU work enqueued before its free, on any
//!   stream the application created through the runtime or the driver, has finished
//!   (`reuse:auto`, the default, knows all work is on one stream until the first stream is
//!   created; a block freed in its own stream's order is reused at once on that stream). The
//!   design of the whole, with these promises: `docs/design.md` in the repository.
//! * A pointer we did not hand out goes to the real `cudaFree`; a double free or an interior
//!   pointer is reported and refused with `cudaErrorInvalidValue`, changing nothing.
//! * No panic crosses the C ABI: an internal failure degrades to passthrough with one message.
//! * A forked child never touches the parent's pools or locks.

pub mod backend;
pub mod cuda;
pub mod ffi;
pub mod gpu;
pub mod hooks;
pub mod ipc_counters;
pub mod log;
pub mod process;
pub mod python_integration;
pub mod rare;
pub mod real;
pub mod report;
pub mod settings;
pub mod stacks;
pub mod streams;
pub mod symbols;
pub mod trace;

/// The NUL-terminated name of an identifier, as a `&'static CStr`.
#[macro_export]
macro_rules! cstr_of {
    ($name:ident) => {
        const {
            match std::ffi::CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                Ok(name) => name,
                Err(_) => panic!("an identifier has no NUL"),
            }
        }
    };
}
