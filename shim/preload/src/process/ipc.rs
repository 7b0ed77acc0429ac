//! Sharing pooled memory with other processes: PyTorch's CUDA tensors sent through
//! `torch.multiprocessing`.
//!
//! # Note [IPC of pooled memory]
//!
//! CUDA shares device memory between processes by *segment*: `cudaIpcGetMemHandle` names a
//! whole `cudaMalloc` allocation from its base, and the other process maps all of it. PyTorch's
//! native allocator sends a tensor's block as (its segment's handle, the block's offset in it),
//! with a reference counter in shared memory so that the block is not reused while the other
//! process holds it. Its `cudaMallocAsync` backend shares nothing; the Python integration
//! replaces `UntypedStorage._share_cuda_`, `_new_shared_cuda` and `_release_ipc_counter_cuda`
//! with calls into the C API (`cachealloc_ipc_*`), and the library keeps PyTorch's protocol:
//!
//! * **Sending** ([`Shim::ipc_share`]): a block of a fixed segment as the segment's handle (a
//!   fixed segment is one `cuMemAlloc_v2` allocation) and the block's offset; a block of an
//!   expandable segment as the memory mapped over it (below); either with a new counter set to
//!   1 ([`crate::ipc_counters`]). The receiver reads what the sender's stream wrote because
//!   the integration records an IPC event on that stream and sends its handle, on which the
//!   receiver's stream waits (PyTorch's protocol: the sender never waits for its device); the
//!   sender keeps the event until its receiver has let go of the block, which it asks the
//!   library (`cachealloc_ipc_sent_released`), since an event destroyed by its creator cannot
//!   be opened. What is sent is a *description*, variable-length
//!   bytes of either kind (`description`), opaque to PyTorch; the Python integration still
//!   sends a fixed segment's block as PyTorch does (the 64-byte handle and the offset), and the
//!   C API keeps its 64-byte functions for fixed segments beside the description's.
//! * **Receiving** ([`ipc_open`], [`ipc_open_shared`]): the segment is opened once per process
//!   and handle, and closed when the last block received through it is let go ([`ipc_close`],
//!   [`ipc_close_shared`], after the device has finished with it); then the receiver
//!   decrements the counter ([`ipc_release`]). Work the receiver queued on the block may not
//!   have run when it lets go (`out.put(t.clone())`, then `del t`), and once the counter is
//!   released the sender may hand the block to new work: so, as PyTorch's own deleter does,
//!   the Python integration waits for the receiver's current stream first (a C program calls
//!   `cachealloc_ipc_release` once its work on the block is done).
//! * **The sender's free.** A block freed while any of its counters is above zero is not
//!   freed: it waits in *limbo*, still allocated (so its segment cannot be released, nor the
//!   memory mapped over it unmapped), and is freed once every counter is zero. The limbo is
//!   looked at on every free and every allocation while it is not empty (so a block let go of
//!   serves the next request before new memory does, as PyTorch's limbo is collected before
//!   its allocator grows), at `empty_cache`, and before an allocation gives up with out of
//!   memory. A look reads the counters of the blocks in limbo only if a release was counted
//!   since the last look (each counter file counts the releases made through it,
//!   [`crate::ipc_counters`]; one look in 256 reads them all the same): a producer whose
//!   receivers hold thousands of its freed blocks would otherwise read all their counters at
//!   every allocation and free. Out of memory and `empty_cache` always read them.
//!
//! **Expandable segments.** Mapped memory has no legacy IPC handle; as PyTorch does, it is shared
//! through POSIX file descriptors. The device's memory is made exportable where it can be
//! (`backend::vmm`: `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` requested when the device says it
//! supports it; where a creation asking for it fails, later memory is made without, and a share of
//! it fails saying why). The sender exports the physical memory of each mapping over the block
//! (`cuMemRetainAllocationHandle` + `cuMemExportToShareableHandle`: one file descriptor per
//! mapping, the first starting at or before the block, the last ending at or after it) and
//! describes them with its pid, its device, where the range they cover starts and its size, each
//! mapping's size and descriptor, and the block's offset in that range. It keeps the descriptors
//! open until the share's counter is released (the receiver takes them from this process; they are
//! closed by a later look after the release: each free and each share checks a few shares, eight,
//! the one checked longest ago first, so that a producer holding thousands of shares does not read
//! all their counters at every free; `empty_cache` and an allocation out of memory check them all).
//! A mapping is exported once while shares of memory under it are held: a later share sends the
//! same descriptor (`backend::vmm`'s exports, counted by the descriptor server), which is closed
//! with the last of those shares, and forgotten when the mapping is unmapped. An export is a driver
//! call that opens a file, and a producer that sends many tensors of one segment (a model's
//! parameters) holds their shares together (BENCHMARKS.md, "Two GPUs again; what a share costs the
//! sender"). The receiver (`expandable`) takes each descriptor with `pidfd_open` + `pidfd_getfd`;
//! where that is refused (ptrace restrictions: a child may not take its parent's, the usual
//! direction of `torch.multiprocessing`) it asks the sender's descriptor server (`fd_server`: an
//! abstract Unix socket that passes descriptors exported for shares still held, to peers of the
//! same user), else opens `/proc/PID/fd/N` (if all fail, the error names each cause); it imports
//! each (`cuMemImportFromShareableHandle`), reserves a range of the total size, maps them in order,
//! gives its current device read and write access, and returns the range's address plus the offset.
//! A range is mapped once per (sender's pid, device, range start, size), and unmapped (after a
//! device synchronization) with the last block received through it, its range freed and the
//! descriptors closed. While any block received through a range is held, the sender cannot unmap
//! the memory under it (that block is live or in limbo), so a later block with the same range
//! identity lies in the same memory.
//!
//! A program's own `cudaIpcGetMemHandle` of a pooled block goes through the same shares
//! (`handles`, Note [CUDA's IPC handles for pooled blocks]).
//!
//! Not covered: receiving in a process that does not run under the shim; sharing between
//! processes of different users or network namespaces where ptrace restrictions also refuse
//! `pidfd_getfd` and `/proc`.

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use cachealloc_core::{AddressInfo, Allocator, BlockState};

