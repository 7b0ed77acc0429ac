//! [`Vmm`]: CUDA's virtual memory API behind expandable segments — `cuMemAddressReserve` for a
//! range, `cuMemCreate` + `cuMemMap` + `cuMemSetAccess` to back granules of it with memory,
//! `cuMemUnmap` to give them back (see
//! [Note [Expandable segments]](cachealloc_core::pools::expandable#note-expandable-segments)).
//!
//! Each map is one physical allocation of its size and one mapping; the allocator unmaps only
//! whole mappings (the driver allows nothing less). The calls cost about the same for 2 MiB as
//! for 1 GiB, so one mapping per granule, as PyTorch makes, would make big maps slow. The
//! allocation's handle is released right after it is mapped; the driver keeps the memory while
//! it is mapped and frees it at the unmap, so no handle needs keeping.
//!
//! # Note [Peer access to mapped memory]
//!
//! Memory from `cudaMalloc` is readable by every device that enabled peer access to its device
//! (`cudaDeviceEnablePeerAccess`, `cuCtxEnablePeerAccess`), and the driver's pool memory by the
//! devices given access to the pool (`cudaMemPoolSetAccess`: PyTorch's way on its
//! `cudaMallocAsync` route); mapped memory only by the devices `cuMemSetAccess` named. So that
//! expandable segments behave like the memory they stand in for, each map grants access to its
//! own device and to every device that was given access to its device's memory either way so
//! far ([`PEER_ACCESS`]), and when a device is, [`Vmm::grant`] gives it access to everything
//! already mapped (the shim's `process/peer_access.rs` calls it).
//! [`Vmm`] keeps its own list of the driver's mappings (`mappings`: every place, the parked ones
//! of moved memory too, which flip back into use with no driver call), under a lock that a map
//! holds from recording its mappings through its `cuMemSetAccess` and a grant holds throughout:
//! a map either sees the new peer or is seen by the grant (or both, which is harmless), and an
//! unmap leaves the list before the driver unmaps, so no grant touches memory going away.
//! Access once granted stays: disabling peer access revokes nothing (PyTorch's expandable
//! segments do the same).
//!
//! Memory moves (see [Note [Moving memory instead of unmapping
//! it]](cachealloc_core::pools::expandable::moves#note-moving-memory-instead-of-unmapping-it)) by
//! `cuMemRetainAllocationHandle` on its present place and `cuMemMap` of that handle at the new
//! one: the same memory at two places, each unmapped on its own; the driver frees the memory
//! with its last mapping.
//!
//! Memory is made exportable as POSIX file descriptors where the device says it can be
//! (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`), so that a block of an
//! expandable segment can be shared with another process ([`Vmm::export`]; see Note [IPC of
//! pooled memory] in the shim's `process::ipc`). Where a creation asking for it fails, the
//! device's later memory is made without, and cannot be shared ([`Vmm::export`] says why).
//!
//! The caller runs every method with the device's primary context current, and makes sure no
//! kernel still uses what it unmaps (unlike `cudaFree`, `cuMemUnmap` does not wait for them).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cachealloc_core::DeviceError;
use cudarc::driver::sys;

use crate::cuda::driver::{CuResult, ERROR_OUT_OF_MEMORY, SUCCESS};
use crate::real::driver::{self as real_driver, call_driver};

/// Devices this process gave peer access to each device's memory: bit `a` of entry `d` is set
/// once device `a` enabled peer access to device `d` (see [Note [Peer access to mapped
/// memory]](self#note-peer-access-to-mapped-memory)). Process-wide, as the driver's peer access
/// is.
static PEER_ACCESS: [AtomicU64; 64] = [const { AtomicU64::new(0) }; 64];

/// Note that `accessor` enabled peer access to `owner`'s memory. True the first time (the
/// caller then grants it what `owner` already has mapped,
/// [`CudaDevice::grant_peer`](crate::backend::CudaDevice::grant_peer)).
pub fn note_peer_access(owner: i32, accessor: i32) -> bool {
    let (Ok(o), Ok(a)) = (usize::try_from(owner), u32::try_from(accessor)) else {
        return false;
    };
    let (Some(entry), true) = (PEER_ACCESS.get(o), a < 64 && owner != accessor) else {
        return false;
    };
    let bit = 1u64 << a;
    entry.fetch_or(bit, Ordering::AcqRel) & bit == 0
}

