//! Pack files: many compressed objects written once, with their index as a trailer.
//!
//! ```text
//! header   "TINEPACK" | version u32 LE | flags u32 LE                       16 bytes
//! frame*   the stored bytes of one object, or one zstd block of small objects
//! index    zstd( count x (id [32] | kind u8 | codec u8 | 0u16 | raw_len u32 | stored_len u32
//!                         | offset u64 | block_offset u32) )
//! footer   index_offset u64 | count u64 | BLAKE3(header ++ stored index) [32] | "TINEPIDX"
//! ```
//! All integers little-endian. Small objects are gathered into blocks compressed
//! as one zstd frame, which compresses many small files far better than one frame
//! each. How small, how big a block and how hard to compress is the pack's
//! [`Density`]: snapshots write fast packs, `gc` rewrites them dense. A pack is written to
//! a temporary file, fsynced once, and renamed to `<hex BLAKE3 of header and index>.pack`;
//! the directory is then fsynced.

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
pub const INDEX_ENTRY_LEN: usize = 56;
pub const FOOTER_LEN: usize = 56;
pub const FOOTER_MAGIC: [u8; 8] = *b"TINEPIDX";
/// Largest decompressed pack index a reader accepts (about 4.7 million objects).
const MAX_INDEX: u64 = 256 << 20;
pub const TEMP_PREFIX: &str = "tmp-";
pub const PACK_SUFFIX: &str = ".pack";

/// Codec of a stored object: its own frame, raw or zstd, or a member of a zstd block.
pub const CODEC_RAW: u8 = 0;
pub const CODEC_ZSTD: u8 = 1;
pub const CODEC_BLOCK: u8 = 2;
/// A member of a block that did not compress and is stored raw.
pub const CODEC_RAW_BLOCK: u8 = 3;

/// Largest decompressed block a reader accepts (a dense block plus its last member).
pub const MAX_BLOCK: usize = (256 << 10) + (64 << 10);
/// Large objects are first probed with this many bytes (at the fast level);
/// incompressible ones are stored raw.
const PROBE: usize = 64 << 10;
/// Header flag of a pack written [`Density::Dense`].
pub const FLAG_DENSE: u32 = 1;
const KNOWN_FLAGS: u32 = FLAG_DENSE;

/// How hard a pack is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Density {
    /// Snapshots: they are on the agent's critical path, so single objects get
    /// zstd level 1 and small objects 64 KiB blocks at level 3.
    Fast,
    /// `gc` compaction, off the critical path: 256 KiB blocks and level 19
    /// (about 15 % smaller on source-like text, ~50x slower to write, as fast to read).
    Dense,
}

impl Density {
    /// Objects smaller than this go into blocks.
    pub fn small_object(self) -> usize {
        match self {
            Density::Fast => 16 << 10,
            Density::Dense => 64 << 10,
        }
    }

    /// A block is compressed once it holds this many raw bytes.
    pub fn block_target(self) -> usize {
        match self {
            Density::Fast => 64 << 10,
            Density::Dense => 256 << 10,
        }
    }

    fn block_level(self) -> i32 {
        match self {
            Density::Fast => 3,
            Density::Dense => 19,
        }
    }

    fn single_level(self, len: usize) -> i32 {
        match self {
            Density::Fast => 1,
            // Chunks of big files stay affordable even for gc.
            Density::Dense if len > 1 << 20 => 9,
            Density::Dense => 19,
        }
    }

    fn flags(self) -> u32 {
        match self {
            Density::Fast => 0,
            Density::Dense => FLAG_DENSE,
        }
    }
}

/// Where an object lives inside a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PackEntry {
    pub id: ObjectId,
    pub kind: Kind,
    pub codec: u8,
    pub raw_len: u32,
    /// Length of the frame (for a block member, of the whole block).
    pub stored_len: u32,
    /// Offset of the frame.
    pub offset: u64,
    /// Offset of the object inside its decompressed block (0 for single frames).
    pub block_offset: u32,
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

fn saves_enough(raw: usize, compressed: usize) -> bool {
    compressed < raw - raw / 32
}

