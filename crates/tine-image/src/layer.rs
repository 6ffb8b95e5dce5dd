//! One layer applied to a directory: its whiteouts remove what lower layers
//! put there (`.wh.NAME`, and `.wh..wh..opq` for a whole directory), then its
//! entries are written. Every path stays inside the directory: names with
//! `..` or through a symbolic link are refused, and what an entry replaces is
//! removed first, so nothing is written through a link. Device nodes are
//! skipped (a sandbox has none) and named.

use std::io::Read;
use std::path::{Component, Path, PathBuf};

use serde::Serialize;

use crate::digest::{Digest, Verifying};
use crate::{ImageError, Layer};

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

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

/// A layer's entry name as a relative path, refused if it could leave the
/// directory.
fn relative(layer: &Digest, raw: &[u8]) -> Result<PathBuf, ImageError> {
    let name = String::from_utf8_lossy(raw);
    let p = Path::new(name.trim_start_matches('/'));
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(s) => out.push(s),
            Component::CurDir => {}
            _ => {
                return Err(ImageError::BadEntry {
                    layer: layer.to_string(),
                    path: name.into_owned(),
                    reason: "it leaves the image's root".into(),
                });
            }
        }
    }
    Ok(out)
}

/// `rel`'s parent directories inside `root`, none of them a link.
fn no_links_above(root: &Path, rel: &Path, layer: &Digest) -> Result<(), ImageError> {
    let mut at = root.to_path_buf();
    if let Some(parent) = rel.parent() {
        for c in parent.components() {
            at.push(c);
            if std::fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink()) {
                return Err(ImageError::BadEntry {
                    layer: layer.to_string(),
                    path: rel.display().to_string(),
                    reason: format!("it goes through the symbolic link {}", at.display()),
                });
            }
        }
    }
    Ok(())
}

fn remove(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn write_err(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Write {
        path: path.to_path_buf(),
        source,
    }
}

/// What is done with each entry of a layer as it is read.
type EachEntry<'f> =
    dyn for<'e, 'r> FnMut(&mut tar::Entry<'e, Box<dyn Read + 'r>>) -> Result<(), ImageError> + 'f;

/// Reads the layer once, end to end, through `each`, and checks its digests.
fn each_entry(
    open: &dyn Fn() -> Result<Box<dyn Read + Send>, ImageError>,
    layer: &Layer,
    as_root: bool,
    each: &mut EachEntry<'_>,
) -> Result<u64, ImageError> {
    let what = format!("layer {}", layer.digest);
    let read = |e: std::io::Error| ImageError::Read {
        what: what.clone(),
        source: e,
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
        let mut tar_stream = Verifying::new(unpacked);
        {
            let mut ar = tar::Archive::new(Box::new(&mut tar_stream) as Box<dyn Read + '_>);
            // Owners only as root (elsewhere chown fails); never xattrs.
            ar.set_preserve_ownerships(as_root);
            for e in ar.entries().map_err(read)? {
                let mut e = e.map_err(read)?;
                each(&mut e)?;
            }
        }
        match &layer.diff_id {
            Some(diff_id) => tar_stream.finish(diff_id, &format!("{what} (uncompressed)"))?,
            None => 0,
        }
    };
    blob.finish(&layer.digest, &what)?;
    Ok(bytes)
}

/// Applies `layer` (its blob opened by `open`, as often as needed) to `root`.
pub(crate) fn apply(
    open: &dyn Fn() -> Result<Box<dyn Read + Send>, ImageError>,
    layer: &Layer,
    root: &Path,
    as_root: bool,
) -> Result<Applied, ImageError> {
    let mut out = Applied::default();
    // First the whiteouts (they apply to lower layers only, wherever they
    // stand in this one), checked against the blob's digest.
    let mut gone: Vec<(PathBuf, bool)> = Vec::new();
    each_entry(open, layer, false, &mut |e| {
        let rel = relative(&layer.digest, &e.path_bytes())?;
        let Some(name) = rel.file_name().and_then(|n| n.to_str()) else {
            return Ok(());
        };
        if name == OPAQUE {
            gone.push((rel.parent().unwrap_or(Path::new("")).to_path_buf(), true));
        } else if let Some(hidden) = name.strip_prefix(WHITEOUT) {
            gone.push((rel.with_file_name(hidden), false));
        }
        Ok(())
    })?;
    for (rel, opaque) in &gone {
        no_links_above(root, &rel.join("x"), &layer.digest)?;
        let p = root.join(rel);
        if *opaque {
            if let Ok(dir) = std::fs::read_dir(&p) {
                for child in dir.flatten() {
                    remove(&child.path()).map_err(write_err(&p))?;
                }
            }
        } else {
            remove(&p).map_err(write_err(&p))?;
        }
        out.whiteouts += 1;
    }
    // Then the entries, read again and checked again.
    out.blob_bytes = layer.size;
    each_entry(open, layer, as_root, &mut |e| {
        let rel = relative(&layer.digest, &e.path_bytes())?;
        if rel.as_os_str().is_empty() {
            return Ok(());
        }
        let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with(WHITEOUT) {
            return Ok(());
        }
        let kind = e.header().entry_type();
        if matches!(
            kind,
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo
        ) {
            out.skipped.push(rel.display().to_string());
            return Ok(());
        }
        no_links_above(root, &rel, &layer.digest)?;
        let dst = root.join(&rel);
        let keep_dir = kind.is_dir() && std::fs::symlink_metadata(&dst).is_ok_and(|m| m.is_dir());
        if !keep_dir {
            remove(&dst).map_err(write_err(&dst))?;
        }
        e.set_preserve_permissions(true);
        e.set_preserve_mtime(true);
        e.set_unpack_xattrs(false);
        let unpacked = e.unpack_in(root).map_err(write_err(&dst))?;
        if !unpacked {
            return Err(ImageError::BadEntry {
                layer: layer.digest.to_string(),
                path: rel.display().to_string(),
                reason: "it leaves the image's root".into(),
            });
        }
        out.entries += 1;
        Ok(())
    })?;
    Ok(out)
}
