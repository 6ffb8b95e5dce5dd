//! The file operations a restore is made of, each relative to an open
//! directory descriptor and never through a link: directories opened without
//! following symlinks, entries removed or replaced, contents prefetched and
//! written.

use super::*;

pub(super) fn errno(e: rustix::io::Errno) -> io::Error {
    io::Error::from(e)
}

pub(super) fn os(b: &[u8]) -> &OsStr {
    OsStr::from_bytes(b)
}

/// Open directory descriptors by relative path, opened without following symlinks.
pub(super) struct Dirs {
    pub(super) root: PathBuf,
    pub(super) fds: HashMap<Vec<u8>, OwnedFd>,
}

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

impl Dirs {
    pub(super) fn new(root: &Path) -> Result<Dirs, RestoreError> {
        let fd = rustix::fs::open(root, DIR_FLAGS.difference(OFlags::NOFOLLOW), Mode::empty())
            .map_err(|e| io_err("open target directory", root.to_path_buf())(errno(e)))?;
        let mut fds = HashMap::new();
        fds.insert(Vec::new(), fd);
        Ok(Dirs {
            root: root.to_path_buf(),
            fds,
        })
    }

    pub(super) fn abs(&self, rel: &[u8]) -> PathBuf {
        self.root.join(os(rel))
    }

    pub(super) fn get(&mut self, rel: &[u8]) -> Result<&OwnedFd, RestoreError> {
        if !self.fds.contains_key(rel) {
            let (parent, name) = split(rel);
            let parent = parent.to_vec();
            self.get(&parent)?;
            let pfd = &self.fds[&parent];
            let fd = rustix::fs::openat(pfd, os(name), DIR_FLAGS, Mode::empty()).map_err(|e| {
                io_err(
                    "open directory (refusing to follow a symlink)",
                    self.abs(rel),
                )(errno(e))
            })?;
            self.fds.insert(rel.to_vec(), fd);
        }
        Ok(&self.fds[rel])
    }

    pub(super) fn forget_below(&mut self, rel: &[u8]) {
        self.fds.retain(|k, _| !is_at_or_below(k, rel));
    }
}

/// Removes `name` in `dir`: a directory only as far as the scan saw it.
pub(super) fn remove_entry(
    dirs: &mut Dirs,
    trees: &Trees<'_>,
    parent: &[u8],
    e: &TreeEntry,
    warnings: &mut Vec<Warning>,
) -> Result<(), RestoreError> {
    let rel = join(parent, &e.name);
    if let Node::Dir { tree } = &e.node {
        let t = trees.load(tree)?.into_owned();
        for c in &t.entries {
            remove_entry(dirs, trees, &rel, c, warnings)?;
        }
        dirs.forget_below(&rel);
        let pfd = dirs.get(parent)?;
        match rustix::fs::unlinkat(pfd, os(&e.name), AtFlags::REMOVEDIR) {
            Ok(()) => {}
            Err(rustix::io::Errno::NOTEMPTY) => warnings.push(Warning {
                path: dirs.abs(&rel).display().to_string(),
                message: "kept: holds files excluded by .tineignore".into(),
            }),
            Err(rustix::io::Errno::NOENT) => {}
            Err(err) => return Err(io_err("remove directory", dirs.abs(&rel))(errno(err))),
        }
        return Ok(());
    }
    let pfd = dirs.get(parent)?;
    match rustix::fs::unlinkat(pfd, os(&e.name), AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(err) => Err(io_err("remove", dirs.abs(&rel))(errno(err))),
    }
}

/// Removes whatever untracked thing (e.g. an ignored file) is in the way at `name`.
pub(super) fn clear_path(pfd: &OwnedFd, name: &[u8]) -> io::Result<()> {
    match rustix::fs::unlinkat(pfd, os(name), AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(rustix::io::Errno::ISDIR) => {
            rustix::fs::unlinkat(pfd, os(name), AtFlags::REMOVEDIR).map_err(errno)
        }
        Err(e) => Err(errno(e)),
    }
}

/// Creates `name` with `create`; if something untracked (an ignored file) is in the
/// way, removes it and tries once more.
pub(super) fn create_replacing<T>(
    pfd: &OwnedFd,
    name: &[u8],
    create: impl Fn() -> rustix::io::Result<T>,
) -> io::Result<T> {
    match create() {
        Err(rustix::io::Errno::EXIST) => {
            clear_path(pfd, name)?;
            create().map_err(errno)
        }
        r => r.map_err(errno),
    }
}

/// What an existing file a restore rewrites in place holds already of its
/// chunked content: each chunk hashed where it lies in the snapshot's
/// file, with the file's identity. Only the others are verified, fetched
/// and written: a database's 16 MiB log segment with a few blocks written
/// since was rewritten whole, inside a rollback's pause.
pub(super) struct Held {
    dev: u64,
    ino: u64,
    pub(super) same: Vec<bool>,
}

impl Held {
    /// Whether open file `f` is the file this was read from.
    pub(super) fn is(&self, f: &File) -> bool {
        f.metadata()
            .is_ok_and(|m| m.dev() == self.dev && m.ino() == self.ino)
    }
}

