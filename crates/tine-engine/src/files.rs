//! A live sandbox's files as its processes see them (`/workspace/...`),
//! reached from the host through the sandbox's workspace directory. Every
//! path is resolved by the kernel inside that directory (`openat2` with
//! `RESOLVE_IN_ROOT`), so neither `..` nor a symlink planted by the sandbox
//! can lead outside it; writes are atomic (temporary file, fsync, rename).

use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags};
use serde::Serialize;

use crate::EngineError;

/// Where a sandbox's workspace appears to its processes.
pub const SANDBOX_ROOT: &str = tine_sandbox::WORKSPACE;

/// A directory listing stops here (a larger one is refused, not cut short).
pub const MAX_LIST_ENTRIES: usize = 100_000;

/// One entry of a directory listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct FileEntry {
    pub name: String,
    /// The path as the sandbox sees it (`/workspace/...`).
    pub path: String,
    pub kind: tine_store::EntryKind,
    pub size: u64,
    pub mode: u32,
    pub mtime_ns: i64,
}

/// `path` (as the sandbox sees it, or relative to `/workspace`) as a path
/// relative to the workspace, normalized; `""` is the workspace itself.
pub fn relative(path: &str) -> Result<String, EngineError> {
    relative_in(path, SANDBOX_ROOT)
}

/// [`relative`], for a sandbox whose files are at `shown` (`/` for a
/// sandbox whose root is an image's: every absolute path is its own).
pub fn relative_in(path: &str, shown: &str) -> Result<String, EngineError> {
    let bad = |reason: &str| EngineError::BadPath {
        path: path.to_string(),
        reason: reason.to_string(),
    };
    if path.contains('\0') {
        return Err(bad("it contains a NUL byte"));
    }
    // What the kernel would refuse (ENAMETOOLONG) is refused by name.
    if path.len() > 4095 {
        return Err(bad("it is longer than 4,095 bytes"));
    }
    let top = shown.trim_end_matches('/');
    let rest = if let Some(abs) = path.strip_prefix('/') {
        match abs.strip_prefix(top.trim_start_matches('/')) {
            Some(r) if top.is_empty() || r.is_empty() || r.starts_with('/') => r,
            _ => {
                return Err(bad(&format!(
                    "only files under {top} are reachable through the API"
                )));
            }
        }
    } else {
        path
    };
    let mut parts = Vec::new();
    for c in rest.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(bad("'..' is not allowed in a path")),
            c if c.len() > 255 => return Err(bad("a name in it is longer than 255 bytes")),
            c => parts.push(c),
        }
    }
    Ok(parts.join("/"))
}

/// `rel` as the sandbox sees it, its files at `shown` (`/workspace`, or
/// `/` for a sandbox whose root is an image's).
pub fn sandbox_path(shown: &str, rel: &str) -> String {
    match (shown.trim_end_matches('/'), rel.is_empty()) {
        ("", true) => "/".to_string(),
        (top, true) => top.to_string(),
        (top, false) => format!("{top}/{rel}"),
    }
}

fn file_error<'a>(
    shown: &'a str,
    rel: &'a str,
    step: &'static str,
) -> impl FnOnce(std::io::Error) -> EngineError + 'a {
    move |source| EngineError::File {
        path: sandbox_path(shown, rel),
        step,
        source,
    }
}

fn open_root(root: &Path, shown: &str) -> Result<OwnedFd, EngineError> {
    rustix::fs::open(
        root,
        OFlags::DIRECTORY | OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| EngineError::File {
        path: sandbox_path(shown, ""),
        step: "open the workspace",
        source: e.into(),
    })
}

/// Opens `rel` inside `root` (the kernel keeps the walk inside it).
fn open_in(root: &OwnedFd, rel: &str, flags: OFlags) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat2(
        root,
        if rel.is_empty() { "." } else { rel },
        flags | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    )
}

/// Reads a regular file of at most `max` bytes.
pub fn read(root: &Path, rel: &str, max: u64) -> Result<Vec<u8>, EngineError> {
    read_at(root, SANDBOX_ROOT, rel, max)
}

