//! Names from images and archives, and the one way they are written: every
//! path a layer, an archive or a layout names is an [`EntryPath`] (relative,
//! no `..`, no NUL, whiteouts only of real names), and every file made from
//! one goes through a [`Beneath`], a directory under which each lookup is
//! resolved by the kernel with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`: no
//! component, first or last, is followed through a link, and nothing
//! resolves above the directory, whatever raced it meanwhile.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags};

/// A whiteout's name prefix (OCI image spec, "Whiteouts").
pub const WHITEOUT: &str = ".wh.";
/// The opaque whiteout: everything lower layers put in its directory goes.
pub const OPAQUE: &str = ".wh..wh..opq";
/// Longest name of one component (the kernel's `NAME_MAX`).
const NAME_MAX: usize = 255;

/// Why a name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("it climbs out with `..`")]
    Climbs,
    #[error("it holds a NUL byte")]
    Nul,
    #[error("a component is over {NAME_MAX} bytes")]
    TooLong,
    #[error("it is {depth} levels deep, over the limit of {limit}")]
    TooDeep { depth: usize, limit: usize },
    #[error("a whiteout must name an entry: `.wh.` of {0:?} would remove a directory above it")]
    WhiteoutOfItself(String),
    #[error("names starting `.wh..wh.` are reserved, and only `.wh..wh..opq` has a meaning")]
    ReservedWhiteout,
    #[error(
        "the name `{0}` stands for a whiteout in an image layer; a file of that name cannot be written into one"
    )]
    LooksLikeWhiteout(String),
}

/// A relative path below an image's root: one or more plain components.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EntryPath(PathBuf);

/// What a whiteout entry removes from the layers below.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Whiteout {
    /// Everything in this directory (`None`: the root).
    Opaque(Option<EntryPath>),
    /// This entry.
    Hides(EntryPath),
}

impl EntryPath {
    /// Parses a name as archives give it (`/a`, `./a//b/`, `a/./b` are all
    /// fine); `None` for the root itself. `..`, NUL and over-long components
    /// are refused.
    pub fn parse(raw: &[u8]) -> Result<Option<EntryPath>, NameError> {
        if raw.contains(&0) {
            return Err(NameError::Nul);
        }
        let mut out = PathBuf::new();
        for c in raw.split(|b| *b == b'/') {
            match c {
                b"" | b"." => {}
                b".." => return Err(NameError::Climbs),
                c if c.len() > NAME_MAX => return Err(NameError::TooLong),
                c => out.push(OsStr::from_bytes(c)),
            }
        }
        Ok((!out.as_os_str().is_empty()).then_some(EntryPath(out)))
    }

    /// A path of one component.
    pub fn name(name: &OsStr) -> Result<EntryPath, NameError> {
        if name.as_bytes().contains(&b'/') {
            return Err(NameError::Climbs);
        }
        EntryPath::parse(name.as_bytes())?.ok_or(NameError::Climbs)
    }

    /// Refuses it deeper than `limit` components.
    pub fn within(self, limit: usize) -> Result<EntryPath, NameError> {
        let depth = self.depth();
        if depth > limit {
            return Err(NameError::TooDeep { depth, limit });
        }
        Ok(self)
    }

    pub fn as_path(&self) -> &Path {
        &self.0
    }

    pub fn depth(&self) -> usize {
        self.0.components().count()
    }

    /// Its last component.
    pub fn file_name(&self) -> &OsStr {
        self.0.file_name().unwrap_or_default()
    }

    /// The directory holding it (`None`: the root).
    pub fn parent(&self) -> Option<EntryPath> {
        self.0
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map(|p| EntryPath(p.to_path_buf()))
    }

    /// `self/name`.
    pub fn join(&self, name: &EntryPath) -> EntryPath {
        EntryPath(self.0.join(&name.0))
    }

    /// What it removes when it is a whiteout (`.wh.NAME`, `.wh..wh..opq`);
    /// `None` when it is an ordinary entry. A whiteout of `.` or `..` (the
    /// name `.wh..` or `.wh...`) and other reserved `.wh..wh.` names are
    /// refused.
    pub fn whiteout(&self) -> Result<Option<Whiteout>, NameError> {
        let name = self.file_name().as_bytes();
        if name == OPAQUE.as_bytes() {
            return Ok(Some(Whiteout::Opaque(self.parent())));
        }
        let Some(hidden) = name.strip_prefix(WHITEOUT.as_bytes()) else {
            return Ok(None);
        };
        if hidden.starts_with(WHITEOUT.as_bytes()) {
            return Err(NameError::ReservedWhiteout);
        }
        if matches!(hidden, b"" | b"." | b"..") {
            return Err(NameError::WhiteoutOfItself(
                String::from_utf8_lossy(name).into_owned(),
            ));
        }
        let hidden = EntryPath::name(OsStr::from_bytes(hidden))?;
        Ok(Some(Whiteout::Hides(match self.parent() {
            Some(p) => p.join(&hidden),
            None => hidden,
        })))
    }

