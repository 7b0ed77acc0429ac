//! CUDA's own IPC calls on pooled memory: `cudaIpcGetMemHandle` (`cuIpcGetMemHandle`) of a
//! block the driver cannot name, and `cuIpcOpenMemHandle` / `cuIpcCloseMemHandle` of the handle
//! in the receiving process.
//!
//! # Note [CUDA's IPC handles for pooled blocks]
//!
//! Programs that share device memory themselves do it as PyTorch's own IPC does: the
//! allocation's base from `cuPointerGetAttribute(RANGE_START_ADDR)` (or `cuMemGetAddressRange`),
//! `cudaIpcGetMemHandle` of that base, the pointer's offset beside the handle; the other process
//! opens the handle and adds the offset. vLLM's and SGLang's custom all-reduce register every
//! buffer a CUDA graph captured this way, on PyTorch's tensors. Natively a tensor lies in one of
//! PyTorch's `cudaMalloc` segments, whose handle the driver gives. Under the shim a pooled
//! pointer's range is its block (a program that called `cudaMalloc` sees its own allocation), and
//! the block lies inside a segment (a handle would map the segment's base: wrong bytes) or in an
//! expandable segment (mapped memory has no legacy handle); both used to be refused.
//!
//! Now the block is shared as `torch.multiprocessing`'s tensors are (Note [IPC of pooled
//! memory]: the segment's handle and the block's offset, or the memory mapped over it as file
//! descriptors), and the program is given a handle of ours: 64 bytes that start with [`MAGIC`],
//! then the version, this process's id, a token and the pointer's offset in its block. The
//! share's description is written to `cachealloc-ipch-<pid>-<token>` beside the IPC counter
//! files; the receiving process, under the shim too, recognizes the handle at
//! `cuIpcOpenMemHandle` (which the runtime's `cudaIpcOpenMemHandle` calls), reads the
//! description and maps the block as a `torch.multiprocessing` receiver does; its
//! `cuIpcCloseMemHandle` unmaps it. A handle the driver can give (a fixed segment's first block,
//! live) is still the driver's, and other handles reach the driver untouched.
//!
//! The handle is the block's for as long as the program holds the block, as a driver's handle is
//! its allocation's: asked again, it is the same bytes; the program's free of the block withdraws
//! the share (its counter released, its descriptors closed, its file removed), and a receiver
//! that still maps it keeps the memory, not the block (as natively, where a freed segment's
//! bytes may be reused). At exit the process removes its files; files of processes that died are
//! removed by the next process that makes one.
//!
//! Not covered: a receiver that does not run under the shim (the driver refuses our handle, as
//! it refused the share before).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once, OnceLock};

use cachealloc_core::BlockState;

use super::{Held, IpcShare, Shared, ipc_close_shared, ipc_open_shared};
use crate::cuda::{self, CudaError};
use crate::log;
use crate::process::Shim;

/// What a handle of ours starts with.
pub const MAGIC: [u8; 8] = *b"cacheIPC";
/// The layout of the bytes after [`MAGIC`].
const VERSION: u32 = 1;
/// The prefix of a description file's name.
const FILE_PREFIX: &str = "cachealloc-ipch-";

/// A block shared through a handle of ours: the share, and the handle the program was given.
#[derive(Debug)]
pub struct HandleShare {
    /// The share (its counter stays set while the program holds the block).
    pub share: IpcShare,
    /// The token the handle names.
    token: u64,
}

/// A handle of ours: [`MAGIC`], the version, the sender's pid, the token and the pointer's
/// offset in its block, little-endian, the rest zero.
pub fn handle_bytes(pid: u32, token: u64, offset: u64) -> [u8; 64] {
    let mut h = [0u8; 64];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&pid.to_le_bytes());
    h[16..24].copy_from_slice(&token.to_le_bytes());
    h[24..32].copy_from_slice(&offset.to_le_bytes());
    h
}

/// The (pid, token, offset) a handle of ours names; `None` for any other handle.
pub fn parse(h: &[u8; 64]) -> Option<(u32, u64, u64)> {
    let word = |r: std::ops::Range<usize>| u64::from_le_bytes(h[r].try_into().unwrap_or([0; 8]));
    let version = u32::from_le_bytes(h[8..12].try_into().ok()?);
    if h[..8] != MAGIC || version != VERSION || h[32..].iter().any(|&b| b != 0) {
        return None;
    }
    let pid = u32::from_le_bytes(h[12..16].try_into().ok()?);
    Some((pid, word(16..24), word(24..32)))
}

fn file(pid: u32, token: u64) -> PathBuf {
    crate::ipc_counters::directory().join(format!("{FILE_PREFIX}{pid}-{token}"))
}

impl HandleShare {
    /// Publish `share` for receivers: its description written to its file (0600), readable by
    /// processes of the same user.
    pub fn publish(share: IpcShare) -> Result<HandleShare, String> {
        static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);
        static SWEPT: Once = Once::new();
        SWEPT.call_once(remove_files_of_dead_processes);
        let token = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
        let path = file(std::process::id(), token);
        let mut options = std::fs::OpenOptions::new();
        std::os::unix::fs::OpenOptionsExt::mode(options.write(true).create_new(true), 0o600);
        use std::io::Write;
        options
            .open(&path)
            .and_then(|mut f| f.write_all(&share.what.encode()))
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        Ok(HandleShare { share, token })
    }

    /// The handle naming this share, for a pointer `offset` bytes into the block.
    pub fn handle(&self, offset: u64) -> [u8; 64] {
        handle_bytes(std::process::id(), self.token, offset)
    }

    /// Remove the description file (the share itself is taken back by the caller).
    pub fn withdraw(&self) {
        let _ = std::fs::remove_file(file(std::process::id(), self.token));
    }
}

