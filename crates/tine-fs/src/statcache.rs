//! The persisted stat cache: for each file of a scanned directory, the stat fields
//! seen when it was last hashed and the content id it had, so an unchanged file is
//! never read again.
//!
//! ```text
//! "TINESTAT" | version u32 | repo_id (32 ASCII bytes) | gc_generation u64 | count u64
//! | dir_len u16 | directory (canonical path; lets `gc` drop caches of vanished directories)
//! entry*: path_len u16 | size u64 | mtime_ns i64 | ctime_ns i64 | ino u64 | dev u64
//!         | mode u32 | content kind u8 | content id [32] | path bytes
//! BLAKE3 of everything before [32]
//! ```
//! Directories have entries too (content kind tree, stat fields zero): the tree id
//! of their last snapshot, so an unchanged directory needs no database lookup.
//! All integers little-endian. Loading builds only an index (hash of path ->
//! offset), so a 10,000-entry cache costs one read and no per-entry allocation.
//! A cache that fails any check is ignored (it is only a cache). Entries whose
//! mtime or ctime fall within [`RACY_WINDOW_NS`] of the scan's start are never
//! stored: a later write within the same timestamp tick could otherwise go unseen.

use std::fs::Metadata;
use std::hash::Hasher;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustc_hash::{FxHashMap, FxHasher};
use tine_store::{Content, Kind, ObjectId, Repository};

use crate::paths::split;

const MAGIC: &[u8; 8] = b"TINESTAT";
const VERSION: u32 = 3;
const HEADER_LEN: usize = 8 + 4 + 32 + 8 + 8;
const ENTRY_FIXED: usize = 2 + 8 * 5 + 4 + 1 + 32;
/// Far larger than any filesystem timestamp granularity or clock lag.
pub const RACY_WINDOW_NS: i64 = 100_000_000;

/// The stat fields that must all match for a cached hash to be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatKey {
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    pub ino: u64,
    pub dev: u64,
    pub mode: u32,
}

impl StatKey {
    pub fn of(md: &Metadata) -> StatKey {
        StatKey {
            size: md.size(),
            mtime_ns: md.mtime() * 1_000_000_000 + md.mtime_nsec(),
            ctime_ns: md.ctime() * 1_000_000_000 + md.ctime_nsec(),
            ino: md.ino(),
            dev: md.dev(),
            mode: md.mode(),
        }
    }