    /// Refuses it when a layer would read it as a whiteout: for what is
    /// written into a layer (an export), where such a file would delete
    /// something in whoever imports it.
    pub fn writable_in_a_layer(&self) -> Result<(), NameError> {
        for c in self.0.components() {
            if c.as_os_str().as_bytes().starts_with(WHITEOUT.as_bytes()) {
                return Err(NameError::LooksLikeWhiteout(
                    c.as_os_str().to_string_lossy().into_owned(),
                ));
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for EntryPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0.display())
    }
}

/// How every lookup below a [`Beneath`] is resolved.
fn resolve() -> ResolveFlags {
    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS
}

/// Deepest directory tree [`Beneath::remove_all`] descends.
const MAX_REMOVE_DEPTH: usize = 4096;

/// A directory that files are read from or written into only below it.
#[derive(Debug)]
pub struct Beneath {
    root: OwnedFd,
    shown: PathBuf,
}

impl Beneath {
    /// `dir` (which the caller chose; its own path may go through links).
    pub fn open(dir: &Path) -> io::Result<Beneath> {
        let root = rustix::fs::open(
            dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Beneath {
            root,
            shown: dir.to_path_buf(),
        })
    }

    /// Where `p` is, to name it in messages.
    pub fn shown(&self, p: Option<&EntryPath>) -> PathBuf {
        match p {
            Some(p) => self.shown.join(p.as_path()),
            None => self.shown.clone(),
        }
    }

    fn open_at(&self, p: &Path, flags: OFlags, mode: Mode) -> io::Result<OwnedFd> {
        let p = if p.as_os_str().is_empty() {
            Path::new(".")
        } else {
            p
        };
        Ok(rustix::fs::openat2(
            &self.root,
            p,
            flags | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            mode,
            resolve(),
        )?)
    }

    /// The directory `p` (`None`: the root).
    fn dir(&self, p: Option<&EntryPath>) -> io::Result<OwnedFd> {
        let path = p.map_or(Path::new(""), EntryPath::as_path);
        self.open_at(path, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())
    }

    /// The directory holding `p`, and `p`'s name in it.
    fn parent<'p>(&self, p: &'p EntryPath) -> io::Result<(OwnedFd, &'p OsStr)> {
        Ok((self.dir(p.parent().as_ref())?, p.file_name()))
    }

