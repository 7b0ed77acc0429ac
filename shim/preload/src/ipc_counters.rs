//! Reference counters shared between processes, for memory a process shares by IPC (see Note
//! [IPC of pooled memory] in `process::ipc`): the one piece of that protocol that lives in the
//! operating system rather than in CUDA.
//!
//! A process that shares a block takes a *slot* in a counter file of its own
//! (`/dev/shm/cachealloc-ipc-<pid>-<n>`, created 0600, mapped shared) and sets it to 1; the
//! process that receives the block decrements it when it lets go. The sharer reads its slots to
//! know when a block it freed may really be reused. A file has [`SLOTS`] slots; a new file is
//! made when one is full; the sharer removes its files at exit.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Mutex, OnceLock};

/// Counters in one file.
pub const SLOTS: usize = 4096;

/// Where counter files live: shared memory, else the temporary directory.
fn directory() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

/// Whether `name` is a counter file's name (receivers open nothing else).
fn valid_name(name: &str) -> bool {
    name.starts_with("cachealloc-ipc-")
        && name.len() < 64
        && name[15..].bytes().all(|b| b.is_ascii_digit() || b == b'-')
}

/// A counter file mapped into this process.
struct Mapped {
    counters: *const AtomicI64,
}

// SAFETY: the mapping is shared memory of SLOTS atomics, valid for the process's life (never
// unmapped); atomics may be used from any thread.
unsafe impl Send for Mapped {}
// SAFETY: as above: only atomic operations reach the memory.
unsafe impl Sync for Mapped {}

impl Mapped {
    /// Map the counter file `name` (created, sized and zeroed when `create`).
    fn open(name: &str, create: bool) -> std::io::Result<Mapped> {
        let bytes = SLOTS * std::mem::size_of::<AtomicI64>();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(create)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(directory().join(name))?;
        if create {
            file.set_len(bytes as u64)?;
        } else if file.metadata()?.len() < bytes as u64 {
            return Err(std::io::Error::other("counter file too short"));
        }
        use std::os::fd::AsRawFd;
        // SAFETY: a new shared mapping of `bytes` bytes of an open file at least that long; the
        // kernel picks the address. The file may be closed after mapping.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapped {
            counters: address.cast(),
        })
    }

    fn slot(&self, slot: usize) -> &AtomicI64 {
        assert!(slot < SLOTS, "counter slot out of range");
        // SAFETY: the mapping holds SLOTS page-aligned atomics and lives forever; `slot` is in
        // range.
        unsafe { &*self.counters.add(slot) }
    }
}

/// The counter files this process shares blocks through: (name, mapping), the last one
/// filling; and the next free slot of the last.
#[derive(Default)]
struct Sent {
    files: Vec<(String, Mapped)>,
    next: usize,
}

fn sent() -> &'static Mutex<Sent> {
    static SENT: OnceLock<Mutex<Sent>> = OnceLock::new();
    SENT.get_or_init(Mutex::default)
}

/// A slot of this process's counter files: `(file index, slot)`.
pub type SlotId = (usize, usize);

/// A new counter set to 1: its id, and the file's name and slot for the receiving process.
pub fn new_counter() -> std::io::Result<(SlotId, String, u64)> {
    let mut sent = sent().lock().unwrap_or_else(|p| p.into_inner());
    if sent.files.is_empty() || sent.next == SLOTS {
        let name = format!("cachealloc-ipc-{}-{}", std::process::id(), sent.files.len());
        let _ = std::fs::remove_file(directory().join(&name)); // a dead process's, same pid
        let mapped = Mapped::open(&name, true)?;
        sent.files.push((name, mapped));
        sent.next = 0;
    }
    let file = sent.files.len() - 1;
    let slot = sent.next;
    sent.next += 1;
    let (name, mapped) = &sent.files[file];
    mapped.slot(slot).store(1, Ordering::Release);
    Ok(((file, slot), name.clone(), slot as u64))
}

/// Whether the receiving process has let go of counter `id` (it reached zero).
pub fn released(id: SlotId) -> bool {
    let sent = sent().lock().unwrap_or_else(|p| p.into_inner());
    sent.files
        .get(id.0)
        .is_none_or(|(_, m)| m.slot(id.1).load(Ordering::Acquire) <= 0)
}

/// Release counter `id` here: its share was never handed to another process.
pub fn cancel(id: SlotId) {
    let sent = sent().lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, m)) = sent.files.get(id.0) {
        m.slot(id.1).store(0, Ordering::Release);
    }
}

/// Remove this process's counter files (at exit: a receiver still holding a block then finds
/// no file, and its release does nothing).
pub fn remove_files() {
    let sent = sent().lock().unwrap_or_else(|p| p.into_inner());
    for (name, _) in &sent.files {
        let _ = std::fs::remove_file(directory().join(name));
    }
}

/// In the receiving process: let go of slot `slot` of the sharer's counter file `name`.
pub fn release(name: &str, slot: u64) -> Result<(), String> {
    if !valid_name(name) || slot as usize >= SLOTS {
        return Err(format!(
            "not a cachealloc IPC counter: {name:?} slot {slot}"
        ));
    }
    static OPENED: OnceLock<Mutex<HashMap<String, Mapped>>> = OnceLock::new();
    let mut opened = OPENED
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if !opened.contains_key(name) {
        match Mapped::open(name, false) {
            Ok(m) => {
                opened.insert(name.to_string(), m);
            }
            // The sharer has exited: nothing waits for this release.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(format!("opening the IPC counter {name}: {e}")),
        }
    }
    opened[name]
        .slot(slot as usize)
        .fetch_sub(1, Ordering::AcqRel);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_is_released_by_its_receiver_and_names_are_checked() {
        let (id, name, slot) = new_counter().unwrap();
        assert!(!released(id));
        release(&name, slot).unwrap();
        assert!(released(id));
        assert!(release("../etc/passwd", 0).is_err());
        assert!(release(&name, SLOTS as u64).is_err());
        remove_files();
        // The sharer gone, a late release does nothing.
        release(&name, slot).unwrap();
    }
}
