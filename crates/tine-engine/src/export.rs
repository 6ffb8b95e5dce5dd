//! Images out of the repository: each layer written as the tar of what its
//! snapshot changed over the layer below (whiteouts for what it removed),
//! the same bytes for the same two trees, so a layer's digest is known
//! without keeping the tar; and the image as an OCI archive (`podman load`
//! reads it).

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tine_image::Digest;
use tine_image::write::LayerWriter;
use tine_store::{Content, Kind, Node, ObjectId, Repository, Tree, TreeEntry};

use crate::{Ctx, Engine, EngineError};

/// A file's content as a reader, one chunk at a time.
struct ContentRead<'r> {
    repo: &'r Repository,
    chunks: VecDeque<(ObjectId, u32)>,
    buf: Vec<u8>,
    pos: usize,
}

impl<'r> ContentRead<'r> {
    fn new(repo: &'r Repository, content: &Content) -> Result<ContentRead<'r>, EngineError> {
        let chunks = match content.kind {
            Kind::Chunked => repo.read_chunk_list(&content.id)?.chunks.into(),
            _ => VecDeque::from([(content.id, 0)]),
        };
        Ok(ContentRead {
            repo,
            chunks,
            buf: Vec::new(),
            pos: 0,
        })
    }
}

impl Read for ContentRead<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.pos == self.buf.len() {
            let Some((c, len)) = self.chunks.pop_front() else {
                return Ok(0);
            };
            if c == tine_store::ChunkList::HOLE {
                // A hole's zeros, a MiB at a time.
                let n = len.min(1 << 20);
                if len > n {
                    self.chunks.push_front((c, len - n));
                }
                self.buf = vec![0; n as usize];
            } else {
                self.buf = self
                    .repo
                    .read_kind(&c, Kind::Blob)
                    .map_err(std::io::Error::other)?;
            }
            self.pos = 0;
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

fn join(prefix: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = prefix.to_vec();
    if !p.is_empty() {
        p.push(b'/');
    }
    p.extend_from_slice(name);
    p
}

fn io_err(what: &str) -> impl FnOnce(std::io::Error) -> EngineError + '_ {
    move |source| {
        // A name no layer can carry (one an importer would take for a
        // whiteout) is the snapshot's, not the disk's.
        if source.kind() == std::io::ErrorKind::InvalidInput {
            return EngineError::Invalid {
                message: format!("export: {source}"),
            };
        }
        EngineError::File {
            path: what.to_string(),
            step: "write the layer",
            source,
        }
    }
}

/// Writes `e` (and, a directory, all below it) at `path`.
fn put_all<W: Write>(
    repo: &Repository,
    w: &mut LayerWriter<W>,
    path: &[u8],
    e: &TreeEntry,
) -> Result<(), EngineError> {
    let shown = String::from_utf8_lossy(path).into_owned();
    let (uid, gid) = (e.owner.uid, e.owner.gid);
    match &e.node {
        Node::Dir { tree } => {
            w.dir(path, e.mode, uid, gid).map_err(io_err(&shown))?;
            for c in repo.read_tree(tree)?.entries {
                put_all(repo, w, &join(path, &c.name), &c)?;
            }
        }
        Node::File { content, size } => {
            let r = ContentRead::new(repo, content)?;
            w.file(path, (e.mode, uid, gid), *size, r)
                .map_err(io_err(&shown))?;
        }
        Node::Symlink { target } => {
            w.symlink(path, target, uid, gid).map_err(io_err(&shown))?;
        }
    }
    Ok(())
}

/// Writes what `upper` holds that `lower` does not, below `prefix`.
fn put_diff<W: Write>(
    repo: &Repository,
    w: &mut LayerWriter<W>,
    prefix: &[u8],
    lower: &Tree,
    upper: &Tree,
) -> Result<(), EngineError> {
    let mut lo = lower.entries.iter().peekable();
    for u in &upper.entries {
        // Names only below: gone.
        while let Some(l) = lo.next_if(|l| l.name < u.name) {
            let p = join(prefix, &l.name);
            w.whiteout(&p)
                .map_err(io_err(&String::from_utf8_lossy(&p)))?;
        }
        let path = join(prefix, &u.name);
        match lo.next_if(|l| l.name == u.name) {
            None => put_all(repo, w, &path, u)?,
            Some(l) if l == u => {}
            Some(l) => match (&l.node, &u.node) {
                (Node::Dir { tree: a }, Node::Dir { tree: b }) => {
                    if l.mode != u.mode || l.owner != u.owner {
                        w.dir(&path, u.mode, u.owner.uid, u.owner.gid)
                            .map_err(io_err(&String::from_utf8_lossy(&path)))?;
                    }
                    put_diff(repo, w, &path, &repo.read_tree(a)?, &repo.read_tree(b)?)?;
                }
                (Node::Dir { .. }, _) => {
                    // A directory replaced: hidden first, or its files would stay.
                    w.whiteout(&path)
                        .map_err(io_err(&String::from_utf8_lossy(&path)))?;
                    put_all(repo, w, &path, u)?;
                }
                _ => put_all(repo, w, &path, u)?,
            },
        }
    }
    for l in lo {
        let p = join(prefix, &l.name);
        w.whiteout(&p)
            .map_err(io_err(&String::from_utf8_lossy(&p)))?;
    }
    Ok(())
}

fn tree_of(repo: &Repository, snap: &ObjectId) -> Result<Tree, EngineError> {
    Ok(repo.read_tree(&repo.read_snapshot(snap)?.tree)?)
}

/// Writes the layer that makes snapshot `upper` from `lower` (none: an
/// empty root) to `out`; its digest and size.
pub(crate) fn write_layer<W: Write>(
    repo: &Repository,
    lower: Option<&ObjectId>,
    upper: &ObjectId,
    out: W,
) -> Result<(Digest, u64), EngineError> {
    let lower = match lower {
        Some(l) => tree_of(repo, l)?,
        None => Tree::default(),
    };
    let upper = tree_of(repo, upper)?;
    let mut w = LayerWriter::new(tine_image::digest::Hashing::new(out));
    put_diff(repo, &mut w, b"", &lower, &upper)?;
    let h = w.finish().map_err(io_err("the layer's end"))?;
    let (d, n, mut inner) = h.finish();
    inner.flush().map_err(io_err("the layer"))?;
    Ok((d, n))
}

/// What `tine image export` asks for.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExportImage {
    /// The image (name or id).
    pub image: String,
    /// Where the OCI archive goes (replaced if it is there).
    pub path: PathBuf,
}

