//! Container images through the engine: imported from an OCI layout or
//! archive or a `docker save` archive (each layer applied to a scratch
//! directory and snapshotted, its parent the layer below, so that images
//! sharing a base share its snapshots and objects), listed, shown and
//! removed; and what a sandbox made from one runs: its command,
//! environment, working directory and user, from the image's configuration.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tine_image::oci::ImageConfiguration;
use tine_image::{ImageError, ImageSource};
use tine_sandbox::ns::ImageRoot;
use tine_store::{
    ErrorKind, ImageLayer, ImageRecord, ImageRemoved, Node, ObjectId, Repository, now_ns,
};

use crate::{Ctx, Engine, EngineError};

/// What `tine image import` / `POST /v1/images` asks for.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImportImage {
    /// An OCI image layout (directory), an OCI archive or a `docker
    /// save`/`podman save` archive; through the daemon, under one of its
    /// import roots.
    pub path: PathBuf,
    /// Which image of several the source holds (a name, or leading digits
    /// of its id).
    pub image: Option<String>,
    /// Instead of `path`: an image in Podman's local store (its name or id),
    /// saved by Podman for the import.
    pub podman: Option<String>,
    /// Names to give it (default: the names the source gives it).
    pub names: Vec<String>,
    /// Bytes of uncompressed layers the import may unpack at most (default:
    /// 64 GiB, which no real image comes near).
    pub max_bytes: Option<u64>,
    /// Entries its layers may hold at most (default: 4,000,000).
    pub max_entries: Option<u64>,
    /// Components one entry's path may have at most (default: 256).
    pub max_depth: Option<usize>,
}

impl ImportImage {
    /// What the import may unpack: the defaults, or what was asked.
    pub fn limits(&self) -> tine_image::Limits {
        let d = tine_image::Limits::default();
        tine_image::Limits {
            bytes: self.max_bytes.unwrap_or(d.bytes),
            entries: self.max_entries.unwrap_or(d.entries),
            depth: self.max_depth.unwrap_or(d.depth),
        }
    }
}

/// An image in the repository, with what its configuration says to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageView {
    /// `sha256:HEX` of its configuration.
    pub id: String,
    pub names: Vec<String>,
    /// The snapshot of its root filesystem.
    pub snapshot: String,
    pub layers: usize,
    pub source: String,
    pub created_ns: u64,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub workdir: Option<String>,
    pub user: Option<String>,
}

/// What an import did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Imported {
    pub image: ImageView,
    /// Layers applied and snapshotted by this import.
    pub layers_applied: usize,
    /// Layers found already imported (by chain id) and reused.
    pub layers_reused: usize,
    /// Bytes the store grew by.
    pub stored_bytes: u64,
    /// Entries left out (device nodes, FIFOs), by layer and path.
    pub skipped: Vec<String>,
    pub seconds: f64,
}

/// The kind of an error reading an image: a damaged one is corrupt; one
/// that is not an image, names what is not there or is too large, bad input.
pub(crate) fn image_error_kind(e: &ImageError) -> ErrorKind {
    match e {
        ImageError::DigestMismatch { .. } => ErrorKind::Corrupt,
        ImageError::Missing { .. } => ErrorKind::Corrupt,
        ImageError::NoSuchImage { .. } => ErrorKind::NotFound,
        ImageError::WhichImage { .. } => ErrorKind::Ambiguous,
        ImageError::Read { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            ErrorKind::NotFound
        }
        ImageError::Read { .. } | ImageError::Write { .. } => ErrorKind::Io,
        ImageError::NotAnImage { .. }
        | ImageError::TooLarge { .. }
        | ImageError::OverLimit { .. }
        | ImageError::Bad { .. }
        | ImageError::BadDigest { .. }
        | ImageError::BadEntry { .. } => ErrorKind::InvalidInput,
    }
}

fn parse_config(rec: &ImageRecord) -> Result<ImageConfiguration, EngineError> {
    serde_json::from_slice(&rec.config).map_err(|e| {
        EngineError::from(tine_store::ImageRecordError::Corrupt {
            id: rec.id.clone(),
            reason: format!("its configuration does not parse: {e}"),
        })
    })
}

