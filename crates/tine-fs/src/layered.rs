//! Snapshots of overlay workspaces: the merged view's tree is the base tree
//! with the upper layer applied, so a snapshot reads only the upper layer —
//! what changed since the base — never the whole workspace.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use tine_store::{
    Kind, NewSnapshot, Node, ObjectId, PackBuilder, Progress, Repository, Tree, WriteLock,
};

use crate::ops::{SnapshotError, SnapshotOptions, SnapshotOutcome};
use crate::paths::join;
use crate::scan::{Scan, ScanConfig, scan};
use crate::statcache::{StatCache, cache_path};

/// Files and bytes under a stored tree.
fn count(repo: &Repository, tree: &ObjectId) -> Result<(u64, u64), SnapshotError> {
    let mut n = (0, 0);
    for e in repo.read_tree(tree)?.entries {
        match e.node {
            Node::File { size, .. } => {
                n.0 += 1;
                n.1 += size;
            }
            Node::Dir { tree } => {
                let (f, b) = count(repo, &tree)?;
                n.0 += f;
                n.1 += b;
            }
            Node::Symlink { .. } => {}
        }
    }
    Ok(n)
}

fn entry_count(repo: &Repository, node: &Node) -> Result<(i64, i64), SnapshotError> {
    Ok(match node {
        Node::File { size, .. } => (1, *size as i64),
        Node::Dir { tree } => {
            let (f, b) = count(repo, tree)?;
            (f as i64, b as i64)
        }
        Node::Symlink { .. } => (0, 0),
    })
}

struct Merge<'a> {
    repo: &'a Repository,
    /// Where new trees go; `None` keeps them in `made` only.
    pack: Option<&'a PackBuilder<'a>>,
    made: HashMap<ObjectId, Tree>,
    upper: &'a Scan,
    whiteouts: HashMap<Vec<u8>, Vec<Vec<u8>>>,
    opaque: HashSet<Vec<u8>>,
    /// Change in files and bytes against the base.
    delta: (i64, i64),
}

impl<'a> Merge<'a> {
    fn new(repo: &'a Repository, pack: Option<&'a PackBuilder<'a>>, upper: &'a Scan) -> Self {
        let mut whiteouts: HashMap<Vec<u8>, Vec<Vec<u8>>> = HashMap::new();
        for w in &upper.whiteouts {
            let (dir, name) = match w.iter().rposition(|b| *b == b'/') {
                Some(i) => (w[..i].to_vec(), w[i + 1..].to_vec()),
                None => (Vec::new(), w.clone()),
            };
            whiteouts.entry(dir).or_default().push(name);
        }
        Merge {
            repo,
            pack,
            made: HashMap::new(),
            upper,
            whiteouts,
            opaque: upper.opaque_dirs.iter().cloned().collect(),
            delta: (0, 0),
        }
    }

    /// The tree at `rel`: `base` with the upper directory `upper` applied.
    fn dir(
        &mut self,
        rel: &[u8],
        base: Option<&ObjectId>,
        upper: &ObjectId,
    ) -> Result<ObjectId, SnapshotError> {
        let base_tree = match base {
            Some(b) if !self.opaque.contains(rel) => self.repo.read_tree(b)?,
            Some(b) => {
                // An opaque directory hides everything below it in the base.
                let (f, by) = count(self.repo, b)?;
                self.delta.0 -= f as i64;
                self.delta.1 -= by as i64;
                Tree::default()
            }
            None => Tree::default(),
        };
        let mut entries: BTreeMap<Vec<u8>, tine_store::TreeEntry> = base_tree
            .entries
            .into_iter()
            .map(|e| (e.name.clone(), e))
            .collect();
        if let Some(names) = self.whiteouts.get(rel).cloned() {
            for name in names {
                if let Some(old) = entries.remove(&name) {
                    let (f, b) = entry_count(self.repo, &old.node)?;
                    self.delta.0 -= f;
                    self.delta.1 -= b;
                }
            }
        }
        let up = self.upper.trees.get(upper).cloned().unwrap_or_default();
        for mut e in up.entries {
            let sub = join(rel, &e.name);
            let old = entries.remove(&e.name);
            if let Node::Dir { tree } = &e.node {
                let base_sub = match old.as_ref().map(|o| &o.node) {
                    Some(Node::Dir { tree }) => Some(*tree),
                    Some(other) => {
                        let (f, b) = entry_count(self.repo, other)?;
                        self.delta.0 -= f;
                        self.delta.1 -= b;
                        None
                    }
                    None => None,
                };
                let merged = self.dir(&sub, base_sub.as_ref(), tree)?;
                e.node = Node::Dir { tree: merged };
            } else {
                if let Some(o) = &old {
                    let (f, b) = entry_count(self.repo, &o.node)?;
                    self.delta.0 -= f;
                    self.delta.1 -= b;
                }
                let (f, b) = entry_count(self.repo, &e.node)?;
                self.delta.0 += f;
                self.delta.1 += b;
            }
            entries.insert(e.name.clone(), e);
        }
        let tree = Tree {
            entries: entries.into_values().collect(),
        };
        let raw = tree.encode();
        let id = match self.pack {
            Some(p) => p.put(Kind::Tree, &raw)?,
            None => ObjectId::compute(Kind::Tree, &raw),
        };
        self.made.insert(id, tree);
        Ok(id)
    }
}