/// The devices that may use `owner`'s memory: itself and its peers.
fn accessors(owner: i32) -> impl Iterator<Item = i32> {
    let peers = usize::try_from(owner)
        .ok()
        .and_then(|o| PEER_ACCESS.get(o))
        .map_or(0, |entry| entry.load(Ordering::Acquire));
    std::iter::once(owner).chain((0..64).filter(move |a| peers & (1 << a) != 0))
}

/// Read and write access to memory of `owner` for every device that may use it (itself and the
/// peers noted so far): what memory mapped for `owner` is given, received memory too.
pub fn access_for_accessors(owner: i32) -> Vec<sys::CUmemAccessDesc> {
    accessors(owner).map(access_for).collect()
}

/// Read and write access for `device`.
pub fn access_for(device: i32) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// CUDA's virtual memory on one device.
#[derive(Debug)]
pub struct Vmm {
    ordinal: i32,
    granularity: u64,
    /// Every mapping the driver holds for us on this device, start → size: the places of new
    /// memory and of moved memory, parked ones included (for [`Vmm::grant`]).
    mappings: Mutex<BTreeMap<u64, u64>>,
    /// The file descriptor of each mapping (by start) exported for shares some of which are
    /// still held: a later share of memory under the same mapping sends the same descriptor
    /// instead of exporting the memory again (Note [IPC of pooled memory]). Locked after
    /// `mappings`; a mapping's entry goes when it is unmapped.
    exports: Mutex<HashMap<u64, Weak<OwnedFd>>>,
    /// Whether new memory is made exportable as a POSIX file descriptor (for IPC).
    shareable: AtomicBool,
    /// Why it is not, once it is not.
    unshareable: OnceLock<String>,
}

/// The memory mapped over a block, exported for another process
/// ([`CudaDevice::export_mapped`](crate::backend::CudaDevice::export_mapped)).
#[derive(Debug)]
pub struct Exported {
    /// The device.
    pub device: i32,
    /// Where the first mapping over the block starts.
    pub start: u64,
    /// Each mapping from `start` on, in address order, adjacent: its size and its memory's
    /// file descriptor (shared by the shares held of memory under that mapping; closed with the
    /// last of them).
    pub chunks: Vec<(u64, Arc<OwnedFd>)>,
}

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
pub const HANDLE_TYPE_POSIX_FD: u32 = 1;

impl Vmm {
    /// The device's virtual memory, or why it has none (an old driver or a device without
    /// virtual address management).
    pub fn probe(ordinal: i32) -> Result<Vmm, String> {
        let mut supported = 0;
        // SAFETY: valid out-pointer; attribute 102 is
        // CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED, an int.
        let code = call_driver!(cuDeviceGetAttribute(
            &mut supported,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED
                as i32,
            ordinal
        ));
        if code != SUCCESS || supported == 0 {
            return Err(format!(
                "device {ordinal} has no virtual memory management (cuDeviceGetAttribute: {code}, \
                 supported: {supported})"
            ));
        }
        let mut fd_supported = 0;
        // SAFETY: valid out-pointer; the attribute is an int.
        let code = call_driver!(cuDeviceGetAttribute(
            &mut fd_supported,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
                as i32,
            ordinal
        ));
        let shareable = code == SUCCESS && fd_supported != 0;
        let unshareable = OnceLock::new();
        if !shareable {
            let _ = unshareable.set(format!(
                "device {ordinal} cannot export its memory as POSIX file descriptors \
                 (cuDeviceGetAttribute(HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED): {code}, \
                 supported: {fd_supported})"
            ));
        }
        let mut granularity = 0usize;
        let prop = allocation_prop(ordinal, shareable);
        // SAFETY: valid out-pointer and property struct (cuda.h's layout, from cudarc); 0 is
        // CU_MEM_ALLOC_GRANULARITY_MINIMUM.
        let code = call_driver!(cuMemGetAllocationGranularity(&mut granularity, &prop, 0));
        if code != SUCCESS || granularity == 0 || !granularity.is_multiple_of(512) {
            return Err(format!(
                "cuMemGetAllocationGranularity on device {ordinal}: {code}, granularity \
                 {granularity}"
            ));
        }
        Ok(Vmm {
            ordinal,
            granularity: granularity as u64,
            mappings: Mutex::new(BTreeMap::new()),
            exports: Mutex::new(HashMap::new()),
            shareable: AtomicBool::new(shareable),
            unshareable,
        })
    }

