//! Container images imported into the repository: each image's
//! configuration and the snapshots of its layers (layer k's snapshot is the
//! root filesystem after layers 1..k, its parent layer k-1's), found by
//! chain id so that images sharing a base share its snapshots; and the
//! names images go by. `gc` keeps every snapshot an image holds. See
//! docs/FORMAT.md ("Images").

use rusqlite::{OptionalExtension, params};
use serde::{Deserialize, Serialize};

use crate::error::{ErrorKind, HasKind};
use crate::id::ObjectId;
use crate::repo::{Repository, WriteLock};

pub(crate) const IMAGE_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS images (
    id TEXT PRIMARY KEY,
    config BLOB NOT NULL,
    snapshot BLOB NOT NULL,
    layers TEXT NOT NULL,
    source TEXT NOT NULL,
    created_ns INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS image_names (
    name TEXT PRIMARY KEY,
    image TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS image_layers (
    chain TEXT PRIMARY KEY,
    snapshot BLOB NOT NULL
);
";

/// The build cache: what each step of a `tine build` made, by the step's
/// key (a digest of the key before it, the instruction and the files it
/// copies), so that an unchanged prefix is not run again.
pub(crate) const BUILD_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS build_steps (
    key TEXT PRIMARY KEY,
    snapshot BLOB NOT NULL,
    diff_id TEXT NOT NULL,
    created_ns INTEGER NOT NULL
);
";

/// A build step's result in the cache: the root filesystem after it, and
/// the digest of its layer (as an export writes it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildStep {
    pub snapshot: ObjectId,
    pub diff_id: String,
}

/// Longest image name taken, in bytes.
pub const MAX_NAME: usize = 255;
/// Largest image configuration kept, in bytes.
pub const MAX_CONFIG: usize = 4 << 20;

/// One layer of an imported image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageLayer {
    /// The uncompressed layer's digest (`sha256:HEX`): as imported, or as
    /// tine writes the layer (one `tine build` made).
    pub diff_id: String,
    /// The chain id of layers 1..k (OCI's ChainID), by which it is shared.
    pub chain: String,
    /// The root filesystem after layers 1..k.
    pub snapshot: ObjectId,
}

