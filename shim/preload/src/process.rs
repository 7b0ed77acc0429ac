//! The process state machine and the operations behind every hook, in safe Rust (pointers are
//! plain addresses here; [`crate::ffi`] converts).
//!
//! States:
//!
//! * **loaded** — the constructor read the settings; nothing CUDA has happened.
//! * **pooling** — at the first CUDA call the [`Shim`] is built: driver checked, exit summary
//!   registered. Allocations are served from one [`Allocator`] per device, created at that
//!   device's first allocation.
//! * **tracing only** — `pool:off` with the trace on: allocations go to the real runtime and
//!   are recorded (each `cudaMalloc` a segment holding one block).
//! * **passthrough** — `pool:off,trace:off`, a configuration error, or (in pool mode) no usable
//!   driver: every call goes to the real runtime. Chosen once, with one message.
//! * **degraded** — an internal failure (a panic caught at the ABI) in pooling mode: new
//!   allocations pass through; frees of pooled pointers are still served by the pools.
//! * **forked child** — a child of `fork` never touches the parent's pools or locks (another
//!   parent thread may have held them at the fork): everything passes through.
//!
//! Here: the states, [`Shim`] and its per-device pools. The operations, one concept a module:
//!
//! | module | what the shim does |
//! |---|---|
//! | `allocations` | serves allocations and frees (pooled or passed through and traced), cached free bytes, empty cache, stats |
//! | `stream_lifecycle` | a stream's pool key, whether it captures, its creation and destruction |
//! | `graph_capture` | the barrier fence and the private pool at a capture's start, deferred releases at the last one's end |
//! | `recorded_streams` | `record_stream`: frees that wait for the work of a block's other streams (Note [Recorded streams]) |
//! | `private_pools` | private pools (Note [Private pools]): those of graph captures (Note [Capture pools]) and PyTorch's `MemPool`s (Note [PyTorch MemPools]) |
//! | `default_pool` | the default memory pool's statistics, peak resets and trims (PyTorch's `cudaMallocAsync` route) |
//! | `torch_profiler` | PyTorch's profiler's memory events (`profile_memory=True`), reported as the native allocator reports them |
//! | `torch_settings` | PyTorch's memory settings at run time: the memory fraction, the allocator settings, caching on or off |
//! | `backward` | the stack of the Python thread in `backward()` for the autograd engine's threads |
//! | `program_context` | what the Python integration says of the program: module scopes, phases, what blocks hold (for memory by category) |
//! | `peer_access` | peer access to pooled memory |
//! | `ipc` | pooled blocks shared with other processes, and blocks received from them (Note [IPC of pooled memory]) |
//! | `pointers` | which pooled block an address lies in ([`PooledBlock`]) |
//! | `exit` | the facts of the exit summary ([`ExitFacts`]) |

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use cachealloc_core::config::ReusePolicy;
use cachealloc_core::{Allocator, format_bytes};

use cachealloc_recorder::schema::DeviceInfo;

use crate::backend::CudaDevice;
use crate::cuda::{self, CudaError};
use crate::gpu::{self, LoadedDriver};
use crate::log;
use crate::settings;
use crate::stacks::Stacks;
use crate::streams::StreamRegistry;
use crate::trace::{DeviceObserver, Trace};

mod allocations;
mod backward;
mod default_pool;
mod exit;
mod graph_capture;
mod ipc;
mod peer_access;
mod pointers;
mod pool_snapshot;
mod private_pools;
pub mod program_context;
mod recorded_streams;
mod stream_lifecycle;
mod torch_profiler;
mod torch_settings;

pub use exit::ExitFacts;

pub use allocations::OOM_OBSERVERS;
pub use ipc::{
    IpcShare, Shared, handle_close, handle_open, ipc_close, ipc_close_shared, ipc_open,
    ipc_open_shared, ipc_release, ipc_sent_released, remove_handle_files,
};
pub use pointers::PooledBlock;
pub use private_pools::checkpoints::PoolCheckpoint;
pub use private_pools::{PoolKey, PoolSettings};
pub use torch_profiler::{TORCH_PROFILER, TorchProfiler};

/// Most devices a process can have (CUDA's own limit is lower in practice).
const MAX_DEVICES: usize = 64;

static FORKED_CHILD: AtomicBool = AtomicBool::new(false);
static SHIM: OnceLock<Option<Shim>> = OnceLock::new();

/// One device's allocator. A free finds its pool by the addresses its memory has spanned
/// ([`CudaDevice::may_contain`]), without asking the runtime for the current device.
#[derive(Debug)]
struct Pool {
    alloc: Allocator<CudaDevice, DeviceObserver>,
    /// Whether this pool was switched to fenced reuse after a stream appeared.
    fencing: AtomicBool,
}