/// [`read`], of a sandbox whose files are at `shown`.
pub fn read_at(root: &Path, shown: &str, rel: &str, max: u64) -> Result<Vec<u8>, EngineError> {
    let root = open_root(root, shown)?;
    let fd = open_in(&root, rel, OFlags::RDONLY | OFlags::NONBLOCK)
        .map_err(|e| file_error(shown, rel, "open")(e.into()))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| file_error(shown, rel, "stat")(e.into()))?;
    let kind = rustix::fs::FileType::from_raw_mode(st.st_mode);
    if kind != rustix::fs::FileType::RegularFile {
        return Err(EngineError::BadPath {
            path: sandbox_path(shown, rel),
            reason: format!(
                "it is a {}, not a regular file{}",
                kind_of(kind).as_str(),
                if kind == rustix::fs::FileType::Directory {
                    " (list it instead)"
                } else {
                    ""
                }
            ),
        });
    }
    if st.st_size as u64 > max {
        return Err(EngineError::TooLarge {
            what: format!("file {}", sandbox_path(shown, rel)),
            size: st.st_size as u64,
            limit: max,
        });
    }
    let mut data = Vec::with_capacity(st.st_size as usize);
    std::fs::File::from(fd)
        .take(max + 1)
        .read_to_end(&mut data)
        .map_err(file_error(shown, rel, "read"))?;
    if data.len() as u64 > max {
        return Err(EngineError::TooLarge {
            what: format!("file {}", sandbox_path(shown, rel)),
            size: data.len() as u64,
            limit: max,
        });
    }
    Ok(data)
}

fn kind_of(k: rustix::fs::FileType) -> tine_store::EntryKind {
    use rustix::fs::FileType as T;
    use tine_store::EntryKind as K;
    match k {
        T::RegularFile => K::File,
        T::Directory => K::Dir,
        T::Symlink => K::Symlink,
        _ => K::Other,
    }
}

/// Who owns what a write makes: the workspace's owner (an isolated
/// sandbox's root, as the host sees it), not the daemon.
fn owner_of(root: &OwnedFd) -> (Option<rustix::fs::Uid>, Option<rustix::fs::Gid>) {
    match rustix::fs::fstat(root) {
        Ok(st) => (
            Some(rustix::fs::Uid::from_raw(st.st_uid)),
            Some(rustix::fs::Gid::from_raw(st.st_gid)),
        ),
        Err(_) => (None, None),
    }
}

/// The directory `rel` inside `root`, made (with its parents) if missing.
fn ensure_dir(root: &OwnedFd, shown: &str, rel: &str) -> Result<OwnedFd, EngineError> {
    let flags = OFlags::DIRECTORY | OFlags::RDONLY;
    match open_in(root, rel, flags) {
        Ok(fd) => return Ok(fd),
        Err(rustix::io::Errno::NOENT) => {}
        Err(e) => return Err(file_error(shown, rel, "open directory")(e.into())),
    }
    let (parent, name) = rel.rsplit_once('/').unwrap_or(("", rel));
    let pfd = ensure_dir(root, shown, parent)?;
    let (uid, gid) = owner_of(root);
    match rustix::fs::mkdirat(&pfd, name, Mode::from_raw_mode(0o755))
        .and_then(|()| rustix::fs::chownat(&pfd, name, uid, gid, AtFlags::SYMLINK_NOFOLLOW))
    {
        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
        Err(e) => return Err(file_error(shown, rel, "create directory")(e.into())),
    }
    open_in(root, rel, flags).map_err(|e| file_error(shown, rel, "open directory")(e.into()))
}

static WRITE_SEQ: AtomicU64 = AtomicU64::new(0);

/// Writes what `data` reads to `rel` atomically (temporary file beside it,
/// fsync, rename), making missing parent directories; a read error leaves
/// the old file as it was. The mode is `mode`, else that of the file
/// replaced, else 0644.
pub fn write(
    root: &Path,
    rel: &str,
    data: &mut dyn std::io::Read,
    mode: Option<u32>,
) -> Result<FileEntry, EngineError> {
    write_at(root, SANDBOX_ROOT, rel, data, mode)
}

