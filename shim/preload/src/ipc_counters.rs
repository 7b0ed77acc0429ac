//! Reference counters shared between processes, for memory a process shares by IPC (see Note
//! [IPC of pooled memory] in `process::ipc`): the one piece of that protocol that lives in the
//! operating system rather than in CUDA.
//!
//! A process that shares a block takes a *slot* in a counter file of its own
//! (`/dev/shm/cachealloc-ipc-<pid>-<n>`, created 0600, mapped shared) and sets it to 1; the
//! process that receives the block decrements it when it lets go. The sharer reads its slots to
//! know when a block it freed may really be reused. A file has [`SLOTS`] slots; a new file is
//! made when one is full, and a full file whose every counter was released is removed then (a
//! producer that shares at every step of a long run would otherwise fill `/dev/shm`); the
//! sharer removes the rest at exit.
//!
//! A sharer that dies without exiting (killed, `os._exit`, a crash) cannot remove its files, and
//! `/dev/shm` is memory: a job that starts and kills workers would fill it. So a sharer holds a
//! shared `flock` on each of its files for as long as it lives (through its mapping of the file:
//! Note [A lock held by a mapping]; the kernel drops it however the process ends), and the first
//! time a process makes a counter file it removes every counter file on which it can take an
//! exclusive lock: their sharers are gone (`remove_stale_files`). A lock, not the pid in the
//! name, says whether the sharer lives: a pid may be reused, or belong to another pid namespace
//! that shares `/dev/shm`. A file is locked before it gets its name (it is made under a
//! temporary one, then renamed), so no sweep sees it unlocked.
//!
//! A receiver maps the counter files of the senders it releases blocks to, the 16 most recent
//! (`RECEIVER_MAPPINGS`).
//!
//! The last slot of each file is no counter: it counts the releases made through the file (a
//! receiver adds one after each release). The sharer sums them ([`SentCounters::releases`]) to
//! know whether anything was let go since it last looked at the blocks it holds for other
//! processes, without reading every counter (`process::ipc`'s limbo).

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Slots in one file: counters, and the releases' count.
pub const SLOTS: usize = 4096;

/// The slot of a file that counts the releases made through it (the last; never a counter).
const RELEASES: usize = SLOTS - 1;