/// The view of `rec`.
pub fn view(rec: &ImageRecord) -> Result<ImageView, EngineError> {
    let config = parse_config(rec)?;
    let c = config.config().clone().unwrap_or_default();
    Ok(ImageView {
        id: rec.id.clone(),
        names: rec.names.clone(),
        snapshot: rec.snapshot.to_hex(),
        layers: rec.layers.len(),
        source: rec.source.clone(),
        created_ns: rec.created_ns,
        entrypoint: c.entrypoint().clone().unwrap_or_default(),
        cmd: c.cmd().clone().unwrap_or_default(),
        env: c.env().clone().unwrap_or_default(),
        workdir: c.working_dir().clone().filter(|w| !w.is_empty()),
        user: c.user().clone().filter(|u| !u.is_empty()),
    })
}

impl Engine {
    /// Every image in the repository, oldest first.
    pub fn images(&self) -> Result<Vec<ImageView>, EngineError> {
        self.open()?.images()?.iter().map(view).collect()
    }

    /// The image `spec` names (a name, `sha256:HEX`, or leading digits).
    pub fn image(&self, spec: &str) -> Result<ImageView, EngineError> {
        view(&self.open()?.image(spec)?)
    }

    /// Imports an image: each layer not imported before is applied to a
    /// scratch directory in the repository (over the longest chain already
    /// there, restored) and snapshotted with the layer below as its parent.
    /// A damaged layer stops the import, naming its digest; what earlier
    /// layers stored stays, unnamed, and a second import reuses it.
    pub fn import_image(&self, req: &ImportImage, ctx: &Ctx<'_>) -> Result<Imported, EngineError> {
        let t0 = Instant::now();
        let (path, _saved, shown) = match &req.podman {
            Some(name) => {
                if !req.path.as_os_str().is_empty() {
                    return Err(EngineError::Invalid {
                        message: "give `path` or `podman`, not both".into(),
                    });
                }
                let (p, t) = self.podman_save(name)?;
                (p, Some(t), format!("podman:{name}"))
            }
            None if req.path.as_os_str().is_empty() => {
                return Err(EngineError::Invalid {
                    message: "give the `path` of an archive or layout, or `podman`: an image in Podman's local store".into(),
                });
            }
            None => {
                let p = self.importable(&req.path)?;
                let shown = p.display().to_string();
                (p, None, shown)
            }
        };
        let source = ImageSource::open(&path)?;
        let img = source.pick(req.image.as_deref())?;
        let names = if req.names.is_empty() {
            img.names.clone()
        } else {
            req.names.clone()
        };
        for n in &names {
            tine_store::images::check_name(n)?;
        }
        let chains = tine_image::chain_ids(&img.layers);
        let repo = self.open()?;
        let before = repo.store_bytes()?;
        let limits = req.limits();
        let as_root = rustix::process::geteuid().is_root();
        // Owners as the image gives them (applied by root), else 0:0.
        let owners = as_root.then_some(tine_fs::IdMap::IDENTITY);
        let label = names
            .first()
            .cloned()
            .unwrap_or_else(|| img.config_digest.to_string());
        // The layers are unpacked into a staging directory without the
        // repository's lock (a hostile layer costs its importer time, never
        // the repository's other writers); the lock is held to store each
        // layer's snapshot and to record the image.
        let staging = tine_store::staging::Staging::new(&repo, "import").map_err(|source| {
            EngineError::File {
                path: repo.path().display().to_string(),
                step: "make the import's staging directory",
                source,
            }
        })?;
        let root = &staging.path().join("root");
        let (reused, mut parent, mut layers) = {
            let lock = ctx.lock(&repo)?;
            // The longest chain already imported (its snapshot still there).
            let mut reused = 0;
            let mut parent: Option<ObjectId> = None;
            for (i, c) in chains.iter().enumerate().rev() {
                if let Some(s) = repo.image_layer(c.as_str())?
                    && repo.snapshot_info(&s)?.is_some()
                {
                    reused = i + 1;
                    parent = Some(s);
                    break;
                }
            }
            let layers: Vec<ImageLayer> = img
                .layers
                .iter()
                .zip(&chains)
                .take(reused)
                .map(|(l, c)| {
                    Ok(ImageLayer {
                        diff_id: l.diff_id().to_string(),
                        chain: c.to_string(),
                        snapshot: repo.image_layer(c.as_str())?.expect("looked up above"),
                    })
                })
                .collect::<Result<_, EngineError>>()?;
            if reused < img.layers.len()
                && let Some(p) = &parent
            {
                tine_fs::restore_with(
                    &lock,
                    p,
                    root,
                    tine_fs::RestoreOptions {
                        keep_setuid: true,
                        owners,
                    },
                    ctx.progress,
                )?;
            }
            (reused, parent, layers)
        };
        let mut skipped = Vec::new();
        if reused < img.layers.len() || parent.is_none() {
            std::fs::create_dir_all(root).map_err(|source| EngineError::File {
                path: root.display().to_string(),
                step: "make the import's root",
                source,
            })?;
            let n = img.layers.len();
            let mut budget = tine_image::Budget::new(limits);
            // An image of no layers: an empty root.
            let todo: Vec<usize> = if n == 0 {
                vec![]
            } else {
                (reused..n).collect()
            };
            for k in todo {
                let layer = &img.layers[k];
                let applied = source.apply(layer, root, as_root, &mut budget)?;
                skipped.extend(
                    applied
                        .skipped
                        .iter()
                        .map(|p| format!("layer {}: {p}", k + 1)),
                );
                let lock = ctx.lock(&repo)?;
                let snap = tine_fs::snapshot(
                    &lock,
                    root,
                    &tine_fs::SnapshotOptions {
                        message: format!(
                            "image {label}: layer {}/{n} ({})",
                            k + 1,
                            layer.diff_id()
                        ),
                        parents: Some(parent.into_iter().collect()),
                        owners,
                        detached: true,
                        ..Default::default()
                    },
                    ctx.progress,
                )?;
                parent = Some(snap.id);
                layers.push(ImageLayer {
                    diff_id: layer.diff_id().to_string(),
                    chain: chains[k].to_string(),
                    snapshot: snap.id,
                });
            }
            if n == 0 {
                let lock = ctx.lock(&repo)?;
                let snap = tine_fs::snapshot(
                    &lock,
                    root,
                    &tine_fs::SnapshotOptions {
                        message: format!("image {label}: no layers"),
                        parents: Some(vec![]),
                        detached: true,
                        ..Default::default()
                    },
                    ctx.progress,
                )?;
                parent = Some(snap.id);
            }
            // The staging directory's stat cache is of no further use.
            let _ = std::fs::remove_file(tine_fs::statcache::cache_path(&repo, root));
        }
        let lock = ctx.lock(&repo)?;
        // Each layer's snapshot was stored under the lock, which was let go
        // between layers: one a `gc` removed meanwhile fails the import here.
        for l in &layers {
            if repo.snapshot_info(&l.snapshot)?.is_none() {
                return Err(EngineError::Invalid {
                    message: format!(
                        "import of {shown}: the snapshot of layer {} was removed while importing (a gc ran meanwhile?); import again",
                        l.diff_id
                    ),
                });
            }
        }
        let rec = ImageRecord {
            id: img.config_digest.to_string(),
            names,
            config: img.config_json.clone(),
            snapshot: parent.expect("an image's root was snapshotted or found"),
            layers,
            source: shown,
            created_ns: now_ns(),
        };
        lock.put_image(&rec)?;
        drop(lock);
        let after = repo.store_bytes()?;
        Ok(Imported {
            image: view(&repo.image(&rec.id)?)?,
            layers_applied: img.layers.len() - reused,
            layers_reused: reused,
            stored_bytes: after.saturating_sub(before),
            skipped,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// Image `name` of Podman's local store, saved as an OCI archive in a
    /// scratch directory of the repository (removed when it drops).
    fn podman_save(
        &self,
        name: &str,
    ) -> Result<(PathBuf, tine_store::staging::Staging), EngineError> {
        let bin = self.cfg.podman.as_ref().ok_or_else(|| EngineError::Reported {
            kind: ErrorKind::Unsupported,
            message: "no podman is installed to read its local store from (Debian's podman), or give the path of an archive".into(),
        })?;
        // A reference, never an option Podman would take.
        let ok = !name.is_empty()
            && name.len() <= tine_store::images::MAX_NAME
            && name.as_bytes()[0].is_ascii_alphanumeric()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-/:@".contains(&b));
        if !ok {
            return Err(EngineError::Invalid {
                message: format!(
                    "{:?} is not an image reference (letters, digits and ._-/:@, starting with a letter or digit)",
                    name.chars().take(80).collect::<String>()
                ),
            });
        }
        let repo = self.open()?;
        let tmp = tine_store::staging::Staging::new(&repo, "podman").map_err(|source| {
            EngineError::File {
                path: repo.path().display().to_string(),
                step: "make a staging directory for podman's archive",
                source,
            }
        })?;
        let out = tmp.path().join("image.tar");
        let args = ["image", "save", "--format", "oci-archive", "-o"].map(std::ffi::OsStr::new);
        let mut args = args.to_vec();
        args.extend([out.as_os_str(), std::ffi::OsStr::new(name)]);
        crate::podman::output(bin, &args, &format!("podman image save {name}"))?;
        Ok((out, tmp))
    }

    /// Removes an image, or one of its names (see
    /// `WriteLock::remove_image`). Its layers' snapshots that no other image
    /// holds are deleted where nothing else depends on them.
    pub fn remove_image(&self, spec: &str, ctx: &Ctx<'_>) -> Result<ImageRemoved, EngineError> {
        let repo = self.open()?;
        let lock = ctx.lock(&repo)?;
        let mut out = lock.remove_image(spec)?;
        // Top layer first: each is the parent of the next.
        let mut kept = Vec::new();
        for s in out.released.iter().rev() {
            let deleted = crate::dependents(&repo, s)
                .ok()
                .is_some_and(|by| lock.delete_snapshot(s, by).is_ok());
            if !deleted {
                kept.push(*s);
            }
        }
        out.released.retain(|s| kept.contains(s));
        Ok(out)
    }
}

/// What a sandbox made from image `spec` is given.
pub(crate) struct ImageRun {
    pub snapshot: ObjectId,
    pub root: ImageRoot,
    pub command: Vec<String>,
    /// The image's environment (`KEY=VALUE` entries split), before the
    /// caller's.
    pub env: Vec<(String, String)>,
}

/// Where `HOME` is when the image says nothing: the user's home in its
/// `/etc/passwd`, else `/root` for root and `/` for others.
fn home_of(passwd: &str, uid: u32) -> String {
    passwd
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() >= 6 && f[2].parse::<u32>().ok() == Some(uid)).then(|| f[5].to_string())
        })
        .find(|h| h.starts_with('/'))
        .unwrap_or_else(|| if uid == 0 { "/root" } else { "/" }.to_string())
}