use super::Shim;
use crate::backend::CudaDevice;
use crate::cuda::{self, CudaError};
use crate::ipc_counters::{self, SlotId};
use crate::log;
use crate::trace::DeviceObserver;

mod description;
mod expandable;
mod fd_server;
mod handles;

pub use description::{MappedShare, Shared};
pub use handles::{
    close as handle_close, open as handle_open, remove_files as remove_handle_files,
};

/// A block shared with another process: what it needs to map it, and the counter it releases.
#[derive(Clone, Debug)]
pub struct IpcShare {
    /// The memory.
    pub what: Shared,
    /// The counter's file and slot, for the receiver's release.
    pub counter: String,
    /// See `counter`.
    pub slot: u64,
    /// The counter's id here (for [`Shim::ipc_unshare`]) and the block's address.
    id: SlotId,
    block: u64,
}

/// The blocks this process has shared, and those freed while shared.
#[derive(Debug, Default)]
pub struct IpcBook {
    /// Whether the limbo holds blocks (every allocation looks at it then).
    limbo_pending: AtomicBool,
    /// Whether file descriptors exported for shares are still open.
    exports_open: AtomicBool,
    inner: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    /// Each shared live block (by address): the counters of its shares.
    shared: HashMap<u64, Vec<SlotId>>,
    /// Blocks the program freed while shared: (address, stream of the free).
    limbo: Vec<(u64, u64)>,
    /// The file descriptors exported for each share of a block of an expandable segment, kept
    /// open until the receiver releases the share's counter (it takes them from this process);
    /// the share looked at longest ago first.
    exported: VecDeque<(SlotId, fd_server::Exported)>,
    /// Blocks shared through handles of ours (CUDA's own IPC calls), by address: taken back at
    /// the block's free (Note [CUDA's IPC handles for pooled blocks]).
    handles: HashMap<u64, handles::HandleShare>,
    /// The count of releases (`ipc_counters`) when the limbo was last looked at whole, and
    /// how many looks it has saved since.
    limbo_looked: Option<u64>,
    limbo_looks_saved: u32,
}

