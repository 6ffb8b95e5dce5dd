//! Unpacking a plain tar archive (uncompressed or gzip), as a Dockerfile's
//! `ADD` does with a local one: its files, directories and links, never
//! outside the destination; devices and FIFOs are left out.

use std::io::{Read, Seek};
use std::path::Path;

use crate::ImageError;
use crate::entry::{Beneath, EntryPath, NameError};
use crate::layer::{Limits, Written, is_over_limit, write_entry};

/// Whether `path` is a tar archive (plain or gzip).
pub fn is_archive(path: &Path) -> bool {
    let mut head = [0u8; 263];
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let mut n = 0;
    while n < head.len() {
        match f.read(&mut head[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    (n >= 2 && head[..2] == [0x1f, 0x8b]) || (n >= 262 && &head[257..262] == b"ustar")
}

/// Unpacks the archive at `src` into the directory `at`; owners kept when
/// `as_root`. Names go through [`EntryPath`] and writes through a
/// [`Beneath`] of `at`, as a layer's do; a name an image layer would read as
/// a whiteout is refused (it would become one when the image is exported).
pub fn unpack(src: &Path, at: &Path, as_root: bool) -> Result<(), ImageError> {
    let err = |source| ImageError::Read {
        what: src.display().to_string(),
        source,
    };
    let mut f = std::fs::File::open(src).map_err(err)?;
    let mut magic = [0u8; 2];
    let gz = f.read(&mut magic).map_err(err)? == 2 && magic == [0x1f, 0x8b];
    f.rewind().map_err(err)?;
    let reader: Box<dyn Read> = if gz {
        Box::new(flate2::read::GzDecoder::new(f))
    } else {
        Box::new(f)
    };
    let limits = Limits::default();
    let mut a = tar::Archive::new(reader.take(limits.bytes));
    let dir = Beneath::open(at).map_err(|source| ImageError::Write {
        path: at.to_path_buf(),
        source,
    })?;
    let what = src.display();
    let refused = |raw: &[u8], e: NameError| ImageError::BadEntry {
        layer: src.display().to_string(),
        path: String::from_utf8_lossy(raw).into_owned(),
        reason: e.to_string(),
    };
    let mut written = Written {
        bytes: 0,
        cap: limits.bytes,
    };
    for (n, e) in a.entries().map_err(err)?.enumerate() {
        if n as u64 >= limits.entries {
            return Err(ImageError::OverLimit {
                layer: src.display().to_string(),
                what: "entries",
                limit: limits.entries,
            });
        }
        let mut e = e.map_err(err)?;
        let raw = e.path_bytes().into_owned();
        let Some(rel) = EntryPath::parse(&raw)
            .and_then(|p| p.map(|p| p.within(limits.depth)).transpose())
            .map_err(|x| refused(&raw, x))?
        else {
            continue;
        };
        rel.writable_in_a_layer().map_err(|x| refused(&raw, x))?;
        write_entry(&dir, &rel, &mut e, as_root, &what, &limits, &mut written).map_err(
            |x| match x {
                ImageError::Write { source, .. } if is_over_limit(&source) => {
                    ImageError::OverLimit {
                        layer: src.display().to_string(),
                        what: "bytes",
                        limit: limits.bytes,
                    }
                }
                other => other,
            },
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_archive_unpacks_inside_its_destination_only() {
        let d = tempfile::tempdir().unwrap();
        let tarp = d.path().join("a.tar");
        {
            let mut b = tar::Builder::new(std::fs::File::create(&tarp).unwrap());
            let mut h = tar::Header::new_gnu();
            h.set_size(2);
            h.set_mode(0o644);
            b.append_data(&mut h, "x/y.txt", &b"hi"[..]).unwrap();
            // An entry climbing out is not written.
            let mut h = tar::Header::new_gnu();
            h.set_size(2);
            h.set_mode(0o644);
            let name = b"../escaped";
            h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name);
            h.set_cksum();
            b.append(&h, &b"no"[..]).unwrap();
            b.finish().unwrap();
        }
        assert!(is_archive(&tarp));
        assert!(!is_archive(Path::new("/etc/hostname")));
        let at = d.path().join("out");
        std::fs::create_dir(&at).unwrap();
        // Refused, naming the entry, with nothing written out of `at`.
        let e = unpack(&tarp, &at, false).unwrap_err().to_string();
        assert!(e.contains("../escaped") && e.contains("climbs"), "{e}");
        assert_eq!(std::fs::read(at.join("x/y.txt")).unwrap(), b"hi");
        assert!(!d.path().join("escaped").exists());
    }
}
