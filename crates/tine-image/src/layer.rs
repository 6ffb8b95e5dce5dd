//! One layer applied to a directory: its whiteouts remove what lower layers
//! put there (`.wh.NAME`, and `.wh..wh..opq` for a whole directory), then its
//! entries are written. Every name is an [`EntryPath`] and every write goes
//! through a [`Beneath`] of the directory: nothing climbs out, nothing is
//! written or removed through a link. Device nodes and FIFOs are skipped (a
//! sandbox has none) and named. What a layer may cost is bounded
//! ([`Limits`]): bytes unpacked, entries, depth.

use std::io::Read;
use std::path::Path;

use serde::Serialize;

use crate::digest::{Digest, Verifying};
use crate::entry::{Beneath, EntryPath, Finish, NameError, Whiteout};
use crate::{ImageError, Layer};

/// What an import may unpack at most, over all its layers: bounds that a
/// real image does not come near (the largest public images unpack to tens
/// of GiB in a few hundred thousand files), so that a hostile one (a gzip
/// bomb, millions of entries, a chain of nested directories) stops early,
/// named. Callers may raise them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Limits {
    /// Bytes of uncompressed tar read, headers included.
    pub bytes: u64,
    /// Entries, whiteouts included.
    pub entries: u64,
    /// Components of one entry's path.
    pub depth: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            bytes: 64 << 30,
            entries: 4_000_000,
            depth: 256,
        }
    }
}

/// What is left of [`Limits`] as an import goes.
#[derive(Debug, Clone)]
pub struct Budget {
    limits: Limits,
    bytes: u64,
    entries: u64,
}

impl Budget {
    pub fn new(limits: Limits) -> Budget {
        Budget {
            limits,
            bytes: 0,
            entries: 0,
        }
    }
}

fn bad_entry(layer: &dyn std::fmt::Display, raw: &[u8]) -> impl FnOnce(NameError) -> ImageError {
    let (layer, path) = (layer.to_string(), String::from_utf8_lossy(raw).into_owned());
    move |e| ImageError::BadEntry {
        layer,
        path,
        reason: e.to_string(),
    }
}

/// An entry's name, checked: `None` for the root.
fn entry_path(
    layer: &dyn std::fmt::Display,
    raw: &[u8],
    limits: &Limits,
) -> Result<Option<EntryPath>, ImageError> {
    EntryPath::parse(raw)
        .and_then(|p| p.map(|p| p.within(limits.depth)).transpose())
        .map_err(bad_entry(layer, raw))
}

fn write_err(path: std::path::PathBuf) -> impl FnOnce(std::io::Error) -> ImageError {
    move |source| ImageError::Write { path, source }
}

/// A write's failure: one the kernel refused because the way to the entry
/// goes through a link (`ELOOP` under `RESOLVE_NO_SYMLINKS`, `ENOTDIR` for
/// a link where a directory is opened), a file, or above the root (`EXDEV`
/// under `RESOLVE_BENEATH`) is the entry's fault, named so.
fn entry_err(
    layer: &dyn std::fmt::Display,
    rel: &EntryPath,
    shown: std::path::PathBuf,
) -> impl FnOnce(std::io::Error) -> ImageError {
    let (layer, path) = (layer.to_string(), rel.to_string());
    move |source| match source.raw_os_error() {
        Some(code)
            if [
                rustix::io::Errno::LOOP,
                rustix::io::Errno::XDEV,
                rustix::io::Errno::NOTDIR,
            ]
            .iter()
            .any(|e| e.raw_os_error() == code) =>
        {
            ImageError::BadEntry {
                layer,
                path,
                reason: "its way down goes through a symbolic link or a file".into(),
            }
        }
        _ => ImageError::Write {
            path: shown,
            source,
        },
    }
}

/// Counts what is read through it and fails once past `limit` bytes.
struct Capped<R> {
    inner: R,
    read: u64,
    limit: u64,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        if self.read > self.limit {
            return Err(std::io::Error::other(OverLimit));
        }
        Ok(n)
    }
}

/// The marker error [`Capped`] fails with.
#[derive(Debug)]
struct OverLimit;

impl std::fmt::Display for OverLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("over the import's size limit")
    }
}

impl std::error::Error for OverLimit {}

pub(crate) fn is_over_limit(e: &std::io::Error) -> bool {
    e.get_ref().is_some_and(|i| i.is::<OverLimit>())
}

/// How a layer's blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// What applying a layer did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Applied {
    pub entries: u64,
    pub whiteouts: u64,
    /// Device nodes and FIFOs left out, by path.
    pub skipped: Vec<String>,
    /// The blob's size, as read.
    pub blob_bytes: u64,
}