/// A look at the limbo that no release since the last one could change is saved, but one in
/// this many is made all the same (a receiver running an older library counts no releases).
const LIMBO_LOOKS_SAVED_AT_MOST: u32 = 255;

/// Whether a look at the limbo is to be made: always when memory is short,
/// else when the count of releases moved since the last look, or when too many were saved.
fn limbo_look_due(memory_short: bool, releases: u64, looked: Option<u64>, saved: u32) -> bool {
    memory_short || looked != Some(releases) || saved >= LIMBO_LOOKS_SAVED_AT_MOST
}

/// How many shares' exported descriptors a look at the released shares checks (frees and
/// shares look): a producer may hold thousands of shares for as long as it runs (a model's
/// parameters sent to inference workers), and every free would otherwise read all their
/// counters. A look at memory's end (`empty_cache`, out of memory) checks them all.
const EXPORTS_CHECKED_PER_LOOK: usize = 8;

impl Held {
    /// Forget `share` of the block `block`: its counter released, its descriptors closed.
    fn take_back(&mut self, block: u64, share: SlotId) {
        ipc_counters::cancel(share);
        if let Some(ids) = self.shared.get_mut(&block) {
            ids.retain(|&id| id != share);
            if ids.is_empty() {
                self.shared.remove(&block);
            }
        }
        self.exported.retain(|(id, _)| *id != share);
    }

    /// Close the file descriptors of the shares released since, looking at `limit` shares at
    /// most, the one looked at longest ago first. Returns whether some stay.
    fn close_released_exports(&mut self, limit: usize, released: impl Fn(SlotId) -> bool) -> bool {
        for _ in 0..limit.min(self.exported.len()) {
            let Some((id, exported)) = self.exported.pop_front() else {
                break;
            };
            if !released(id) {
                self.exported.push_back((id, exported));
            }
        }
        !self.exported.is_empty()
    }
}

impl Shim {
    /// The live pooled block at `address`, from the device pools or the private ones.
    fn block_at(&self, address: u64) -> Option<AddressInfo> {
        self.allocators()
            .find_map(|a| a.lookup(address))
            .or_else(|| self.private_lookup(address))
    }

    /// Share the block at `address` with another process (Note [IPC of pooled memory]). A block
    /// of an expandable segment only if `mapped` (its description is not a bare IPC handle).
    pub fn ipc_share(&self, address: u64, mapped: bool) -> Result<IpcShare, String> {
        let info = self
            .block_at(address)
            .filter(|i| i.state == BlockState::Active)
            .ok_or_else(|| format!("{address:#x} is not a live pooled allocation"))?;
        let mut fds = Vec::new();
        let what = if info.expandable {
            if !mapped {
                return Err(format!(
                    "{address:#x} lies in an expandable segment (mapped memory), which no \
                     64-byte IPC handle names: share it with cachealloc_ipc_share_desc"
                ));
            }
            let export = |alloc: &Allocator<CudaDevice, DeviceObserver>| {
                (alloc.device()).export_mapped(info.block_address, info.block_size)
            };
            let exported = match self.allocators().find(|a| a.lookup(address).is_some()) {
                Some(alloc) => Some(export(alloc)),
                None => self.with_private_pool_holding(address, export),
            };
            let exported = exported
                .ok_or_else(|| format!("{address:#x} is not in a device's pools"))?
                .map_err(|why| {
                    format!(
                        "{address:#x} lies in an expandable segment that cannot be shared: {why}"
                    )
                })?;
            let chunks = (exported.chunks.iter())
                .map(|(size, fd)| (*size, fd.as_raw_fd()))
                .collect();
            fds.extend(exported.chunks.into_iter().map(|(_, fd)| fd));
            Shared::Mapped(MappedShare {
                pid: std::process::id(),
                device: exported.device,
                start: exported.start,
                chunks,
                offset: address - exported.start,
            })
        } else {
            let handle =
                crate::real::runtime::ipc_get_mem_handle(info.segment_address).map_err(|code| {
                    format!(
                        "cudaIpcGetMemHandle of segment {:#x}: {code}",
                        info.segment_address
                    )
                })?;
            Shared::Segment {
                handle,
                offset: address - info.segment_address,
            }
        };
        let (id, counter, slot) =
            ipc_counters::new_counter().map_err(|e| format!("an IPC counter: {e}"))?;
        let mut held = self.ipc.inner.lock().unwrap_or_else(|p| p.into_inner());
        let shares = held.shared.entry(info.block_address).or_default();
        // A block shared again and again (a parameter sent at every step) keeps only the
        // shares still held, not one entry for each share it ever had.
        if !shares.is_empty() {
            let counters = ipc_counters::sent_counters();
            shares.retain(|&held| !counters.released(held));
        }
        shares.push(id);
        if !fds.is_empty() {
            held.exported.push_back((id, fd_server::Exported::new(fds)));
            self.ipc.exports_open.store(true, Ordering::Release);
        }
        // Whether any block was ever shared is the rare word's bit: frees skip the book until
        // then (Note [Rare conditions in one word]).
        crate::rare::note(crate::rare::IPC);
        drop(held);
        self.ipc_collect();
        Ok(IpcShare {
            what,
            counter,
            slot,
            id,
            block: info.block_address,
        })
    }