impl Pool {
    fn new(alloc: Allocator<CudaDevice, DeviceObserver>) -> Self {
        Pool {
            alloc,
            fencing: AtomicBool::new(false),
        }
    }

    /// Whether `address` may lie in one of this pool's segments or ranges.
    fn may_contain(&self, address: u64) -> bool {
        self.alloc.device().may_contain(address)
    }
}

/// The pooling state of the process.
#[derive(Debug)]
pub struct Shim {
    /// The driver, for fences; `None` only in `pool:off` (trace only).
    driver: Option<LoadedDriver>,
    reuse: ReusePolicy,
    report_cached_as_free: bool,
    streams: Arc<StreamRegistry>,
    /// Visible devices. With exactly one, the current device is always 0 and the runtime is
    /// not asked on every call.
    device_count: usize,
    devices: Vec<OnceLock<Pool>>,
    /// Whether new allocations are pooled: false with `pool:off`, and after an internal failure.
    healthy: AtomicBool,
    /// The program turned caching off (PyTorch's `caching_allocator_enable(False)`): new
    /// allocations go to CUDA, uncounted, until it turns it back on.
    caching_off: AtomicBool,
    /// The allocator settings the program set at run time (`_set_allocator_settings`), for
    /// pools made after it (`None`: the configuration's).
    runtime_allocator: std::sync::Mutex<Option<cachealloc_core::AllocatorConfig>>,
    passthrough_mallocs: AtomicU64,
    /// Allocations passed through while the program had caching off.
    uncached_mallocs: AtomicU64,
    /// Driver-level allocations in a context that is not a device's primary one (not pooled).
    unpooled_context_mallocs: AtomicU64,
    /// Traced allocations that passed through (`pool:off`, or degraded): address → (size,
    /// device), to trace their frees.
    passthrough: std::sync::Mutex<std::collections::HashMap<u64, (u64, u32)>>,
    /// When the shim started (the first CUDA call), for annotation times.
    started: std::time::Instant,
    /// The trace, or why there is none.
    trace: Result<Arc<Trace>, String>,
    /// Stack capture, when the trace is on and `stacks` asks for (and can have) frames.
    stacks: Option<Stacks>,
    /// Default memory pools seen (`cudaDeviceGetDefaultMemPool`): `(pool, device)`.
    default_pools: std::sync::Mutex<Vec<(usize, i32)>>,
    /// The private pools of graph captures and `MemPool`s.
    private_pools: private_pools::PrivatePools,
    /// Blocks shared with other processes.
    ipc: ipc::IpcBook,
    /// Streams recorded for blocks (`record_stream`), and frees waiting for them.
    recorded: recorded_streams::RecordedStreams,
}

/// What runs at the shim's first CUDA use, set by the constructor ([`at_start`]).
static ON_START: OnceLock<fn()> = OnceLock::new();

/// Run `f` when the shim starts, at the first CUDA call (the constructor registers the exit
/// summary this way, so that this module need not know the reporter).
pub fn at_start(f: fn()) {
    let _ = ON_START.set(f);
}

/// Called in the child after `fork` (registered with `pthread_atfork` by the constructor).
pub fn after_fork_in_child() {
    crate::rare::note(crate::rare::FORKED);
    FORKED_CHILD.store(true, Ordering::Release);
}

/// The shim, built at first use; `None` in passthrough and in a forked child.
pub fn shim() -> Option<&'static Shim> {
    // A pool's own allocator (MemPool(allocator)) reaches CUDA, not our pools.
    // Note [Rare conditions in one word]: one line for both questions while neither happened.
    if crate::rare::any(crate::rare::FORKED | crate::rare::FOREIGN)
        && (FORKED_CHILD.load(Ordering::Acquire) || crate::backend::in_foreign_allocator())
    {
        return None;
    }
    SHIM.get_or_init(start).as_ref()
}

/// The shim if it has started (never starts it); `None` in a forked child.
pub fn started_shim() -> Option<&'static Shim> {
    if crate::rare::any(crate::rare::FORKED) && FORKED_CHILD.load(Ordering::Acquire) {
        return None;
    }
    SHIM.get()?.as_ref()
}