/// The (uid, gid) an image's `user` ("name", "uid", "name:group",
/// "uid:gid", ...) stands for, with names looked up in its `/etc/passwd`
/// and `/etc/group`; a user's group is its primary group.
pub(crate) fn resolve_user(
    user: &str,
    passwd: &str,
    group: &str,
    image: &str,
) -> Result<(u32, u32), EngineError> {
    let unknown = |what: &str, name: &str| EngineError::Invalid {
        message: format!(
            "image {image}: its user {user:?} names the {what} {name:?}, which its /etc/{} does not list",
            if what == "user" { "passwd" } else { "group" }
        ),
    };
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let row = |table: &str, key: &str| -> Option<Vec<String>> {
        table
            .lines()
            .map(|l| l.split(':').map(str::to_string).collect::<Vec<_>>())
            .find(|f| f.len() >= 3 && (f[0] == key || f[2] == key))
    };
    let (uid, primary) = match u.parse::<u32>() {
        Ok(n) => (
            n,
            row(passwd, u)
                .and_then(|f| f.get(3).and_then(|g| g.parse().ok()))
                .unwrap_or(n),
        ),
        Err(_) => {
            let f = row(passwd, u).ok_or_else(|| unknown("user", u))?;
            (
                f[2].parse().map_err(|_| unknown("user", u))?,
                f.get(3)
                    .and_then(|g| g.parse().ok())
                    .ok_or_else(|| unknown("user", u))?,
            )
        }
    };
    let gid = match g {
        None | Some("") => primary,
        Some(g) => match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => row(group, g)
                .and_then(|f| f[2].parse().ok())
                .ok_or_else(|| unknown("group", g))?,
        },
    };
    Ok((uid, gid))
}

