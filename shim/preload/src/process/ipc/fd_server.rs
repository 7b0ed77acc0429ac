//! Handing exported file descriptors to a receiving process when it may not take them itself.
//!
//! A receiver takes a sender's exported descriptors with `pidfd_getfd`, which needs ptrace
//! permission over the sender: refused under `kernel.yama.ptrace_scope=1` (a common default)
//! when the receiver is the sender's child, as `torch.multiprocessing`'s workers are; opening
//! `/proc/PID/fd/N` instead does not reach every kind of descriptor (a driver's exported
//! memory may not reopen). So a sender that exports descriptors also answers for them: a thread
//! listening on the abstract Unix socket `cachealloc-ipc-<pid>` passes a descriptor
//! (`SCM_RIGHTS`) to a peer of the same user that names it, and only descriptors this process
//! exported for a share still held ([`Exported`]); anything else is answered with none.
//! Several held shares may send one descriptor (memory under the same mapping: the mapping is
//! exported once while shares of it are held), so the server counts the shares of each number.
//! Descriptors are closed under the same lock the server checks them under, so a number it
//! answers is never a newer file's.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex, OnceLock};

use crate::log;

/// The descriptors exported for shares still held, by number: how many such shares send each.
static SERVED: Mutex<Option<HashMap<RawFd, usize>>> = Mutex::new(None);

/// Descriptors exported for one share: answerable by the server while alive; when dropped, no
/// longer answered for this share, and closed if no other share holds them.
#[derive(Debug)]
pub struct Exported(Vec<Arc<OwnedFd>>);

impl Exported {
    /// Keep `fds` open and answerable; starts the server at the first.
    pub fn new(fds: Vec<Arc<OwnedFd>>) -> Exported {
        if !fds.is_empty() {
            start();
            let mut served = SERVED.lock().unwrap_or_else(|p| p.into_inner());
            let counts = served.get_or_insert_with(HashMap::new);
            for fd in &fds {
                *counts.entry(fd.as_raw_fd()).or_default() += 1;
            }
        }
        Exported(fds)
    }
}

impl Drop for Exported {
    fn drop(&mut self) {
        let mut served = SERVED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(counts) = served.as_mut() {
            for fd in &self.0 {
                let number = fd.as_raw_fd();
                if let Some(count) = counts.get_mut(&number) {
                    *count -= 1;
                    if *count == 0 {
                        counts.remove(&number);
                    }
                }
            }
        }
        // Closed (the last holder's) under the lock: the server never answers a number reused
        // meanwhile.
        self.0.clear();
    }
}

fn name(pid: u32) -> String {
    format!("cachealloc-ipc-{pid}")
}

/// Start the server once per process (a forked child has no thread: it starts its own).
fn start() {
    static STARTED: OnceLock<u32> = OnceLock::new();
    let pid = std::process::id();
    if STARTED.get() == Some(&pid) {
        return;
    }
    let _ = STARTED.set(pid);
    let listener = match SocketAddr::from_abstract_name(name(pid).as_bytes())
        .and_then(|addr| UnixListener::bind_addr(&addr))
    {
        Ok(l) => l,
        Err(e) => {
            log::debug!("IPC: no descriptor server ({e}); receivers take descriptors themselves");
            return;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("cachealloc-ipc".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                if let Err(e) = answer(stream) {
                    log::debug!("IPC: a descriptor request failed: {e}");
                }
            }
        });
    if let Err(e) = spawned {
        log::debug!("IPC: no descriptor server thread ({e})");
    }
}

/// One request: a descriptor number (4 bytes, native order); the answer is one byte (0: here
/// it is, with the descriptor attached; 1: not one of ours).
fn answer(mut stream: UnixStream) -> std::io::Result<()> {
    if peer_uid(&stream)? != own_uid() {
        return Err(std::io::Error::other("a peer of another user"));
    }
    let mut number = [0u8; 4];
    stream.read_exact(&mut number)?;
    let fd = RawFd::from_ne_bytes(number);
    let served = SERVED.lock().unwrap_or_else(|p| p.into_inner());
    if served.as_ref().is_some_and(|s| s.contains_key(&fd)) {
        send_fd(&stream, fd)
    } else {
        drop(served);
        stream.write_all(&[1])
    }
}

/// Ask process `pid`'s server for its descriptor `fd`.
pub fn fetch(pid: u32, fd: RawFd) -> std::io::Result<OwnedFd> {
    let addr = SocketAddr::from_abstract_name(name(pid).as_bytes())?;
    let mut stream = UnixStream::connect_addr(&addr)?;
    stream.write_all(&fd.to_ne_bytes())?;
    receive_fd(&stream)
}

fn own_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes a `ucred` of `len` bytes into `cred`, which is that size.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Room for one descriptor's control message.
const CONTROL: usize = 64;

fn send_fd(stream: &UnixStream, fd: RawFd) -> std::io::Result<()> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = [0u8; CONTROL];
    // SAFETY: a zeroed msghdr is valid; its pointers are set below to live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE computes a size from a length; no memory is touched.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as _;
    // SAFETY: `msg` has a control buffer of CONTROL bytes, at least CMSG_SPACE(4), so its first
    // header and its data lie inside it; `sendmsg` reads the live buffers `msg` points to.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&msg);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(header).cast::<RawFd>(), fd);
        if libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) != 1 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn receive_fd(stream: &UnixStream) -> std::io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = [0u8; CONTROL];
    // SAFETY: a zeroed msghdr is valid; its pointers are set below to live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = CONTROL as _;
    // SAFETY: `recvmsg` writes at most the buffers' lengths into the live buffers `msg` points
    // to; the control headers it reports lie inside `control`.
    unsafe {
        let n = libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let header = libc::CMSG_FIRSTHDR(&msg);
        if n == 1
            && byte[0] == 0
            && !header.is_null()
            && (*header).cmsg_level == libc::SOL_SOCKET
            && (*header).cmsg_type == libc::SCM_RIGHTS
        {
            let fd = std::ptr::read_unaligned(libc::CMSG_DATA(header).cast::<RawFd>());
            // The descriptor is new in this process and ours alone.
            return Ok(OwnedFd::from_raw_fd(fd));
        }
    }
    Err(std::io::Error::other(
        "the sender's server does not hold that descriptor",
    ))
}