/// [`write`], to a sandbox whose files are at `shown`.
pub fn write_at(
    root: &Path,
    shown: &str,
    rel: &str,
    data: &mut dyn std::io::Read,
    mode: Option<u32>,
) -> Result<FileEntry, EngineError> {
    if rel.is_empty() {
        return Err(EngineError::BadPath {
            path: sandbox_path(shown, ""),
            reason: "it is the workspace directory, not a file".into(),
        });
    }
    if let Some(m) = mode
        && (m > 0o7777 || m & 0o6000 != 0)
    {
        return Err(EngineError::Invalid {
            message: format!(
                "mode {m:o} for {}: give permission bits (at most 1777); set-user-ID and \
                 set-group-ID files are made inside the sandbox, not written into it",
                sandbox_path(shown, rel)
            ),
        });
    }
    let root_fd = open_root(root, shown)?;
    let (parent, name) = rel.rsplit_once('/').unwrap_or(("", rel));
    let dir = ensure_dir(&root_fd, shown, parent)?;
    let existing = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW).ok();
    if let Some(st) = &existing
        && rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory
    {
        return Err(EngineError::BadPath {
            path: sandbox_path(shown, rel),
            reason: "it is a directory".into(),
        });
    }
    let mode = mode
        .or_else(|| {
            existing
                .filter(|st| {
                    rustix::fs::FileType::from_raw_mode(st.st_mode)
                        == rustix::fs::FileType::RegularFile
                })
                .map(|st| st.st_mode & 0o7777)
        })
        .unwrap_or(0o644)
        & 0o7777;
    let tmp = format!(
        ".tine-write-{}-{}",
        std::process::id(),
        WRITE_SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let fd = rustix::fs::openat(
        &dir,
        tmp.as_str(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| file_error(shown, rel, "create")(e.into()))?;
    let (uid, gid) = owner_of(&root_fd);
    let result = (|| -> std::io::Result<()> {
        rustix::fs::fchown(&fd, uid, gid)?;
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))?;
        let mut f = std::fs::File::from(fd);
        std::io::copy(data, &mut f)?;
        f.sync_all()?;
        rustix::fs::renameat(&dir, tmp.as_str(), &dir, name)?;
        rustix::fs::fsync(&dir)?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = rustix::fs::unlinkat(&dir, tmp.as_str(), AtFlags::empty());
        return Err(file_error(shown, rel, "write")(e));
    }
    entry(&dir, shown, name, rel)
}

fn entry(dir: &impl AsFd, shown: &str, name: &str, rel: &str) -> Result<FileEntry, EngineError> {
    let st = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| file_error(shown, rel, "stat")(e.into()))?;
    Ok(FileEntry {
        name: name.to_string(),
        path: sandbox_path(shown, rel),
        kind: kind_of(rustix::fs::FileType::from_raw_mode(st.st_mode)),
        size: st.st_size as u64,
        mode: st.st_mode & 0o7777,
        mtime_ns: st.st_mtime * 1_000_000_000 + st.st_mtime_nsec as i64,
    })
}

/// The entries of directory `rel`, sorted by name.
pub fn list(root: &Path, rel: &str) -> Result<Vec<FileEntry>, EngineError> {
    list_at(root, SANDBOX_ROOT, rel)
}