/// An image in the repository.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRecord {
    /// `sha256:HEX` of its configuration.
    pub id: String,
    /// The names it goes by (none when another image took them).
    pub names: Vec<String>,
    /// Its configuration, as the image gave it (JSON).
    #[serde(skip)]
    pub config: Vec<u8>,
    /// Its root filesystem: the last layer's snapshot.
    pub snapshot: ObjectId,
    pub layers: Vec<ImageLayer>,
    /// Where it came from (an archive's path, or the Dockerfile it was built from).
    pub source: String,
    pub created_ns: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ImageRecordError {
    #[error("no image named {spec:?} (see `tine image ls`)")]
    NotFound { spec: String },
    #[error("{spec:?} matches several images: {}; give more digits", candidates.join(", "))]
    Ambiguous {
        spec: String,
        candidates: Vec<String>,
    },
    #[error("image name {name:?}: {reason}")]
    BadName { name: String, reason: &'static str },
    #[error("image {id}: its configuration is {size} bytes, over the limit of {MAX_CONFIG}")]
    ConfigTooLarge { id: String, size: usize },
    #[error("image record {id}: {reason}")]
    Corrupt { id: String, reason: String },
    #[error("repository database ({step}): {source}")]
    Db {
        step: &'static str,
        source: rusqlite::Error,
    },
}

impl HasKind for ImageRecordError {
    fn kind(&self) -> ErrorKind {
        match self {
            ImageRecordError::NotFound { .. } => ErrorKind::NotFound,
            ImageRecordError::Ambiguous { .. } => ErrorKind::Ambiguous,
            ImageRecordError::BadName { .. } | ImageRecordError::ConfigTooLarge { .. } => {
                ErrorKind::InvalidInput
            }
            ImageRecordError::Corrupt { .. } => ErrorKind::Corrupt,
            ImageRecordError::Db { source, .. } => crate::error::db_kind(source),
        }
    }
}

fn db(step: &'static str) -> impl FnOnce(rusqlite::Error) -> ImageRecordError {
    move |source| ImageRecordError::Db { step, source }
}

/// Whether `name` may name an image: 1-255 characters of a reference
/// (letters, digits, `.`, `_`, `-`, `/`, `:`, `@`), starting with a letter
/// or digit, not `sha256:...` (that is an id).
pub fn check_name(name: &str) -> Result<(), ImageRecordError> {
    let bad = |reason| ImageRecordError::BadName {
        name: name.chars().take(80).collect(),
        reason,
    };
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(bad("use 1 to 255 characters"));
    }
    if !name.as_bytes()[0].is_ascii_alphanumeric() {
        return Err(bad("start with a letter or digit"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/' | b':' | b'@'))
    {
        return Err(bad(
            "use letters, digits and '.', '_', '-', '/', ':', '@' only",
        ));
    }
    if name.starts_with("sha256:") {
        return Err(bad("names starting with sha256: are image ids"));
    }
    Ok(())
}

/// The names `spec` may stand for, most exact first: itself; with `:latest`
/// when it has no tag; and each of those under `localhost/` and
/// `docker.io/library/` (how Podman and Docker name local and official images).
pub fn name_candidates(spec: &str) -> Vec<String> {
    let last = spec.rsplit('/').next().unwrap_or(spec);
    let mut bases = vec![spec.to_string()];
    if !last.contains(':') && !spec.contains('@') {
        bases.push(format!("{spec}:latest"));
    }
    let mut out = bases.clone();
    for prefix in ["localhost/", "docker.io/library/", "docker.io/"] {
        out.extend(bases.iter().map(|b| format!("{prefix}{b}")));
    }
    out
}

fn snapshot_id(bytes: &[u8], id: &str) -> Result<ObjectId, ImageRecordError> {
    ObjectId::from_slice(bytes).ok_or_else(|| ImageRecordError::Corrupt {
        id: id.to_string(),
        reason: "its snapshot id is not 32 bytes".into(),
    })
}

impl Repository {
    fn image_names_of(&self, id: &str) -> Result<Vec<String>, ImageRecordError> {
        let conn = self.db();
        let mut q = conn
            .prepare("SELECT name FROM image_names WHERE image = ?1 ORDER BY name")
            .map_err(db("list image names"))?;
        q.query_map([id], |r| r.get(0))
            .map_err(db("list image names"))?
            .collect::<Result<_, _>>()
            .map_err(db("list image names"))
    }

    fn image_by_id(&self, id: &str) -> Result<Option<ImageRecord>, ImageRecordError> {
        let row = self
            .db()
            .query_row(
                "SELECT config, snapshot, layers, source, created_ns FROM images WHERE id = ?1",
                [id],
                |r| {
                    Ok((
                        r.get::<_, Vec<u8>>(0)?,
                        r.get::<_, Vec<u8>>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, String>(3)?,
                        r.get::<_, i64>(4)?,
                    ))
                },
            )
            .optional()
            .map_err(db("read image"))?;
        let Some((config, snap, layers, source, created)) = row else {
            return Ok(None);
        };
        let layers: Vec<ImageLayer> =
            serde_json::from_str(&layers).map_err(|e| ImageRecordError::Corrupt {
                id: id.to_string(),
                reason: format!("its layer list does not parse: {e}"),
            })?;
        Ok(Some(ImageRecord {
            id: id.to_string(),
            names: self.image_names_of(id)?,
            config,
            snapshot: snapshot_id(&snap, id)?,
            layers,
            source,
            created_ns: created as u64,
        }))
    }

    /// Every image, oldest first.
    pub fn images(&self) -> Result<Vec<ImageRecord>, ImageRecordError> {
        let ids: Vec<String> = {
            let conn = self.db();
            let mut q = conn
                .prepare("SELECT id FROM images ORDER BY created_ns, id")
                .map_err(db("list images"))?;
            q.query_map([], |r| r.get(0))
                .map_err(db("list images"))?
                .collect::<Result<_, _>>()
                .map_err(db("list images"))?
        };
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            out.extend(self.image_by_id(&id)?);
        }
        Ok(out)
    }

    /// The image `spec` names: a name (see [`name_candidates`]), an id
    /// (`sha256:HEX`), or 4 or more leading digits of an id's HEX.
    pub fn image(&self, spec: &str) -> Result<ImageRecord, ImageRecordError> {
        let not_found = || ImageRecordError::NotFound {
            spec: spec.to_string(),
        };
        for name in name_candidates(spec) {
            let id: Option<String> = self
                .db()
                .query_row(
                    "SELECT image FROM image_names WHERE name = ?1",
                    [&name],
                    |r| r.get(0),
                )
                .optional()
                .map_err(db("find image"))?;
            if let Some(id) = id {
                return self.image_by_id(&id)?.ok_or_else(not_found);
            }
        }
        let hex = spec.strip_prefix("sha256:").unwrap_or(spec);
        if hex.len() < 4 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(not_found());
        }
        let pattern = format!("sha256:{}%", hex.to_ascii_lowercase());
        let ids: Vec<String> = {
            let conn = self.db();
            let mut q = conn
                .prepare("SELECT id FROM images WHERE id LIKE ?1 ORDER BY id LIMIT 5")
                .map_err(db("find image"))?;
            q.query_map([&pattern], |r| r.get(0))
                .map_err(db("find image"))?
                .collect::<Result<_, _>>()
                .map_err(db("find image"))?
        };
        match ids.as_slice() {
            [] => Err(not_found()),
            [one] => self.image_by_id(one)?.ok_or_else(not_found),
            _ => Err(ImageRecordError::Ambiguous {
                spec: spec.to_string(),
                candidates: ids,
            }),
        }
    }

    /// The snapshot of the root filesystem a chain of layers makes, if one
    /// was imported.
    pub fn image_layer(&self, chain: &str) -> Result<Option<ObjectId>, ImageRecordError> {
        let row: Option<Vec<u8>> = self
            .db()
            .query_row(
                "SELECT snapshot FROM image_layers WHERE chain = ?1",
                [chain],
                |r| r.get(0),
            )
            .optional()
            .map_err(db("find image layer"))?;
        row.map(|b| snapshot_id(&b, chain)).transpose()
    }

    /// The root filesystem build step `key` made, if it was recorded. (Its
    /// snapshot may since have been collected: the caller checks.)
    pub fn build_step(&self, key: &str) -> Result<Option<BuildStep>, ImageRecordError> {
        let row: Option<(Vec<u8>, String)> = self
            .db()
            .query_row(
                "SELECT snapshot, diff_id FROM build_steps WHERE key = ?1",
                [key],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(db("find build step"))?;
        row.map(|(b, diff_id)| {
            Ok(BuildStep {
                snapshot: snapshot_id(&b, key)?,
                diff_id,
            })
        })
        .transpose()
    }

    /// Every snapshot an image holds (kept by `gc`).
    pub fn image_snapshots(&self) -> Result<Vec<ObjectId>, ImageRecordError> {
        let mut out = Vec::new();
        for img in self.images()? {
            out.push(img.snapshot);
            out.extend(img.layers.iter().map(|l| l.snapshot));
        }
        Ok(out)
    }
}

/// What [`WriteLock::remove_image`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRemoved {
    pub id: String,
    /// The names it no longer goes by.
    pub names: Vec<String>,
    /// The image itself is gone (false: only a name was removed; it has others).
    pub image: bool,
    /// Snapshots of its layers no other image holds: `gc` may now drop them
    /// (with `--keep-last`), or `tine rm` them.
    pub released: Vec<ObjectId>,
}

impl WriteLock<'_> {
    /// Records image `img` (replacing one with the same id) and its layers'
    /// chains, and gives it `img.names`, taking each from any image that had it.
    pub fn put_image(&self, img: &ImageRecord) -> Result<(), ImageRecordError> {
        for n in &img.names {
            check_name(n)?;
        }
        if img.config.len() > MAX_CONFIG {
            return Err(ImageRecordError::ConfigTooLarge {
                id: img.id.clone(),
                size: img.config.len(),
            });
        }
        let layers = serde_json::to_string(&img.layers).expect("layers serialize");
        let mut conn = self.repo().db();
        let tx = conn.transaction().map_err(db("begin"))?;
        tx.execute(
            "INSERT OR REPLACE INTO images (id, config, snapshot, layers, source, created_ns)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                img.id,
                img.config,
                img.snapshot.as_bytes().as_slice(),
                layers,
                img.source,
                img.created_ns as i64
            ],
        )
        .map_err(db("record image"))?;
        for l in &img.layers {
            tx.execute(
                "INSERT OR REPLACE INTO image_layers (chain, snapshot) VALUES (?1, ?2)",
                params![l.chain, l.snapshot.as_bytes().as_slice()],
            )
            .map_err(db("record image layer"))?;
        }
        for n in &img.names {
            tx.execute(
                "INSERT OR REPLACE INTO image_names (name, image) VALUES (?1, ?2)",
                params![n, img.id],
            )
            .map_err(db("name image"))?;
        }
        tx.commit().map_err(db("commit image"))?;
        Ok(())
    }

    /// Records what build step `key` made.
    pub fn put_build_step(&self, key: &str, step: &BuildStep) -> Result<(), ImageRecordError> {
        self.repo()
            .db()
            .execute(
                "INSERT OR REPLACE INTO build_steps (key, snapshot, diff_id, created_ns)
                 VALUES (?1, ?2, ?3, ?4)",
                params![
                    key,
                    step.snapshot.as_bytes().as_slice(),
                    step.diff_id,
                    crate::now_ns() as i64
                ],
            )
            .map_err(db("record build step"))?;
        Ok(())
    }

    /// Removes `spec`: given a name of an image that has others, that name
    /// only; otherwise the image and all its names. Chains no image holds
    /// any more are forgotten.
    pub fn remove_image(&self, spec: &str) -> Result<ImageRemoved, ImageRecordError> {
        let repo = self.repo();
        let img = repo.image(spec)?;
        let by_name = name_candidates(spec)
            .into_iter()
            .find(|c| img.names.contains(c));
        let mut conn = repo.db();
        let tx = conn.transaction().map_err(db("begin"))?;
        if let Some(name) = by_name.filter(|_| img.names.len() > 1) {
            tx.execute("DELETE FROM image_names WHERE name = ?1", [&name])
                .map_err(db("remove image name"))?;
            tx.commit().map_err(db("commit image removal"))?;
            return Ok(ImageRemoved {
                id: img.id,
                names: vec![name],
                image: false,
                released: Vec::new(),
            });
        }
        tx.execute("DELETE FROM image_names WHERE image = ?1", [&img.id])
            .map_err(db("remove image names"))?;
        tx.execute("DELETE FROM images WHERE id = ?1", [&img.id])
            .map_err(db("remove image"))?;
        // The chains the remaining images still use.
        let mut used = std::collections::HashSet::new();
        {
            let mut q = tx
                .prepare("SELECT layers FROM images")
                .map_err(db("list image layers"))?;
            let rows: Vec<String> = q
                .query_map([], |r| r.get(0))
                .map_err(db("list image layers"))?
                .collect::<Result<_, _>>()
                .map_err(db("list image layers"))?;
            for r in rows {
                let layers: Vec<ImageLayer> = serde_json::from_str(&r).unwrap_or_default();
                used.extend(layers.into_iter().map(|l| l.chain));
            }
        }
        let mut released = Vec::new();
        for l in &img.layers {
            if !used.contains(&l.chain) {
                tx.execute("DELETE FROM image_layers WHERE chain = ?1", [&l.chain])
                    .map_err(db("forget image layer"))?;
                released.push(l.snapshot);
            }
        }
        tx.commit().map_err(db("commit image removal"))?;
        Ok(ImageRemoved {
            id: img.id,
            names: img.names,
            image: true,
            released,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_reference_rules() {
        for ok in ["busybox", "localhost/py:3.11", "a.b/c_d-e:1@x"] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "-x", "a b", "sha256:abcd", "a\nb", &"x".repeat(256)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_short_name_stands_for_its_latest_tag_and_registry_forms() {
        let c = name_candidates("busybox");
        assert_eq!(c[0], "busybox");
        assert!(c.contains(&"busybox:latest".to_string()));
        assert!(c.contains(&"localhost/busybox:latest".to_string()));
        assert!(c.contains(&"docker.io/library/busybox:latest".to_string()));
        // A tag is not added twice.
        assert!(
            !name_candidates("py:3")
                .iter()
                .any(|n| n.ends_with(":latest"))
        );
    }
}