    /// Too recent to trust later: modified within the racy window before `scan_start_ns`.
    pub fn is_racy(&self, scan_start_ns: i64) -> bool {
        self.mtime_ns.max(self.ctime_ns) >= scan_start_ns - RACY_WINDOW_NS
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheEntry {
    pub stat: StatKey,
    pub content: Content,
}

/// A loaded stat cache: the file's bytes and an index into them.
#[derive(Debug, Default)]
pub struct StatCache {
    buf: Vec<u8>,
    index: FxHashMap<u64, u32>,
    /// The ids were recorded before the last gc: check that they still exist.
    pub needs_validation: bool,
}

/// Where the stat cache of directory `dir` (canonical) lives.
pub fn cache_path(repo: &Repository, dir: &Path) -> PathBuf {
    let key = blake3::hash(dir.as_os_str().as_encoded_bytes()).to_hex();
    repo.cache_dir().join(format!("stat-{}", &key[..32]))
}

/// Hash of `dir/name` computed from the parts, so lookups need no joined path.
fn path_hash(dir: &[u8], name: &[u8]) -> u64 {
    let mut h = FxHasher::default();
    h.write(dir);
    h.write_u8(0xff);
    h.write(name);
    h.finish()
}

fn decode_entry(b: &[u8]) -> Option<CacheEntry> {
    let stat = StatKey {
        size: u64_at(b, 2),
        mtime_ns: u64_at(b, 10) as i64,
        ctime_ns: u64_at(b, 18) as i64,
        ino: u64_at(b, 26),
        dev: u64_at(b, 34),
        mode: u32::from_le_bytes(b[42..46].try_into().ok()?),
    };
    let kind = Kind::from_u8(b[46])?;
    let id = ObjectId::from_slice(&b[47..79])?;
    Some(CacheEntry {
        stat,
        content: Content { kind, id },
    })
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl StatCache {
    /// Loads the cache; anything missing, damaged or from another repository gives an empty cache.
    pub fn load(path: &Path, repo_id: &str, generation: u64) -> StatCache {
        let Ok(buf) = std::fs::read(path) else {
            return StatCache::default();
        };
        Self::parse(buf, repo_id, generation).unwrap_or_default()
    }

    fn parse(mut buf: Vec<u8>, repo_id: &str, generation: u64) -> Option<StatCache> {
        if buf.len() < HEADER_LEN + 32 {
            return None;
        }
        let body_len = buf.len() - 32;
        if blake3::hash(&buf[..body_len]).as_bytes() != &buf[body_len..] {
            return None;
        }
        buf.truncate(body_len);
        if &buf[..8] != MAGIC || u32::from_le_bytes(buf[8..12].try_into().ok()?) != VERSION {
            return None;
        }
        if buf[12..44] != repo_id_bytes(repo_id) {
            return None;
        }
        let cached_gen = u64_at(&buf, 44);
        let count = u64_at(&buf, 52);
        if count > (buf.len() / ENTRY_FIXED) as u64 || buf.len() > u32::MAX as usize {
            return None;
        }
        let mut index = FxHashMap::with_capacity_and_hasher(count as usize, Default::default());
        let dlen = usize::from(u16::from_le_bytes(
            buf.get(HEADER_LEN..HEADER_LEN + 2)?.try_into().ok()?,
        ));
        let mut at = HEADER_LEN + 2 + dlen;
        for _ in 0..count {
            let plen = usize::from(u16::from_le_bytes(buf.get(at..at + 2)?.try_into().ok()?));
            let end = at + ENTRY_FIXED + plen;
            let path = buf.get(at + ENTRY_FIXED..end)?;
            Kind::from_u8(buf[at + 2 + 40 + 4])
                .filter(|k| matches!(k, Kind::Blob | Kind::Chunked | Kind::Tree))?;
            let (d, n) = split(path);
            index.insert(path_hash(d, n), at as u32);
            at = end;
        }
        if at != buf.len() {
            return None;
        }
        Some(StatCache {
            buf,
            index,
            needs_validation: cached_gen != generation,
        })
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The cached entry for `dir/name` (`name` alone at the top), and its position.
    pub fn get(&self, dir: &[u8], name: &[u8]) -> Option<(CacheEntry, u32)> {
        let at = *self.index.get(&path_hash(dir, name))? as usize;
        let b = &self.buf[at..];
        let plen = usize::from(u16::from_le_bytes([b[0], b[1]]));
        let path = &b[ENTRY_FIXED..ENTRY_FIXED + plen];
        let (d, n) = split(path);
        if d != dir || n != name {
            return None;
        }
        Some((decode_entry(b)?, at as u32))
    }

    /// The tree id the directory at `rel` had when last snapshotted (`""` is the root).
    pub fn get_dir(&self, rel: &[u8]) -> Option<ObjectId> {
        let (dir, name) = split(rel);
        self.get(dir, name)
            .filter(|(e, _)| e.content.kind == Kind::Tree)
            .map(|(e, _)| e.content.id)
    }

    /// Every entry as (path, encoded bytes), in file order.
    pub fn entries_raw(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        let mut at = match self.buf.get(HEADER_LEN..HEADER_LEN + 2) {
            Some(d) => HEADER_LEN + 2 + usize::from(u16::from_le_bytes([d[0], d[1]])),
            None => self.buf.len(),
        };
        std::iter::from_fn(move || {
            let b = self.buf.get(at..)?;
            if b.len() < ENTRY_FIXED {
                return None;
            }
            let plen = usize::from(u16::from_le_bytes([b[0], b[1]]));
            at += ENTRY_FIXED + plen;
            Some((
                &b[ENTRY_FIXED..ENTRY_FIXED + plen],
                &b[..ENTRY_FIXED + plen],
            ))
        })
    }

    /// The encoded bytes of the entry at `at` (from [`StatCache::get`]).
    pub fn raw(&self, at: u32) -> &[u8] {
        let b = &self.buf[at as usize..];
        let plen = usize::from(u16::from_le_bytes([b[0], b[1]]));
        &b[..ENTRY_FIXED + plen]
    }

    /// Writes an encoded cache to a temporary file next to `path`; [`PendingCache::persist`]
    /// renames it into place. Not fsynced: a cache damaged by a crash fails its
    /// checksum and is ignored.
    pub fn write_pending(path: &Path, data: &[u8]) -> std::io::Result<PendingCache> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let tmp = tine_store::pack::temp_path(dir, ".tmp");
        if let Err(e) = std::fs::write(&tmp, data) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        Ok(PendingCache {
            tmp: Some(tmp),
            path: path.to_path_buf(),
        })
    }
}

/// The entries of the next stat cache, already encoded.
#[derive(Debug, Default)]
pub struct CacheBuilder {
    buf: Vec<u8>,
    count: u64,
}

impl CacheBuilder {
    pub fn len(&self) -> usize {
        self.count as usize
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Copies an entry of a loaded cache unchanged.
    pub fn push_raw(&mut self, raw: &[u8]) {
        self.buf.extend_from_slice(raw);
        self.count += 1;
    }

    pub fn push(&mut self, dir: &[u8], name: &[u8], e: &CacheEntry) {
        let sep = usize::from(!dir.is_empty());
        let plen = (dir.len() + sep + name.len()).min(usize::from(u16::MAX));
        let w = &mut self.buf;
        w.extend_from_slice(&(plen as u16).to_le_bytes());
        w.extend_from_slice(&e.stat.size.to_le_bytes());
        w.extend_from_slice(&e.stat.mtime_ns.to_le_bytes());
        w.extend_from_slice(&e.stat.ctime_ns.to_le_bytes());
        w.extend_from_slice(&e.stat.ino.to_le_bytes());
        w.extend_from_slice(&e.stat.dev.to_le_bytes());
        w.extend_from_slice(&e.stat.mode.to_le_bytes());
        w.push(e.content.kind as u8);
        w.extend_from_slice(e.content.id.as_bytes());
        let start = w.len();
        w.extend_from_slice(dir);
        if sep == 1 {
            w.push(b'/');
        }
        w.extend_from_slice(name);
        w.truncate(start + plen);
        self.count += 1;
    }

    /// Records the tree id of the directory at `rel`. Only for trees that are stored
    /// (a snapshot's), since a matching id is then trusted to be in the repository.
    pub fn push_dir(&mut self, rel: &[u8], tree: ObjectId) {
        let (dir, name) = split(rel);
        let stat = StatKey {
            size: 0,
            mtime_ns: 0,
            ctime_ns: 0,
            ino: 0,
            dev: 0,
            mode: 0,
        };
        self.push(
            dir,
            name,
            &CacheEntry {
                stat,
                content: Content {
                    kind: Kind::Tree,
                    id: tree,
                },
            },
        );
    }

    pub fn append(&mut self, other: CacheBuilder) {
        if self.buf.is_empty() {
            *self = other;
        } else {
            self.buf.extend_from_slice(&other.buf);
            self.count += other.count;
        }
    }

    /// Every entry as (path, entry).
    pub fn entries(&self) -> impl Iterator<Item = (&[u8], CacheEntry)> + '_ {
        let mut at = 0;
        std::iter::from_fn(move || {
            let b = self.buf.get(at..)?;
            if b.len() < ENTRY_FIXED {
                return None;
            }
            let plen = usize::from(u16::from_le_bytes([b[0], b[1]]));
            let e = decode_entry(b)?;
            at += ENTRY_FIXED + plen;
            Some((&b[ENTRY_FIXED..ENTRY_FIXED + plen], e))
        })
    }

    /// Keeps only the entries whose path satisfies `keep`.
    pub fn retain(&mut self, mut keep: impl FnMut(&[u8]) -> bool) {
        let mut out = Vec::with_capacity(self.buf.len());
        let mut count = 0;
        let mut at = 0;
        while at + ENTRY_FIXED <= self.buf.len() {
            let plen = usize::from(u16::from_le_bytes([self.buf[at], self.buf[at + 1]]));
            let end = at + ENTRY_FIXED + plen;
            if keep(&self.buf[at + ENTRY_FIXED..end]) {
                out.extend_from_slice(&self.buf[at..end]);
                count += 1;
            }
            at = end;
        }
        self.buf = out;
        self.count = count;
    }

    /// The complete cache file.
    pub fn encode(&self, repo_id: &str, generation: u64, dir: &Path) -> Vec<u8> {
        let d = dir.as_os_str().as_encoded_bytes();
        let d = &d[..d.len().min(usize::from(u16::MAX))];
        let mut w = Vec::with_capacity(HEADER_LEN + 2 + d.len() + self.buf.len() + 32);
        w.extend_from_slice(MAGIC);
        w.extend_from_slice(&VERSION.to_le_bytes());
        w.extend_from_slice(&repo_id_bytes(repo_id));
        w.extend_from_slice(&generation.to_le_bytes());
        w.extend_from_slice(&self.count.to_le_bytes());
        w.extend_from_slice(&(d.len() as u16).to_le_bytes());
        w.extend_from_slice(d);
        w.extend_from_slice(&self.buf);
        let sum = blake3::hash(&w);
        w.extend_from_slice(sum.as_bytes());
        w
    }

    /// Encodes and replaces the cache file at once.
    pub fn save(
        &self,
        path: &Path,
        repo_id: &str,
        generation: u64,
        dir: &Path,
    ) -> std::io::Result<()> {
        StatCache::write_pending(path, &self.encode(repo_id, generation, dir))?.persist()
    }
}

/// Removes stat caches that can no longer help: their directory is gone, they
/// belong to another repository, or they are in an older format. Call with the
/// write lock held, so no snapshot is writing one meanwhile.
pub fn prune_caches(repo: &Repository) -> std::io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for e in std::fs::read_dir(repo.cache_dir())? {
        let path = e?.path();
        if !path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("stat-"))
        {
            continue;
        }
        let keep = cached_dir(&path, repo.repo_id())
            .is_some_and(|dir| dir.is_dir() && cache_path(repo, &dir) == path);
        if !keep {
            std::fs::remove_file(&path)?;
            removed.push(path);
        }
    }
    removed.sort();
    Ok(removed)
}

/// The directory a cache file describes, read from its header alone.
fn cached_dir(path: &Path, repo_id: &str) -> Option<PathBuf> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let mut head = [0u8; HEADER_LEN + 2];
    f.read_exact(&mut head).ok()?;
    if &head[..8] != MAGIC
        || u32::from_le_bytes(head[8..12].try_into().ok()?) != VERSION
        || head[12..44] != repo_id_bytes(repo_id)
    {
        return None;
    }
    let mut dir =
        vec![0u8; usize::from(u16::from_le_bytes([head[HEADER_LEN], head[HEADER_LEN + 1]]))];
    f.read_exact(&mut dir).ok()?;
    Some(PathBuf::from(std::ffi::OsString::from_vec(dir)))
}