/// What an export wrote.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Exported {
    /// The image as tine names it.
    pub image: String,
    /// The exported configuration's digest: the id Podman gives it once
    /// loaded (a layer imported is written anew, so its digest, and the
    /// id, can differ from the imported image's).
    pub id: String,
    pub path: PathBuf,
    pub layers: usize,
    pub bytes: u64,
    pub seconds: f64,
}

impl Engine {
    /// Writes image `req.image` as an OCI archive at `req.path`.
    pub fn export_image(&self, req: &ExportImage, _ctx: &Ctx<'_>) -> Result<Exported, EngineError> {
        let t0 = Instant::now();
        let repo = self.open()?;
        let rec = repo.image(&req.image)?;
        let config: serde_json::Value =
            serde_json::from_slice(&rec.config).map_err(|e| EngineError::Internal {
                message: format!("image {}: its configuration does not parse: {e}", rec.id),
            })?;
        let dir = req
            .path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let scratch = tempfile::Builder::new()
            .prefix(".tine-export-")
            .tempdir_in(dir)
            .map_err(|source| EngineError::File {
                path: dir.display().to_string(),
                step: "make a scratch directory beside the archive",
                source,
            })?;
        let mut layers = Vec::new();
        let mut history = Vec::new();
        let mut below: Option<ObjectId> = None;
        for (k, l) in rec.layers.iter().enumerate() {
            let p = scratch.path().join(format!("layer-{k}.tar"));
            let f = std::fs::File::create(&p).map_err(|source| EngineError::File {
                path: p.display().to_string(),
                step: "create",
                source,
            })?;
            write_layer(
                &repo,
                below.as_ref(),
                &l.snapshot,
                std::io::BufWriter::new(f),
            )?;
            layers.push(p);
            history.push(
                repo.snapshot_info(&l.snapshot)?
                    .map(|i| i.message)
                    .unwrap_or_default(),
            );
            below = Some(l.snapshot);
        }
        let img = tine_image::write::NewImage {
            name: rec.names.first().cloned(),
            run: config
                .get("config")
                .cloned()
                .unwrap_or(serde_json::json!({})),
            layers,
            history,
        };
        let written = tine_image::write::write_oci_archive(&req.path, &img)?;
        Ok(Exported {
            image: rec.names.first().cloned().unwrap_or(rec.id.clone()),
            id: written.config.to_string(),
            path: req.path.clone(),
            layers: rec.layers.len(),
            bytes: written.bytes,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }
}