/// What is done with each entry of a layer as it is read.
type EachEntry<'f> =
    dyn for<'e, 'r> FnMut(&mut tar::Entry<'e, Box<dyn Read + 'r>>) -> Result<(), ImageError> + 'f;

/// Reads the layer once, end to end, through `each`, at most `cap` bytes of
/// uncompressed tar, and checks its digests; the bytes read.
fn each_entry(
    open: &dyn Fn() -> Result<Box<dyn Read + Send>, ImageError>,
    layer: &Layer,
    cap: u64,
    each: &mut EachEntry<'_>,
) -> Result<u64, ImageError> {
    let what = format!("layer {}", layer.digest);
    let read = |e: std::io::Error| {
        if is_over_limit(&e) {
            over(&layer.digest, "bytes", cap)
        } else {
            ImageError::Read {
                what: what.clone(),
                source: e,
            }
        }
    };
    let mut blob = Verifying::new(open()?);
    let bytes = {
        let unpacked: Box<dyn Read + '_> = match layer.compression {
            Compression::None => Box::new(&mut blob),
            Compression::Gzip => Box::new(flate2::read::GzDecoder::new(&mut blob)),
            Compression::Zstd => {
                Box::new(zstd::stream::read::Decoder::new(&mut blob).map_err(read)?)
            }
        };
        let mut tar_stream = Verifying::new(Capped {
            inner: unpacked,
            read: 0,
            limit: cap,
        });
        {
            let mut ar = tar::Archive::new(Box::new(&mut tar_stream) as Box<dyn Read + '_>);
            for e in ar.entries().map_err(read)? {
                let mut e = e.map_err(read)?;
                each(&mut e).map_err(|err| match err {
                    ImageError::Write { source, .. } if is_over_limit(&source) => {
                        over(&layer.digest, "bytes", cap)
                    }
                    other => other,
                })?;
            }
        }
        match &layer.diff_id {
            Some(diff_id) => tar_stream
                .finish(diff_id, &format!("{what} (uncompressed)"))
                .map_err(|e| match e {
                    ImageError::Read { source, .. } if is_over_limit(&source) => {
                        over(&layer.digest, "bytes", cap)
                    }
                    other => other,
                })?,
            None => tar_stream.bytes_read(),
        }
    };
    blob.finish(&layer.digest, &what)?;
    Ok(bytes)
}

fn over(layer: &Digest, what: &'static str, limit: u64) -> ImageError {
    ImageError::OverLimit {
        layer: layer.to_string(),
        what,
        limit,
    }
}

/// Applies `layer` (its blob opened by `open`, as often as needed) to `root`,
/// within what is left of `budget`.
pub(crate) fn apply(
    open: &dyn Fn() -> Result<Box<dyn Read + Send>, ImageError>,
    layer: &Layer,
    root: &Path,
    as_root: bool,
    budget: &mut Budget,
) -> Result<Applied, ImageError> {
    let dir = Beneath::open(root).map_err(write_err(root.to_path_buf()))?;
    let limits = budget.limits;
    let cap = limits.bytes.saturating_sub(budget.bytes);
    let mut out = Applied::default();
    // First the whiteouts (they apply to lower layers only, wherever they
    // stand in this one), checked against the blob's digest.
    let mut gone: Vec<Whiteout> = Vec::new();
    let mut entries = 0u64;
    each_entry(open, layer, cap, &mut |e| {
        entries += 1;
        if budget.entries + entries > limits.entries {
            return Err(over(&layer.digest, "entries", limits.entries));
        }
        let raw = e.path_bytes();
        let Some(rel) = entry_path(&layer.digest, &raw, &limits)? else {
            return Ok(());
        };
        if let Some(w) = rel.whiteout().map_err(bad_entry(&layer.digest, &raw))? {
            gone.push(w);
        }
        Ok(())
    })?;
    for w in &gone {
        match w {
            Whiteout::Opaque(None) => dir.empty_dir(None).map_err(write_err(dir.shown(None)))?,
            Whiteout::Opaque(Some(d)) => {
                dir.empty_dir(Some(d))
                    .map_err(entry_err(&layer.digest, d, dir.shown(Some(d))))?
            }
            Whiteout::Hides(p) => {
                dir.remove_all(p)
                    .map_err(entry_err(&layer.digest, p, dir.shown(Some(p))))?
            }
        }
        out.whiteouts += 1;
    }
    // Then the entries, read again and checked again.
    out.blob_bytes = layer.size;
    // Bytes written to files: a GNU sparse entry expands past what the tar
    // stream holds, so both count against the limit.
    let mut written = Written { bytes: 0, cap };
    let read = each_entry(open, layer, cap, &mut |e| {
        let raw = e.path_bytes().into_owned();
        let Some(rel) = entry_path(&layer.digest, &raw, &limits)? else {
            return Ok(());
        };
        if rel
            .whiteout()
            .map_err(bad_entry(&layer.digest, &raw))?
            .is_some()
        {
            return Ok(());
        }
        if write_entry(&dir, &rel, e, as_root, &layer.digest, &limits, &mut written)? {
            out.entries += 1;
        } else {
            out.skipped.push(rel.to_string());
        }
        Ok(())
    })?;
    budget.bytes += read.max(written.bytes);
    budget.entries += entries;
    Ok(out)
}

