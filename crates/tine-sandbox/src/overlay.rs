//! Overlay workspaces: the base snapshot materialized once as the read-only
//! lower layer (shared by every sandbox built on it), a private upper layer per
//! sandbox, mounted on the host so that the supervisor can snapshot the upper
//! layer and restore through the merged view while the sandbox runs.

use std::ffi::CString;
use std::io;
use std::path::{Path, PathBuf};

use rustix::mount::{MountFlags, UnmountFlags};
use tine_store::{ErrorKind, HasKind};

#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    #[error(
        "overlay: path {} contains ',', ':' or a newline, which overlayfs options cannot carry; use another directory",
        path.display()
    )]
    BadPath { path: PathBuf },
    #[error("overlay: {step} {}: {source}", path.display())]
    Io {
        step: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

impl HasKind for OverlayError {
    fn kind(&self) -> ErrorKind {
        match self {
            OverlayError::BadPath { .. } => ErrorKind::InvalidInput,
            OverlayError::Io { source, .. }
                if matches!(
                    source.raw_os_error(),
                    Some(libc::EPERM) | Some(libc::ENODEV) | Some(libc::EINVAL)
                ) =>
            {
                ErrorKind::Unsupported
            }
            OverlayError::Io { .. } => ErrorKind::Io,
        }
    }
}

/// The directories of one overlay workspace.
#[derive(Debug, Clone)]
pub struct Overlay {
    pub lower: PathBuf,
    pub upper: PathBuf,
    /// overlayfs's scratch directory (same filesystem as `upper`).
    pub work: PathBuf,
    pub merged: PathBuf,
    /// What `upper` may hold (a project quota, where the filesystem keeps
    /// them; see [`crate::quota`]).
    pub limit_bytes: Option<u64>,
}

/// Detaches an overlay when dropped: a mount made for one operation is gone
/// on every way out of it, early returns included.
#[derive(Debug)]
pub struct Unmounting<'a>(pub &'a Overlay);

impl Unmounting<'_> {
    /// Leaves the overlay mounted: someone else (a supervisor) owns it now.
    pub fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for Unmounting<'_> {
    fn drop(&mut self) {
        let _ = self.0.unmount();
    }
}

fn checked(p: &Path) -> Result<String, OverlayError> {
    let s = p
        .to_str()
        .ok_or_else(|| OverlayError::BadPath { path: p.into() })?;
    if s.contains([',', ':', '\n']) {
        return Err(OverlayError::BadPath { path: p.into() });
    }
    Ok(s.to_string())
}

impl Overlay {
    /// Mounts the overlay on `merged`, creating `upper`, `work` and `merged` if
    /// needed. The mount is `volatile`: overlayfs skips every sync — copy-ups,
    /// and `fsync` calls of the sandbox's programs. A live sandbox is the hot tier:
    /// what must survive a crash is in its snapshots. After a crash overlayfs
    /// refuses such an upper layer until its work directory is cleared, which
    /// this does (the upper layer may then miss the last writes before the crash).
    /// `owner`: who owns the sandbox's files (the root of its user
    /// namespace, as the host sees it); the upper and lower layers are made
    /// theirs.
    pub fn mount(&self, owner: Option<(u32, u32)>) -> Result<(), OverlayError> {
        if self.work.join("work/incompat").exists() {
            let _ = std::fs::remove_dir_all(&self.work);
        }
        self.make_upper()?;
        std::fs::create_dir_all(&self.merged).map_err(|source| OverlayError::Io {
            step: "create directory",
            path: self.merged.clone(),
            source,
        })?;
        if let Some(owner) = owner {
            // Layers made before sandboxes had user namespaces (or bases
            // materialized by root) become theirs once; later this is a stat.
            for d in [&self.lower, &self.upper] {
                chown_tree(d, owner).map_err(|source| OverlayError::Io {
                    step: "give the sandbox's root",
                    path: d.clone(),
                    source,
                })?;
            }
        }
        let opts = format!(
            "lowerdir={},upperdir={},workdir={},volatile",
            checked(&self.lower)?,
            checked(&self.upper)?,
            checked(&self.work)?
        );
        let data = CString::new(opts).map_err(|_| OverlayError::BadPath {
            path: self.lower.clone(),
        })?;
        rustix::mount::mount(
            "overlay",
            &self.merged,
            "overlay",
            MountFlags::NOSUID | MountFlags::NODEV,
            data.as_c_str(),
        )
        .map_err(|e| OverlayError::Io {
            step: "mount overlay on",
            path: self.merged.clone(),
            source: e.into(),
        })
    }

