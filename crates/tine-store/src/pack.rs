//! Pack files: many compressed objects written once, with their index as a trailer.
//!
//! ```text
//! header   "TINEPACK" | version u32 LE | flags u32 LE                       16 bytes
//! entry*   id [32] | kind u8 | codec u8 | 0u16 | raw_len u32 | stored_len u32 | data
//! index    count x (id [32] | kind u8 | codec u8 | 0u16 | raw_len u32 | stored_len u32 | offset u64)
//! footer   index_offset u64 | count u64 | BLAKE3(header ++ index) [32] | "TINEPIDX"
//! ```
//! All integers little-endian. A pack is written to a temporary file, fsynced once,
//! and renamed to `<hex BLAKE3 of the index>.pack`; the directory is then fsynced.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::id::{Kind, ObjectId};
use crate::object::MAX_OBJECT_SIZE;

pub const PACK_MAGIC: [u8; 8] = *b"TINEPACK";
pub const PACK_VERSION: u32 = 1;
pub const HEADER_LEN: u64 = 16;
pub const ENTRY_HEADER_LEN: usize = 44;
pub const INDEX_ENTRY_LEN: usize = 52;
pub const FOOTER_LEN: usize = 56;
pub const FOOTER_MAGIC: [u8; 8] = *b"TINEPIDX";
pub const TEMP_PREFIX: &str = "tmp-";
pub const PACK_SUFFIX: &str = ".pack";

/// Codec of a stored object.
pub const CODEC_RAW: u8 = 0;
pub const CODEC_ZSTD: u8 = 1;

/// zstd level: fast, since snapshots are on the agent's critical path.
const ZSTD_LEVEL: i32 = 1;
/// Objects smaller than this are not worth compressing.
const MIN_COMPRESS: usize = 64;

/// Where an object lives inside a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PackEntry {
    pub id: ObjectId,
    pub kind: Kind,
    pub codec: u8,
    pub raw_len: u32,
    pub stored_len: u32,
    /// Offset of the entry header.
    pub offset: u64,
}

/// An object ready to be appended: id computed, bytes compressed (or not).
#[derive(Debug)]
pub struct Encoded {
    pub id: ObjectId,
    pub kind: Kind,
    pub codec: u8,
    pub raw_len: u32,
    pub data: Vec<u8>,
}

