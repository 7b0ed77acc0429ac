//! Blocks of expandable segments received from another process (see Note [IPC of pooled
//! memory] in `process::ipc`): the sender's file descriptors taken over (`pidfd_getfd`, else
//! `/proc/PID/fd/N`), their memory imported, mapped in order into a range reserved here, and
//! made readable and writable by the current device and the devices that have peer access to it
//! (a process on GPU 1 copying a tensor received from GPU 0, say; [`grant_peer`] for peers that
//! come later); unmapped with the last block received through the same range.

use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys;

use super::description::MappedShare;
use crate::backend::HANDLE_TYPE_POSIX_FD;
use crate::cuda::driver::SUCCESS;
use crate::cuda::{self, CudaError};
use crate::log;
use crate::real::driver::call_driver;

/// A range of another process's memory mapped here.
struct Opened {
    /// Where it is mapped here, and its size.
    base: u64,
    size: u64,
    /// The device it was mapped for (the memory's own).
    device: i32,
    /// The file descriptors taken from the sender, closed with the range.
    _fds: Vec<OwnedFd>,
    /// Blocks received through it and not let go.
    blocks: usize,
}

/// A covering range's identity: the sender's pid and device, and where the range starts there
/// and its size. While a block received through it is held, the sender cannot unmap the range's
/// memory, so a second block with the same identity lies in the same memory.
type Key = (u32, i32, u64, u64);

fn opened() -> &'static Mutex<HashMap<Key, Opened>> {
    static OPENED: OnceLock<Mutex<HashMap<Key, Opened>>> = OnceLock::new();
    OPENED.get_or_init(Mutex::default)
}

fn key(share: &MappedShare) -> Key {
    (share.pid, share.device, share.start, share.size())
}

/// The address here of the block `share` describes, its range mapped at the first block.
pub fn open(share: &MappedShare) -> Result<u64, String> {
    let mut opened = opened().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(o) = opened.get_mut(&key(share)) {
        o.blocks += 1;
        return Ok(o.base + share.offset);
    }
    crate::gpu::LoadedDriver::load()?;
    let device = crate::real::runtime::current_device().unwrap_or(share.device);
    let fds = (share.chunks.iter())
        .map(|&(_, fd)| take_fd(share.pid, fd))
        .collect::<Result<Vec<OwnedFd>, String>>()?;
    let base = map(share, &fds, device)?;
    opened.insert(
        key(share),
        Opened {
            base,
            size: share.size(),
            device,
            _fds: fds,
            blocks: 1,
        },
    );
    Ok(base + share.offset)
}

/// A block received through `share` is let go; its range is unmapped with the last (once the
/// device has finished with it).
pub fn close(share: &MappedShare) -> CudaError {
    let mut opened = opened().lock().unwrap_or_else(|p| p.into_inner());
    let Some(o) = opened.get_mut(&key(share)) else {
        return cuda::ERROR_INVALID_VALUE;
    };
    o.blocks -= 1;
    if o.blocks > 0 {
        return cuda::SUCCESS;
    }
    let Some(o) = opened.remove(&key(share)) else {
        return cuda::ERROR_INVALID_VALUE;
    };
    drop(opened);
    let synced = crate::real::runtime::device_synchronize();
    if synced != cuda::SUCCESS {
        log::error!("synchronizing before unmapping memory of another process: {synced}");
    }
    // SAFETY: `[base, base + size)` is a range `map` reserved and mapped whole, which nothing
    // uses any more (the device has finished with it).
    let unmapped = call_driver!(cuMemUnmap(o.base, o.size as usize));
    if unmapped != SUCCESS {
        log::error!("cuMemUnmap of memory received from another process: {unmapped}");
        return cuda::ERROR_INVALID_VALUE;
    }
    // SAFETY: the range `map` reserved, with nothing mapped in it any more.
    let freed = call_driver!(cuMemAddressFree(o.base, o.size as usize));
    if freed != SUCCESS {
        log::error!("cuMemAddressFree of a range of another process's memory: {freed}");
    }
    cuda::SUCCESS
}