    /// What `p` is, without following it; `None` when nothing is there.
    pub fn kind(&self, p: &EntryPath) -> io::Result<Option<rustix::fs::FileType>> {
        let (dir, name) = match self.parent(p) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(rustix::fs::FileType::from_raw_mode(st.st_mode))),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Opens the regular file `p` to read.
    pub fn open_file(&self, p: &EntryPath) -> io::Result<File> {
        // (Non-blocking: a FIFO put where a file is named must not hang the
        // open; it is then refused as no regular file.)
        let fd = self.open_at(
            p.as_path(),
            OFlags::RDONLY | OFlags::NONBLOCK,
            Mode::empty(),
        )?;
        let st = rustix::fs::fstat(&fd)?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file",
            ));
        }
        Ok(File::from(fd))
    }

    /// Removes `p` and, when it is a directory, everything in it; nothing
    /// there is fine.
    pub fn remove_all(&self, p: &EntryPath) -> io::Result<()> {
        let (dir, name) = match self.parent(p) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        remove_in(&dir, name, 0)
    }

    /// Removes everything in directory `p` (`None`: the root), keeping it.
    pub fn empty_dir(&self, p: Option<&EntryPath>) -> io::Result<()> {
        let dir = match self.dir(p) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        empty(&dir, 0)
    }

    /// Makes the directories above `p` that are not there yet (mode 0755,
    /// as `tar` does for an entry whose directory the archive never names).
    pub fn make_parents(&self, p: &EntryPath) -> io::Result<()> {
        let Some(parent) = p.parent() else {
            return Ok(());
        };
        match self.dir(Some(&parent)) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let mut at: Option<OwnedFd> = None;
        for c in parent.as_path().components() {
            let d = match &at {
                Some(d) => d.as_fd(),
                None => self.root.as_fd(),
            };
            match rustix::fs::mkdirat(d, c.as_os_str(), Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(e.into()),
            }
            let next = rustix::fs::openat2(
                d,
                c.as_os_str(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
                resolve(),
            )?;
            at = Some(next);
        }
        Ok(())
    }

    /// Makes directory `p` (an existing directory is kept; anything else
    /// there is replaced).
    pub fn make_dir(&self, p: &EntryPath) -> io::Result<()> {
        let (dir, name) = self.parent(p)?;
        match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st)
                if rustix::fs::FileType::from_raw_mode(st.st_mode)
                    == rustix::fs::FileType::Directory =>
            {
                return Ok(());
            }
            Ok(_) => remove_in(&dir, name, 0)?,
            Err(rustix::io::Errno::NOENT) => {}
            Err(e) => return Err(e.into()),
        }
        rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(0o700))?;
        Ok(())
    }

    /// Makes the regular file `p`, empty, replacing whatever is there.
    pub fn create_file(&self, p: &EntryPath) -> io::Result<File> {
        let (dir, name) = self.parent(p)?;
        remove_in(&dir, name, 0)?;
        let fd = rustix::fs::openat(
            &dir,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        Ok(File::from(fd))
    }

    /// Makes the symbolic link `p` to `target` (never followed here),
    /// replacing whatever is there.
    pub fn symlink(&self, target: &[u8], p: &EntryPath) -> io::Result<()> {
        let (dir, name) = self.parent(p)?;
        remove_in(&dir, name, 0)?;
        rustix::fs::symlinkat(OsStr::from_bytes(target), &dir, name)?;
        Ok(())
    }

    /// Makes `p` a hard link to the existing `existing` (itself, never what
    /// a link there points to), replacing whatever is at `p`.
    pub fn hard_link(&self, existing: &EntryPath, p: &EntryPath) -> io::Result<()> {
        let (from_dir, from) = self.parent(existing)?;
        let (dir, name) = self.parent(p)?;
        if existing == p {
            return Ok(());
        }
        remove_in(&dir, name, 0)?;
        rustix::fs::linkat(&from_dir, from, &dir, name, AtFlags::empty())?;
        Ok(())
    }

    /// Sets `p`'s owner, mode (not for links) and modification time, in
    /// that order (a `chown` clears set-user-ID bits the mode then sets).
    pub fn finish(&self, p: &EntryPath, how: &Finish) -> io::Result<()> {
        let (dir, name) = self.parent(p)?;
        if let Some((uid, gid)) = how.owner {
            rustix::fs::chownat(
                &dir,
                name,
                Some(rustix::fs::Uid::from_raw(uid)),
                Some(rustix::fs::Gid::from_raw(gid)),
                AtFlags::SYMLINK_NOFOLLOW,
            )?;
        }
        if let Some(mode) = how.mode {
            // fchmodat has no flag for links; `p` is no link here (the caller
            // says so), and its name is resolved in `dir` without following.
            let fd = rustix::fs::openat(
                &dir,
                name,
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            let st = rustix::fs::fstat(&fd)?;
            if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Symlink {
                // Through the descriptor's /proc link: the inode just
                // resolved, whatever its name points at by now.
                rustix::fs::chmod(
                    format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd)),
                    Mode::from_raw_mode(mode & 0o7777),
                )?;
            }
        }
        if let Some(secs) = how.mtime {
            let t = rustix::fs::Timestamps {
                last_access: rustix::fs::Timespec {
                    tv_sec: secs,
                    tv_nsec: 0,
                },
                last_modification: rustix::fs::Timespec {
                    tv_sec: secs,
                    tv_nsec: 0,
                },
            };
            rustix::fs::utimensat(&dir, name, &t, AtFlags::SYMLINK_NOFOLLOW)?;
        }
        Ok(())
    }
}

/// What [`Beneath::finish`] sets.
#[derive(Debug, Clone, Default)]
pub struct Finish {
    pub owner: Option<(u32, u32)>,
    pub mode: Option<u32>,
    pub mtime: Option<i64>,
}

/// Removes `name` in `dir` (a directory with all it holds), never following
/// a link.
fn remove_in(dir: &impl AsFd, name: &OsStr, depth: usize) -> io::Result<()> {
    match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(rustix::io::Errno::ISDIR) | Err(rustix::io::Errno::PERM) => {}
        Err(e) => return Err(e.into()),
    }
    if depth >= MAX_REMOVE_DEPTH {
        return Err(io::Error::other(format!(
            "a directory tree over {MAX_REMOVE_DEPTH} levels deep"
        )));
    }
    let sub = rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    empty(&sub, depth + 1)?;
    drop(sub);
    match rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Removes everything in the directory `dir`.