/// First CUDA call: decide between pooling, tracing only and passthrough.
fn start() -> Option<Shim> {
    let settings = settings::get();
    if settings.problem.is_some() {
        return None; // the constructor already said why
    }
    let config = &settings.config;
    if let Some(on_start) = ON_START.get() {
        on_start();
    }
    if !config.pool && !config.trace {
        log::debug!("pool:off, trace:off: passing everything through");
        return None;
    }
    // The driver is needed for fences (pooling); without it, only a trace is possible.
    let driver = match LoadedDriver::load() {
        Ok(d) => Some(d),
        Err(why) if config.pool => {
            log::error!("{why}; reuse fences are impossible, so allocations pass through unpooled");
            return None;
        }
        Err(_) => None,
    };
    let pooling = config.pool;
    if pooling {
        log::debug!("pooling with {}", config.allocator.to_conf_string());
    } else {
        log::debug!("pool:off: passing allocations through, tracing them");
    }
    let device_count = driver
        .map(gpu::device_facts::device_count)
        .filter(|&n| n > 0)
        .unwrap_or_else(crate::real::runtime::device_count);
    let slots = if device_count > 0 {
        device_count.min(MAX_DEVICES)
    } else {
        MAX_DEVICES
    };
    let trace = if config.trace {
        let devices = (0..device_count)
            .filter_map(|d| {
                let (name, total_memory) = gpu::device_facts::device_info(driver?, d as i32)?;
                Some(DeviceInfo {
                    index: d as u32,
                    name,
                    total_memory,
                })
            })
            .collect();
        Trace::start(config, devices)
            .map(Arc::new)
            .inspect_err(|why| log::error!("{why}; running without a trace"))
    } else {
        Err("trace:off".to_string())
    };
    let stacks = match &trace {
        Ok(_) => Stacks::new(
            config.stacks,
            config.stack_depth as usize,
            config.system_unwinder,
        ),
        Err(_) => None,
    };
    Some(Shim {
        trace,
        stacks,
        device_count,
        driver,
        reuse: config.allocator.reuse,
        report_cached_as_free: config.report_cached_as_free,
        streams: Arc::new(StreamRegistry::default()),
        devices: (0..slots).map(|_| OnceLock::new()).collect(),
        healthy: AtomicBool::new(pooling),
        caching_off: AtomicBool::new(false),
        runtime_allocator: std::sync::Mutex::new(None),
        passthrough_mallocs: AtomicU64::new(0),
        uncached_mallocs: AtomicU64::new(0),
        unpooled_context_mallocs: AtomicU64::new(0),
        passthrough: std::sync::Mutex::new(std::collections::HashMap::new()),
        started: std::time::Instant::now(),
        default_pools: std::sync::Mutex::new(Vec::new()),
        private_pools: private_pools::PrivatePools::default(),
        recorded: recorded_streams::RecordedStreams::new(config.graph_capture_record_stream_reuse),
        ipc: ipc::IpcBook::default(),
    })
}

/// An internal failure was caught at the ABI: stop pooling new allocations.
pub fn degrade(what: &str) {
    if let Some(Some(shim)) = SHIM.get()
        && shim.healthy.swap(false, Ordering::AcqRel)
    {
        log::error!("internal failure in {what}; new allocations now pass through unpooled");
    }
}

impl Shim {
    /// Write everything traced so far to the trace files (waiting up to `timeout`) and return
    /// the trace's directory; `None` without a trace.
    pub fn flush_trace(&self, timeout: std::time::Duration) -> Option<std::path::PathBuf> {
        let trace = self.trace.as_ref().ok()?;
        if !trace.flush(timeout) {
            log::error!("the trace could not be flushed in {timeout:?}");
        }
        Some(trace.dir.clone())
    }

    /// Record an annotation (`cachealloc_annotate`) in the trace; returns the seconds since the
    /// shim started.
    pub fn annotation(&self, name: &str) -> f64 {
        if let Ok(trace) = &self.trace {
            trace.annotation(name);
        }
        self.started.elapsed().as_secs_f64()
    }

    /// Whether new allocations are pooled: not with `pool:off` nor after an internal failure
    /// (see `Shim::healthy`), nor while the program has turned caching off.
    pub fn pooling(&self) -> bool {
        self.healthy() && !self.caching_off.load(Ordering::Relaxed)
    }

    /// Whether the shim pools at all: not with `pool:off`, nor after an internal failure.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    /// The calling thread's current device: the runtime's, or without a shared runtime (one
    /// linked statically), the current context's.
    fn current_device(&self) -> Result<i32, CudaError> {
        if self.device_count == 1 {
            return Ok(0);
        }
        if crate::real::runtime::cudaGetDevice().is_some() {
            return crate::real::runtime::current_device();
        }
        match self.driver.map(gpu::contexts::current_context) {
            Some(gpu::contexts::CurrentContext::Primary(device)) => Ok(device),
            _ => Err(cuda::ERROR_INVALID_VALUE),
        }
    }

    /// The context current on the calling thread (for the driver's door).
    pub fn current_context(&self) -> gpu::contexts::CurrentContext {
        self.driver.map_or(
            gpu::contexts::CurrentContext::None,
            gpu::contexts::current_context,
        )
    }

    /// A driver-level allocation in a context other than a device's primary one passed
    /// through: count it, and say so once.
    pub fn note_unpooled_context(&self) {
        if self
            .unpooled_context_mallocs
            .fetch_add(1, Ordering::Relaxed)
            == 0
        {
            log::info!(
                "an allocation in a context made with cuCtxCreate passes through unpooled (only \
                 the devices' primary contexts, the runtime's, are pooled)"
            );
        }
    }