    /// Take back a share no other process has seen (its description could not be handed
    /// over): its counter released, its file descriptors closed.
    pub fn ipc_unshare(&self, share: &IpcShare) {
        let mut held = self.ipc.inner.lock().unwrap_or_else(|p| p.into_inner());
        held.take_back(share.block, share.id);
    }

    /// Whether the block at `address` was shared with another process (its free may wait for
    /// that process: [`Shim::ipc_hold`]).
    pub(super) fn ipc_shares(&self, address: u64) -> bool {
        crate::rare::any(crate::rare::IPC)
            && self
                .ipc
                .inner
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .shared
                .contains_key(&address)
    }

    /// At a free of `address` on `stream`: hold it in limbo if another process may still use
    /// it (answering the free with success), else forget its shares. `None`: free it now.
    pub(super) fn ipc_hold(&self, address: u64, stream: u64) -> Option<CudaError> {
        if !crate::rare::any(crate::rare::IPC) {
            return None;
        }
        let mut held = self.ipc.inner.lock().unwrap_or_else(|p| p.into_inner());
        // A handle of ours lasts as long as the program holds the block (as a driver's handle
        // lasts as long as its allocation): the free takes it back.
        if let Some(h) = held.handles.remove(&address) {
            h.withdraw();
            held.take_back(address, h.share.id);
        }
        let counters = held.shared.get(&address)?;
        if counters.iter().all(|&id| ipc_counters::released(id)) {
            held.shared.remove(&address);
            return None;
        }
        held.limbo.push((address, stream));
        self.ipc.limbo_pending.store(true, Ordering::Release);
        Some(cuda::SUCCESS)
    }

    /// At an allocation while blocks wait in limbo: free those let go of first, so that their
    /// memory serves the request before new memory is reserved for it (PyTorch collects its
    /// IPC limbo before its allocator grows: a free-memory callback). A look reads the
    /// counters of the blocks in limbo only after a release (Note [IPC of pooled memory]).
    pub(super) fn ipc_collect_if_pending(&self) {
        // Note [Rare conditions in one word]: no block was ever shared.
        if crate::rare::any(crate::rare::IPC) && self.ipc.limbo_pending.load(Ordering::Relaxed) {
            self.ipc_collect();
        }
    }

    /// Free the blocks in limbo that no other process holds any more, and close the file
    /// descriptors exported for shares released since (a few shares' a look:
    /// [`EXPORTS_CHECKED_PER_LOOK`]). Returns how many blocks.
    pub(super) fn ipc_collect(&self) -> usize {
        self.ipc_collect_looking(false)
    }

