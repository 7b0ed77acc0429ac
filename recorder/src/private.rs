//! Private trace files: a trace holds command lines, paths and stacks, so its directories are
//! created `0700` and its files `0600` unless the writer is given a wider file mode
//! (`trace_mode` in the shim's configuration).
//!
//! * [`dir_mode`]: a directory's mode from the files' (an `x` bit wherever an `r` bit is given).
//! * [`prepare_dir`]: create a trace directory (and missing parents) with that mode, or check an
//!   existing one — opened without following a symbolic link, it must be this user's (when the
//!   writer knows the user) and nobody else may write into it beyond what the mode grants.
//!   Anything else is refused with one [`Refused`] error, which the shim prints as it is.
//! * [`create_file`]: create a file without following a symbolic link, with exactly the mode
//!   (whatever the umask).

use std::fmt;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// The mode of trace files by default: the user's alone.
pub const DEFAULT_FILE_MODE: u32 = 0o600;

/// The mode of a trace directory whose files have `file_mode`: the owner's `rwx`, and the
/// group's and others' bits of the files with `x` added wherever `r` is given (`0640` gives
/// `0750`).
pub fn dir_mode(file_mode: u32) -> u32 {
    let shared = file_mode & 0o066;
    0o700 | shared | ((shared & 0o044) >> 2)
}

/// Why a trace directory was refused: the whole sentence, naming the directory.
#[derive(Debug)]
pub struct Refused(pub String);

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// Whether `e` is a refusal of [`prepare_dir`] (as opposed to a failure to create or open).
pub fn is_refusal(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Refused>())
}

fn refuse(dir: &Path, why: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        Refused(format!(
            "refusing the trace directory {}: {why} (a trace holds command lines, paths and \
             stacks: its directory must be this user's, not a symbolic link, and not writable \
             by others; see trace_dir, trace_mode)",
            dir.display()
        )),
    )
}

/// Create `dir` (with its missing parents) with [`dir_mode`]`(file_mode)`, or check the existing
/// one (see the module docs). `owner`: the effective user id the directory must belong to
/// (`None`: not checked).
pub fn prepare_dir(dir: &Path, file_mode: u32, owner: Option<u32>) -> io::Result<()> {
    let mode = dir_mode(file_mode);
    let created = match DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // Missing parents: create them (no-op for those that exist), then the directory.
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                DirBuilder::new()
                    .mode(mode)
                    .recursive(true)
                    .create(parent)?;
            }
            match DirBuilder::new().mode(mode).create(dir) {
                Ok(()) => true,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
                Err(e) => return Err(e),
            }
        }
        Err(e) => return Err(e),
    };
    // Opened without following a link: what is checked is what the files will go into.
    let handle = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)
    {
        Ok(handle) => handle,
        Err(_) if fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink()) => {
            return Err(refuse(dir, "it is a symbolic link".to_string()));
        }
        Err(_) if fs::symlink_metadata(dir).is_ok_and(|m| !m.is_dir()) => {
            return Err(refuse(dir, "it is not a directory".to_string()));
        }
        Err(e) => return Err(e),
    };
    let meta = handle.metadata()?;
    if let Some(uid) = owner
        && meta.uid() != uid
    {
        return Err(refuse(
            dir,
            format!(
                "it belongs to user {}, not to this user ({uid})",
                meta.uid()
            ),
        ));
    }
    if created {
        // Exactly the mode, whatever the umask took away (the owner created it just now).
        handle.set_permissions(fs::Permissions::from_mode(mode))?;
        return Ok(());
    }
    let writable_by_others = meta.mode() & 0o022 & !mode;
    if writable_by_others != 0 {
        let who = match writable_by_others {
            0o020 => "its group",
            0o002 => "others",
            _ => "its group and others",
        };
        return Err(refuse(
            dir,
            format!(
                "{who} may write into it (mode {:04o})",
                meta.mode() & 0o7777
            ),
        ));
    }
    Ok(())
}

/// Create (or truncate) the file `path` for writing, without following a symbolic link, with
/// exactly `file_mode`.
pub fn create_file(path: &Path, file_mode: u32) -> io::Result<File> {
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(file_mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    if file.metadata()?.mode() & 0o777 != file_mode {
        file.set_permissions(fs::Permissions::from_mode(file_mode))?;
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("cachealloc-private-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn directory_modes_follow_the_file_mode() {
        assert_eq!(dir_mode(0o600), 0o700);
        assert_eq!(dir_mode(0o640), 0o750);
        assert_eq!(dir_mode(0o660), 0o770);
        assert_eq!(dir_mode(0o644), 0o755);
    }

    #[test]
    fn created_private_then_refused_when_others_may_write() {
        let root = scratch("modes");
        let dir = root.join("a/b");
        prepare_dir(&dir, DEFAULT_FILE_MODE, None).unwrap();
        assert_eq!(fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        assert_eq!(fs::metadata(root.join("a")).unwrap().mode() & 0o777, 0o700);
        let f = create_file(&dir.join("f"), 0o600).unwrap();
        assert_eq!(f.metadata().unwrap().mode() & 0o777, 0o600);
        // Existing and private: accepted again.
        prepare_dir(&dir, DEFAULT_FILE_MODE, None).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
        let e = prepare_dir(&dir, DEFAULT_FILE_MODE, None).unwrap_err();
        assert!(is_refusal(&e), "{e}");
        assert!(
            e.to_string().contains("its group and others may write"),
            "{e}"
        );
        // The group may write when the mode gives it.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o770)).unwrap();
        prepare_dir(&dir, 0o660, None).unwrap();
        // Another owner.
        let uid = fs::metadata(&dir).unwrap().uid();
        let e = prepare_dir(&dir, 0o660, Some(uid + 1)).unwrap_err();
        assert!(
            is_refusal(&e) && e.to_string().contains("belongs to user"),
            "{e}"
        );
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn symbolic_links_are_not_followed() {
        let root = scratch("links");
        fs::create_dir_all(root.join("real")).unwrap();
        std::os::unix::fs::symlink(root.join("real"), root.join("link")).unwrap();
        let e = prepare_dir(&root.join("link"), DEFAULT_FILE_MODE, None).unwrap_err();
        assert!(
            is_refusal(&e) && e.to_string().contains("symbolic link"),
            "{e}"
        );
        std::os::unix::fs::symlink(root.join("elsewhere"), root.join("real/f")).unwrap();
        create_file(&root.join("real/f"), 0o600).unwrap_err();
        assert!(!root.join("elsewhere").exists());
        fs::remove_dir_all(&root).unwrap();
    }
}
