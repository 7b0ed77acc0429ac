//! PyTorch's profiler's memory events under the shim: what `torch.profiler.profile(
//! profile_memory=True)`, its memory timeline (`export_memory_timeline`) and the snapshot made
//! from a profile (`_profile_to_snapshot`) are built from.
//!
//! PyTorch's native allocator tells the profiler of every allocation and free as it happens
//! (`c10::reportMemoryUsageToProfiler`: the block, its size, the device's allocated and reserved
//! bytes) and of every allocation that runs out of memory (`reportOutOfMemoryToProfiler`), on
//! the thread that allocates, while an operator's record is open. Its `cudaMallocAsync` backend,
//! which the shim runs under, tells it nothing: a profile of a program under the shim would
//! have no CUDA memory at all. So the Python integration hands the library c10's three
//! functions (found by their C++ names in `libc10.so`, [`TORCH_PROFILER`], set through the C
//! API), and the shim reports as the native allocator does: after serving an allocation (its
//! block's size, as natively), after a program's free (not the later release of a free that
//! waited for recorded streams: the program freed it then), and on running out of memory, with
//! the device's totals over all its pools. While no profiler records memory, each of these
//! costs one call of c10's `memoryProfilingEnabled` (a thread-local read).

use std::sync::OnceLock;

use super::Shim;

/// c10's profiler functions, as the C API wraps them (this module calls no foreign code).
#[derive(Clone, Copy, Debug)]
pub struct TorchProfiler {
    /// Whether a profiler on the calling thread records memory (`memoryProfilingEnabled`).
    pub enabled: fn() -> bool,
    /// `reportMemoryUsageToProfiler`: the block's address, its bytes (negative for a free), the
    /// device's allocated and reserved bytes, the device.
    pub usage: fn(address: u64, bytes: i64, allocated: u64, reserved: u64, device: i32),
    /// `reportOutOfMemoryToProfiler`: the request's bytes, the device's allocated and reserved
    /// bytes, the device.
    pub out_of_memory: fn(bytes: i64, allocated: u64, reserved: u64, device: i32),
}

/// The profiler functions, once the Python integration has found them.
pub static TORCH_PROFILER: OnceLock<TorchProfiler> = OnceLock::new();

impl Shim {
    /// The profiler functions, while a profiler on this thread records memory.
    #[inline]
    pub(super) fn memory_profiler(&self) -> Option<&'static TorchProfiler> {
        if !crate::rare::any(crate::rare::PROFILER) {
            return None; // Note [Rare conditions in one word]
        }
        TORCH_PROFILER.get().filter(|p| (p.enabled)())
    }

    /// Tell `profiler` of the block served at `address` of `device`.
    pub(super) fn profile_alloc(&self, profiler: &TorchProfiler, device: i32, address: u64) {
        if let Some((_, size)) = self.live_block(address) {
            let (allocated, reserved) = self.device_totals(device);
            (profiler.usage)(address, size as i64, allocated, reserved, device);
        }
    }

    /// Tell `profiler` that the program freed `block` (its device and size) at `address`.
    pub(super) fn profile_free(&self, profiler: &TorchProfiler, address: u64, block: (i32, u64)) {
        let (device, size) = block;
        let (allocated, reserved) = self.device_totals(device);
        (profiler.usage)(address, -(size as i64), allocated, reserved, device);
    }

    /// Tell `profiler` that a request of `size` bytes on `device` ran out of memory.
    pub(super) fn profile_out_of_memory(&self, profiler: &TorchProfiler, device: i32, size: u64) {
        let (allocated, reserved) = self.device_totals(device);
        (profiler.out_of_memory)(size as i64, allocated, reserved, device);
    }

    /// `device`'s allocated and reserved bytes over all its pools, as PyTorch counts them.
    fn device_totals(&self, device: i32) -> (u64, u64) {
        self.pytorch_device_stats(device).map_or((0, 0), |s| {
            (
                s.allocated_bytes.all.current.max(0) as u64,
                s.reserved_bytes.all.current.max(0) as u64,
            )
        })
    }
}