    /// The driver's allocation granularity on this device.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// Reserve `size` bytes of address space.
    pub fn reserve(&self, size: u64) -> Result<u64, DeviceError> {
        let mut address = 0;
        // SAFETY: valid out-pointer; size and alignment are multiples of the granularity (the
        // allocator's geometry); no fixed address, no flags.
        let code = call_driver!(cuMemAddressReserve(
            &mut address,
            size as usize,
            self.granularity as usize,
            0,
            0
        ));
        match code {
            SUCCESS => Ok(address),
            ERROR_OUT_OF_MEMORY => Err(DeviceError::OutOfMemory),
            other => Err(error(other, "cuMemAddressReserve")),
        }
    }

    /// Give back a reserved range with nothing mapped in it.
    pub fn free_range(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        // SAFETY: a range `reserve` returned, with nothing mapped in it (the allocator's
        // contract).
        check(
            call_driver!(cuMemAddressFree(address, size as usize)),
            "cuMemAddressFree",
        )
    }

    /// Back `[address, address + size)` (whole granules of a reserved range, not mapped) with
    /// new memory of this device, readable and writable by it: one physical allocation, one
    /// mapping. On failure nothing stays mapped.
    pub fn map(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.map_run(&[(address, size)])
    }

    /// Make the adjacent `mappings` (address order; each whole granules of a reserved range,
    /// not mapped), each one physical allocation, then grant this device access to the whole
    /// run in one `cuMemSetAccess` (one call, but the driver still charges about 30 µs per
    /// mapping it covers on an H200: `scripts/gpu/map_parts.cu`). On failure nothing stays
    /// mapped.
    pub fn map_run(&self, mappings: &[(u64, u64)]) -> Result<(), DeviceError> {
        self.map_with_moves(&[], mappings)
    }

    /// Whether memory can be mapped at a second place (the driver has
    /// `cuMemRetainAllocationHandle`, CUDA 11.0 and later).
    pub fn can_alias(&self) -> bool {
        real_driver::cuMemRetainAllocationHandle().is_some()
    }

    /// Make a map's memory: the `moves` (`(from, to, size)`: the memory of the mapping at
    /// `from` mapped at `to` as well), then the new `mappings`, all adjacent in address order,
    /// then grant this device and its peers access to the whole run in one `cuMemSetAccess`.
    /// On failure nothing of it stays mapped.
    pub fn map_with_moves(
        &self,
        moves: &[(u64, u64, u64)],
        mappings: &[(u64, u64)],
    ) -> Result<(), DeviceError> {
        let run: Vec<(u64, u64)> = (moves.iter().map(|&(_, to, size)| (to, size)))
            .chain(mappings.iter().copied())
            .collect();
        let (Some(&(start, _)), Some(&(last, last_size))) = (run.first(), run.last()) else {
            return Ok(());
        };
        for (i, &(from, to, size)) in moves.iter().enumerate() {
            if let Err(e) = self.map_again(from, to, size) {
                self.unmap_all(&run[..i]);
                return Err(e);
            }
        }
        for (i, &(address, size)) in mappings.iter().enumerate() {
            if let Err(e) = self.back(address, size) {
                self.unmap_all(&run[..moves.len() + i]);
                return Err(e);
            }
        }
        // Recorded and given access under one lock, against a peer's grant (see the Note).
        let mut mapped = self.mappings.lock().unwrap_or_else(|p| p.into_inner());
        let access: Vec<sys::CUmemAccessDesc> = accessors(self.ordinal).map(access_for).collect();
        let length = (last + last_size - start) as usize;
        // SAFETY: the run is mapped throughout (just above), by whole mappings; `access` holds
        // `access.len()` valid descriptors.
        let code = call_driver!(cuMemSetAccess(start, length, access.as_ptr(), access.len()));
        if let Err(e) = check(code, "cuMemSetAccess") {
            drop(mapped);
            self.unmap_all(&run);
            return Err(e);
        }
        mapped.extend(run.iter().copied());
        Ok(())
    }