/// Import each chunk's memory, map the chunks in order into a new range and give `device`
/// read and write access to it. Returns the range's address; on failure nothing stays.
fn map(share: &MappedShare, fds: &[OwnedFd], device: i32) -> Result<u64, String> {
    let size = share.size();
    let mut base = 0;
    // SAFETY: valid out-pointer; the size is the sum of the sender's mappings (whole granules
    // of its device); default alignment, no fixed address, no flags.
    let code = call_driver!(cuMemAddressReserve(&mut base, size as usize, 0, 0, 0));
    if code != SUCCESS {
        return Err(format!(
            "cuMemAddressReserve of {size} bytes returned {code}"
        ));
    }
    let undo = |mapped: u64, why: String| {
        let mut at = base;
        for &(len, _) in &share.chunks {
            if at >= base + mapped {
                break;
            }
            // SAFETY: one whole mapping made below, which nothing uses yet.
            let _ = call_driver!(cuMemUnmap(at, len as usize));
            at += len;
        }
        // SAFETY: the range reserved above, with nothing mapped in it any more.
        let _ = call_driver!(cuMemAddressFree(base, size as usize));
        Err(why)
    };
    let mut at = base;
    for (&(len, _), fd) in share.chunks.iter().zip(fds) {
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer; for a POSIX file descriptor the driver takes the fd's
        // number in the pointer's place, and `fd` is open (the driver does not take it over).
        let code = call_driver!(cuMemImportFromShareableHandle(
            &mut handle,
            fd.as_raw_fd() as usize as *mut c_void,
            HANDLE_TYPE_POSIX_FD
        ));
        if code != SUCCESS {
            return undo(
                at - base,
                format!("cuMemImportFromShareableHandle returned {code}"),
            );
        }
        // SAFETY: unmapped whole granules of the range reserved above, and a live handle of
        // that size (the sender's mapping of it was `len` bytes); offset and flags 0.
        let code = call_driver!(cuMemMap(at, len as usize, 0, handle, 0));
        // The mapping keeps the memory: the handle is not needed either way.
        // SAFETY: `handle` came from the import above and is released once.
        let _ = call_driver!(cuMemRelease(handle));
        if code != SUCCESS {
            return undo(at - base, format!("cuMemMap returned {code}"));
        }
        at += len;
    }
    // The device and its peers (the `opened` lock, held by the caller, orders this against
    // `grant_peer`: a peer noted later is granted there).
    let access = crate::backend::access_for_accessors(device);
    // SAFETY: the range is mapped throughout (just above), by whole mappings; `access` holds
    // `access.len()` valid descriptors.
    let code = call_driver!(cuMemSetAccess(
        base,
        size as usize,
        access.as_ptr(),
        access.len()
    ));
    if code != SUCCESS {
        return undo(
            size,
            format!("cuMemSetAccess for device {device} and its peers returned {code}"),
        );
    }
    Ok(base)
}

/// `accessor` may now use `owner`'s memory (peer access): give it the ranges received from
/// other processes and mapped for `owner`. Returns how many could not be granted.
pub fn grant_peer(owner: i32, accessor: i32) -> usize {
    let opened = opened().lock().unwrap_or_else(|p| p.into_inner());
    let access = crate::backend::access_for(accessor);
    let mut failed = 0;
    for o in opened.values().filter(|o| o.device == owner) {
        // SAFETY: a range `map` mapped whole and has not unmapped (it is in `opened`); one
        // valid descriptor.
        let code = call_driver!(cuMemSetAccess(o.base, o.size as usize, &access, 1));
        if code != SUCCESS {
            failed += 1;
        }
    }
    failed
}

/// One way of taking a sender's descriptor: its name (for the error) and the call.
type Way<'a> = (&'a str, &'a dyn Fn(u32, i32) -> std::io::Result<OwnedFd>);

/// The sender's file descriptor `fd`, opened here: through `pidfd_getfd`; where that is refused
/// (ptrace restrictions, an old kernel), from the sender's descriptor server
/// ([`fd_server`](super::fd_server)); else by opening `/proc/PID/fd/N`.
fn take_fd(pid: u32, fd: i32) -> Result<OwnedFd, String> {
    take_fd_with(
        pid,
        fd,
        &[
            ("pidfd_getfd", &pidfd_getfd),
            ("the sender's descriptor server", &super::fd_server::fetch),
            ("/proc/PID/fd", &open_proc),
        ],
    )
}

