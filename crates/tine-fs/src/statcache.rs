//! The persisted stat cache: for each file of a scanned directory, the stat fields
//! seen when it was last hashed and the content id it had, so an unchanged file is
//! never read again.
//!
//! ```text
//! "TINESTAT" | version u32 | repo_id (32 ASCII bytes) | gc_generation u64 | count u64
//! entry*: path (varint len + bytes) | size | mtime_ns | ctime_ns | ino | dev | mode
//!         (varints, times as zigzag) | content kind u8 | content id [32]
//! BLAKE3 of everything before [32]
//! ```
//! A cache that fails any check is ignored (it is only a cache). Entries whose
//! mtime or ctime fall within [`RACY_WINDOW_NS`] of the scan's start are never
//! stored: a later write within the same timestamp tick could otherwise go unseen.

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use tine_store::codec::{Reader, Writer};
use rustc_hash::FxHashMap;
use tine_store::{Content, Kind, Repository};

const MAGIC: &[u8; 8] = b"TINESTAT";
const VERSION: u32 = 1;
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

/// A loaded stat cache.
#[derive(Debug, Default)]
pub struct StatCache {
    pub entries: FxHashMap<Vec<u8>, CacheEntry>,
    /// The ids were recorded before the last gc: check that they still exist.
    pub needs_validation: bool,
}

/// Where the stat cache of directory `dir` (canonical) lives.
pub fn cache_path(repo: &Repository, dir: &Path) -> PathBuf {
    let key = blake3::hash(dir.as_os_str().as_encoded_bytes()).to_hex();
    repo.cache_dir().join(format!("stat-{}", &key[..32]))
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

impl StatCache {
    /// Loads the cache; anything missing, damaged or from another repository gives an empty cache.
    pub fn load(path: &Path, repo_id: &str, generation: u64) -> StatCache {
        let Ok(buf) = std::fs::read(path) else {
            return StatCache::default();
        };
        Self::parse(&buf, repo_id, generation).unwrap_or_default()
    }

    fn parse(buf: &[u8], repo_id: &str, generation: u64) -> Option<StatCache> {
        if buf.len() < 8 + 4 + 32 + 16 + 32 {
            return None;
        }
        let (body, sum) = buf.split_at(buf.len() - 32);
        if blake3::hash(body).as_bytes() != sum {
            return None;
        }
        if &body[..8] != MAGIC || u32::from_le_bytes(body[8..12].try_into().ok()?) != VERSION {
            return None;
        }
        if &body[12..44] != repo_id.as_bytes() {
            return None;
        }
        let cached_gen = u64::from_le_bytes(body[44..52].try_into().ok()?);
        let count = u64::from_le_bytes(body[52..60].try_into().ok()?);
        let mut r = Reader::new(&body[60..]);
        let mut entries = FxHashMap::with_capacity_and_hasher(count.min(1 << 22) as usize, Default::default());
        for _ in 0..count {
            let path = r.bytes("path", 1 << 16).ok()?.to_vec();
            let stat = StatKey {
                size: r.varint("size").ok()?,
                mtime_ns: unzigzag(r.varint("mtime").ok()?),
                ctime_ns: unzigzag(r.varint("ctime").ok()?),
                ino: r.varint("ino").ok()?,
                dev: r.varint("dev").ok()?,
                mode: r.varint("mode").ok()? as u32,
            };
            let kind = match Kind::from_u8(r.u8("kind").ok()?)? {
                k @ (Kind::Blob | Kind::Chunked) => k,
                _ => return None,
            };
            let id = r.id("id").ok()?;
            entries.insert(path, CacheEntry {
                stat,
                content: Content { kind, id },
            });
        }
        r.finish().ok()?;
        Some(StatCache {
            entries,
            needs_validation: cached_gen != generation,
        })
    }

    /// Replaces the cache file (temporary file + rename). Not fsynced: a cache
    /// damaged by a crash fails its checksum and is ignored.
    pub fn save<'a>(
        path: &Path,
        repo_id: &str,
        generation: u64,
        entries: impl ExactSizeIterator<Item = (&'a Vec<u8>, &'a CacheEntry)>,
    ) -> std::io::Result<()> {
        let mut w = Writer::new();
        w.buf.extend_from_slice(MAGIC);
        w.buf.extend_from_slice(&VERSION.to_le_bytes());
        let mut rid = [b'0'; 32];
        let n = repo_id.len().min(32);
        rid[..n].copy_from_slice(&repo_id.as_bytes()[..n]);
        w.buf.extend_from_slice(&rid);
        w.buf.extend_from_slice(&generation.to_le_bytes());
        w.buf.extend_from_slice(&(entries.len() as u64).to_le_bytes());
        for (p, e) in entries {
            w.bytes(p);
            w.varint(e.stat.size);
            w.varint(zigzag(e.stat.mtime_ns));
            w.varint(zigzag(e.stat.ctime_ns));
            w.varint(e.stat.ino);
            w.varint(e.stat.dev);
            w.varint(u64::from(e.stat.mode));
            w.u8(e.content.kind as u8);
            w.id(&e.content.id);
        }
        let sum = blake3::hash(&w.buf);
        w.buf.extend_from_slice(sum.as_bytes());
        let dir = path.parent().unwrap_or(Path::new("."));
        let tmp = tine_store::pack::temp_path(dir, ".tmp");
        let result = std::fs::write(&tmp, &w.buf).and_then(|()| std::fs::rename(&tmp, path));
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tine_store::ObjectId;

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
        let mut m = FxHashMap::default();
        m.insert(b"a/b".to_vec(), e);
        StatCache::save(&p, rid, 3, m.iter()).unwrap();
        let c = StatCache::load(&p, rid, 3);
        assert_eq!(c.entries, m);
        assert!(!c.needs_validation);
        assert!(StatCache::load(&p, rid, 4).needs_validation);
        assert!(StatCache::load(&p, "other-repo-id-0000000000000000000", 3).entries.is_empty());
        let mut b = std::fs::read(&p).unwrap();
        b[70] ^= 1;
        std::fs::write(&p, &b).unwrap();
        assert!(StatCache::load(&p, rid, 3).entries.is_empty());
    }
}