/// [`list`], of a sandbox whose files are at `shown`.
pub fn list_at(root: &Path, shown: &str, rel: &str) -> Result<Vec<FileEntry>, EngineError> {
    let root_fd = open_root(root, shown)?;
    let fd = open_in(&root_fd, rel, OFlags::DIRECTORY | OFlags::RDONLY).map_err(|e| {
        if e == rustix::io::Errno::NOTDIR {
            EngineError::BadPath {
                path: sandbox_path(shown, rel),
                reason: "it is not a directory (read it instead)".into(),
            }
        } else {
            file_error(shown, rel, "open directory")(e.into())
        }
    })?;
    let mut out = Vec::new();
    let dir = rustix::fs::Dir::read_from(&fd)
        .map_err(|e| file_error(shown, rel, "read directory")(e.into()))?;
    for ent in dir {
        let ent = ent.map_err(|e| file_error(shown, rel, "read directory")(e.into()))?;
        let name = ent.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        let Ok(name) = std::str::from_utf8(name) else {
            continue;
        };
        if out.len() == MAX_LIST_ENTRIES {
            return Err(EngineError::TooLarge {
                what: format!("directory {}", sandbox_path(shown, rel)),
                size: MAX_LIST_ENTRIES as u64 + 1,
                limit: MAX_LIST_ENTRIES as u64,
            });
        }
        let child = if rel.is_empty() {
            name.to_string()
        } else {
            format!("{rel}/{name}")
        };
        match entry(&fd, shown, name, &child) {
            Ok(e) => out.push(e),
            // Removed since it was listed.
            Err(EngineError::File { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_taken_relative_to_the_workspace_and_never_escape() {
        assert_eq!(relative("/workspace").unwrap(), "");
        assert_eq!(relative("/workspace/").unwrap(), "");
        assert_eq!(relative("/workspace/a//b/./c").unwrap(), "a/b/c");
        assert_eq!(relative("a/b").unwrap(), "a/b");
        assert_eq!(relative("").unwrap(), "");
        for bad in [
            "/etc/passwd",
            "/workspacex/a",
            "/workspace/../etc",
            "a/../../b",
            "..",
            "a\0b",
        ] {
            let e = relative(bad).unwrap_err();
            assert!(
                matches!(e, EngineError::BadPath { .. }),
                "{bad:?} gave {e:?}"
            );
        }
    }

    #[test]
    fn symlinks_resolve_inside_the_workspace() {
        let t = tempfile::tempdir().unwrap();
        let ws = t.path().join("ws");
        std::fs::create_dir(&ws).unwrap();
        std::fs::write(t.path().join("secret"), b"host").unwrap();
        std::os::unix::fs::symlink("../secret", ws.join("up")).unwrap();
        std::os::unix::fs::symlink("/secret", ws.join("abs")).unwrap();
        std::fs::write(ws.join("secret"), b"inside").unwrap();
        // Both resolve as the sandbox would see them: at the workspace's root.
        assert_eq!(read(&ws, "up", 100).unwrap(), b"inside");
        assert_eq!(read(&ws, "abs", 100).unwrap(), b"inside");
        // Writing through a symlink replaces the link, never its target.
        write(&ws, "up", &mut &b"new"[..], None).unwrap();
        assert_eq!(std::fs::read(t.path().join("secret")).unwrap(), b"host");
        assert_eq!(std::fs::read(ws.join("secret")).unwrap(), b"inside");
        assert_eq!(std::fs::read(ws.join("up")).unwrap(), b"new");
    }

    #[test]
    fn write_makes_parents_keeps_modes_and_lists_sorted() {
        let t = tempfile::tempdir().unwrap();
        let ws = t.path();
        let e = write(ws, "a/b/c.txt", &mut &b"hello"[..], None).unwrap();
        assert_eq!(
            (e.kind, e.size, e.mode),
            (tine_store::EntryKind::File, 5, 0o644)
        );
        assert_eq!(e.path, "/workspace/a/b/c.txt");
        write(ws, "a/b/x.sh", &mut &b"#!/bin/sh\n"[..], Some(0o755)).unwrap();
        let again = write(ws, "a/b/x.sh", &mut &b"#!/bin/sh\necho\n"[..], None).unwrap();
        assert_eq!(again.mode, 0o755, "a rewrite keeps the mode");
        let names: Vec<_> = list(ws, "a/b")
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names, ["c.txt", "x.sh"]);
        assert!(matches!(
            read(ws, "a/b/c.txt", 4),
            Err(EngineError::TooLarge { .. })
        ));
        assert!(matches!(
            read(ws, "a", 100),
            Err(EngineError::BadPath { .. })
        ));
        assert!(matches!(
            write(ws, "a/b", &mut &b"x"[..], None),
            Err(EngineError::BadPath { .. })
        ));
        // No temporary file is left behind.
        assert_eq!(list(ws, "a/b").unwrap().len(), 2);
    }
}