    /// Forget every mapping (the device was reset: the driver dropped them with its context).
    pub fn forget_mappings(&self) {
        let mut mapped = self.mappings.lock().unwrap_or_else(|p| p.into_inner());
        mapped.clear();
        self.exports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Give `peer` access to everything mapped on this device (it just enabled peer access to
    /// it; see [Note [Peer access to mapped memory]](self#note-peer-access-to-mapped-memory)):
    /// one `cuMemSetAccess` per run of adjacent mappings, or per mapping of a run the driver
    /// refuses whole. Returns how many mappings could not be granted.
    pub fn grant(&self, peer: i32) -> usize {
        let mapped = self.mappings.lock().unwrap_or_else(|p| p.into_inner());
        let access = access_for(peer);
        let set_access = |start: u64, end: u64| {
            // SAFETY: `[start, end)` is whole live mappings of ours (the list is the driver's,
            // and no unmap can start while we hold it); one valid descriptor.
            call_driver!(cuMemSetAccess(start, (end - start) as usize, &access, 1)) == SUCCESS
        };
        let mut failed = 0;
        for (start, end) in runs(&mapped) {
            if !set_access(start, end) {
                failed += (mapped.range(start..end))
                    .filter(|&(&address, &size)| !set_access(address, address + size))
                    .count();
            }
        }
        failed
    }

    /// Map the memory of the whole mapping at `from` (`size` bytes) at `to` too, with no access
    /// yet.
    fn map_again(&self, from: u64, to: u64, size: u64) -> Result<(), DeviceError> {
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer; `from` is the start of a live mapping of ours.
        let code = call_driver!(cuMemRetainAllocationHandle(
            &mut handle,
            from as *mut std::ffi::c_void
        ));
        check(code, "cuMemRetainAllocationHandle")?;
        // SAFETY: unmapped whole granules of a reserved range, and a live handle of that size
        // (the whole memory of the mapping at `from`); offset and flags 0.
        let code = call_driver!(cuMemMap(to, size as usize, 0, handle, 0));
        // The retained reference is not needed either way: the mappings keep the memory.
        release_handle(handle);
        check(code, "cuMemMap")
    }

    /// Map one physical allocation of `size` bytes at `address`, with no access yet.
    fn back(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        let create = |shareable: bool, handle: &mut sys::CUmemGenericAllocationHandle| {
            let prop = allocation_prop(self.ordinal, shareable);
            // SAFETY: valid out-pointer and property struct; the size is whole granules.
            call_driver!(cuMemCreate(handle, size as usize, &prop, 0))
        };
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        let shareable = self.shareable.load(Ordering::Relaxed);
        let mut code = create(shareable, &mut handle);
        if shareable && code != SUCCESS && code != ERROR_OUT_OF_MEMORY {
            // Memory that cannot be exported is still memory: made without, never shared.
            let why = format!(
                "cuMemCreate asking for a POSIX file descriptor handle on device {} returned \
                 {code}",
                self.ordinal
            );
            crate::log::info!(
                "{why}; its expandable segments cannot be shared with other processes"
            );
            let _ = self.unshareable.set(why);
            self.shareable.store(false, Ordering::Relaxed);
            code = create(false, &mut handle);
        }
        match code {
            SUCCESS => {}
            ERROR_OUT_OF_MEMORY => return Err(DeviceError::OutOfMemory),
            other => return Err(error(other, "cuMemCreate")),
        }
        // SAFETY: unmapped whole granules of a reserved range, and a live handle of that size;
        // offset and flags 0.
        let code = call_driver!(cuMemMap(address, size as usize, 0, handle, 0));
        // The driver keeps the memory while it is mapped: the handle is not needed either way.
        release_handle(handle);
        check(code, "cuMemMap")
    }

    /// Undo mappings just made (nothing uses them).
    fn unmap_all(&self, mappings: &[(u64, u64)]) {
        for &(address, size) in mappings {
            let _ = self.unmap(address, size);
        }
    }

    /// Unmap one whole mapping `map_with_moves` made (its memory goes back to the device with
    /// its last mapping). The caller made sure no kernel uses it any more (see
    /// `Device::unmap`).
    pub fn unmap(&self, address: u64, size: u64) -> Result<(), DeviceError> {
        // Off the list first, so that no grant touches it while it goes (see the Note).
        let mut mapped = self.mappings.lock().unwrap_or_else(|p| p.into_inner());
        mapped.remove(&address);
        // The next memory mapped here is other memory: never sent under this one's descriptor.
        (self.exports.lock().unwrap_or_else(|p| p.into_inner())).remove(&address);
        drop(mapped);
        // SAFETY: `[address, address + size)` is exactly one mapping `map_with_moves` made.
        let result = check(
            call_driver!(cuMemUnmap(address, size as usize)),
            "cuMemUnmap",
        );
        if result.is_err() {
            // Still mapped: still to be granted.
            let mut mapped = self.mappings.lock().unwrap_or_else(|p| p.into_inner());
            mapped.insert(address, size);
        }
        result
    }
}

impl Vmm {
    /// Export the memory mapped over `[address, address + size)` (a live block of ours) for
    /// another process: each mapping that overlaps it, from the first on, as a POSIX file
    /// descriptor of its physical memory (see Note [IPC of pooled memory] in the shim's
    /// `process::ipc`). The block's memory stays mapped while it lives, so the mappings found
    /// cannot go while they are exported. A mapping whose descriptor a held share still has is
    /// not exported again: the share gets that descriptor.
    pub fn export(&self, address: u64, size: u64) -> Result<Exported, String> {
        let mapped = self.mappings.lock().unwrap_or_else(|p| p.into_inner());
        let mut exports = self.exports.lock().unwrap_or_else(|p| p.into_inner());
        let end = address.saturating_add(size.max(1));
        let start = match mapped.range(..=address).next_back() {
            Some((&start, &len)) if start + len > address => start,
            _ => return Err(format!("{address:#x} is not mapped memory of ours")),
        };
        let mut chunks = Vec::new();
        let mut at = start;
        while at < end {
            let Some(&len) = mapped.get(&at) else {
                return Err(format!(
                    "the memory under {address:#x} is not mapped at {at:#x}"
                ));
            };
            let fd = match exports.get(&at).and_then(Weak::upgrade) {
                Some(fd) => fd,
                None => {
                    let fd = Arc::new(self.export_one(at)?);
                    exports.insert(at, Arc::downgrade(&fd));
                    fd
                }
            };
            chunks.push((len, fd));
            at += len;
        }
        Ok(Exported {
            device: self.ordinal,
            start,
            chunks,
        })
    }

    /// A POSIX file descriptor of the memory of the mapping at `at`.
    fn export_one(&self, at: u64) -> Result<OwnedFd, String> {
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer; `at` is the start of a live mapping of ours.
        let code = call_driver!(cuMemRetainAllocationHandle(
            &mut handle,
            at as *mut std::ffi::c_void
        ));
        if code != SUCCESS {
            return Err(format!(
                "cuMemRetainAllocationHandle({at:#x}) returned {code}"
            ));
        }
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for a POSIX file descriptor the out-pointer is an int's; `handle` is live
        // (retained just above); no flags.
        let code = call_driver!(cuMemExportToShareableHandle(
            (&raw mut fd).cast(),
            handle,
            HANDLE_TYPE_POSIX_FD,
            0
        ));
        release_handle(handle);
        if code != SUCCESS || fd < 0 {
            return Err(match self.unshareable.get() {
                Some(why) => format!(
                    "its memory was made without a shareable handle ({why}); \
                     cuMemExportToShareableHandle returned {code}"
                ),
                None => format!("cuMemExportToShareableHandle returned {code}"),
            });
        }
        // SAFETY: the driver just opened `fd` for us; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // Not inherited by programs this process starts (they would keep the memory alive).
        // SAFETY: F_SETFD on a descriptor we own, with a valid flag.
        let _ = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
        Ok(fd)
    }
}

/// The runs of adjacent mappings in `mappings` (start → size), as `(start, end)`.
fn runs(mappings: &BTreeMap<u64, u64>) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (&start, &size) in mappings {
        match runs.last_mut() {
            Some((_, end)) if *end == start => *end = start + size,
            _ => runs.push((start, start + size)),
        }
    }
    runs
}

/// Release an allocation handle (a failure leaks at most one granule, and is not actionable).
fn release_handle(handle: sys::CUmemGenericAllocationHandle) {
    // SAFETY: `handle` came from cuMemCreate or cuMemRetainAllocationHandle, and each such
    // reference is released once.
    let _ = call_driver!(cuMemRelease(handle));
}

/// Pinned device memory on `ordinal`, exportable as a POSIX file descriptor if `shareable`.
fn allocation_prop(ordinal: i32, shareable: bool) -> sys::CUmemAllocationProp {
    let handle_types = if shareable { HANDLE_TYPE_POSIX_FD } else { 0 };
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType_enum(handle_types),
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

fn check(code: CuResult, what: &str) -> Result<(), DeviceError> {
    match code {
        SUCCESS => Ok(()),
        other => Err(error(other, what)),
    }
}

fn error(code: CuResult, what: &str) -> DeviceError {
    DeviceError::Other {
        code: code.0,
        message: format!("{what} returned {code}"),
    }
}