/// [`Held`] of regular file `name` of `pfd` (one link, never followed)
/// against chunked `content`; `None` for other content or files.
pub(super) fn chunks_held(
    repo: &Repository,
    pfd: &OwnedFd,
    name: &[u8],
    content: &Content,
) -> Option<Held> {
    if content.kind != Kind::Chunked {
        return None;
    }
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
    let file = File::from(rustix::fs::openat(pfd, os(name), flags, Mode::empty()).ok()?);
    let md = file.metadata().ok()?;
    if !md.file_type().is_file() || md.nlink() != 1 {
        return None;
    }
    let list = repo.read_chunk_list(&content.id).ok()?;
    // A sparse file is written whole (its holes as holes): nothing to compare.
    if list.has_holes() {
        return None;
    }
    let mut at = Vec::with_capacity(list.chunks.len());
    let mut off = 0u64;
    for (_, len) in &list.chunks {
        at.push(off);
        off += u64::from(*len);
    }
    let same = crate::scan::in_pool(|| {
        list.chunks
            .par_iter()
            .zip(at.par_iter())
            .map(|(&(id, len), &off)| {
                use std::os::unix::fs::FileExt;
                let mut buf = vec![0u8; len as usize];
                off + u64::from(len) <= md.len()
                    && file.read_exact_at(&mut buf, off).is_ok()
                    && ObjectId::compute(Kind::Blob, &buf) == id
            })
            .collect()
    });
    Some(Held {
        dev: md.dev(),
        ino: md.ino(),
        same,
    })
}

/// Reads and verifies every object the writes need (`writes`: each
/// content with the chunks its file holds already, left out); keeps them
/// while under budget.
pub(super) fn prefetch(
    repo: &Repository,
    writes: &[(Content, Option<&[bool]>)],
    progress: &dyn Progress,
) -> Result<HashMap<ObjectId, Vec<u8>>, ObjectError> {
    let mut ids: Vec<ObjectId> = Vec::new();
    let mut seen = HashSet::new();
    let mut lists = HashSet::new();
    for (c, held) in writes {
        match c.kind {
            Kind::Chunked => {
                if held.is_none() && !lists.insert(c.id) {
                    continue;
                }
                let list = repo.read_chunk_list(&c.id)?;
                ids.extend(
                    list.chunks
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| !held.is_some_and(|h| h.get(*i) == Some(&true)))
                        .map(|(_, (id, _))| *id)
                        .filter(|id| *id != tine_store::ChunkList::HOLE)
                        .filter(|id| seen.insert(*id)),
                );
            }
            _ => {
                if seen.insert(c.id) {
                    ids.push(c.id);
                }
            }
        }
    }
    progress.start("verifying", ids.len() as u64);
    let kept = Mutex::new((HashMap::new(), 0u64));
    crate::scan::in_pool(|| {
        ids.par_iter()
            .try_for_each(|id| -> Result<(), ObjectError> {
                let raw = repo.read_kind(id, Kind::Blob)?;
                progress.advance(1);
                let mut k = kept.lock().unwrap_or_else(|e| e.into_inner());
                if k.1 + raw.len() as u64 <= PREFETCH_BUDGET {
                    k.1 += raw.len() as u64;
                    k.0.insert(*id, raw);
                }
                Ok(())
            })
    })?;
    progress.finish();
    Ok(kept.into_inner().unwrap_or_else(|e| e.into_inner()).0)
}

/// Writes `content` into `out` (opened at its start); where `held` says
/// which chunks it holds already, only the others, each where it lies.
/// Returns the content's size and the bytes written.
pub(super) fn write_content(
    repo: &Repository,
    cache: &HashMap<ObjectId, Vec<u8>>,
    content: &Content,
    out: &mut File,
    path: &Path,
    held: Option<&[bool]>,
) -> Result<(u64, u64), RestoreError> {
    let blob = |id: &ObjectId| -> Result<std::borrow::Cow<'_, [u8]>, ObjectError> {
        match cache.get(id) {
            Some(b) => Ok(std::borrow::Cow::Borrowed(b.as_slice())),
            None => Ok(std::borrow::Cow::Owned(repo.read_kind(id, Kind::Blob)?)),
        }
    };
    let chunks = match content.kind {
        Kind::Chunked => repo.read_chunk_list(&content.id)?.chunks,
        _ => {
            let b = blob(&content.id)?;
            out.write_all(&b).map_err(io_err("write", path))?;
            return Ok((b.len() as u64, b.len() as u64));
        }
    };
    use std::os::unix::fs::FileExt;
    // Holes are left unwritten: the file is emptied first so that they read
    // as zeros (the caller sets its length after).
    if chunks
        .iter()
        .any(|(id, _)| *id == tine_store::ChunkList::HOLE)
    {
        out.set_len(0).map_err(io_err("truncate", path))?;
    }
    let (mut at, mut written) = (0u64, 0u64);
    for (i, (id, len)) in chunks.iter().enumerate() {
        if *id == tine_store::ChunkList::HOLE {
            at += u64::from(*len);
            continue;
        }
        if held.and_then(|h| h.get(i)) != Some(&true) {
            let b = blob(id)?;
            if b.len() != *len as usize {
                return Err(RestoreError::Object(ObjectError::Damaged {
                    id: content.id,
                    pack: "?".into(),
                    offset: at,
                    reason: format!("chunk {id} is {} bytes, the list says {len}", b.len()),
                }));
            }
            out.write_all_at(&b, at).map_err(io_err("write", path))?;
            written += b.len() as u64;
        }
        at += u64::from(*len);
    }
    Ok((at, written))
}