    /// [`Shim::ipc_collect`] for when memory is short: every share's exported descriptors
    /// checked (one left open keeps its memory from the device), the whole limbo looked at.
    pub(super) fn ipc_collect_all(&self) -> usize {
        self.ipc_collect_looking(true)
    }

    fn ipc_collect_looking(&self, memory_short: bool) -> usize {
        if !crate::rare::any(crate::rare::IPC) {
            return 0;
        }
        let ready: Vec<(u64, u64)> = {
            let mut held = self.ipc.inner.lock().unwrap_or_else(|p| p.into_inner());
            // One lock of the counters for every look below (held, then the counters: the
            // order every path takes).
            let counters = ipc_counters::sent_counters();
            if self.ipc.exports_open.load(Ordering::Acquire)
                && !held.close_released_exports(
                    if memory_short {
                        usize::MAX
                    } else {
                        EXPORTS_CHECKED_PER_LOOK
                    },
                    |id| counters.released(id),
                )
            {
                self.ipc.exports_open.store(false, Ordering::Release);
            }
            if held.limbo.is_empty() {
                return 0;
            }
            // Nothing was let go since the last look: the limbo holds what it held (a look
            // reads a counter per block, and every allocation and free looks).
            let releases = counters.releases();
            if !limbo_look_due(
                memory_short,
                releases,
                held.limbo_looked,
                held.limbo_looks_saved,
            ) {
                held.limbo_looks_saved += 1;
                return 0;
            }
            held.limbo_looked = Some(releases);
            held.limbo_looks_saved = 0;
            let Held { shared, limbo, .. } = &mut *held;
            let mut ready = Vec::new();
            limbo.retain(|&(address, stream)| {
                let free = shared
                    .get(&address)
                    .is_none_or(|ids| ids.iter().all(|&id| counters.released(id)));
                if free {
                    shared.remove(&address);
                    ready.push((address, stream));
                }
                !free
            });
            if limbo.is_empty() {
                self.ipc.limbo_pending.store(false, Ordering::Release);
            }
            ready
        };
        for &(address, stream) in &ready {
            if let Some(code) = self.free_pooled(address, stream)
                && code != cuda::SUCCESS
            {
                log::error!("freeing {address:#x}, shared by IPC earlier: {code}");
            }
        }
        ready.len()
    }
}

/// Segments this process opened from other processes: handle → (address, blocks received).
type Opened = Mutex<HashMap<[u8; 64], (u64, usize)>>;

fn opened() -> &'static Opened {
    static OPENED: OnceLock<Opened> = OnceLock::new();
    OPENED.get_or_init(Mutex::default)
}

/// In the receiving process: the address of the segment `handle` names, on the current
/// device, opened at its first block (Note [IPC of pooled memory]).
pub fn ipc_open(handle: [u8; 64]) -> Result<u64, CudaError> {
    let mut opened = opened().lock().unwrap_or_else(|p| p.into_inner());
    if let Some((address, blocks)) = opened.get_mut(&handle) {
        *blocks += 1;
        return Ok(*address);
    }
    let address = crate::real::runtime::ipc_open_mem_handle(handle)?;
    opened.insert(handle, (address, 1));
    Ok(address)
}

/// In the receiving process: a block received through `handle` is let go; the segment is
/// closed with the last (once the device has finished with it).
pub fn ipc_close(handle: [u8; 64]) -> CudaError {
    let mut opened = opened().lock().unwrap_or_else(|p| p.into_inner());
    let Some((address, blocks)) = opened.get_mut(&handle) else {
        return cuda::ERROR_INVALID_VALUE;
    };
    *blocks -= 1;
    if *blocks > 0 {
        return cuda::SUCCESS;
    }
    let address = *address;
    opened.remove(&handle);
    drop(opened);
    let synced = crate::real::runtime::device_synchronize();
    if synced != cuda::SUCCESS {
        log::error!("synchronizing before closing an IPC segment: {synced}");
    }
    crate::real::runtime::ipc_close_mem_handle(address)
}