/// Compresses `raw` when that saves at least 1/32 of its size. A large object is
/// probed first, so incompressible data (media, archives) costs no full attempt.
pub fn encode(kind: Kind, id: ObjectId, raw: &[u8], density: Density) -> Encoded {
    assert!(
        (raw.len() as u64) <= MAX_OBJECT_SIZE,
        "object over size limit"
    );
    let worth_trying = match raw.len() {
        0..64 => false,
        n if n <= 2 * PROBE => true,
        _ => zstd::bulk::compress(&raw[..PROBE], Density::Fast.single_level(PROBE))
            .is_ok_and(|z| saves_enough(PROBE, z.len())),
    };
    if worth_trying
        && let Ok(z) = zstd::bulk::compress(raw, density.single_level(raw.len()))
        && saves_enough(raw.len(), z.len())
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

/// Small objects collected for one block, not yet compressed.
#[derive(Debug)]
pub struct PendingBlock {
    density: Density,
    data: Vec<u8>,
    members: Vec<(ObjectId, Kind, u32, u32)>,
}

impl PendingBlock {
    fn new(density: Density) -> PendingBlock {
        PendingBlock {
            density,
            data: Vec::new(),
            members: Vec::new(),
        }
    }

    /// Bytes gathered so far.
    pub fn raw_len(&self) -> usize {
        self.data.len()
    }

    /// Compresses the block (callers do this outside any lock).
    pub fn compress(self) -> EncodedBlock {
        let raw_len = self.data.len() as u32;
        match zstd::bulk::compress(&self.data, self.density.block_level()) {
            Ok(z) if saves_enough(self.data.len(), z.len()) => EncodedBlock {
                data: z,
                members: self.members,
                raw_len,
                raw: false,
            },
            _ => EncodedBlock {
                data: self.data,
                members: self.members,
                raw_len,
                raw: true,
            },
        }
    }
}

/// A compressed block ready to be appended.
#[derive(Debug)]
pub struct EncodedBlock {
    data: Vec<u8>,
    members: Vec<(ObjectId, Kind, u32, u32)>,
    raw_len: u32,
    raw: bool,
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
    pending: PendingBlock,
    density: Density,
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
    pub fn create(dir: &Path, density: Density) -> Result<PackWriter, PackWriteError> {
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
            pending: PendingBlock::new(density),
            density,
        };
        let header = w.header();
        w.write_all(&header)?;
        Ok(w)
    }

    fn header(&self) -> Vec<u8> {
        let mut header = Vec::with_capacity(HEADER_LEN as usize);
        header.extend_from_slice(&PACK_MAGIC);
        header.extend_from_slice(&PACK_VERSION.to_le_bytes());
        header.extend_from_slice(&self.density.flags().to_le_bytes());
        header
    }

    pub fn density(&self) -> Density {
        self.density
    }

    fn take_pending(&mut self) -> PendingBlock {
        std::mem::replace(&mut self.pending, PendingBlock::new(self.density))
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
        self.entries.len() + self.pending.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.pending.members.is_empty()
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.offset
    }

    /// Appends an object in its own frame unless this pack already has it.
    /// Returns whether it was added.
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
            block_offset: 0,
        };
        self.write_all(&obj.data)?;
        self.entries.push(entry);
        Ok(true)
    }

    /// Adds a small object to the pending block. Returns whether it was new, and
    /// the block if it is now full (to be compressed and passed to [`PackWriter::add_block`]).
    pub fn push_small(
        &mut self,
        kind: Kind,
        id: ObjectId,
        raw: &[u8],
    ) -> (bool, Option<PendingBlock>) {
        debug_assert!(raw.len() < self.density.small_object());
        if !self.seen.insert(id) {
            return (false, None);
        }
        let at = self.pending.data.len() as u32;
        self.pending.data.extend_from_slice(raw);
        self.pending.members.push((id, kind, at, raw.len() as u32));
        let full =
            (self.pending.data.len() >= self.density.block_target()).then(|| self.take_pending());
        (true, full)
    }

    /// Appends a compressed block.
    pub fn add_block(&mut self, b: EncodedBlock) -> Result<(), PackWriteError> {
        let offset = self.offset;
        let codec = if b.raw { CODEC_RAW_BLOCK } else { CODEC_BLOCK };
        let stored_len = b.data.len() as u32;
        debug_assert!(!b.raw || stored_len == b.raw_len);
        self.write_all(&b.data)?;
        for (id, kind, at, len) in b.members {
            self.entries.push(PackEntry {
                id,
                kind,
                codec,
                raw_len: len,
                stored_len,
                offset,
                block_offset: at,
            });
        }
        Ok(())
    }

    /// Adds any object: small ones through blocks, others in their own frame.
    pub fn add_object(
        &mut self,
        kind: Kind,
        id: ObjectId,
        raw: &[u8],
    ) -> Result<bool, PackWriteError> {
        if raw.len() < self.density.small_object() {
            let (added, full) = self.push_small(kind, id, raw);
            if let Some(block) = full {
                self.add_block(block.compress())?;
            }
            return Ok(added);
        }
        self.add(&encode(kind, id, raw, self.density))
    }

    /// Writes the index, fsyncs once, renames into place and fsyncs the directory.
    pub fn finish(mut self) -> Result<FinishedPack, PackWriteError> {
        if !self.pending.members.is_empty() {
            let block = self.take_pending();
            self.add_block(block.compress())?;
        }
        let index_offset = self.offset;
        let index = encode_index(&self.entries);
        let header = self.header();
        let name = pack_name(&header, &self.entries);
        let stored_index = zstd::bulk::compress(&index, Density::Fast.single_level(index.len()))
            .map_err(|source| PackWriteError {
                step: "compress pack index",
                path: self.tmp.clone(),
                source,
            })?;
        let sum = index_checksum(&header, &stored_index);
        self.write_all(&stored_index)?;
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

fn encode_index(entries: &[PackEntry]) -> Vec<u8> {
    let mut index = Vec::with_capacity(entries.len() * INDEX_ENTRY_LEN);
    for e in entries {
        let mut b = [0u8; INDEX_ENTRY_LEN];
        encode_index_entry(e, &mut b);
        index.extend_from_slice(&b);
    }
    index
}

/// A pack's name: the hash of its header and its (uncompressed) index. The
/// header is part of it, so a dense copy of a fast pack never takes the fast
/// pack's name; the index names every object by its hash, so the name covers
/// the content too.
pub fn pack_name(header: &[u8], entries: &[PackEntry]) -> String {
    let mut h = blake3::Hasher::new();
    h.update(header);
    h.update(&encode_index(entries));
    h.finalize().to_hex().to_string()
}

fn index_checksum(header: &[u8], index: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(header);
    h.update(index);
    *h.finalize().as_bytes()
}

fn encode_index_entry(e: &PackEntry, b: &mut [u8; INDEX_ENTRY_LEN]) {
    b[..32].copy_from_slice(e.id.as_bytes());
    b[32] = e.kind as u8;
    b[33] = e.codec;
    b[34..36].copy_from_slice(&[0, 0]);
    b[36..40].copy_from_slice(&e.raw_len.to_le_bytes());
    b[40..44].copy_from_slice(&e.stored_len.to_le_bytes());
    b[44..52].copy_from_slice(&e.offset.to_le_bytes());
    b[52..56].copy_from_slice(&e.block_offset.to_le_bytes());
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Reads and decompresses the frame holding `e`: the object itself, or its whole block.
pub fn read_frame(file: &File, e: &PackEntry) -> Result<Vec<u8>, String> {
    let limit = match e.codec {
        CODEC_BLOCK | CODEC_RAW_BLOCK => MAX_BLOCK as u64,
        _ => MAX_OBJECT_SIZE,
    };
    if u64::from(e.raw_len) > limit || u64::from(e.stored_len) > MAX_OBJECT_SIZE {
        return Err(format!(
            "sizes in the index ({} / {}) are over the limit of {limit}",
            e.raw_len, e.stored_len
        ));
    }
    let mut buf = vec![0u8; e.stored_len as usize];
    file.read_exact_at(&mut buf, e.offset)
        .map_err(|err| format!("read failed: {err}"))?;
    match e.codec {
        CODEC_RAW | CODEC_RAW_BLOCK => Ok(buf),
        CODEC_ZSTD => {
            zstd::bulk::decompress(&buf, e.raw_len as usize).map_err(|err| format!("zstd: {err}"))
        }
        CODEC_BLOCK => {
            zstd::bulk::decompress(&buf, MAX_BLOCK).map_err(|err| format!("zstd block: {err}"))
        }
        c => Err(format!("unknown codec {c}")),
    }
}

/// Takes the object out of its decompressed frame and verifies its length and hash.
pub fn extract(frame: &[u8], e: &PackEntry) -> Result<Vec<u8>, String> {
    let raw = match e.codec {
        CODEC_BLOCK | CODEC_RAW_BLOCK => {
            let (at, len) = (e.block_offset as usize, e.raw_len as usize);
            frame
                .get(at..at + len)
                .ok_or("object lies outside its block")?
                .to_vec()
        }
        _ => frame.to_vec(),
    };
    if raw.len() != e.raw_len as usize {
        return Err(format!(
            "decoded to {} bytes, expected {}",
            raw.len(),
            e.raw_len
        ));
    }
    if ObjectId::compute(e.kind, &raw) != e.id {
        return Err("content does not match its hash".into());
    }
    Ok(raw)
}

/// Reads one object and verifies everything: it decompresses to exactly
/// `raw_len` bytes and they hash to its id.
pub fn read_verified(file: &File, e: &PackEntry) -> Result<Vec<u8>, String> {
    extract(&read_frame(file, e)?, e)
}

/// Reads and checks a pack's header: its raw bytes and its density.
pub fn read_header(file: &File) -> Result<([u8; HEADER_LEN as usize], Density), String> {
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
    let flags = u32_at(&header, 12);
    if flags & !KNOWN_FLAGS != 0 {
        return Err(format!("unknown pack flags {flags:#x}"));
    }
    let density = if flags & FLAG_DENSE != 0 {
        Density::Dense
    } else {
        Density::Fast
    };
    Ok((header, density))
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
    let (header, _) = read_header(file)?;
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
        .filter(|l| *l <= MAX_INDEX)
        .ok_or("index entry count in the footer is over the limit")?;
    let stored_len = (len - FOOTER_LEN as u64)
        .checked_sub(index_offset)
        .filter(|_| index_offset >= HEADER_LEN)
        .ok_or("index position in the footer is inconsistent")?;
    let mut stored = vec![0u8; stored_len as usize];
    file.read_exact_at(&mut stored, index_offset)
        .map_err(|e| format!("read index: {e}"))?;
    if index_checksum(&header, &stored)[..] != footer[16..48] {
        return Err("index checksum mismatch".into());
    }
    let index = zstd::bulk::decompress(&stored, index_len as usize)
        .map_err(|e| format!("index: zstd: {e}"))?;
    if index.len() as u64 != index_len {
        return Err("index is shorter than the footer says".into());
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
            block_offset: u32_at(b, 52),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_round_trip_and_detects_every_flipped_byte() {
        for density in [Density::Fast, Density::Dense] {
            round_trip_and_flips(density);
        }
    }

    fn round_trip_and_flips(density: Density) {
        let dir = tempfile::tempdir().unwrap();
        let mut w = PackWriter::create(dir.path(), density).unwrap();
        let small = b"hello hello hello hello hello hello hello hello hello hello hello hello";
        let small2 = b"a different small object";
        let big: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
        let objs: Vec<(ObjectId, &[u8])> = [&small[..], &small2[..], &big[..]]
            .iter()
            .map(|r| (ObjectId::compute(Kind::Blob, r), *r))
            .collect();
        for (id, raw) in &objs {
            assert!(w.add_object(Kind::Blob, *id, raw).unwrap());
            assert!(!w.add_object(Kind::Blob, *id, raw).unwrap());
        }
        let p = w.finish().unwrap();
        let f = File::open(&p.path).unwrap();
        let idx = read_index(&f).unwrap();
        assert_eq!(idx.len(), 3);
        for (id, raw) in &objs {
            let e = idx.iter().find(|e| e.id == *id).unwrap();
            assert_eq!(read_verified(&f, e).unwrap(), *raw);
        }
        // The 40 kB object is blocked only in a dense pack.
        let blocked = if density == Density::Dense { 3 } else { 2 };
        assert_eq!(
            idx.iter().filter(|e| e.codec == CODEC_BLOCK).count(),
            blocked
        );
        assert_eq!(read_header(&f).unwrap().1, density);

        let bytes = fs::read(&p.path).unwrap();
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x01;
            fs::write(&p.path, &b).unwrap();
            let f = File::open(&p.path).unwrap();
            let objs_ok = p.entries.iter().all(|e| read_verified(&f, e).is_ok());
            let idx_ok = read_index(&f).map(|i| i == p.entries).unwrap_or(false);
            assert!(!(objs_ok && idx_ok), "flip at byte {i} went unnoticed");
        }
    }

    #[test]
    fn unknown_header_flags_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let w = PackWriter::create(dir.path(), Density::Fast).unwrap();
        let p = w.finish().unwrap();
        let mut bytes = fs::read(&p.path).unwrap();
        bytes[12] = 0x02;
        fs::write(&p.path, &bytes).unwrap();
        let err = read_index(&File::open(&p.path).unwrap()).unwrap_err();
        assert!(err.contains("unknown pack flags 0x2"), "{err}");
    }

    #[test]
    fn incompressible_large_objects_are_stored_raw() {
        let mut x: u64 = 1;
        let raw: Vec<u8> = (0..300_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let e = encode(
            Kind::Blob,
            ObjectId::compute(Kind::Blob, &raw),
            &raw,
            Density::Fast,
        );
        assert_eq!(e.codec, CODEC_RAW);
        let text = b"compressible ".repeat(30_000);
        assert_eq!(
            encode(
                Kind::Blob,
                ObjectId::compute(Kind::Blob, &text),
                &text,
                Density::Fast
            )
            .codec,
            CODEC_ZSTD
        );
    }

    #[test]
    fn unfinished_pack_is_removed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let w = PackWriter::create(dir.path(), Density::Fast).unwrap();
        drop(w);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
