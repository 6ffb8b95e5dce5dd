//! Scratch directories of work in progress (an image's layers unpacked
//! before they are snapshotted, a build step's files, a merge's result):
//! `REPO/staging/NAME/`, each held by an exclusive `flock` on
//! `REPO/staging/NAME.lock` for as long as its maker lives. Removed when
//! the [`Staging`] drops; one whose maker was killed is found by its lock
//! being free, and `gc` removes it ([`stale`]). Nothing in a staging
//! directory is ever read as the repository's own: it sits below a
//! directory of its own, never beside the database or the packs.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

use crate::repo::Repository;

/// The directory below the repository that holds them.
pub const STAGING_DIR: &str = "staging";
const LOCK_SUFFIX: &str = ".lock";

/// A scratch directory in the repository, removed on drop.
#[derive(Debug)]
pub struct Staging {
    dir: PathBuf,
    lock_path: PathBuf,
    _lock: File,
}

impl Staging {
    /// A new empty directory (0700) for `what` (a word: `import`, `build`).
    pub fn new(repo: &Repository, what: &str) -> io::Result<Staging> {
        let parent = repo.path().join(STAGING_DIR);
        match fs::create_dir(&parent) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        // A unique name as the packs' temporary files have (pid, counter, time).
        let unique = crate::pack::temp_path(&parent, "");
        let unique = unique
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default();
        let name = format!(
            "{what}-{}",
            unique.trim_start_matches(crate::pack::TEMP_PREFIX)
        );
        let lock_path = parent.join(format!("{name}{LOCK_SUFFIX}"));
        // Locked under a name `stale` does not list, then given its own: a
        // gc never finds it unlocked.
        let unnamed = parent.join(format!("{name}{LOCK_SUFFIX}.new"));
        let lock = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&unnamed)?;
        lock.try_lock().map_err(|e| match e {
            fs::TryLockError::Error(e) => e,
            fs::TryLockError::WouldBlock => io::Error::other("a new lock file is locked"),
        })?;
        fs::rename(&unnamed, &lock_path)?;
        let dir = parent.join(&name);
        {
            use std::os::unix::fs::DirBuilderExt;
            fs::DirBuilder::new().mode(0o700).create(&dir)?;
        }
        Ok(Staging {
            dir,
            lock_path,
            _lock: lock,
        })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // std's remove_dir_all never follows a link out of the directory.
        let _ = fs::remove_dir_all(&self.dir);
        let _ = fs::remove_file(&self.lock_path);
    }
}

/// A staging directory whose maker is gone, its lock (when it has one)
/// held so that nothing takes it meanwhile.
#[derive(Debug)]
pub struct Stale {
    pub dir: PathBuf,
    lock: Option<(PathBuf, File)>,
}

/// Staging directories whose maker is gone: their lock can be taken.
pub fn stale(repo: &Repository) -> io::Result<Vec<Stale>> {
    let parent = repo.path().join(STAGING_DIR);
    let rd = match fs::read_dir(&parent) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".new") {
            // A lock file being named (or one its maker died naming).
            continue;
        }
        match name.strip_suffix(LOCK_SUFFIX) {
            Some(stem) => {
                let Ok(f) = OpenOptions::new().write(true).open(e.path()) else {
                    continue;
                };
                if f.try_lock().is_ok() {
                    out.push(Stale {
                        dir: parent.join(stem),
                        lock: Some((e.path(), f)),
                    });
                }
            }
            // A directory without its lock file (its maker died between
            // removing the two).
            None if !parent.join(format!("{name}{LOCK_SUFFIX}")).exists() => out.push(Stale {
                dir: e.path(),
                lock: None,
            }),
            None => {}
        }
    }
    Ok(out)
}

/// Removes what [`stale`] found: each directory whole (made writable where
/// it is not: an image's read-only directories), then its lock file. One
/// that cannot be removed stays, listed by the next gc again; it never
/// fails the gc.
pub fn remove_stale(found: Vec<Stale>) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for s in found {
        let gone = match fs::remove_dir_all(&s.dir) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => true,
            Err(_) => {
                writable(&s.dir);
                fs::remove_dir_all(&s.dir).is_ok()
            }
        };
        if gone {
            removed.push(s.dir.clone());
            if let Some((path, _held)) = &s.lock
                && fs::remove_file(path).is_ok()
            {
                removed.push(path.clone());
            }
        }
    }
    Ok(removed)
}

/// Gives the owner write and search permission on every directory below
/// `dir` (never following a link).
fn writable(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(md) = fs::symlink_metadata(&d) else {
            continue;
        };
        if !md.is_dir() {
            continue;
        }
        let _ = fs::set_permissions(
            &d,
            fs::Permissions::from_mode(md.permissions().mode() | 0o700),
        );
        if let Ok(rd) = fs::read_dir(&d) {
            todo.extend(rd.flatten().map(|e| e.path()));
        }
    }
}
