//! Where an image's files come from: a directory (an OCI image layout) or an
//! uncompressed tar archive (an OCI archive, `docker save`, `podman save`),
//! indexed once so each blob is read where it lies, not extracted.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::ImageError;
use crate::entry::{Beneath, EntryPath};

/// Entries an archive may hold at most.
const MAX_ENTRIES: usize = 1 << 20;

#[derive(Debug)]
pub(crate) enum Source {
    Dir(PathBuf),
    Tar {
        path: PathBuf,
        /// Entry name (without `./`) to (data offset, size).
        entries: HashMap<String, (u64, u64)>,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ImageError {
    let what = what.into();
    move |source| ImageError::Read { what, source }
}

fn clean(name: &str) -> String {
    name.trim_start_matches("./")
        .trim_end_matches('/')
        .to_string()
}

impl Source {
    pub(crate) fn open(path: &Path) -> Result<Source, ImageError> {
        let meta = std::fs::metadata(path).map_err(io(path.display().to_string()))?;
        if meta.is_dir() {
            return Ok(Source::Dir(path.to_path_buf()));
        }
        let mut f = File::open(path).map_err(io(path.display().to_string()))?;
        let mut magic = [0u8; 4];
        let n = f.read(&mut magic).map_err(io(path.display().to_string()))?;
        if n >= 2 && magic[..2] == [0x1f, 0x8b] || n == 4 && magic == [0x28, 0xb5, 0x2f, 0xfd] {
            return Err(ImageError::NotAnImage {
                path: path.to_path_buf(),
                reason: "a compressed archive; decompress it first (gunzip or zstd -d), or give the directory of an OCI layout".into(),
            });
        }
        f.seek(SeekFrom::Start(0))
            .map_err(io(path.display().to_string()))?;
        let mut entries = HashMap::new();
        let mut ar = tar::Archive::new(f);
        let not_tar = |e: std::io::Error| ImageError::NotAnImage {
            path: path.to_path_buf(),
            reason: format!("not a tar archive or a directory ({e})"),
        };
        for e in ar.entries().map_err(not_tar)? {
            let e = e.map_err(not_tar)?;
            if entries.len() >= MAX_ENTRIES {
                return Err(ImageError::NotAnImage {
                    path: path.to_path_buf(),
                    reason: format!("more than {MAX_ENTRIES} entries"),
                });
            }
            if e.header().entry_type().is_file() {
                let name = clean(&String::from_utf8_lossy(&e.path_bytes()));
                entries.insert(name, (e.raw_file_position(), e.size()));
            }
        }
        Ok(Source::Tar {
            path: path.to_path_buf(),
            entries,
        })
    }

    pub(crate) fn describe(&self) -> &Path {
        match self {
            Source::Dir(p) | Source::Tar { path: p, .. } => p,
        }
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        match self {
            // (Regular files only, reached through no link.)
            Source::Dir(_) => self.open_file(name).is_ok(),
            Source::Tar { entries, .. } => entries.contains_key(&clean(name)),
        }
    }

    /// The file `name` to read, and its size.
    pub(crate) fn open_file(&self, name: &str) -> Result<(Box<dyn Read + Send>, u64), ImageError> {
        let missing = || ImageError::Missing {
            image: self.describe().to_path_buf(),
            name: name.to_string(),
        };
        if name.split('/').any(|c| c == ".." || c.is_empty()) || name.starts_with('/') {
            return Err(missing());
        }
        match self {
            Source::Dir(root) => {
                // Below the layout's directory, through no link on any
                // component (`x/shadow` with `x -> /etc` is not there).
                let rel = EntryPath::parse(name.as_bytes())
                    .ok()
                    .flatten()
                    .ok_or_else(missing)?;
                let dir = Beneath::open(root).map_err(io(root.display().to_string()))?;
                let f = dir.open_file(&rel).map_err(|_| missing())?;
                let len = f.metadata().map_err(io(name))?.len();
                Ok((Box::new(f), len))
            }
            Source::Tar { path, entries } => {
                let (at, size) = *entries.get(&clean(name)).ok_or_else(missing)?;
                let mut f = File::open(path).map_err(io(path.display().to_string()))?;
                f.seek(SeekFrom::Start(at))
                    .map_err(io(path.display().to_string()))?;
                Ok((Box::new(f.take(size)), size))
            }
        }
    }

    /// A small file (JSON) whole, refused over `limit` bytes.
    pub(crate) fn read_small(&self, name: &str, limit: u64) -> Result<Vec<u8>, ImageError> {
        let (r, size) = self.open_file(name)?;
        if size > limit {
            return Err(ImageError::TooLarge {
                name: name.to_string(),
                size,
                limit,
            });
        }
        let mut buf = Vec::with_capacity(size as usize);
        r.take(limit + 1).read_to_end(&mut buf).map_err(io(name))?;
        Ok(buf)
    }
}