/// In the receiving process: the address of the block `shared` describes, mapped at its
/// segment's or range's first block (Note [IPC of pooled memory]).
pub fn ipc_open_shared(shared: &Shared) -> Result<u64, String> {
    match shared {
        Shared::Segment { handle, offset } => ipc_open(*handle)
            .map(|base| base + offset)
            .map_err(|code| format!("cudaIpcOpenMemHandle: {code}")),
        Shared::Mapped(share) => expandable::open(share),
    }
}

/// In the receiving process: a block received through `shared` is let go; its segment or
/// range is unmapped with the last (once the device has finished with it).
pub fn ipc_close_shared(shared: &Shared) -> CudaError {
    match shared {
        Shared::Segment { handle, .. } => ipc_close(*handle),
        Shared::Mapped(share) => expandable::close(share),
    }
}

/// In the receiving process: tell the sender its block `slot` of `counter` is let go.
pub fn ipc_release(counter: &str, slot: u64) -> Result<(), String> {
    ipc_counters::release(counter, slot)
}

/// In the sending process: whether the receiver has let go of slot `slot` of this process's
/// counter `counter`; `None` when the counter is not this process's.
pub fn ipc_sent_released(counter: &str, slot: u64) -> Option<bool> {
    ipc_counters::sent_released(counter, slot)
}

/// `accessor` may now use `owner`'s memory (peer access): the blocks of expandable segments
/// received from other processes for `owner` become its to use too. Returns how many of their
/// ranges could not be granted.
pub(super) fn grant_received_to_peer(owner: i32, accessor: i32) -> usize {
    expandable::grant_peer(owner, accessor)
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[test]
    fn the_limbo_is_looked_at_after_a_release_or_now_and_then() {
        assert!(limbo_look_due(false, 0, None, 0), "never looked at");
        assert!(
            !limbo_look_due(false, 7, Some(7), 0),
            "nothing let go since"
        );
        assert!(limbo_look_due(false, 8, Some(7), 0), "a release since");
        assert!(limbo_look_due(true, 7, Some(7), 0), "memory is short");
        assert!(!limbo_look_due(
            false,
            7,
            Some(7),
            LIMBO_LOOKS_SAVED_AT_MOST - 1
        ));
        assert!(limbo_look_due(false, 7, Some(7), LIMBO_LOOKS_SAVED_AT_MOST));
    }

    #[test]
    fn a_look_checks_a_few_shares_oldest_first_and_the_rest_in_later_looks() {
        let mut held = Held::default();
        for slot in 0..20 {
            let id: SlotId = (0, slot);
            held.exported
                .push_back((id, fd_server::Exported::new(Vec::new())));
        }
        let released = |id: SlotId| id.1.is_multiple_of(2); // every other share let go of
        let checked = Cell::new(Vec::new());
        let look = |held: &mut Held| {
            held.close_released_exports(EXPORTS_CHECKED_PER_LOOK, |id| {
                let mut seen = checked.take();
                seen.push(id.1);
                checked.set(seen);
                released(id)
            })
        };
        assert!(look(&mut held));
        assert_eq!(checked.take(), (0..8).collect::<Vec<_>>(), "the oldest 8");
        assert_eq!(held.exported.len(), 16, "the 4 released of them closed");
        assert!(look(&mut held));
        assert_eq!(
            checked.take(),
            (8..16).collect::<Vec<_>>(),
            "then the next 8"
        );
        // The shares not yet let go of come round again after the ones never looked at.
        assert!(look(&mut held));
        assert_eq!(checked.take(), vec![16, 17, 18, 19, 1, 3, 5, 7]);
        assert_eq!(held.exported.len(), 10);
        // Checking them all: only the held ones stay.
        assert!(held.close_released_exports(usize::MAX, released));
        assert!(held.exported.iter().all(|(id, _)| !released(*id)));
        assert!(!held.close_released_exports(usize::MAX, |_| true));
    }
}