fn empty(dir: &OwnedFd, depth: usize) -> io::Result<()> {
    let names: Vec<OsString> = {
        let mut d = rustix::fs::Dir::read_from(dir)?;
        let mut names = Vec::new();
        while let Some(e) = d.read() {
            let e = e?;
            let n = e.file_name().to_bytes();
            if n != b"." && n != b".." {
                names.push(OsString::from_vec(n.to_vec()));
            }
        }
        names
    };
    for n in names {
        remove_in(dir, &n, depth)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Option<EntryPath> {
        EntryPath::parse(s.as_bytes()).unwrap()
    }

    #[test]
    fn names_are_relative_and_never_climb() {
        assert_eq!(p("./a//b/").unwrap().as_path(), Path::new("a/b"));
        assert_eq!(p("/etc/passwd").unwrap().as_path(), Path::new("etc/passwd"));
        assert_eq!(p("./"), None);
        assert_eq!(p("/"), None);
        for bad in ["..", "a/../../b", "../x", "a/.."] {
            assert_eq!(
                EntryPath::parse(bad.as_bytes()),
                Err(NameError::Climbs),
                "{bad}"
            );
        }
        assert_eq!(EntryPath::parse(b"a\0b"), Err(NameError::Nul));
        assert_eq!(EntryPath::parse(&[b'x'; 256]), Err(NameError::TooLong));
        assert!(matches!(
            p("a/b/c").unwrap().within(2),
            Err(NameError::TooDeep { depth: 3, limit: 2 })
        ));
    }

    #[test]
    fn whiteouts_name_entries_never_their_own_directory_or_above() {
        assert_eq!(p("a/b").unwrap().whiteout(), Ok(None));
        assert_eq!(
            p("a/.wh.b").unwrap().whiteout(),
            Ok(Some(Whiteout::Hides(p("a/b").unwrap())))
        );
        assert_eq!(
            p(".wh.b").unwrap().whiteout(),
            Ok(Some(Whiteout::Hides(p("b").unwrap())))
        );
        assert_eq!(
            p("a/.wh..wh..opq").unwrap().whiteout(),
            Ok(Some(Whiteout::Opaque(p("a"))))
        );
        assert_eq!(
            p(".wh..wh..opq").unwrap().whiteout(),
            Ok(Some(Whiteout::Opaque(None)))
        );
        for bad in [".wh...", ".wh..", ".wh.", "a/.wh...", "a/.wh.."] {
            assert!(
                matches!(
                    p(bad).unwrap().whiteout(),
                    Err(NameError::WhiteoutOfItself(_))
                ),
                "{bad}"
            );
        }
        assert_eq!(
            p(".wh..wh.x").unwrap().whiteout(),
            Err(NameError::ReservedWhiteout)
        );
        assert!(p("a/.wh.x/b").unwrap().writable_in_a_layer().is_err());
        assert!(p("a/x.wh./b").unwrap().writable_in_a_layer().is_ok());
    }

    #[test]
    fn nothing_is_written_or_removed_through_a_link_or_above_the_root() {
        let d = tempfile::tempdir().unwrap();
        let outside = d.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"k").unwrap();
        let root = d.path().join("root");
        std::fs::create_dir(&root).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        std::os::unix::fs::symlink("../outside", root.join("rel")).unwrap();
        let b = Beneath::open(&root).unwrap();
        for via in ["link/x", "rel/x", "link/keep"] {
            let at = p(via).unwrap();
            assert!(b.create_file(&at).is_err(), "{via}");
            assert!(b.make_dir(&at).is_err(), "{via}");
            assert!(b.symlink(b"/", &at).is_err(), "{via}");
            assert!(b.remove_all(&at).is_err(), "{via}");
            assert!(b.open_file(&at).is_err(), "{via}");
            assert!(b.empty_dir(Some(&p("link").unwrap())).is_err());
        }
        assert!(
            b.hard_link(&p("link/keep").unwrap(), &p("h").unwrap())
                .is_err()
        );
        // The link itself is replaced, not followed.
        b.create_file(&p("link").unwrap()).unwrap();
        assert!(
            std::fs::symlink_metadata(root.join("link"))
                .unwrap()
                .is_file()
        );
        assert_eq!(std::fs::read(outside.join("keep")).unwrap(), b"k");
        // A directory tree goes whole, its links as links.
        b.make_dir(&p("t").unwrap()).unwrap();
        b.make_dir(&p("t/u").unwrap()).unwrap();
        b.symlink(outside.as_os_str().as_bytes(), &p("t/u/out").unwrap())
            .unwrap();
        b.remove_all(&p("t").unwrap()).unwrap();
        assert!(!root.join("t").exists());
        b.empty_dir(None).unwrap();
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);
        assert_eq!(std::fs::read(outside.join("keep")).unwrap(), b"k");
    }
}
