//! Writing images: a directory as a layer tar, and an OCI archive (an OCI
//! image layout in an uncompressed tar, which `podman load` and
//! [`crate::ImageSource::open`] read) from a configuration and layer tars.
//! The archive is written beside its destination and renamed into place.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::json;

use crate::ImageError;
use crate::digest::Digest;
use crate::entry::EntryPath;

fn write_err(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Write {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `dir`'s tree (links as links, owners and modes as they are) as
/// an uncompressed layer tar at `out`.
pub fn dir_layer(dir: &Path, out: &Path) -> Result<(), ImageError> {
    let f = File::create(out).map_err(write_err(out))?;
    let mut b = tar::Builder::new(std::io::BufWriter::new(f));
    b.follow_symlinks(false);
    b.mode(tar::HeaderMode::Complete);
    b.append_dir_all(".", dir).map_err(write_err(out))?;
    let mut w = b.into_inner().map_err(write_err(out))?;
    w.flush().map_err(write_err(out))?;
    w.get_ref().sync_all().map_err(write_err(out))
}

/// A layer tar written entry by entry, the same bytes for the same
/// entries: no times (all 0), no user or group names, GNU long names.
/// Paths are relative to the root, without a leading `/` or `./`.
pub struct LayerWriter<W: Write> {
    b: tar::Builder<W>,
}

fn header(kind: tar::EntryType, mode: u32, uid: u32, gid: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode & 0o7777);
    h.set_uid(uid.into());
    h.set_gid(gid.into());
    h.set_mtime(0);
    h.set_size(size);
    h
}

fn os(path: &[u8]) -> &Path {
    use std::os::unix::ffi::OsStrExt;
    Path::new(std::ffi::OsStr::from_bytes(path))
}

/// `path` as an entry of a layer, refused where an importer would read it
/// otherwise: climbing out, or named like a whiteout (a file `.wh...` a
/// `RUN` step made would delete whatever directory holds the importer's
/// root).
fn checked(path: &[u8]) -> std::io::Result<&Path> {
    let refused = |why: String| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "{:?} cannot be written into an image layer: {why}",
                String::from_utf8_lossy(path)
            ),
        )
    };
    match EntryPath::parse(path) {
        Ok(Some(p)) => p
            .writable_in_a_layer()
            .map_err(|e| refused(e.to_string()))?,
        Ok(None) => return Err(refused("it is the root".into())),
        Err(e) => return Err(refused(e.to_string())),
    }
    Ok(os(path))
}

impl<W: Write> std::fmt::Debug for LayerWriter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerWriter").finish_non_exhaustive()
    }
}

impl<W: Write> LayerWriter<W> {
    pub fn new(w: W) -> LayerWriter<W> {
        LayerWriter {
            b: tar::Builder::new(w),
        }
    }

    pub fn dir(&mut self, path: &[u8], mode: u32, uid: u32, gid: u32) -> std::io::Result<()> {
        let mut h = header(tar::EntryType::Directory, mode, uid, gid, 0);
        self.b.append_data(&mut h, checked(path)?, std::io::empty())
    }

    /// A regular file of `size` bytes read from `data`.
    pub fn file(
        &mut self,
        path: &[u8],
        (mode, uid, gid): (u32, u32, u32),
        size: u64,
        data: impl std::io::Read,
    ) -> std::io::Result<()> {
        let mut h = header(tar::EntryType::Regular, mode, uid, gid, size);
        self.b.append_data(&mut h, checked(path)?, data)
    }

    pub fn symlink(
        &mut self,
        path: &[u8],
        target: &[u8],
        uid: u32,
        gid: u32,
    ) -> std::io::Result<()> {
        let mut h = header(tar::EntryType::Symlink, 0o777, uid, gid, 0);
        self.b.append_link(&mut h, checked(path)?, os(target))
    }

    /// A whiteout: `path` of the layers below is gone.
    pub fn whiteout(&mut self, path: &[u8]) -> std::io::Result<()> {
        checked(path)?;
        let (dir, name) = match path.iter().rposition(|b| *b == b'/') {
            Some(i) => (&path[..=i], &path[i + 1..]),
            None => (&b""[..], path),
        };
        let mut p = dir.to_vec();
        p.extend_from_slice(b".wh.");
        p.extend_from_slice(name);
        let mut h = header(tar::EntryType::Regular, 0o644, 0, 0, 0);
        self.b.append_data(&mut h, os(&p), std::io::empty())
    }

    /// Ends the archive; the writer back.
    pub fn finish(self) -> std::io::Result<W> {
        self.b.into_inner()
    }
}

