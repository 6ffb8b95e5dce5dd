//! tine-image: container images as tine reads them. [`ImageSource::open`]
//! takes an OCI image layout (a directory), an OCI archive or a `docker
//! save`/`podman save` archive (uncompressed tar), and lists its images with
//! their configuration and layers; [`ImageSource::apply`] writes one layer
//! onto a directory (whiteouts applied), checking the blob against its digest
//! (and, where the configuration gives it, the uncompressed layer against its
//! diff id) as it reads. Nothing here touches the repository: the engine
//! snapshots the directory after each layer.
#![forbid(unsafe_code)]

pub mod digest;
pub mod dockerfile;
pub mod entry;
pub mod layer;
mod source;
pub mod unpack;
pub mod write;

use std::path::{Path, PathBuf};

use oci_spec::image::{ImageConfiguration, ImageIndex, ImageManifest, MediaType};
use serde::Serialize;

pub use digest::Digest;
pub use layer::{Applied, Budget, Compression, Limits};
/// The OCI image specification's types, as this crate reads them.
pub use oci_spec::image as oci;
use source::Source;

/// JSON documents (index, manifest, configuration) read at most.
pub const MAX_JSON: u64 = 4 << 20;
/// Layers an image may have.
pub const MAX_LAYERS: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{}: not an image: {reason}", path.display())]
    NotAnImage { path: PathBuf, reason: String },
    #[error("{}: {name} is missing", image.display())]
    Missing { image: PathBuf, name: String },
    #[error("{name} is {size} bytes, over the limit of {limit}")]
    TooLarge { name: String, size: u64, limit: u64 },
    #[error("{what}: {reason}")]
    Bad { what: String, reason: String },
    #[error("digest {digest:?}: {reason}")]
    BadDigest { digest: String, reason: String },
    #[error("{what} is damaged: its digest is {got}, not {expected}; nothing of it was used")]
    DigestMismatch {
        what: String,
        expected: String,
        got: String,
    },
    #[error("layer {layer}: entry {path:?} refused: {reason}")]
    BadEntry {
        layer: String,
        path: String,
        reason: String,
    },
    #[error(
        "layer {layer}: the image unpacks to more than {limit} {what}, the import's limit; nothing of it was kept"
    )]
    OverLimit {
        layer: String,
        what: &'static str,
        limit: u64,
    },
    #[error("{}: no image named {name:?} (it holds: {known})", image.display())]
    NoSuchImage {
        image: PathBuf,
        name: String,
        known: String,
    },
    #[error("{}: {n} images; name the one to use (it holds: {known})", image.display())]
    WhichImage {
        image: PathBuf,
        n: usize,
        known: String,
    },
    #[error("reading {what}: {source}")]
    Read {
        what: String,
        source: std::io::Error,
    },
    #[error("writing {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// How an archive or layout is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// An OCI image layout (`oci-layout`, `index.json`, `blobs/`), as a
    /// directory or a tar archive.
    Oci,
    /// `docker save` (also `podman save`'s default): `manifest.json`.
    Docker,
}

/// One layer of an image.
#[derive(Debug, Clone, Serialize)]
pub struct Layer {
    /// The blob's digest (for a docker archive: the uncompressed tar's).
    pub digest: Digest,
    /// The uncompressed tar's digest, from the configuration's diff ids.
    pub diff_id: Option<Digest>,
    pub compression: Compression,
    pub size: u64,
    /// Where the blob is in the source.
    #[serde(skip)]
    file: String,
}

impl Layer {
    /// The uncompressed tar's digest (a docker archive's layers are
    /// uncompressed: their digest is it).
    pub fn diff_id(&self) -> &Digest {
        self.diff_id.as_ref().unwrap_or(&self.digest)
    }
}

/// OCI's chain ids of `layers`: the first is its diff id; each next one is
/// the digest of "PREVIOUS DIFF_ID". Two images share layers 1..k exactly
/// when their k-th chain ids are equal.
pub fn chain_ids(layers: &[Layer]) -> Vec<Digest> {
    chain_of(layers.iter().map(Layer::diff_id))
}

/// The chain ids of layers given by their diff ids, lowest first.
pub fn chain_of<'a>(diff_ids: impl IntoIterator<Item = &'a Digest>) -> Vec<Digest> {
    let mut out: Vec<Digest> = Vec::new();
    for d in diff_ids {
        let next = match out.last() {
            None => d.clone(),
            Some(prev) => Digest::of(format!("{prev} {d}").as_bytes()),
        };
        out.push(next);
    }
    out
}

/// One image an archive or layout holds.
#[derive(Debug, Clone, Serialize)]
pub struct Image {
    /// Its names (`ref.name` annotations, `RepoTags`).
    pub names: Vec<String>,
    /// The manifest's digest (OCI), or the configuration's (docker).
    pub id: Digest,
    pub config_digest: Digest,
    pub config: ImageConfiguration,
    /// The configuration's bytes, as stored (its digest is `config_digest`).
    #[serde(skip)]
    pub config_json: Vec<u8>,
    pub layers: Vec<Layer>,
}