    /// Creates the upper and work directories if needed, a new upper layer
    /// under its disk limit from the start (so that what is copied into it
    /// before the first mount, a fork's seed, counts too).
    pub fn make_upper(&self) -> Result<(), OverlayError> {
        let fresh = !self.upper.exists();
        for d in [&self.upper, &self.work] {
            std::fs::create_dir_all(d).map_err(|source| OverlayError::Io {
                step: "create directory",
                path: d.clone(),
                source,
            })?;
        }
        match self.limit_bytes {
            Some(bytes) => self.limit(bytes, fresh),
            None => Ok(()),
        }
    }

    /// Puts the upper layer (and the work directory, where copy-ups begin)
    /// under a project quota of `bytes` ([`crate::quota::limit`]).
    fn limit(&self, bytes: u64, fresh: bool) -> Result<(), OverlayError> {
        let seed = tine_fs::paths::stable_hash(self.upper.as_os_str().as_encoded_bytes());
        crate::quota::limit(&[&self.upper, &self.work], bytes, seed, fresh)
            .map(|_| ())
            .map_err(|source| OverlayError::Io {
                step: "set the disk limit (project quota) of",
                path: self.upper.clone(),
                source,
            })
    }

    /// Whether `merged` is a mount point now (compared with its parent's device).
    pub fn is_mounted(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        let parent = self.merged.parent().unwrap_or(Path::new("/"));
        match (std::fs::metadata(&self.merged), std::fs::metadata(parent)) {
            (Ok(m), Ok(p)) => m.dev() != p.dev(),
            _ => false,
        }
    }

    /// Detaches the overlay (lazily: a process still inside keeps its view).
    pub fn unmount(&self) -> Result<(), OverlayError> {
        match rustix::mount::unmount(&self.merged, UnmountFlags::DETACH) {
            Ok(()) => Ok(()),
            Err(rustix::io::Errno::INVAL) if !self.is_mounted() => Ok(()),
            Err(e) => Err(OverlayError::Io {
                step: "unmount overlay",
                path: self.merged.clone(),
                source: e.into(),
            }),
        }
    }
}

/// What an entry of an upper directory means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpperEntry {
    /// A file, symlink or directory that exists in the merged view.
    Present,
    /// A whiteout: the lower entry of this name is deleted.
    Whiteout,
    /// A directory that replaces the lower one entirely (nothing below shows through).
    OpaqueDir,
}

/// Classifies an entry of an upper directory (overlayfs conventions: a
/// whiteout is a 0:0 character device; an opaque directory carries the
/// `trusted.overlay.opaque` xattr "y").
pub fn classify(path: &Path) -> io::Result<UpperEntry> {
    let m = std::fs::symlink_metadata(path)?;
    Ok(if tine_fs::scan::is_whiteout(&m) {
        UpperEntry::Whiteout
    } else if m.is_dir() && tine_fs::scan::is_opaque(path) {
        UpperEntry::OpaqueDir
    } else {
        UpperEntry::Present
    })
}