/// A cache file written under a temporary name; dropped without `persist`, it is removed.
#[derive(Debug)]
pub struct PendingCache {
    tmp: Option<PathBuf>,
    path: PathBuf,
}

impl PendingCache {
    pub fn persist(mut self) -> std::io::Result<()> {
        let tmp = self.tmp.take().expect("persist once");
        std::fs::rename(&tmp, &self.path).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    }
}

impl Drop for PendingCache {
    fn drop(&mut self) {
        if let Some(t) = self.tmp.take() {
            let _ = std::fs::remove_file(t);
        }
    }
}

fn repo_id_bytes(repo_id: &str) -> [u8; 32] {
    let mut rid = [b'0'; 32];
    let n = repo_id.len().min(32);
    rid[..n].copy_from_slice(&repo_id.as_bytes()[..n]);
    rid
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejects_damage() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c");
        let rid = "0123456789abcdef0123456789abcdef";
        let e = CacheEntry {
            stat: StatKey {
                size: 5,
                mtime_ns: -3,
                ctime_ns: 1_700_000_000_000_000_000,
                ino: 7,
                dev: 9,
                mode: 0o100644,
            },
            content: Content {
                kind: Kind::Blob,
                id: ObjectId::compute(Kind::Blob, b"hello"),
            },
        };
        let mut m = CacheBuilder::default();
        m.push(b"a", b"b", &e);
        m.push(
            b"",
            b"c",
            &CacheEntry {
                content: Content {
                    kind: Kind::Chunked,
                    ..e.content
                },
                ..e
            },
        );
        m.save(&p, rid, 3, Path::new("/some/dir")).unwrap();
        let c = StatCache::load(&p, rid, 3);
        assert_eq!(c.len(), 2);
        let (got, at) = c.get(b"a", b"b").unwrap();
        assert_eq!(got, e);
        let mut copy = CacheBuilder::default();
        copy.push_raw(c.raw(at));
        assert_eq!(copy.entries().next().unwrap(), (&b"a/b"[..], e));
        assert_eq!(c.get(b"", b"c").unwrap().0.content.kind, Kind::Chunked);
        assert_eq!(c.get(b"a", b"c"), None);
        assert_eq!(c.get(b"", b"a/b"), None);
        assert!(!c.needs_validation);
        assert!(StatCache::load(&p, rid, 4).needs_validation);
        assert!(StatCache::load(&p, "other-repo-id-0000000000000000000", 3).is_empty());
        m.retain(|p| p != b"c");
        assert_eq!(m.len(), 1);
        // Directory entries: the root is "" and is distinct from every file.
        let t1 = ObjectId::compute(Kind::Tree, b"root");
        let t2 = ObjectId::compute(Kind::Tree, b"sub");
        m.push_dir(b"", t1);
        m.push_dir(b"a", t2);
        m.save(&p, rid, 3, Path::new("/some/dir")).unwrap();
        let c = StatCache::load(&p, rid, 3);
        assert_eq!(c.get_dir(b""), Some(t1));
        assert_eq!(c.get_dir(b"a"), Some(t2));
        assert_eq!(c.get_dir(b"a/b"), None, "a file is not a directory");
        assert_eq!(c.get(b"a", b"b").unwrap().0, e);
        let mut b = std::fs::read(&p).unwrap();
        b[70] ^= 1;
        std::fs::write(&p, &b).unwrap();
        assert!(StatCache::load(&p, rid, 3).is_empty());
    }

    #[test]
    fn pending_cache_is_removed_unless_persisted() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c");
        drop(StatCache::write_pending(&p, b"x").unwrap());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        StatCache::write_pending(&p, b"x")
            .unwrap()
            .persist()
            .unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"x");
    }
}