/// Compresses `raw` when that saves at least 1/32 of its size.
pub fn encode(kind: Kind, id: ObjectId, raw: &[u8]) -> Encoded {
    assert!(
        (raw.len() as u64) <= MAX_OBJECT_SIZE,
        "object over size limit"
    );
    if raw.len() >= MIN_COMPRESS
        && let Ok(z) = zstd::bulk::compress(raw, ZSTD_LEVEL)
        && z.len() < raw.len() - raw.len() / 32
    {
        return Encoded {
            id,
            kind,
            codec: CODEC_ZSTD,
            raw_len: raw.len() as u32,
            data: z,
        };
    }
    Encoded {
        id,
        kind,
        codec: CODEC_RAW,
        raw_len: raw.len() as u32,
        data: raw.to_vec(),
    }
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A unique temporary path in `dir` (created with `create_new`, so never shared).
pub fn temp_path(dir: &Path, suffix: &str) -> PathBuf {
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    dir.join(format!(
        "{TEMP_PREFIX}{}-{n}-{nanos:08x}{suffix}",
        std::process::id()
    ))
}

/// Why writing a pack failed.
#[derive(Debug, thiserror::Error)]
#[error("{step} {path}: {source}")]
pub struct PackWriteError {
    pub step: &'static str,
    pub path: PathBuf,
    pub source: io::Error,
}

/// Appends objects to a temporary file; [`PackWriter::finish`] makes it a durable pack.
#[derive(Debug)]
pub struct PackWriter {
    dir: PathBuf,
    tmp: PathBuf,
    out: Option<BufWriter<File>>,
    offset: u64,
    entries: Vec<PackEntry>,
    seen: HashSet<ObjectId>,
}

/// A pack that is on disk, durable, under its final name.
#[derive(Debug)]
pub struct FinishedPack {
    pub name: String,
    pub path: PathBuf,
    pub bytes: u64,
    pub entries: Vec<PackEntry>,
}

impl PackWriter {
    pub fn create(dir: &Path) -> Result<PackWriter, PackWriteError> {
        let tmp = temp_path(dir, PACK_SUFFIX);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|source| PackWriteError {
                step: "create temporary pack",
                path: tmp.clone(),
                source,
            })?;
        let mut w = PackWriter {
            dir: dir.to_path_buf(),
            tmp,
            out: Some(BufWriter::with_capacity(1 << 20, file)),
            offset: 0,
            entries: Vec::new(),
            seen: HashSet::new(),
        };
        let mut header = Vec::with_capacity(HEADER_LEN as usize);
        header.extend_from_slice(&PACK_MAGIC);
        header.extend_from_slice(&PACK_VERSION.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        w.write_all(&header)?;
        Ok(w)
    }

    fn write_all(&mut self, buf: &[u8]) -> Result<(), PackWriteError> {
        let out = self.out.as_mut().expect("pack writer used after finish");
        out.write_all(buf).map_err(|source| PackWriteError {
            step: "write pack",
            path: self.tmp.clone(),
            source,
        })?;
        self.offset += buf.len() as u64;
        Ok(())
    }

    pub fn contains(&self, id: &ObjectId) -> bool {
        self.seen.contains(id)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.offset
    }

    /// Appends an object unless this pack already has it. Returns whether it was added.
    pub fn add(&mut self, obj: &Encoded) -> Result<bool, PackWriteError> {
        if !self.seen.insert(obj.id) {
            return Ok(false);
        }
        let entry = PackEntry {
            id: obj.id,
            kind: obj.kind,
            codec: obj.codec,
            raw_len: obj.raw_len,
            stored_len: obj.data.len() as u32,
            offset: self.offset,
        };
        let mut h = [0u8; ENTRY_HEADER_LEN];
        encode_entry_header(&entry, &mut h);
        self.write_all(&h)?;
        self.write_all(&obj.data)?;
        self.entries.push(entry);
        Ok(true)
    }

    /// Writes the index, fsyncs once, renames into place and fsyncs the directory.
    pub fn finish(mut self) -> Result<FinishedPack, PackWriteError> {
        let index_offset = self.offset;
        let mut index = Vec::with_capacity(self.entries.len() * INDEX_ENTRY_LEN);
        for e in &self.entries {
            let mut b = [0u8; INDEX_ENTRY_LEN];
            encode_index_entry(e, &mut b);
            index.extend_from_slice(&b);
        }
        let mut header = Vec::new();
        header.extend_from_slice(&PACK_MAGIC);
        header.extend_from_slice(&PACK_VERSION.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        let sum = index_checksum(&header, &index);
        let name = blake3::hash(&index).to_hex().to_string();
        self.write_all(&index)?;
        let mut footer = Vec::with_capacity(FOOTER_LEN);
        footer.extend_from_slice(&index_offset.to_le_bytes());
        footer.extend_from_slice(&(self.entries.len() as u64).to_le_bytes());
        footer.extend_from_slice(&sum);
        footer.extend_from_slice(&FOOTER_MAGIC);
        self.write_all(&footer)?;
        let out = self.out.take().expect("finish once");
        let file = out.into_inner().map_err(|e| PackWriteError {
            step: "flush pack",
            path: self.tmp.clone(),
            source: e.into_error(),
        })?;
        file.sync_all().map_err(|source| PackWriteError {
            step: "fsync pack",
            path: self.tmp.clone(),
            source,
        })?;
        drop(file);
        let path = self.dir.join(format!("{name}{PACK_SUFFIX}"));
        fs::rename(&self.tmp, &path).map_err(|source| PackWriteError {
            step: "rename pack into place",
            path: path.clone(),
            source,
        })?;
        sync_dir(&self.dir).map_err(|source| PackWriteError {
            step: "fsync pack directory",
            path: self.dir.clone(),
            source,
        })?;
        let entries = std::mem::take(&mut self.entries);
        Ok(FinishedPack {
            name,
            path,
            bytes: self.offset,
            entries,
        })
    }
}

impl Drop for PackWriter {
    fn drop(&mut self) {
        // An unfinished pack is garbage: remove it (a crash leaves it for gc instead).
        if self.out.is_some() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn index_checksum(header: &[u8], index: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(header);
    h.update(index);
    *h.finalize().as_bytes()
}

fn encode_entry_header(e: &PackEntry, b: &mut [u8; ENTRY_HEADER_LEN]) {
    b[..32].copy_from_slice(e.id.as_bytes());
    b[32] = e.kind as u8;
    b[33] = e.codec;
    b[36..40].copy_from_slice(&e.raw_len.to_le_bytes());
    b[40..44].copy_from_slice(&e.stored_len.to_le_bytes());
}

fn encode_index_entry(e: &PackEntry, b: &mut [u8; INDEX_ENTRY_LEN]) {
    let mut h = [0u8; ENTRY_HEADER_LEN];
    encode_entry_header(e, &mut h);
    b[..ENTRY_HEADER_LEN].copy_from_slice(&h);
    b[ENTRY_HEADER_LEN..].copy_from_slice(&e.offset.to_le_bytes());
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Reads the object whose entry header is at `offset` and verifies everything:
/// the header matches what the index says, the data decompresses to `raw_len`
/// bytes, and the bytes hash to `id`. Returns the raw bytes or a reason.
pub fn read_verified(file: &File, expected: &PackEntry) -> Result<Vec<u8>, String> {
    if u64::from(expected.raw_len) > MAX_OBJECT_SIZE {
        return Err(format!(
            "raw length {} over the limit of {MAX_OBJECT_SIZE}",
            expected.raw_len
        ));
    }
    let mut buf = vec![0u8; ENTRY_HEADER_LEN + expected.stored_len as usize];
    file.read_exact_at(&mut buf, expected.offset)
        .map_err(|e| format!("read failed: {e}"))?;
    let mut want = [0u8; ENTRY_HEADER_LEN];
    encode_entry_header(expected, &mut want);
    if buf[..ENTRY_HEADER_LEN] != want {
        return Err("entry header does not match the index".into());
    }
    let data = &buf[ENTRY_HEADER_LEN..];
    let raw = match expected.codec {
        CODEC_RAW => data.to_vec(),
        CODEC_ZSTD => zstd::bulk::decompress(data, expected.raw_len as usize)
            .map_err(|e| format!("zstd: {e}"))?,
        c => return Err(format!("unknown codec {c}")),
    };
    if raw.len() != expected.raw_len as usize {
        return Err(format!(
            "decoded to {} bytes, expected {}",
            raw.len(),
            expected.raw_len
        ));
    }
    if ObjectId::compute(expected.kind, &raw) != expected.id {
        return Err("content does not match its hash".into());
    }
    Ok(raw)
}

/// Reads and checks a pack's header, footer and index (not the objects).
pub fn read_index(file: &File) -> Result<Vec<PackEntry>, String> {
    let len = file
        .metadata()
        .map_err(|e| format!("stat failed: {e}"))?
        .len();
    if len < HEADER_LEN + FOOTER_LEN as u64 {
        return Err(format!("{len} bytes is too short for a pack"));
    }
    let mut header = [0u8; HEADER_LEN as usize];
    file.read_exact_at(&mut header, 0)
        .map_err(|e| format!("read header: {e}"))?;
    if header[..8] != PACK_MAGIC {
        return Err("bad magic (not a tine pack)".into());
    }
    let version = u32_at(&header, 8);
    if version != PACK_VERSION {
        return Err(format!(
            "pack version {version}, this tine reads {PACK_VERSION}"
        ));
    }
    let mut footer = [0u8; FOOTER_LEN];
    file.read_exact_at(&mut footer, len - FOOTER_LEN as u64)
        .map_err(|e| format!("read footer: {e}"))?;
    if footer[48..56] != FOOTER_MAGIC {
        return Err("bad footer magic (truncated or damaged pack)".into());
    }
    let index_offset = u64_at(&footer, 0);
    let count = u64_at(&footer, 8);
    let index_len = count
        .checked_mul(INDEX_ENTRY_LEN as u64)
        .filter(|l| index_offset >= HEADER_LEN && index_offset + l + FOOTER_LEN as u64 == len)
        .ok_or("index position in the footer is inconsistent")?;
    let mut index = vec![0u8; index_len as usize];
    file.read_exact_at(&mut index, index_offset)
        .map_err(|e| format!("read index: {e}"))?;
    if index_checksum(&header, &index)[..] != footer[16..48] {
        return Err("index checksum mismatch".into());
    }
    let mut out = Vec::with_capacity(count as usize);
    for b in index.chunks_exact(INDEX_ENTRY_LEN) {
        let kind = Kind::from_u8(b[32]).ok_or("unknown object kind in index")?;
        out.push(PackEntry {
            id: ObjectId::from_slice(&b[..32]).expect("32 bytes"),
            kind,
            codec: b[33],
            raw_len: u32_at(b, 36),
            stored_len: u32_at(b, 40),
            offset: u64_at(b, 44),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_round_trip_and_detects_every_flipped_byte_in_data() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = PackWriter::create(dir.path()).unwrap();
        let raw = b"hello hello hello hello hello hello hello hello hello hello hello hello";
        let id = ObjectId::compute(Kind::Blob, raw);
        assert!(w.add(&encode(Kind::Blob, id, raw)).unwrap());
        assert!(!w.add(&encode(Kind::Blob, id, raw)).unwrap());
        let p = w.finish().unwrap();
        let f = File::open(&p.path).unwrap();
        let idx = read_index(&f).unwrap();
        assert_eq!(idx, p.entries);
        assert_eq!(read_verified(&f, &idx[0]).unwrap(), raw);

        let bytes = fs::read(&p.path).unwrap();
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x01;
            fs::write(&p.path, &b).unwrap();
            let f = File::open(&p.path).unwrap();
            let obj_ok = read_verified(&f, &p.entries[0]).is_ok();
            let idx_ok = read_index(&f).map(|i| i == p.entries).unwrap_or(false);
            assert!(!(obj_ok && idx_ok), "flip at byte {i} went unnoticed");
        }
    }

    #[test]
    fn unfinished_pack_is_removed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let w = PackWriter::create(dir.path()).unwrap();
        drop(w);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
