//! The Python integration: in a Python process, the constructor puts a directory holding
//! `sitecustomize.py`, `cachealloc_hooks.py` and the modules it installs (`cachealloc_common.py`,
//! `cachealloc_memory.py`, `cachealloc_history.py`, `cachealloc_categories.py` and
//! `cachealloc_backward_scopes.py`, `cachealloc_torch_allocator.py`, `cachealloc_torch_build.py`
//! and the C++ sources and headers they build; `shim/python/`,
//! embedded in the library)
//! first on `PYTHONPATH`, so that Python runs them at start-up with no change to the program.
//! They adjust what PyTorch cannot do on the `cudaMallocAsync` route (see
//! `cachealloc_hooks.py`); nothing on the allocation path, no import of torch.
//!
//! The files are written once per content into a directory of the user's own
//! (`$XDG_RUNTIME_DIR`, else the temporary directory: `cachealloc-python-<uid>-<hash>/`, mode
//! 0700), which is used only if it belongs to the user and is not writable by others; anything
//! else turns the integration off with a debug message. `python:off` turns it off.

use std::ffi::CStr;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::log;

/// The files of the integration: name and text.
const FILES: [(&str, &str); 14] = [
    (
        "sitecustomize.py",
        include_str!("../../python/sitecustomize.py"),
    ),
    (
        "cachealloc_hooks.py",
        include_str!("../../python/cachealloc_hooks.py"),
    ),
    (
        "cachealloc_common.py",
        include_str!("../../python/cachealloc_common.py"),
    ),
    (
        "cachealloc_memory.py",
        include_str!("../../python/cachealloc_memory.py"),
    ),
    (
        "cachealloc_history.py",
        include_str!("../../python/cachealloc_history.py"),
    ),
    (
        "cachealloc_categories.py",
        include_str!("../../python/cachealloc_categories.py"),
    ),
    (
        "cachealloc_backward_scopes.py",
        include_str!("../../python/cachealloc_backward_scopes.py"),
    ),
    (
        "cachealloc_torch_build.py",
        include_str!("../../python/cachealloc_torch_build.py"),
    ),
    (
        "cachealloc_torch_scopes.cpp",
        include_str!("../../python/cachealloc_torch_scopes.cpp"),
    ),
    (
        "cachealloc_torch_allocator.py",
        include_str!("../../python/cachealloc_torch_allocator.py"),
    ),
    (
        "cachealloc_torch_allocator.cpp",
        include_str!("../../python/cachealloc_torch_allocator.cpp"),
    ),
    (
        "cachealloc_torch_history.h",
        include_str!("../../python/cachealloc_torch_history.h"),
    ),
    (
        "cachealloc_torch_library.h",
        include_str!("../../python/cachealloc_torch_library.h"),
    ),
    (
        "cachealloc_torch_trackers.h",
        include_str!("../../python/cachealloc_torch_trackers.h"),
    ),
];

/// Constructor work: in a Python process, install the integration's directory first on
/// `PYTHONPATH`.
pub fn on_load() {
    if !is_python_process() {
        return;
    }
    match install() {
        Ok(dir) => {
            let path = match std::env::var_os("PYTHONPATH") {
                Some(old) if !old.is_empty() => {
                    let mut joined = dir.clone().into_os_string();
                    joined.push(":");
                    joined.push(old);
                    joined
                }
                _ => dir.clone().into_os_string(),
            };
            // SAFETY: this runs in the library's constructor, before `main`, while the process
            // has no other threads that could read the environment concurrently.
            unsafe { std::env::set_var("PYTHONPATH", &path) };
            log::debug!("Python integration from {}", dir.display());
        }
        Err(why) => log::debug!("Python integration off: {why}"),
    }
}

/// Whether this process is a Python interpreter (or embeds one): it defines `Py_BytesMain` or
/// `Py_Initialize`.
fn is_python_process() -> bool {
    [c"Py_BytesMain", c"Py_Initialize"]
        .iter()
        .any(|name: &&CStr| {
            // SAFETY: a NUL-terminated name; looking a symbol up in the global scope runs no code.
            !unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }.is_null()
        })
}

/// Write the files (once per content) and return their directory.
fn install() -> Result<PathBuf, String> {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    FILES.hash(&mut hasher);
    // SAFETY: getuid cannot fail and has no preconditions.
    let uid = unsafe { libc::getuid() };
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_dir())
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("cachealloc-python-{uid}-{:016x}", hasher.finish()));
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
    }
    let meta = std::fs::symlink_metadata(&dir).map_err(|e| e.to_string())?;
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o022 != 0 {
        return Err(format!(
            "{} is not a directory of this user's alone",
            dir.display()
        ));
    }
    for (name, text) in FILES {
        write_if_changed(&dir, name, text)?;
    }
    Ok(dir)
}

/// Write `text` to `dir/name` unless it holds it already (atomically: a temporary file, then a
/// rename, so that a concurrent start never reads half a file).
fn write_if_changed(dir: &Path, name: &str, text: &str) -> Result<(), String> {
    let path = dir.join(name);
    if std::fs::read_to_string(&path).is_ok_and(|t| t == text) {
        return Ok(());
    }
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(text.as_bytes())?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|e| format!("cannot write {}: {e}", path.display()))
}
