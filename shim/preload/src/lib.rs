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
//! | module | what |
//! |---|---|
//! | [`ffi`] | every exported symbol: the interposed CUDA calls and the C API, and the constructor, fork and exit callbacks (the only module the C ABI touches); `ffi::driver`: the driver functions; `ffi::entry_points`: `dlsym` and the entry-point resolvers |
//! | [`doors`] | the four ways into CUDA's allocation functions (runtime, driver symbols, `dlsym`, `cuGetProcAddress`) and how lookups are substituted |
//! | [`hooks`] | what each interposed call does: pool or pass through; `hooks::driver` for the driver's |
//! | [`process`] | the process state machine (loaded, pooling, passthrough, degraded, forked child), per-device allocators; `process::stream_api`: stream keys, graph captures, the default memory pool, backward stacks |
//! | [`report`] | the exit summary (from the plain facts `process` gathers), annotations, the stats JSON |
//! | [`settings`] | the configuration, read once by the constructor; how PyTorch's tensors reach the pools |
//! | [`python_integration`] | in a Python process, `shim/python/` first on `PYTHONPATH` |
//! | [`backend`] | the real device behind `cachealloc-core`'s `Device` trait |
//! | [`driver`] | the driver through cudarc: reuse fences (CUDA events), contexts, devices |
//! | [`streams`] | the application's streams, for fences and `reuse:auto` |
//! | [`trace`] | the trace: directory, header, allocator events as records |
//! | [`stacks`] | stack capture (native and Python) and interning |
//! | [`real`] | the real runtime functions, found at first use |
//! | [`real_driver`] | libcuda's own functions, found with the real `dlsym` |
//! | [`cuda`] | CUDA ABI constants and types |
//! | [`log`] | stderr messages |
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
pub mod doors;
pub mod driver;
pub mod ffi;
pub mod hooks;
pub mod log;
pub mod process;
pub mod python_integration;
pub mod real;
pub mod real_driver;
pub mod report;
pub mod settings;
pub mod stacks;
pub mod streams;
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