/// Where counter files live: shared memory, else the temporary directory.
pub(crate) fn directory() -> PathBuf {
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

// SAFETY: the mapping is shared memory of SLOTS atomics, valid until the `Mapped` is dropped;
// atomics may be used from any thread.
unsafe impl Send for Mapped {}
// SAFETY: as above: only atomic operations reach the memory.
unsafe impl Sync for Mapped {}

/// Open the file at `path`, made new (and not there before) when `create`.
fn open_file(path: &Path, create: bool) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(create)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// `flock(2)` on `file` with `operation` (`LOCK_SH`, `LOCK_EX`, with `LOCK_NB` to not wait).
fn flock(file: &File, operation: libc::c_int) -> std::io::Result<()> {
    // SAFETY: `flock` takes an open descriptor, which `file` owns, and a flag word; no memory.
    if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl Mapped {
    /// Map the counter file `file` (sized and zeroed first when `create`).
    fn map(file: &File, create: bool) -> std::io::Result<Mapped> {
        let bytes = SLOTS * std::mem::size_of::<AtomicI64>();
        if create {
            file.set_len(bytes as u64)?;
        } else if file.metadata()?.len() < bytes as u64 {
            return Err(std::io::Error::other("counter file too short"));
        }
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

impl Drop for Mapped {
    fn drop(&mut self) {
        let bytes = SLOTS * std::mem::size_of::<AtomicI64>();
        // SAFETY: the mapping was made by `Mapped::map` with this length, and the slots are
        // reached only through `&self`, so no reference to them outlives it.
        unsafe { libc::munmap(self.counters as *mut libc::c_void, bytes) };
    }
}

/// One of this process's counter files: its name and its mapping. The mapping holds the
/// file's opening, and with it the shared lock that says the sharer lives (Note [A lock held
/// by a mapping]); dropping it unmaps the file. `None` once the file is retired: every one of
/// its counters was handed out and released, and the file removed.
struct SentFile {
    name: String,
    mapped: Option<Mapped>,
}

// Note [A lock held by a mapping]
// A `flock` belongs to an opening of a file (an open file description), and the kernel drops it
// when the opening's last reference goes — a descriptor or a mapping: a mapping keeps the opening
// it was made through. So a sharer takes its lock through the opening it maps and closes the
// descriptor: the lock lasts as long as the mapping, which is the process's life, however the
// process ends, and costs no descriptor (programs count theirs). A child forked after sharing
// inherits the mapping, and with it keeps its parent's files from being swept while it lives;
// it unmaps them only when it shares blocks itself (its own files replace them).

/// The counter files this process shares blocks through, the last one filling; the next free
/// slot of the last; and the process they belong to (a child forked after sharing starts its
/// own files, never taking slots of its parent's).
#[derive(Default)]
struct Sent {
    files: Vec<SentFile>,
    next: usize,
    owner: u32,
    /// The releases counted by the files retired so far (the count goes on across them).
    retired_releases: u64,
}

impl Sent {
    /// Remove the full files whose every counter was released (a file's releases count has
    /// reached its counters'): a producer that shares for as long as it runs (weights sent at
    /// every step) would otherwise fill `/dev/shm` with files, and its address space with
    /// their mappings, as PyTorch's own counter files are dropped once all their slots are
    /// back. A counter is released once, so a full count means no receiver holds any.
    fn retire_released_files(&mut self) {
        let full = self.files.len().saturating_sub(1); // the last one is still filling
        for file in &mut self.files[..full] {
            let count = (file.mapped.as_ref()).map(|m| m.slot(RELEASES).load(Ordering::Acquire));
            if let Some(count) = count
                && count >= RELEASES as i64
            {
                let _ = std::fs::remove_file(directory().join(&file.name));
                file.mapped = None;
                self.retired_releases += count as u64;
            }
        }
    }
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
    let pid = std::process::id();
    if sent.owner != pid {
        // This process's first counter (or a forked child's: its parent's files stay its
        // parent's, locks and all). Dead sharers' files go first.
        remove_stale_files(&directory());
        *sent = Sent {
            owner: pid,
            ..Sent::default()
        };
    }
    if sent.files.is_empty() || sent.next == RELEASES {
        sent.retire_released_files();
        let file = new_file(&directory(), pid, sent.files.len())?;
        sent.files.push(file);
        sent.next = 0;
    }
    let file = sent.files.len() - 1;
    let slot = sent.next;
    sent.next += 1;
    let SentFile { name, mapped } = &sent.files[file];
    let mapped = mapped
        .as_ref()
        .expect("the file being filled is not retired");
    mapped.slot(slot).store(1, Ordering::Release);
    Ok(((file, slot), name.clone(), slot as u64))
}

/// Make counter file `n` of process `pid` in `directory`: made, locked and mapped under a
/// temporary name, then renamed, so that a sweep never finds it unlocked (Note [A lock held by
/// a mapping]).
fn new_file(directory: &Path, pid: u32, n: usize) -> std::io::Result<SentFile> {
    let name = format!("cachealloc-ipc-{pid}-{n}");
    let path = directory.join(&name);
    let _ = std::fs::remove_file(&path); // a dead process's, same pid
    let temporary = directory.join(format!("cachealloc-new-{pid}-{n}"));
    let _ = std::fs::remove_file(&temporary);
    let file = open_file(&temporary, true)?;
    let made = flock(&file, libc::LOCK_SH)
        .and_then(|()| Mapped::map(&file, true))
        .and_then(|mapped| {
            let sent = SentFile {
                name,
                mapped: Some(mapped),
            };
            std::fs::rename(&temporary, &path).map(|()| sent)
        });
    match made {
        Ok(sent) => Ok(sent),
        Err(e) => {
            let _ = std::fs::remove_file(&temporary);
            Err(e)
        }
    }
}

/// Remove the counter files in `directory` whose sharers are gone: those on which an
/// exclusive lock can be taken at once. Returns how many were removed.
fn remove_stale_files(directory: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(directory) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str().filter(|n| valid_name(n)) else {
            continue;
        };
        let path = directory.join(name);
        // A file that does not open (another user's: 0600) is left alone.
        let Ok(file) = open_file(&path, false) else {
            continue;
        };
        if flock(&file, libc::LOCK_EX | libc::LOCK_NB).is_ok()
            && std::fs::remove_file(&path).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

/// This process's counters, locked once for many looks: a look at the limbo asks about every
/// block in it, and an allocation looks while blocks wait there.
pub struct SentCounters(MutexGuard<'static, Sent>);

impl SentCounters {
    /// Whether the receiving process has let go of counter `id` (it reached zero).
    pub fn released(&self, id: SlotId) -> bool {
        (self.0.files.get(id.0).and_then(|f| f.mapped.as_ref()))
            .is_none_or(|m| m.slot(id.1).load(Ordering::Acquire) <= 0)
    }

    /// How many releases were made through this process's counter files so far: it changes
    /// after every release (a receiver's, or a share taken back here).
    pub fn releases(&self) -> u64 {
        if self.0.owner != std::process::id() {
            return 0; // a forked child's copy of its parent's: nothing of this process's
        }
        (self.0.files.iter().filter_map(|f| f.mapped.as_ref()))
            .map(|m| m.slot(RELEASES).load(Ordering::Acquire) as u64)
            .fold(self.0.retired_releases, u64::wrapping_add)
    }
}

/// Lock this process's counters for [`SentCounters::released`].
pub fn sent_counters() -> SentCounters {
    SentCounters(sent().lock().unwrap_or_else(|p| p.into_inner()))
}

/// Whether the receiving process has let go of counter `id` (it reached zero).
pub fn released(id: SlotId) -> bool {
    sent_counters().released(id)
}

/// In the sharing process: whether slot `slot` of this process's counter file `name` (as
/// [`new_counter`] returned them) has been let go by its receiver; `None` when `name` is not
/// one of this process's files (another process's, or removed at exit).
pub fn sent_released(name: &str, slot: u64) -> Option<bool> {
    let sent = sent().lock().unwrap_or_else(|p| p.into_inner());
    if sent.owner != std::process::id() || slot as usize >= RELEASES {
        return None;
    }
    let file = sent.files.iter().find(|f| f.name == name)?;
    Some((file.mapped.as_ref()).is_none_or(|m| m.slot(slot as usize).load(Ordering::Acquire) <= 0))
}

/// Release counter `id` here: its share was never handed to another process.
pub fn cancel(id: SlotId) {
    let sent = sent().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(m) = sent.files.get(id.0).and_then(|f| f.mapped.as_ref()) {
        m.slot(id.1).store(0, Ordering::Release);
        m.slot(RELEASES).fetch_add(1, Ordering::AcqRel);
    }
}

/// Remove this process's counter files (at exit: a receiver still holding a block then finds
/// no file, and its release does nothing). A forked child that exits removes none of its
/// parent's.
pub fn remove_files() {
    let sent = sent().lock().unwrap_or_else(|p| p.into_inner());
    if sent.owner != std::process::id() {
        return;
    }
    for f in sent.files.iter().filter(|f| f.mapped.is_some()) {
        let _ = std::fs::remove_file(directory().join(&f.name));
    }
}

/// How many senders' counter files a receiving process keeps mapped, the most recently
/// released through first. A mapping keeps its file's memory even once the sender is gone and
/// the file removed, so a receiver that outlives many senders (a trainer fed by workers that
/// come and go) must not keep them all; a file used again after it was let go is mapped again.
const RECEIVER_MAPPINGS: usize = 16;

/// In the receiving process: let go of slot `slot` of the sharer's counter file `name`.
pub fn release(name: &str, slot: u64) -> Result<(), String> {
    if !valid_name(name) || slot as usize >= RELEASES {
        return Err(format!(
            "not a cachealloc IPC counter: {name:?} slot {slot}"
        ));
    }
    static OPENED: Mutex<Vec<(String, Mapped)>> = Mutex::new(Vec::new());
    let mut opened = OPENED.lock().unwrap_or_else(|p| p.into_inner());
    match opened.iter().position(|(n, _)| n == name) {
        Some(0) => {}
        Some(i) => {
            let file = opened.remove(i);
            opened.insert(0, file);
        }
        None => {
            match open_file(&directory().join(name), false).and_then(|f| Mapped::map(&f, false)) {
                Ok(m) => opened.insert(0, (name.to_string(), m)),
                // The sharer has exited: nothing waits for this release.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(format!("opening the IPC counter {name}: {e}")),
            }
            opened.truncate(RECEIVER_MAPPINGS); // the least recent unmapped
        }
    }
    let mapped = &opened[0].1;
    mapped.slot(slot as usize).fetch_sub(1, Ordering::AcqRel);
    // Counted after the counter moved: a sharer that sees the new count sees the release.
    mapped.slot(RELEASES).fetch_add(1, Ordering::AcqRel);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The receiver's mapped files and the sharer's files are the process's: tests that use
    /// them take turns.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    #[test]
    fn a_counter_is_released_by_its_receiver_and_names_are_checked() {
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let (id, name, slot) = new_counter().unwrap();
        assert!(!released(id));
        assert_eq!(sent_released(&name, slot), Some(false));
        let before = sent_counters().releases();
        release(&name, slot).unwrap();
        assert!(released(id));
        assert_eq!(sent_released(&name, slot), Some(true));
        // The release is counted, for the sharer's look at what it holds.
        assert_eq!(sent_counters().releases(), before + 1);
        assert_eq!(sent_released("cachealloc-ipc-1-0", 0), None); // not this process's
        assert_eq!(sent_released(&name, SLOTS as u64), None);
        assert!(release("../etc/passwd", 0).is_err());
        assert!(release(&name, SLOTS as u64).is_err());
        // The count's slot is no counter: never handed out, never released.
        assert_eq!(sent_released(&name, RELEASES as u64), None);
        assert!(release(&name, RELEASES as u64).is_err());
        let slots: Vec<u64> = (0..RELEASES).map(|_| new_counter().unwrap().2).collect();
        assert!(
            slots.iter().all(|&s| s < RELEASES as u64),
            "the count's slot handed out"
        );
        assert!(slots.contains(&0), "a new file was started");
        remove_files();
        // The sharer gone, a late release does nothing.
        release(&name, slot).unwrap();
    }

    #[test]
    fn a_full_file_goes_once_every_counter_in_it_was_released() {
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        // Fill the file being filled, then a whole file of our own.
        while new_counter().unwrap().2 != RELEASES as u64 - 1 {}
        let ours: Vec<(SlotId, String, u64)> =
            (0..RELEASES).map(|_| new_counter().unwrap()).collect();
        let name = ours[0].1.clone();
        assert!(ours.iter().all(|c| c.1 == name), "one file");
        let path = directory().join(&name);
        let before = sent_counters().releases();
        // All but one released: the file stays when later files start (the first after it
        // starts while it is still the last; the second looks at it).
        for (_, n, slot) in &ours[1..] {
            release(n, *slot).unwrap();
        }
        new_counter().unwrap();
        while new_counter().unwrap().2 != 0 {}
        assert!(path.exists(), "a file with a counter held was removed");
        assert!(!released(ours[0].0));
        // The last one released: the file goes when the next file after it starts.
        release(&name, ours[0].2).unwrap();
        while new_counter().unwrap().2 != 0 {}
        assert!(
            !path.exists(),
            "a file whose counters were all released stayed"
        );
        assert!(ours.iter().all(|c| released(c.0)));
        assert_eq!(sent_released(&name, ours[0].2), Some(true));
        // Its releases still count: the sum never goes back.
        assert_eq!(sent_counters().releases(), before + RELEASES as u64);
    }

    #[test]
    fn a_receiver_keeps_the_most_recent_senders_files_mapped() {
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let bytes = SLOTS * std::mem::size_of::<AtomicI64>();
        let name = |k: usize| format!("cachealloc-ipc-3999999999-{}-{k}", std::process::id());
        let mapped = || {
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            let prefix = name(0);
            let prefix = &prefix[..prefix.len() - 1];
            let mut files: Vec<usize> = (maps.lines())
                .filter_map(|l| {
                    l.split('/')
                        .next_back()?
                        .split(' ')
                        .next()?
                        .strip_prefix(prefix)
                })
                .map(|k| k.parse().unwrap())
                .collect();
            files.sort();
            files
        };
        let files = RECEIVER_MAPPINGS + 1;
        for k in 0..files {
            let mut counters = vec![0u8; bytes];
            counters[..8].copy_from_slice(&2i64.to_ne_bytes());
            std::fs::write(directory().join(name(k)), counters).unwrap();
        }
        for k in 0..files {
            release(&name(k), 0).unwrap();
        }
        // The least recent file is unmapped; each counter was released once.
        assert_eq!(mapped(), (1..files).collect::<Vec<_>>());
        for k in 0..files {
            let counters = std::fs::read(directory().join(name(k))).unwrap();
            assert_eq!(i64::from_ne_bytes(counters[..8].try_into().unwrap()), 1);
        }
        // Used again, it is mapped again, in place of the least recent one then.
        release(&name(0), 0).unwrap();
        assert_eq!(
            mapped(),
            [0].into_iter().chain(2..files).collect::<Vec<_>>()
        );
        let counters = std::fs::read(directory().join(name(0))).unwrap();
        assert_eq!(i64::from_ne_bytes(counters[..8].try_into().unwrap()), 0);
        for k in 0..files {
            std::fs::remove_file(directory().join(name(k))).unwrap();
        }
    }

    #[test]
    fn only_files_whose_sharers_are_gone_are_swept() {
        let directory =
            std::env::temp_dir().join(format!("cachealloc-sweep-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir(&directory).unwrap();
        let names = || {
            let mut names: Vec<String> = std::fs::read_dir(&directory)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            names.sort();
            names
        };
        // A live sharer's file (its lock held by `live`), a dead one's (no lock), another file.
        let live = new_file(&directory, 7, 0).unwrap();
        std::fs::write(directory.join("cachealloc-ipc-4000000000-0"), [0u8; 8]).unwrap();
        std::fs::write(directory.join("unrelated"), b"x").unwrap();
        assert_eq!(remove_stale_files(&directory), 1);
        assert_eq!(names(), ["cachealloc-ipc-7-0", "unrelated"]);
        // The sharer's lock goes with its mapping, however it ends.
        drop(live);
        assert_eq!(remove_stale_files(&directory), 1);
        assert_eq!(names(), ["unrelated"]);
        std::fs::remove_dir_all(&directory).unwrap();
    }
}