impl Shim {
    /// `cudaIpcGetMemHandle(address)` (Note [CUDA's IPC handles for pooled blocks]): `None` where
    /// the driver's handle is the right one (not pooled memory, or a fixed segment's first
    /// block, which the handle maps from its base), else a handle of ours for the block, the
    /// same one each time while the program holds the block.
    pub fn ipc_handle(&self, address: u64) -> Result<Option<[u8; 64]>, String> {
        let Some(info) = self.block_at(address) else {
            return Ok(None);
        };
        if info.state != BlockState::Active {
            return Err(format!(
                "cudaIpcGetMemHandle({address:#x}) refused: the pointer lies in a pooled block \
                 that is not allocated"
            ));
        }
        if !info.expandable && info.block_address == info.segment_address {
            return Ok(None);
        }
        let offset = address - info.block_address;
        let known = |held: &Held| {
            held.handles
                .get(&info.block_address)
                .map(|h| h.handle(offset))
        };
        if let Some(handle) = known(&self.ipc.inner.lock().unwrap_or_else(|p| p.into_inner())) {
            return Ok(Some(handle));
        }
        let share = self.ipc_share(info.block_address, true)?;
        let published = match HandleShare::publish(share.clone()) {
            Ok(published) => published,
            Err(why) => {
                self.ipc_unshare(&share);
                return Err(why);
            }
        };
        let mut held = self.ipc.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(handle) = known(&held) {
            // Another thread gave the block a handle meanwhile: that one stays.
            published.withdraw();
            held.take_back(share.block, share.id);
            return Ok(Some(handle));
        }
        let handle = published.handle(offset);
        held.handles.insert(info.block_address, published);
        Ok(Some(handle))
    }
}

/// Remove this process's description files (at exit).
pub fn remove_files() {
    remove_files_where(|pid| pid == std::process::id());
}

/// Remove the description files of processes that no longer run.
fn remove_files_of_dead_processes() {
    remove_files_where(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists());
}

fn remove_files_where(remove: impl Fn(u32) -> bool) {
    let Ok(entries) = std::fs::read_dir(crate::ipc_counters::directory()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = (name.to_str())
            .and_then(|n| n.strip_prefix(FILE_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok());
        if pid.is_some_and(&remove) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Blocks this process opened through handles of ours: the address given to the program →
/// (what was mapped, how many opens hold it).
type Opened = Mutex<HashMap<u64, (Shared, usize)>>;

fn opened() -> &'static Opened {
    static OPENED: OnceLock<Opened> = OnceLock::new();
    OPENED.get_or_init(Mutex::default)
}

/// In the receiving process, `cuIpcOpenMemHandle`: the address the handle names, if it is one of
/// ours (`None`: the driver's to open).
pub fn open(h: &[u8; 64]) -> Option<Result<u64, CudaError>> {
    let (pid, token, offset) = parse(h)?;
    let result = (|| {
        let path = file(pid, token);
        let bytes = std::fs::read(&path).map_err(|e| {
            format!(
                "{}: {e} (the sender freed the block, or exited)",
                path.display()
            )
        })?;
        let shared = Shared::decode(&bytes)?;
        let block = ipc_open_shared(&shared)?;
        Ok::<_, String>((shared, block))
    })();
    Some(match result {
        Ok((shared, block)) => {
            let address = block + offset;
            let mut opened = opened().lock().unwrap_or_else(|p| p.into_inner());
            opened.entry(address).or_insert((shared, 0)).1 += 1;
            Ok(address)
        }
        Err(why) => {
            log::error!("cuIpcOpenMemHandle of process {pid}'s pooled block: {why}");
            Err(cuda::ERROR_INVALID_VALUE)
        }
    })
}

/// In the receiving process, `cuIpcCloseMemHandle`: unmap a block opened through a handle of
/// ours at `address` (`None`: not one, the driver's to close).
pub fn close(address: u64) -> Option<CudaError> {
    let mut opened = opened().lock().unwrap_or_else(|p| p.into_inner());
    let (shared, opens) = opened.get_mut(&address)?;
    *opens -= 1;
    let shared = shared.clone();
    if *opens == 0 {
        opened.remove(&address);
    }
    drop(opened);
    // Each open mapped it once (counted by `ipc_open_shared`): each close lets one go.
    Some(ipc_close_shared(&shared))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_of_ours_names_its_sender_token_and_offset_and_no_other_handle_is_taken_for_one() {
        let h = handle_bytes(4242, 7, 4096);
        assert_eq!(parse(&h), Some((4242, 7, 4096)));
        let mut driver = [0u8; 64];
        driver[..8].copy_from_slice(b"\x01\x02\x03\x04\x05\x06\x07\x08");
        assert_eq!(parse(&driver), None);
        let mut other_version = h;
        other_version[8] = 2;
        assert_eq!(parse(&other_version), None);
        let mut trailing = h;
        trailing[63] = 1;
        assert_eq!(parse(&trailing), None, "bytes past the layout must be zero");
    }
}