/// The digest of a file's bytes.
pub fn digest_file(path: &Path) -> Result<Digest, ImageError> {
    let f = File::open(path).map_err(|source| ImageError::Read {
        what: path.display().to_string(),
        source,
    })?;
    let mut v = crate::digest::Verifying::new(std::io::BufReader::new(f));
    std::io::copy(&mut v, &mut std::io::sink()).map_err(|source| ImageError::Read {
        what: path.display().to_string(),
        source,
    })?;
    Ok(v.digest())
}

/// An image to write.
#[derive(Debug, Clone)]
pub struct NewImage {
    /// Its name (`org.opencontainers.image.ref.name`), if any.
    pub name: Option<String>,
    /// The configuration's `config` section (`Entrypoint`, `Cmd`, `Env`,
    /// `WorkingDir`, `User`, ...), as the OCI specification names its keys.
    pub run: serde_json::Value,
    /// Its layers, lowest first: uncompressed tars.
    pub layers: Vec<PathBuf>,
    /// `history` entries, one per layer (what made it), or none.
    pub history: Vec<String>,
}

/// What [`write_oci_archive`] wrote.
#[derive(Debug, Clone)]
pub struct Written {
    /// The configuration's digest (the image's id as tine and Podman name it).
    pub config: Digest,
    pub manifest: Digest,
    pub bytes: u64,
}

/// Writes `img` as an OCI archive at `out`.
pub fn write_oci_archive(out: &Path, img: &NewImage) -> Result<Written, ImageError> {
    let mut diff_ids = Vec::new();
    let mut layer_descs = Vec::new();
    for l in &img.layers {
        let d = digest_file(l)?;
        let size = std::fs::metadata(l).map_err(write_err(l))?.len();
        layer_descs.push(json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": d.to_string(),
            "size": size,
        }));
        diff_ids.push((d, l.clone()));
    }
    let mut config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": img.run,
        "rootfs": {"type": "layers", "diff_ids": diff_ids.iter().map(|(d, _)| d.to_string()).collect::<Vec<_>>()},
    });
    if !img.history.is_empty() {
        config["history"] = img
            .history
            .iter()
            .map(|h| json!({"created_by": h}))
            .collect();
    }
    let config = serde_json::to_vec(&config).expect("JSON serializes");
    let config_digest = Digest::of(&config);
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest.to_string(),
            "size": config.len(),
        },
        "layers": layer_descs,
    }))
    .expect("JSON serializes");
    let manifest_digest = Digest::of(&manifest);
    let mut desc = json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": manifest_digest.to_string(),
        "size": manifest.len(),
    });
    if let Some(n) = &img.name {
        desc["annotations"] = json!({"org.opencontainers.image.ref.name": n});
    }
    let index = serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": [desc]}))
        .expect("JSON serializes");
    let dir = out.parent().unwrap_or(Path::new("."));
    let tmp = tempfile::NamedTempFile::new_in(dir).map_err(write_err(out))?;
    {
        let mut b = tar::Builder::new(std::io::BufWriter::new(tmp.as_file()));
        let mut put = |name: &str, data: &[u8]| -> std::io::Result<()> {
            let mut h = tar::Header::new_ustar();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_mtime(0);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, name, data)
        };
        put("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#).map_err(write_err(out))?;
        put("index.json", &index).map_err(write_err(out))?;
        put(&format!("blobs/sha256/{}", config_digest.hex()), &config).map_err(write_err(out))?;
        put(
            &format!("blobs/sha256/{}", manifest_digest.hex()),
            &manifest,
        )
        .map_err(write_err(out))?;
        let mut seen = std::collections::HashSet::new();
        for (d, path) in &diff_ids {
            if !seen.insert(d.clone()) {
                continue;
            }
            let mut f = File::open(path).map_err(write_err(path))?;
            let mut h = tar::Header::new_ustar();
            h.set_size(f.metadata().map_err(write_err(path))?.len());
            h.set_mode(0o644);
            h.set_mtime(0);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, format!("blobs/sha256/{}", d.hex()), &mut f)
                .map_err(write_err(out))?;
        }
        let mut w = b.into_inner().map_err(write_err(out))?;
        w.flush().map_err(write_err(out))?;
    }
    tmp.as_file().sync_all().map_err(write_err(out))?;
    tmp.persist(out).map_err(|e| write_err(out)(e.error))?;
    let bytes = std::fs::metadata(out).map_err(write_err(out))?.len();
    Ok(Written {
        config: config_digest,
        manifest: manifest_digest,
        bytes,
    })
}