/// Writes the tar entry `e` as `rel` below `dir`; false when it was left out
/// (a device node or a FIFO).
/// Bytes written to files so far, and how many may be.
#[derive(Debug)]
pub(crate) struct Written {
    pub(crate) bytes: u64,
    pub(crate) cap: u64,
}

/// Copies `from` into the new file `to`, leaving holes where `from` has
/// blocks of zeros (a sparse file stays sparse, whatever its size), at most
/// `w`'s cap in all; the bytes copied.
fn copy_sparse(
    from: &mut impl Read,
    to: &mut std::fs::File,
    w: &mut Written,
) -> std::io::Result<u64> {
    use std::io::{Seek, SeekFrom, Write};
    let mut buf = vec![0u8; 64 << 10];
    let mut len = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        w.bytes += n as u64;
        if w.bytes > w.cap {
            return Err(std::io::Error::other(OverLimit));
        }
        if buf[..n].iter().all(|b| *b == 0) {
            to.seek(SeekFrom::Current(n as i64))?;
        } else {
            to.write_all(&buf[..n])?;
        }
        len += n as u64;
    }
    to.set_len(len)?;
    Ok(len)
}

pub(crate) fn write_entry(
    dir: &Beneath,
    rel: &EntryPath,
    e: &mut tar::Entry<'_, impl Read>,
    as_root: bool,
    layer: &dyn std::fmt::Display,
    limits: &Limits,
    written: &mut Written,
) -> Result<bool, ImageError> {
    use tar::EntryType as T;
    let h = e.header();
    let kind = h.entry_type();
    if matches!(kind, T::Char | T::Block | T::Fifo) {
        return Ok(false);
    }
    // Fields that do not parse (archivers leave a link's mode empty) get
    // what tar itself would give.
    let mode = h
        .mode()
        .unwrap_or(if kind.is_dir() { 0o755 } else { 0o644 });
    let mtime = h.mtime().unwrap_or(0);
    let owner = as_root.then(|| {
        (
            u32::try_from(h.uid().unwrap_or(0)).unwrap_or(0),
            u32::try_from(h.gid().unwrap_or(0)).unwrap_or(0),
        )
    });
    let how = Finish {
        owner,
        mode: Some(mode),
        mtime: Some(i64::try_from(mtime).unwrap_or(0)),
    };
    let shown = dir.shown(Some(rel));
    let w = |e: std::io::Error| entry_err(layer, rel, shown.clone())(e);
    dir.make_parents(rel).map_err(w)?;
    match kind {
        T::Directory => {
            dir.make_dir(rel).map_err(w)?;
            dir.finish(rel, &how).map_err(w)?;
        }
        T::Regular | T::Continuous | T::GNUSparse => {
            let mut f = dir.create_file(rel).map_err(w)?;
            copy_sparse(e, &mut f, written).map_err(|err| {
                if is_over_limit(&err) {
                    // Caught by each_entry's caller as the byte limit.
                    ImageError::Write {
                        path: shown.clone(),
                        source: err,
                    }
                } else {
                    w(err)
                }
            })?;
            drop(f);
            dir.finish(rel, &how).map_err(w)?;
        }
        T::Symlink => {
            let target = e.link_name_bytes().ok_or_else(|| ImageError::BadEntry {
                layer: layer.to_string(),
                path: rel.to_string(),
                reason: "a symbolic link without a target".into(),
            })?;
            dir.symlink(&target, rel).map_err(w)?;
            dir.finish(rel, &Finish { mode: None, ..how }).map_err(w)?;
        }
        T::Link => {
            let target = e.link_name_bytes().unwrap_or_default();
            let to = entry_path(layer, &target, limits)?.ok_or_else(|| ImageError::BadEntry {
                layer: layer.to_string(),
                path: rel.to_string(),
                reason: "a hard link to the root".into(),
            })?;
            dir.hard_link(&to, rel)
                .map_err(|e| entry_err(layer, &to, dir.shown(Some(&to)))(e))?;
        }
        // Headers of extensions the reader has applied (PAX globals), and
        // kinds no root filesystem holds: nothing to write.
        _ => return Ok(true),
    }
    Ok(true)
}