/// [`take_fd`] by `ways`, in order; the error names each way's cause.
fn take_fd_with(pid: u32, fd: i32, ways: &[Way<'_>]) -> Result<OwnedFd, String> {
    let mut causes = Vec::new();
    let mut refused = false;
    for (name, way) in ways {
        match way(pid, fd) {
            Ok(taken) => return Ok(taken),
            Err(e) => {
                refused |= matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES));
                causes.push(format!("{name}: {e}"));
            }
        }
    }
    let hint = if refused {
        " (this process may not take another's file descriptors: a ptrace restriction such as \
         kernel.yama.ptrace_scope, or a different user)"
    } else {
        ""
    };
    Err(format!(
        "could not take file descriptor {fd} of process {pid}: {}{hint}",
        causes.join("; ")
    ))
}

/// `/proc/PID/fd/N`, opened.
fn open_proc(pid: u32, fd: i32) -> std::io::Result<OwnedFd> {
    let path = format!("/proc/{pid}/fd/{fd}");
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map(OwnedFd::from)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{path}: {e}")))
}

/// `pidfd_getfd(pidfd_open(pid), fd)`.
fn pidfd_getfd(pid: u32, fd: i32) -> std::io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).map_err(std::io::Error::other)?;
    // SAFETY: pidfd_open takes a pid and flags (0) and returns a new file descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just opened `pidfd` for us; nothing else owns it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    // SAFETY: pidfd_getfd takes an open pidfd, a file descriptor number of that process and
    // flags (0), and returns a new file descriptor (close-on-exec) or -1.
    let taken = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if taken < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above, a new file descriptor of ours.
    Ok(unsafe { OwnedFd::from_raw_fd(taken as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// A pipe: (read end, write end).
    fn pipe() -> (std::fs::File, std::fs::File) {
        let mut fds = [0; 2];
        // SAFETY: a valid array of two ints for the new descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors were just opened for us.
        unsafe {
            (
                std::fs::File::from_raw_fd(fds[0]),
                std::fs::File::from_raw_fd(fds[1]),
            )
        }
    }

    #[test]
    fn a_descriptor_is_taken_by_pidfd_getfd_else_from_the_server_else_through_proc() {
        let me = std::process::id();
        let (mut read, write) = pipe();
        let refused = |_: u32, _: i32| -> std::io::Result<OwnedFd> {
            Err(std::io::Error::from_raw_os_error(libc::EPERM))
        };
        // The server answers only for descriptors exported for a share still held. Two shares
        // of memory under one mapping send one descriptor.
        let fd = std::sync::Arc::new(OwnedFd::from(write.try_clone().unwrap()));
        let exported = super::super::fd_server::Exported::new(vec![fd.clone()]);
        let second = super::super::fd_server::Exported::new(vec![fd]);
        let served = {
            let fds: Vec<i32> = (0..1024)
                .filter(|&n| n != write.as_raw_fd())
                .filter(|&n| super::super::fd_server::fetch(me, n).is_ok())
                .collect();
            assert_eq!(fds.len(), 1, "one descriptor served: {fds:?}");
            fds[0]
        };
        let server: Way<'_> = ("server", &super::super::fd_server::fetch);
        for taken in [
            take_fd(me, write.as_raw_fd()),
            take_fd_with(
                me,
                write.as_raw_fd(),
                &[("pidfd_getfd", &refused), ("/proc/PID/fd", &open_proc)],
            ),
            take_fd_with(me, served, &[("pidfd_getfd", &refused), server]),
        ] {
            let mut taken = std::fs::File::from(taken.expect("the descriptor is taken"));
            taken.write_all(b"x").unwrap();
            let mut byte = [0];
            read.read_exact(&mut byte).unwrap();
            assert_eq!(&byte, b"x");
        }
        // A descriptor not exported for a share is not served.
        let why = take_fd_with(me, write.as_raw_fd(), &[server]).unwrap_err();
        assert!(why.contains("does not hold"), "{why}");
        // One share ended, the other held: still served, still open.
        drop(second);
        let mut taken = std::fs::File::from(
            take_fd_with(me, served, &[server]).expect("served while a share holds it"),
        );
        taken.write_all(b"y").unwrap();
        drop(exported);
        assert!(
            super::super::fd_server::fetch(me, served).is_err(),
            "served after its share ended"
        );
        // Nothing works: every cause, and the hint about ptrace restrictions.
        let why = take_fd_with(
            me,
            1 << 20,
            &[("pidfd_getfd", &refused), ("/proc/PID/fd", &open_proc)],
        )
        .unwrap_err();
        assert!(
            why.contains("pidfd_getfd") && why.contains(&format!("/proc/{me}/fd/")),
            "{why}"
        );
        assert!(why.contains("ptrace"), "{why}");
    }
}