/// Makes everything in `dir` owned by `owner`, unless `dir` already is
/// (then it was done before, or made so); never follows a symlink.
pub fn chown_tree(dir: &Path, (uid, gid): (u32, u32)) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    use std::rc::Rc;
    let md = std::fs::symlink_metadata(dir)?;
    if (md.uid(), md.gid()) == (uid, gid) {
        return Ok(());
    }
    // Each directory with the anchor its path goes through (deep trees are
    // named through descriptors, held while something below still needs them).
    type Held = Option<Rc<tine_fs::paths::Anchor>>;
    let mut stack: Vec<(PathBuf, Held)> = vec![(dir.to_path_buf(), None)];
    while let Some((d, held)) = stack.pop() {
        let anchor = tine_fs::paths::Anchor::at(&d)?.map(Rc::new);
        let (base, keep) = match &anchor {
            Some(a) => (a.path().to_path_buf(), anchor.clone()),
            None => (d.clone(), held.clone()),
        };
        for e in std::fs::read_dir(&base)? {
            let e = e?;
            let p = base.join(e.file_name());
            if e.file_type()?.is_dir() {
                stack.push((p, keep.clone()));
            } else {
                std::os::unix::fs::lchown(&p, Some(uid), Some(gid))?;
            }
        }
        // The top one at the very end: its owner says it is done.
        if d != dir {
            std::os::unix::fs::lchown(&d, Some(uid), Some(gid))?;
        }
    }
    std::os::unix::fs::lchown(dir, Some(uid), Some(gid))
}

/// Copies an upper layer — files, symlinks, directories with their modes,
/// whiteouts and opaque marks — into `dst` (an empty upper layer), so that
/// sandboxes forked from one snapshot are seeded by copying the first one's
/// difference instead of computing it again. overlayfs's other bookkeeping
/// xattrs are not copied: it merges directories by path without them.
pub fn copy_upper(src: &Path, dst: &Path) -> io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    // Deep below the root, both are named through descriptors (a deep `dst`
    // was made by the caller already).
    let src_anchor = tine_fs::paths::Anchor::at(src)?;
    let src = src_anchor.as_ref().map_or(src, |a| a.path());
    let dst_anchor = tine_fs::paths::Anchor::at(dst)?;
    let dst = dst_anchor.as_ref().map_or(dst, |a| a.path());
    std::fs::create_dir_all(dst)?;
    for e in std::fs::read_dir(src)? {
        let e = e?;
        let (from, to) = (e.path(), dst.join(e.file_name()));
        let md = std::fs::symlink_metadata(&from)?;
        let ft = md.file_type();
        if ft.is_dir() {
            match std::fs::create_dir(&to) {
                Err(err) if err.kind() != io::ErrorKind::AlreadyExists => return Err(err),
                _ => {}
            }
            if tine_fs::scan::is_opaque(&from) {
                rustix::fs::lsetxattr(
                    &to,
                    tine_fs::scan::OPAQUE_XATTR,
                    b"y",
                    rustix::fs::XattrFlags::empty(),
                )
                .map_err(io::Error::from)?;
            }
            copy_upper(&from, &to)?;
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(md.mode() & 0o7777))?;
        } else if ft.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&from)?, &to)?;
        } else if tine_fs::scan::is_whiteout(&md) {
            rustix::fs::mknodat(
                rustix::fs::CWD,
                &to,
                rustix::fs::FileType::CharacterDevice,
                rustix::fs::Mode::empty(),
                0,
            )
            .map_err(io::Error::from)?;
        } else if ft.is_file() {
            let src = std::fs::File::open(&from)?;
            let dst = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&to)?;
            tine_fs::sparse::copy(&src, &dst)?;
            dst.set_permissions(std::fs::Permissions::from_mode(md.mode() & 0o7777))?;
        } else {
            continue;
        }
        // As the original's: each keeps the owner the sandbox gave it.
        std::os::unix::fs::lchown(&to, Some(md.uid()), Some(md.gid()))?;
        if ft.is_file() && md.mode() & 0o6000 != 0 {
            // A chown clears the set-user-ID and set-group-ID bits.
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(md.mode() & 0o7777))?;
        }
    }
    // The top one last, as the original's: that says it is done (a mount's
    // `chown_tree` then leaves the owners alone).
    let top = std::fs::symlink_metadata(src)?;
    std::os::unix::fs::lchown(dst, Some(top.uid()), Some(top.gid()))
}