/// A small file of snapshot `snap` at `rel` (no link followed on the way),
/// if it is there: what the image's `/etc/passwd` says.
pub(crate) fn file_in_snapshot(repo: &Repository, snap: &ObjectId, rel: &str) -> Option<String> {
    let mut tree = repo.read_tree(&repo.read_snapshot(snap).ok()?.tree).ok()?;
    let parts: Vec<&str> = rel.split('/').collect();
    for (i, name) in parts.iter().enumerate() {
        let e = tree.entries.iter().find(|e| e.name == name.as_bytes())?;
        match (&e.node, i + 1 == parts.len()) {
            (Node::Dir { tree: t }, false) => tree = repo.read_tree(t).ok()?,
            (Node::File { content, size }, true) if *size <= 1 << 20 => {
                let mut out = Vec::new();
                repo.write_content(content, &mut out, Path::new(rel)).ok()?;
                return String::from_utf8(out).ok();
            }
            _ => return None,
        }
    }
    None
}

/// What a sandbox from image `spec` runs. The command: `entrypoint`
/// (given, else the image's) followed by `command` (given, else the
/// image's cmd), as Docker does; neither: `None`, the caller's default.
pub(crate) fn image_run(
    repo: &Repository,
    spec: &str,
    entrypoint: Option<&[String]>,
    command: &[String],
) -> Result<(ImageRun, bool), EngineError> {
    let rec = repo.image(spec)?;
    let config = parse_config(&rec)?;
    let c = config.config().clone().unwrap_or_default();
    let entry = entrypoint
        .map(<[String]>::to_vec)
        .unwrap_or_else(|| c.entrypoint().clone().unwrap_or_default());
    let args = if command.is_empty() {
        // An entrypoint given anew drops the image's cmd too (Docker's rule).
        if entrypoint.is_some() {
            vec![]
        } else {
            c.cmd().clone().unwrap_or_default()
        }
    } else {
        command.to_vec()
    };
    let full: Vec<String> = entry.into_iter().chain(args).collect();
    let passwd = file_in_snapshot(repo, &rec.snapshot, "etc/passwd").unwrap_or_default();
    let group = file_in_snapshot(repo, &rec.snapshot, "etc/group").unwrap_or_default();
    let (uid, gid) = match c.user().as_deref().filter(|u| !u.is_empty()) {
        Some(u) => resolve_user(u, &passwd, &group, &rec.id)?,
        None => (0, 0),
    };
    let mut env: Vec<(String, String)> = c
        .env()
        .iter()
        .flatten()
        .filter_map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.insert(0, ("PATH".into(), tine_sandbox::DEFAULT_PATH.into()));
    }
    if !env.iter().any(|(k, _)| k == "HOME") {
        env.push(("HOME".into(), home_of(&passwd, uid)));
    }
    let workdir = c
        .working_dir()
        .clone()
        .filter(|w| w.starts_with('/'))
        .unwrap_or_else(|| "/".into());
    let has_command = !full.is_empty();
    Ok((
        ImageRun {
            snapshot: rec.snapshot,
            root: ImageRoot {
                image: rec.id,
                workdir,
                uid,
                gid,
            },
            command: full,
            env,
        },
        has_command,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001:App:/home/app:/bin/sh\n";
    const GROUP: &str = "root:x:0:\nstaff:x:50:\napp:x:1001:\n";

    #[test]
    fn an_images_user_is_looked_up_in_its_own_passwd_and_group() {
        let r = |u| resolve_user(u, PASSWD, GROUP, "img");
        assert_eq!(r("app").unwrap(), (1000, 1001));
        assert_eq!(r("1000").unwrap(), (1000, 1001));
        assert_eq!(r("app:staff").unwrap(), (1000, 50));
        assert_eq!(r("1000:7").unwrap(), (1000, 7));
        assert_eq!(r("0").unwrap(), (0, 0));
        // A number it does not list: that uid, its group the same number.
        assert_eq!(r("4242").unwrap(), (4242, 4242));
        let e = r("nobody").unwrap_err().to_string();
        assert!(e.contains("\"nobody\"") && e.contains("/etc/passwd"), "{e}");
        let e = r("app:wheel").unwrap_err().to_string();
        assert!(e.contains("/etc/group"), "{e}");
    }

    #[test]
    fn home_comes_from_passwd_else_a_default() {
        assert_eq!(home_of(PASSWD, 1000), "/home/app");
        assert_eq!(home_of("", 0), "/root");
        assert_eq!(home_of("", 5), "/");
    }
}
