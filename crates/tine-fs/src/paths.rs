//! Relative paths inside a tree, as `/`-separated bytes (`""` is the root).

/// How deep a tree may go (directories below its root). Deeper trees are
/// refused by name, never walked into a stack overflow: every walk over a
/// sandbox's files (scan, restore, diff, merge) checks it. Paths from the
/// root are about 2,000 levels deep already at the kernel's `PATH_MAX`.
pub const MAX_DEPTH: usize = 4096;

/// The stack a thread that walks trees should have: enough for
/// [`MAX_DEPTH`] levels of the walks' recursion (reserved address space;
/// only what a walk touches is used). Scans run on a pool of such threads;
/// callers that walk trees on threads of their own size them so.
pub const WALK_STACK: usize = 256 << 20;

/// How long a directory's path may grow before a walk names it through a
/// descriptor instead ([`Anchor`]): a name (at most 255 bytes) below it
/// still fits in the kernel's `PATH_MAX` (4,096).
pub const ANCHOR_AT: usize = 2048;

/// A directory held open so that what is below it can be named by a short
/// path, `/proc/self/fd/N/...`, however deep it lies: walks stay clear of
/// `ENAMETOOLONG` (a sandbox can nest directories past `PATH_MAX` from the
/// root). Opened without following a symlink at its last name; the rest of
/// the path resolves as the walk's own paths always did.
#[derive(Debug)]
pub struct Anchor {
    _fd: std::os::fd::OwnedFd,
    path: std::path::PathBuf,
}

impl Anchor {
    /// `dir` itself when its path is short, else an anchor at it.
    pub fn at(dir: &std::path::Path) -> std::io::Result<Option<Anchor>> {
        if dir.as_os_str().len() <= ANCHOR_AT {
            return Ok(None);
        }
        use rustix::fs::{Mode, OFlags};
        let fd = rustix::fs::open(
            dir,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd)).into();
        Ok(Some(Anchor { _fd: fd, path }))
    }

    /// The short path that names the directory while this lives.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

/// Runs `f` on a new thread of scope `sc` with a [`WALK_STACK`] stack: for
/// work that walks a sandbox's tree (a thread's default 2 MiB overflow at
/// about a thousand levels, and an overflow aborts the whole process).
pub fn spawn_walker<'scope, T: Send + 'scope>(
    sc: &'scope std::thread::Scope<'scope, '_>,
    f: impl FnOnce() -> T + Send + 'scope,
) -> std::io::Result<std::thread::ScopedJoinHandle<'scope, T>> {
    std::thread::Builder::new()
        .stack_size(WALK_STACK)
        .spawn_scoped(sc, f)
}

/// `path` for a message: whole when short, else its start and end around
/// the number of bytes (a sandbox can make paths of tens of kilobytes).
pub fn shown(path: &std::path::Path) -> String {
    let s = path.to_string_lossy();
    if s.len() <= 512 {
        return s.into_owned();
    }
    let head: String = s.chars().take(120).collect();
    let tail: String = {
        let rev: Vec<char> = s.chars().rev().take(60).collect();
        rev.into_iter().rev().collect()
    };
    format!("{head}…{tail} (a path of {} bytes)", s.len())
}

/// FNV-1a's start: a 64-bit hash that is the same in every build and
/// version (std's hasher is not), for what must stay put across runs.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// One byte of FNV-1a.
pub fn fnv_step(h: u64, b: u8) -> u64 {
    (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
}

/// FNV-1a of `bytes`.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV_OFFSET, |h, &b| fnv_step(h, b))
}

/// The number of names in `rel` (0 for the root).
pub fn depth(rel: &[u8]) -> usize {
    if rel.is_empty() {
        0
    } else {
        1 + rel.iter().filter(|&&b| b == b'/').count()
    }
}

/// `prefix/name`, or `name` at the root.
pub fn join(prefix: &[u8], name: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(prefix.len() + 1 + name.len());
    if !prefix.is_empty() {
        v.extend_from_slice(prefix);
        v.push(b'/');
    }
    v.extend_from_slice(name);
    v
}

/// (parent, name); the parent of a top-level name is `""`.
pub fn split(path: &[u8]) -> (&[u8], &[u8]) {
    match path.iter().rposition(|&b| b == b'/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => (&[], path),
    }
}

/// True if `path` is `ancestor` or lies below it.
pub fn is_at_or_below(path: &[u8], ancestor: &[u8]) -> bool {
    path.starts_with(ancestor)
        && (path.len() == ancestor.len() || ancestor.is_empty() || path[ancestor.len()] == b'/')
}

/// The ancestors of `path` between the root and it, outermost first:
/// `a` and `a/b` for `a/b/c` (neither `""` nor `path` itself).
pub fn inner_ancestors(path: &[u8]) -> impl Iterator<Item = &[u8]> {
    path.iter()
        .enumerate()
        .filter(|(_, b)| **b == b'/')
        .map(move |(i, _)| &path[..i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_split_below() {
        assert_eq!(join(b"", b"a"), b"a");
        assert_eq!(join(b"a/b", b"c"), b"a/b/c");
        assert_eq!(split(b"a/b/c"), (&b"a/b"[..], &b"c"[..]));
        assert_eq!(split(b"c"), (&b""[..], &b"c"[..]));
        assert!(is_at_or_below(b"a/b", b"a"));
        assert!(is_at_or_below(b"a", b"a"));
        assert!(!is_at_or_below(b"ab", b"a"));
        assert!(is_at_or_below(b"x", b""));
        let a: Vec<&[u8]> = inner_ancestors(b"a/b/c").collect();
        assert_eq!(a, [&b"a"[..], &b"a/b"[..]]);
        assert_eq!(inner_ancestors(b"a").count(), 0);
    }

    #[test]
    fn long_paths_are_named_through_an_anchor() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(Anchor::at(tmp.path()).unwrap().is_none());
        // Deeper than PATH_MAX from the root, made one step at a time.
        let mut dir = tmp.path().to_path_buf();
        let mut anchors = Vec::new();
        for _ in 0..40 {
            let a = Anchor::at(&dir).unwrap();
            if let Some(a) = &a {
                dir = a.path().to_path_buf();
            }
            anchors.push(a);
            dir = dir.join("d".repeat(200));
            std::fs::create_dir(&dir).unwrap();
        }
        std::fs::write(dir.join("leaf"), b"x").unwrap();
        assert!(anchors.iter().flatten().count() >= 3);
        assert_eq!(std::fs::read(dir.join("leaf")).unwrap(), b"x");
        assert!(dir.as_os_str().len() <= ANCHOR_AT + 256);
    }
}