/// An archive or layout, opened.
#[derive(Debug)]
pub struct ImageSource {
    source: Source,
    pub format: Format,
    pub images: Vec<Image>,
}

fn bad(what: impl Into<String>, reason: impl std::fmt::Display) -> ImageError {
    ImageError::Bad {
        what: what.into(),
        reason: reason.to_string(),
    }
}

fn blob_path(d: &Digest) -> String {
    format!("blobs/sha256/{}", d.hex())
}

impl ImageSource {
    /// Opens `path` and reads every image's manifest and configuration (each
    /// checked against its digest); layers are read by [`ImageSource::apply`].
    pub fn open(path: &Path) -> Result<ImageSource, ImageError> {
        let source = Source::open(path)?;
        if source.has("index.json") {
            let images = oci_images(&source)?;
            return Ok(ImageSource {
                source,
                format: Format::Oci,
                images,
            });
        }
        if source.has("manifest.json") {
            let images = docker_images(&source)?;
            return Ok(ImageSource {
                source,
                format: Format::Docker,
                images,
            });
        }
        Err(ImageError::NotAnImage {
            path: path.to_path_buf(),
            reason: "it has neither index.json (an OCI layout) nor manifest.json (docker save)"
                .into(),
        })
    }

    /// The image called `name` (a name, or a prefix of its id's hex), or the
    /// only one.
    pub fn pick(&self, name: Option<&str>) -> Result<&Image, ImageError> {
        let known = || {
            self.images
                .iter()
                .map(|i| {
                    i.names
                        .first()
                        .cloned()
                        .unwrap_or_else(|| i.id.hex()[..12].to_string())
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        match name {
            Some(n) => self
                .images
                .iter()
                .find(|i| {
                    i.names.iter().any(|x| x == n) || (n.len() >= 4 && i.id.hex().starts_with(n))
                })
                .ok_or_else(|| ImageError::NoSuchImage {
                    image: self.source.describe().to_path_buf(),
                    name: n.to_string(),
                    known: known(),
                }),
            None if self.images.len() == 1 => Ok(&self.images[0]),
            None => Err(ImageError::WhichImage {
                image: self.source.describe().to_path_buf(),
                n: self.images.len(),
                known: known(),
            }),
        }
    }

    /// Writes `layer` onto `root` (the layers below it already there). A
    /// damaged blob is refused by its digest once read; the caller discards
    /// `root` then.
    pub fn apply(
        &self,
        layer: &Layer,
        root: &Path,
        as_root: bool,
        budget: &mut Budget,
    ) -> Result<Applied, ImageError> {
        let open = || self.source.open_file(&layer.file).map(|(r, _)| r);
        layer::apply(&open, layer, root, as_root, budget)
    }
}

/// A JSON document checked against its digest.
fn verified_json<T: serde::de::DeserializeOwned>(
    source: &Source,
    name: &str,
    digest: &Digest,
    what: &str,
) -> Result<T, ImageError> {
    verified_doc(source, name, digest, what).map(|(t, _)| t)
}

/// [`verified_json`], with the document's bytes.
fn verified_doc<T: serde::de::DeserializeOwned>(
    source: &Source,
    name: &str,
    digest: &Digest,
    what: &str,
) -> Result<(T, Vec<u8>), ImageError> {
    let bytes = source.read_small(name, MAX_JSON)?;
    let got = Digest::of(&bytes);
    if &got != digest {
        return Err(ImageError::DigestMismatch {
            what: what.to_string(),
            expected: digest.to_string(),
            got: got.to_string(),
        });
    }
    let doc = serde_json::from_slice(&bytes).map_err(|e| bad(what, e))?;
    Ok((doc, bytes))
}

fn layer_compression(m: &MediaType) -> Result<Compression, ImageError> {
    Ok(match m {
        MediaType::ImageLayer => Compression::None,
        MediaType::ImageLayerGzip => Compression::Gzip,
        MediaType::ImageLayerZstd => Compression::Zstd,
        MediaType::Other(s) if s == "application/vnd.docker.image.rootfs.diff.tar.gzip" => {
            Compression::Gzip
        }
        MediaType::Other(s) if s == "application/vnd.docker.image.rootfs.diff.tar" => {
            Compression::None
        }
        other => {
            return Err(bad(
                "layer",
                format!("media type {other} is not a layer tine reads"),
            ));
        }
    })
}

fn diff_ids(
    config: &ImageConfiguration,
    layers: usize,
    what: &str,
) -> Result<Vec<Digest>, ImageError> {
    let ids = config.rootfs().diff_ids();
    if ids.len() != layers {
        return Err(bad(
            what,
            format!(
                "{layers} layers but {} diff ids in its configuration",
                ids.len()
            ),
        ));
    }
    ids.iter().map(|d| Digest::parse(d)).collect()
}

fn oci_images(source: &Source) -> Result<Vec<Image>, ImageError> {
    let index_bytes = source.read_small("index.json", MAX_JSON)?;
    let index: ImageIndex =
        serde_json::from_slice(&index_bytes).map_err(|e| bad("index.json", e))?;
    let mut images = Vec::new();
    for desc in index.manifests() {
        let mut names: Vec<String> = desc
            .annotations()
            .iter()
            .flatten()
            .filter(|(k, _)| {
                k.as_str() == "org.opencontainers.image.ref.name"
                    || k.as_str() == "io.containerd.image.name"
            })
            .map(|(_, v)| v.clone())
            .collect();
        names.dedup();
        let mut digest = Digest::parse(desc.digest().as_ref())?;
        let mut media = desc.media_type().clone();
        // A nested index (a multi-platform image): its linux/amd64 manifest,
        // else its only one.
        if media == MediaType::ImageIndex {
            let nested: ImageIndex = verified_json(
                source,
                &blob_path(&digest),
                &digest,
                &format!("index {digest}"),
            )?;
            let pick = nested
                .manifests()
                .iter()
                .find(|m| {
                    m.platform().as_ref().is_some_and(|p| {
                        p.os().to_string() == "linux" && p.architecture().to_string() == "amd64"
                    })
                })
                .or(if nested.manifests().len() == 1 {
                    nested.manifests().first()
                } else {
                    None
                })
                .ok_or_else(|| bad(format!("index {digest}"), "no linux/amd64 manifest"))?;
            digest = Digest::parse(pick.digest().as_ref())?;
            media = pick.media_type().clone();
        }
        if media != MediaType::ImageManifest
            && media
                != MediaType::Other("application/vnd.docker.distribution.manifest.v2+json".into())
        {
            continue;
        }
        let what = format!("manifest {digest}");
        let manifest: ImageManifest = verified_json(source, &blob_path(&digest), &digest, &what)?;
        if manifest.layers().len() > MAX_LAYERS {
            return Err(bad(what, format!("over {MAX_LAYERS} layers")));
        }
        let config_digest = Digest::parse(manifest.config().digest().as_ref())?;
        let (config, config_json): (ImageConfiguration, _) = verified_doc(
            source,
            &blob_path(&config_digest),
            &config_digest,
            &format!("configuration {config_digest}"),
        )?;
        let ids = diff_ids(&config, manifest.layers().len(), &what)?;
        let layers = manifest
            .layers()
            .iter()
            .zip(ids)
            .map(|(l, diff_id)| {
                let digest = Digest::parse(l.digest().as_ref())?;
                Ok(Layer {
                    file: blob_path(&digest),
                    compression: layer_compression(l.media_type())?,
                    size: l.size(),
                    diff_id: Some(diff_id),
                    digest,
                })
            })
            .collect::<Result<Vec<_>, ImageError>>()?;
        images.push(Image {
            names,
            id: digest,
            config_digest,
            config,
            config_json,
            layers,
        });
    }
    if images.is_empty() {
        return Err(bad("index.json", "it lists no image manifest"));
    }
    Ok(images)
}

/// One entry of `docker save`'s manifest.json.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

fn docker_images(source: &Source) -> Result<Vec<Image>, ImageError> {
    let bytes = source.read_small("manifest.json", MAX_JSON)?;
    let entries: Vec<DockerEntry> =
        serde_json::from_slice(&bytes).map_err(|e| bad("manifest.json", e))?;
    let mut images = Vec::new();
    for e in entries {
        // The configuration's file is named by its digest: `HEX.json`, or
        // `blobs/sha256/HEX` (Docker 25 on).
        let hex = e
            .config
            .rsplit('/')
            .next()
            .unwrap_or("")
            .trim_end_matches(".json")
            .to_string();
        let config_digest = Digest::parse(&format!("sha256:{hex}"))?;
        let (config, config_json): (ImageConfiguration, _) = verified_doc(
            source,
            &e.config,
            &config_digest,
            &format!("configuration {config_digest}"),
        )?;
        if e.layers.len() > MAX_LAYERS {
            return Err(bad("manifest.json", format!("over {MAX_LAYERS} layers")));
        }
        let ids = diff_ids(&config, e.layers.len(), "manifest.json")?;
        // docker save's layers are uncompressed tars, checked by diff id.
        let layers = e
            .layers
            .iter()
            .zip(ids)
            .map(|(file, diff_id)| {
                let size = source.open_file(file)?.1;
                Ok(Layer {
                    digest: diff_id.clone(),
                    diff_id: None,
                    compression: Compression::None,
                    size,
                    file: file.clone(),
                })
            })
            .collect::<Result<Vec<_>, ImageError>>()?;
        images.push(Image {
            names: e.repo_tags.unwrap_or_default(),
            id: config_digest.clone(),
            config_digest,
            config,
            config_json,
            layers,
        });
    }
    if images.is_empty() {
        return Err(bad("manifest.json", "it lists no image"));
    }
    Ok(images)
}