    /// The pool of `device`, created at its first use.
    fn pool(&self, device: i32) -> Result<&Pool, CudaError> {
        let slot = usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
            .ok_or(cuda::ERROR_INVALID_VALUE)?;
        // Pooling is only ever on with a driver; without one, say so rather than panic.
        let driver = self.driver.ok_or(cuda::ERROR_INITIALIZATION)?;
        let pool = slot.get_or_init(|| {
            let config = self.allocator_config_now();
            let config_fraction_set = config.per_process_memory_fraction < 1.0;
            let observer = DeviceObserver {
                device: device as u32,
                trace: self.trace.as_ref().ok().cloned(),
                oom_checkpoint: settings::get().config.oom_checkpoint,
            };
            let alloc = Allocator::with_observer(
                CudaDevice::new(
                    driver,
                    device,
                    self.streams.clone(),
                    config.expandable_segments.any(),
                ),
                config,
                observer,
            );
            log::debug!(
                "device {device}: pool created, limit {}",
                format_bytes(alloc.limit())
            );
            if config_fraction_set {
                // The fraction limits the device's private pools too (backend::budget).
                crate::backend::budget::set_limit(
                    device,
                    alloc.limit(),
                    alloc.config().per_process_memory_fraction,
                    if alloc.config().fraction_counts_synchronous {
                        crate::backend::budget::Scope::Everything
                    } else {
                        crate::backend::budget::Scope::PyTorch
                    },
                );
            }
            Pool::new(alloc)
        });
        // A stream created while this pool was being built: fence now (once).
        if self.streams.any_created() && !pool.fencing.load(Ordering::Acquire) {
            self.start_fencing_on(pool);
        }
        Ok(pool)
    }

    fn start_fencing_on(&self, pool: &Pool) {
        if pool.fencing.swap(true, Ordering::AcqRel) {
            return;
        }
        if self.reuse == ReusePolicy::Auto
            && let Err(e) = pool.alloc.start_fencing()
        {
            log::error!("could not fence cached blocks at the first stream: {e}");
        }
    }

    /// Pools that exist.
    fn pools(&self) -> impl Iterator<Item = &Pool> {
        self.devices.iter().filter_map(|slot| slot.get())
    }

    /// Allocators that exist.
    fn allocators(&self) -> impl Iterator<Item = &Allocator<CudaDevice, DeviceObserver>> {
        self.devices
            .iter()
            .filter_map(|slot| slot.get())
            .map(|p| &p.alloc)
    }

    /// The calling thread's stack id for an allocation record, or 0: no stacks configured, or
    /// shed because the trace's channel is congested (stacks are the one payload the recorder
    /// may drop under overload; the count goes into the trace's `Dropped` records).
    fn capture_stack(&self) -> u32 {
        let (Some(stacks), Ok(trace)) = (&self.stacks, &self.trace) else {
            return 0;
        };
        // Either pause: one read of the rare conditions' word, which holds both switches.
        if crate::rare::any(crate::rare::STACKS_PAUSED | crate::rare::TRACE_PAUSED) {
            return 0;
        }
        if trace.congested() {
            trace.note_stack_shed();
            return 0;
        }
        stacks.capture(trace)
    }

    /// The current device's context was reset: forget its pools (their memory is gone).
    pub fn device_reset(&self) {
        if let Ok(device) = self.current_device() {
            self.device_reset_of(device);
        }
    }

    /// `device`'s primary context was reset: forget its pools (their memory is gone).
    pub fn device_reset_of(&self, device: i32) {
        gpu::contexts::forget_primary_context(device);
        crate::backend::budget::forget_held(device);
        if let Some(alloc) = self.allocator_of(device) {
            alloc.forget_all();
            alloc.device().forget_mappings();
            log::debug!("device {device} was reset: its pools were forgotten");
        }
    }

    /// Switch the calling thread to `device` for the duration of `f` (the PyTorch pluggable
    /// allocator names the device explicitly).
    pub fn on_device<T>(&self, device: i32, f: impl FnOnce() -> T) -> Result<T, CudaError> {
        let current = self.current_device()?;
        if current == device {
            return Ok(f());
        }
        let code = crate::real::runtime::set_device(device);
        if code != cuda::SUCCESS {
            return Err(code);
        }
        let result = f();
        crate::real::runtime::set_device(current); // back to the caller's device
        Ok(result)
    }

    /// The allocator of `device`, if it exists.
    pub(super) fn allocator_of(
        &self,
        device: i32,
    ) -> Option<&Allocator<CudaDevice, DeviceObserver>> {
        let slot = self.devices.get(usize::try_from(device).ok()?)?;
        slot.get().map(|p| &p.alloc)
    }
}