/// Snapshots an overlay workspace from its parts: the snapshot its lower layer
/// was materialized from (`base`), and its upper layer. `after_scan` runs as
/// soon as the upper layer has been read — a live sandbox is thawed there,
/// before the pack is made durable. `key` names the workspace's head.
pub fn snapshot_layered(
    lock: &WriteLock<'_>,
    base: Option<&ObjectId>,
    upper: &Path,
    key: &str,
    opts: &SnapshotOptions,
    after_scan: impl FnOnce(),
    progress: &dyn Progress,
) -> Result<SnapshotOutcome, SnapshotError> {
    let repo = lock.repo();
    repo.check_new_tags(&opts.tags, opts.force_tags)?;
    let base_info = match base {
        Some(b) => Some(
            repo.snapshot_info(b)?
                .ok_or(tine_store::ObjectError::Missing { id: *b })?,
        ),
        None => None,
    };
    let base_tree = match base {
        Some(b) => Some(repo.read_snapshot(b)?.tree),
        None => None,
    };
    let cpath = cache_path(repo, upper);
    let generation = repo.gc_generation()?;
    let cache = StatCache::load(&cpath, repo.repo_id(), generation);
    let pack = lock.pack()?;
    let scanned = scan(
        upper,
        ScanConfig {
            sink: Some(&pack),
            cache: &cache,
            exclude: None,
            progress,
            keep_trees: true,
            overlay_upper: true,
        },
    );
    after_scan();
    let s = scanned?;
    let mut m = Merge::new(repo, Some(&pack), &s);
    let tree = m.dir(&[], base_tree.as_ref(), &s.root)?;
    let (files, bytes) = match &base_info {
        Some(i) => (
            (i.files as i64 + m.delta.0).max(0) as u64,
            (i.bytes as i64 + m.delta.1).max(0) as u64,
        ),
        None => (m.delta.0.max(0) as u64, m.delta.1.max(0) as u64),
    };
    let parent = repo.head(key)?.or(base.copied());
    let commit = lock.commit(
        pack,
        Some(NewSnapshot {
            tree,
            parents: parent.into_iter().collect(),
            message: opts.message.clone(),
            source: key.to_string(),
            tags: opts.tags.clone(),
            attachments: vec![],
            files,
            bytes,
            head: Some(key.to_string()),
            force_tags: opts.force_tags,
        }),
    )?;
    if let Ok(p) =
        StatCache::write_pending(&cpath, &s.cache.encode(repo.repo_id(), generation, upper))
    {
        let _ = p.persist();
    }
    Ok(SnapshotOutcome {
        id: commit.snapshot.expect("commit with a snapshot"),
        tree,
        parent,
        source: upper.to_path_buf(),
        stats: s.stats,
        commit,
        warnings: s.warnings,
    })
}

/// The tree of an overlay workspace as it is now, without storing anything:
/// its root id and the trees that are not in the repository (for a restore
/// that must know what is there without walking the whole workspace).
pub fn layered_tree(
    repo: &Repository,
    base: Option<&ObjectId>,
    upper: &Path,
    progress: &dyn Progress,
) -> Result<(ObjectId, HashMap<ObjectId, Tree>), SnapshotError> {
    let base_tree = match base {
        Some(b) => Some(repo.read_snapshot(b)?.tree),
        None => None,
    };
    let cache = StatCache::load(
        &cache_path(repo, upper),
        repo.repo_id(),
        repo.gc_generation()?,
    );
    let s = scan(
        upper,
        ScanConfig {
            sink: None,
            cache: &cache,
            exclude: None,
            progress,
            keep_trees: true,
            overlay_upper: true,
        },
    )?;
    let mut m = Merge::new(repo, None, &s);
    let root = m.dir(&[], base_tree.as_ref(), &s.root)?;
    Ok((root, m.made))
}
