//! Snapshots of overlay workspaces: the merged view's tree is the base tree
//! with the upper layer applied, so a snapshot reads only the upper layer —
//! what changed since the base — never the whole workspace. With a change
//! tracker ([`Tracked`]) it reads only the upper directories that changed
//! since the last snapshot.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use tine_store::{
    Kind, NewSnapshot, Node, ObjectId, PackBuilder, Progress, Repository, Tree, WriteLock,
};

use crate::ops::{SnapshotError, SnapshotOptions, SnapshotOutcome};
use crate::paths::{inner_ancestors, join, split};
use crate::scan::{Scan, ScanConfig, Unchanged, scan};
use crate::statcache::{StatCache, cache_path};

/// A change tracker's position: which tracker (`watch`, unique per tracker
/// start) and how far it had read (`seq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stamp {
    pub watch: u64,
    pub seq: u64,
}

/// Directories changed up to which [`DirtySet::is_small`] holds.
const SMALL_DIRTY: usize = 16;

/// The upper directories a change tracker saw change.
///
/// Paths are kept as 64-bit hashes of their bytes, where each ancestor's
/// hash is the running hash at its `/`: a question costs one pass over the
/// path, whatever its depth (a chain of thousands of new directories, each
/// thousands of bytes long, made the sets of whole paths cost the cube of
/// the depth). A collision can only make an unchanged directory look changed,
/// which reads more, never less.
#[derive(Debug, Clone, Default)]
pub struct DirtySet {
    /// Directories whose own entries changed.
    dirs: HashSet<u64>,
    /// Directories new or moved as a whole: everything below them is read.
    trees: HashSet<u64>,
    /// Every proper ancestor of the above.
    ancestors: HashSet<u64>,
}

/// FNV-1a over `rel`, reporting the running hash at each `/` (the hash of
/// that ancestor) to `at_ancestor`; returns the hash of `rel`. The root (`""`)
/// is an ancestor of every other path.
fn path_hash(rel: &[u8], mut at_ancestor: impl FnMut(u64)) -> u64 {
    use crate::paths::{FNV_OFFSET, fnv_step};
    if !rel.is_empty() {
        at_ancestor(FNV_OFFSET);
    }
    let mut h = FNV_OFFSET;
    for &b in rel {
        if b == b'/' {
            at_ancestor(h);
        }
        h = fnv_step(h, b);
    }
    h
}

impl DirtySet {
    pub fn new(
        dirs: impl IntoIterator<Item = Vec<u8>>,
        trees: impl IntoIterator<Item = Vec<u8>>,
    ) -> DirtySet {
        let mut ancestors = HashSet::new();
        let mut hash = |p: Vec<u8>| {
            path_hash(&p, |a| {
                ancestors.insert(a);
            })
        };
        let dirs: HashSet<u64> = dirs.into_iter().map(&mut hash).collect();
        let trees: HashSet<u64> = trees.into_iter().map(&mut hash).collect();
        DirtySet {
            dirs,
            trees,
            ancestors,
        }
    }

    /// Whether reading what it names is small work: no directory read
    /// whole, and a few whose own entries changed.
    pub fn is_small(&self) -> bool {
        self.trees.is_empty() && self.dirs.len() <= SMALL_DIRTY
    }

    /// True when nothing at or below the directory `rel` changed.
    pub fn unchanged(&self, rel: &[u8]) -> bool {
        // Below a tree read whole, but not the root's: the root in `trees`
        // (an attribute change of the top directory, which every copy-up
        // of a new top-level directory makes) says to read its own entries.
        let mut under_tree = false;
        let h = path_hash(rel, |a| {
            under_tree |= a != crate::paths::FNV_OFFSET && self.trees.contains(&a)
        });
        !under_tree
            && !self.dirs.contains(&h)
            && !self.trees.contains(&h)
            && !self.ancestors.contains(&h)
    }
}

/// What a change tracker vouches for when a snapshot is taken.
#[derive(Debug, Clone)]
pub struct Tracked {
    /// The tracker now: the merge memo this snapshot saves is stamped with it.
    pub now: Stamp,
    /// The tracker position `dirty` is relative to.
    pub since: Stamp,
    /// `None` when the tracker cannot vouch for anything (it lost events, or
    /// something it cannot see may have written): everything is read.
    pub dirty: Option<DirtySet>,
    /// Files may have changed without their stat changing (writes through a
    /// shared mapping): read every file's content, trusting no stat cache.
    pub rehash: bool,
}

impl Tracked {
    /// Whether a read it guides is small work ([`DirtySet::is_small`]):
    /// never when it vouches for nothing.
    pub fn is_small(&self) -> bool {
        self.dirty.as_ref().is_some_and(DirtySet::is_small)
    }
}

/// One directory's remembered merge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Memo {
    /// Of the upper directory: its tree, whiteouts and opaque marks, recursively.
    sig: [u8; 32],
    /// The upper directory's own tree.
    upper: ObjectId,
    base: Option<ObjectId>,
    merged: ObjectId,
    /// Files and bytes this subtree adds to the base's.
    delta: (i64, i64),
}

const MEMO_MAGIC: &[u8; 8] = b"TINEMRGC";
const MEMO_VERSION: u32 = 2;
const MEMO_ENTRY: usize = 32 + 32 + 1 + 32 + 32 + 8 + 8;
/// Refuse memo files claiming more entries than this.
const MEMO_MAX: usize = 1 << 22;

/// Remembered merges of an overlay workspace's directories (`merge.cache`, see
/// docs/FORMAT.md): a directory whose upper layer is as it was at the last
/// snapshot, over the same base, merges to the same tree without reading any.
/// Disposable: anything wrong with it only costs time.
#[derive(Debug, Default)]
pub struct MergeMemo {
    entries: HashMap<Vec<u8>, Memo>,
    /// The change tracker's position when the upper layer was read.
    stamp: Option<Stamp>,
}

impl MergeMemo {
    /// Loads `path`, or nothing if it is missing, damaged, or from another gc generation.
    pub fn load(path: &Path, generation: u64) -> MergeMemo {
        let Ok(b) = std::fs::read(path) else {
            return MergeMemo::default();
        };
        Self::decode(&b, generation).unwrap_or_default()
    }

    fn decode(b: &[u8], generation: u64) -> Option<MergeMemo> {
        let (body, sum) = b.split_at_checked(b.len().checked_sub(32)?)?;
        if blake3::hash(body).as_bytes() != sum || body.get(..8)? != MEMO_MAGIC {
            return None;
        }
        let u32_at = |at: usize| Some(u32::from_le_bytes(body.get(at..at + 4)?.try_into().ok()?));
        let u64_at = |at: usize| Some(u64::from_le_bytes(body.get(at..at + 8)?.try_into().ok()?));
        if u32_at(8)? != MEMO_VERSION || u64_at(12)? != generation {
            return None;
        }
        let stamp = match *body.get(20)? {
            0 => None,
            1 => Some(Stamp {
                watch: u64_at(21)?,
                seq: u64_at(29)?,
            }),
            _ => return None,
        };
        let count = u32_at(37)? as usize;
        if count > MEMO_MAX {
            return None;
        }
        let mut at = 41;
        let mut entries = HashMap::with_capacity(count);
        for _ in 0..count {
            let len = u16::from_le_bytes(body.get(at..at + 2)?.try_into().ok()?) as usize;
            let path = body.get(at + 2..at + 2 + len)?.to_vec();
            at += 2 + len;
            let e = body.get(at..at + MEMO_ENTRY)?;
            let id = |o: usize| ObjectId::from_slice(&e[o..o + 32]);
            let memo = Memo {
                sig: e[..32].try_into().ok()?,
                upper: id(32)?,
                base: if e[64] == 1 { Some(id(65)?) } else { None },
                merged: id(97)?,
                delta: (
                    i64::from_le_bytes(e[129..137].try_into().ok()?),
                    i64::from_le_bytes(e[137..145].try_into().ok()?),
                ),
            };
            entries.insert(path, memo);
            at += MEMO_ENTRY;
        }
        (at == body.len()).then_some(MergeMemo { entries, stamp })
    }

    fn encode(&self, generation: u64) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.entries.len() * (MEMO_ENTRY + 32));
        b.extend_from_slice(MEMO_MAGIC);
        b.extend_from_slice(&MEMO_VERSION.to_le_bytes());
        b.extend_from_slice(&generation.to_le_bytes());
        match self.stamp {
            Some(st) => {
                b.push(1);
                b.extend_from_slice(&st.watch.to_le_bytes());
                b.extend_from_slice(&st.seq.to_le_bytes());
            }
            None => b.extend_from_slice(&[0; 17]),
        }
        b.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        let mut sorted: Vec<_> = self.entries.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(b.0));
        for (path, m) in sorted {
            b.extend_from_slice(&(path.len() as u16).to_le_bytes());
            b.extend_from_slice(path);
            b.extend_from_slice(&m.sig);
            b.extend_from_slice(m.upper.as_bytes());
            b.push(u8::from(m.base.is_some()));
            b.extend_from_slice(m.base.as_ref().map_or(&[0u8; 32], |x| x.as_bytes()));
            b.extend_from_slice(m.merged.as_bytes());
            b.extend_from_slice(&m.delta.0.to_le_bytes());
            b.extend_from_slice(&m.delta.1.to_le_bytes());
        }
        let sum = blake3::hash(&b);
        b.extend_from_slice(sum.as_bytes());
        b
    }

    /// Writes the memo (not fsynced: it is disposable).
    pub fn save(&self, path: &Path, generation: u64) -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, self.encode(generation))?;
        std::fs::rename(&tmp, path)
    }
}

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
    memo_in: &'a MergeMemo,
    /// Memos of this merge: what the next one may reuse.
    memo_out: MergeMemo,
    sigs: HashMap<Vec<u8>, [u8; 32]>,
    /// Where new trees go; `None` keeps them in `made` only.
    pack: Option<&'a PackBuilder<'a>>,
    made: HashMap<ObjectId, Tree>,
    upper: &'a Scan,
    whiteouts: HashMap<Vec<u8>, Vec<Vec<u8>>>,
    opaque: HashSet<Vec<u8>>,
    /// Directories the scan did not read (their trees are not in `upper.trees`).
    pruned: HashSet<Vec<u8>>,
    /// Directories merged from `memo_in`: their memos, and those below, carry over.
    hits: HashSet<Vec<u8>>,
    /// A directory that was not read had to be merged anew: where.
    stale: Option<Vec<u8>>,
    /// Change in files and bytes against the base.
    delta: (i64, i64),
}

impl<'a> Merge<'a> {
    fn new(
        repo: &'a Repository,
        pack: Option<&'a PackBuilder<'a>>,
        upper: &'a Scan,
        memo_in: &'a MergeMemo,
    ) -> Self {
        let mut whiteouts: HashMap<Vec<u8>, Vec<Vec<u8>>> = HashMap::new();
        for w in &upper.whiteouts {
            let (dir, name) = split(w);
            whiteouts
                .entry(dir.to_vec())
                .or_default()
                .push(name.to_vec());
        }
        let mut m = Merge {
            repo,
            memo_in,
            memo_out: MergeMemo::default(),
            sigs: HashMap::new(),
            pack,
            made: HashMap::new(),
            upper,
            whiteouts,
            opaque: upper.opaque_dirs.iter().cloned().collect(),
            pruned: upper.pruned.iter().cloned().collect(),
            hits: HashSet::new(),
            stale: None,
            delta: (0, 0),
        };
        m.sign(&[], &upper.root);
        m
    }

    /// The memos to keep: this merge's, and those below every directory it
    /// took from the last one.
    fn finish(&mut self) -> MergeMemo {
        let mut out = std::mem::take(&mut self.memo_out);
        if self.hits.contains(&b""[..]) {
            out.entries
                .extend(self.memo_in.entries.iter().map(|(k, v)| (k.clone(), *v)));
        } else if !self.hits.is_empty() {
            for (k, v) in &self.memo_in.entries {
                let under =
                    self.hits.contains(k) || inner_ancestors(k).any(|a| self.hits.contains(a));
                if under {
                    out.entries.entry(k.clone()).or_insert(*v);
                }
            }
        }
        out
    }

    /// Signs every upper directory: its tree id says nothing of the whiteouts
    /// and opaque marks in and below it, which a merge depends on too.
    fn sign(&mut self, rel: &[u8], upper: &ObjectId) -> [u8; 32] {
        if self.pruned.contains(rel) {
            // Not read: the tracker vouched that it is as the last merge saw it.
            let sig = match self.memo_in.entries.get(rel) {
                Some(m) if m.upper == *upper => m.sig,
                _ => {
                    self.stale.get_or_insert_with(|| rel.to_vec());
                    [0; 32]
                }
            };
            self.sigs.insert(rel.to_vec(), sig);
            return sig;
        }
        let mut h = blake3::Hasher::new();
        h.update(upper.as_bytes());
        h.update(&[u8::from(self.opaque.contains(rel))]);
        if let Some(w) = self.whiteouts.get(rel) {
            let mut w = w.clone();
            w.sort();
            for n in w {
                h.update(&(n.len() as u32).to_le_bytes());
                h.update(&n);
            }
        }
        let children: Vec<(Vec<u8>, ObjectId)> = self
            .upper
            .trees
            .get(upper)
            .map(|t| {
                t.entries
                    .iter()
                    .filter_map(|e| match &e.node {
                        Node::Dir { tree } => Some((e.name.clone(), *tree)),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        for (name, tree) in children {
            let sig = self.sign(&join(rel, &name), &tree);
            h.update(&(name.len() as u32).to_le_bytes());
            h.update(&name);
            h.update(&sig);
        }
        let sig = *h.finalize().as_bytes();
        self.sigs.insert(rel.to_vec(), sig);
        sig
    }

    /// The tree at `rel`: `base` with the upper directory `upper` applied.
    fn dir(
        &mut self,
        rel: &[u8],
        base: Option<&ObjectId>,
        upper: &ObjectId,
    ) -> Result<ObjectId, SnapshotError> {
        let sig = self.sigs.get(rel).copied().unwrap_or_default();
        if let Some(m) = self.memo_in.entries.get(rel)
            && m.sig == sig
            && m.base.as_ref() == base
        {
            self.hits.insert(rel.to_vec());
            self.delta.0 += m.delta.0;
            self.delta.1 += m.delta.1;
            return Ok(m.merged);
        }
        let before = self.delta;
        let id = self.dir_uncached(rel, base, upper)?;
        self.memo_out.entries.insert(
            rel.to_vec(),
            Memo {
                sig,
                upper: *upper,
                base: base.copied(),
                merged: id,
                delta: (self.delta.0 - before.0, self.delta.1 - before.1),
            },
        );
        Ok(id)
    }

    /// Counts `node`'s files and bytes into the delta, `sign` times.
    fn account(&mut self, node: &Node, sign: i64) -> Result<(), SnapshotError> {
        let (f, b) = entry_count(self.repo, node)?;
        self.delta.0 += sign * f;
        self.delta.1 += sign * b;
        Ok(())
    }

    fn dir_uncached(
        &mut self,
        rel: &[u8],
        base: Option<&ObjectId>,
        upper: &ObjectId,
    ) -> Result<ObjectId, SnapshotError> {
        let base_tree = match base {
            Some(b) if !self.opaque.contains(rel) => self.repo.read_tree(b)?,
            Some(b) => {
                // An opaque directory hides everything below it in the base.
                self.account(&Node::Dir { tree: *b }, -1)?;
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
                    self.account(&old.node, -1)?;
                }
            }
        }
        if self.pruned.contains(rel) {
            // Its remembered merge does not apply (another base): the upper
            // directory would have to be read after all.
            self.stale.get_or_insert_with(|| rel.to_vec());
        }
        let up = self.upper.trees.get(upper).cloned().unwrap_or_default();
        for mut e in up.entries {
            let sub = join(rel, &e.name);
            let old = entries.remove(&e.name);
            if let Node::Dir { tree } = &e.node {
                let base_sub = match old.as_ref().map(|o| &o.node) {
                    Some(Node::Dir { tree }) => Some(*tree),
                    Some(other) => {
                        self.account(other, -1)?;
                        None
                    }
                    None => None,
                };
                let merged = self.dir(&sub, base_sub.as_ref(), tree)?;
                e.node = Node::Dir { tree: merged };
            } else {
                if let Some(o) = &old {
                    self.account(&o.node, -1)?;
                }
                self.account(&e.node, 1)?;
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

/// The dirty set to trust, if `tracked` continues where `memo` left off.
fn trusted<'a>(tracked: Option<&'a Tracked>, memo: &MergeMemo) -> Option<&'a DirtySet> {
    let t = tracked?;
    (memo.stamp == Some(t.since))
        .then_some(t.dirty.as_ref())
        .flatten()
}

/// Reads the upper layer, skipping the directories the tracker vouches for
/// and the memo remembers.
fn scan_upper(
    upper: &Path,
    cache: &StatCache,
    memo_in: &MergeMemo,
    dirty: Option<&DirtySet>,
    sink: Option<&PackBuilder<'_>>,
    owners: Option<crate::IdMap>,
    progress: &dyn Progress,
) -> Result<Scan, SnapshotError> {
    let unchanged = |rel: &[u8], tree: &ObjectId| {
        dirty.is_some_and(|d| d.unchanged(rel))
            && memo_in.entries.get(rel).is_some_and(|m| m.upper == *tree)
    };
    Ok(scan(
        upper,
        ScanConfig {
            sink,
            cache,
            exclude: None,
            progress,
            keep_trees: true,
            overlay_upper: true,
            unchanged: dirty.map(|_| &unchanged as &Unchanged<'_>),
            owners,
        },
    )?)
}

fn stale(upper: &Path, m: &Merge<'_>) -> Result<(), SnapshotError> {
    match &m.stale {
        Some(rel) => Err(SnapshotError::TrackerStale {
            upper: upper.to_path_buf(),
            rel: String::from_utf8_lossy(rel).into_owned(),
        }),
        None => Ok(()),
    }
}

/// What a snapshot or read of an overlay workspace needs before it touches the
/// upper layer: the base, the stat cache and the merge memo. Loaded before a
/// live sandbox is frozen, so that the frozen window does not pay for it.
#[derive(Debug)]
pub struct Layered {
    /// The base snapshot (id, tree, files and bytes).
    base_info: Option<tine_store::SnapshotInfo>,
    upper: std::path::PathBuf,
    memo_path: std::path::PathBuf,
    cache_path: std::path::PathBuf,
    generation: u64,
    cache: StatCache,
    memo: MergeMemo,
    /// The sandbox's ID range: owners are recorded as it sees them.
    owners: Option<crate::IdMap>,
}

impl Layered {
    /// The workspace whose lower layer was materialized from snapshot `base`,
    /// with upper layer `upper` and merge memo file `memo`; `owners`: the
    /// ID range of the sandbox whose files these are.
    pub fn load(
        repo: &Repository,
        base: Option<&ObjectId>,
        upper: &Path,
        memo: &Path,
        owners: Option<crate::IdMap>,
    ) -> Result<Layered, SnapshotError> {
        let base_info = match base {
            Some(b) => Some(
                repo.snapshot_info(b)?
                    .ok_or(tine_store::ObjectError::Missing { id: *b })?,
            ),
            None => None,
        };
        let generation = repo.gc_generation()?;
        let cache_path = cache_path(repo, upper);
        Ok(Layered {
            base_info,
            upper: upper.to_path_buf(),
            memo_path: memo.to_path_buf(),
            cache: StatCache::load(&cache_path, repo.repo_id(), generation),
            cache_path,
            generation,
            memo: MergeMemo::load(memo, generation),
            owners,
        })
    }

    fn base_tree(&self) -> Option<ObjectId> {
        self.base_info.as_ref().map(|i| i.tree)
    }

    /// Reads the upper layer as `tracked` allows.
    fn scan(
        &self,
        tracked: Option<&Tracked>,
        sink: Option<&PackBuilder<'_>>,
        progress: &dyn Progress,
    ) -> Result<Scan, SnapshotError> {
        let empty = StatCache::default();
        let cache = match tracked {
            Some(t) if t.rehash => &empty,
            _ => &self.cache,
        };
        scan_upper(
            &self.upper,
            cache,
            &self.memo,
            trusted(tracked, &self.memo),
            sink,
            self.owners,
            progress,
        )
    }
}

/// Snapshots an overlay workspace (see [`Layered`]). `after_scan` runs as
/// soon as the upper layer has been read — a live sandbox is thawed there,
/// before the pack is made durable; it returns false when the workspace may
/// have changed during the read, and then nothing is stored
/// ([`SnapshotError::Interfered`]). `key` names the workspace's head. With
/// `tracked`, only the directories it names as changed are read; if that
/// proves insufficient the error is [`SnapshotError::TrackerStale`] (nothing
/// is stored) and the caller takes the snapshot again without it. New
/// objects go to `pack`, made by the caller (`lock.pack()`, before freezing
/// anything: creating its file can take a millisecond).
#[allow(clippy::too_many_arguments)]
pub fn snapshot_layered<'r>(
    lock: &WriteLock<'r>,
    pack: PackBuilder<'r>,
    ws: &Layered,
    key: &str,
    tracked: Option<&Tracked>,
    opts: &SnapshotOptions,
    after_scan: impl FnOnce() -> bool,
    progress: &dyn Progress,
) -> Result<SnapshotOutcome, SnapshotError> {
    let repo = lock.repo();
    repo.check_new_tags(&opts.tags, opts.force_tags)?;
    let scanned = ws.scan(tracked, Some(&pack), progress);
    if !after_scan() {
        return Err(SnapshotError::Interfered {
            upper: ws.upper.clone(),
        });
    }
    let mut s = scanned?;
    if !s.pruned.is_empty() {
        crate::scan::carry_over(&ws.cache, &s.pruned, &mut s.cache);
    }
    let mut m = Merge::new(repo, Some(&pack), &s, &ws.memo);
    let tree = m.dir(&[], ws.base_tree().as_ref(), &s.root)?;
    stale(&ws.upper, &m)?;
    let mut memo_out = m.finish();
    memo_out.stamp = tracked.map(|t| t.now);
    let (files, bytes) = match &ws.base_info {
        Some(i) => (
            (i.files as i64 + m.delta.0).max(0) as u64,
            (i.bytes as i64 + m.delta.1).max(0) as u64,
        ),
        None => (m.delta.0.max(0) as u64, m.delta.1.max(0) as u64),
    };
    // Parents given (a build step's: the step before) are taken as they are.
    let parents: Vec<ObjectId> = match &opts.parents {
        Some(p) => p.clone(),
        None => repo
            .head(key)?
            .or(ws.base_info.as_ref().map(|i| i.id))
            .into_iter()
            .collect(),
    };
    let parent = parents.first().copied();
    let attachments = crate::ops::store_attachments(opts, &pack)?;
    let commit = lock.commit(
        pack,
        Some(NewSnapshot {
            tree,
            parents,
            message: opts.message.clone(),
            source: key.to_string(),
            tags: opts.tags.clone(),
            attachments,
            files,
            bytes,
            head: (!opts.detached).then(|| key.to_string()),
            force_tags: opts.force_tags,
        }),
    )?;
    // Only now do the memo's trees exist in the repository. The stat cache goes
    // first: the memo's stamp is what lets the next snapshot trust both.
    let _ = std::fs::remove_file(&ws.memo_path);
    if let Ok(p) = StatCache::write_pending(
        &ws.cache_path,
        &s.cache.encode(repo.repo_id(), ws.generation, &ws.upper),
    ) && p.persist().is_ok()
    {
        let _ = memo_out.save(&ws.memo_path, ws.generation);
    }
    Ok(SnapshotOutcome {
        id: commit.snapshot.expect("commit with a snapshot"),
        tree,
        parent,
        source: ws.upper.clone(),
        stats: s.stats,
        commit,
        warnings: s.warnings,
    })
}

/// The tree of an overlay workspace as it is now, without storing anything:
/// its root id and the trees that are not in the repository (for a restore
/// that must know what is there without walking the whole workspace).
/// `tracked` as for [`snapshot_layered`].
pub fn layered_tree(
    repo: &Repository,
    ws: &Layered,
    tracked: Option<&Tracked>,
    progress: &dyn Progress,
) -> Result<(ObjectId, HashMap<ObjectId, Tree>), SnapshotError> {
    let s = ws.scan(tracked, None, progress)?;
    // Memoized trees were stored by a snapshot; new ones live in `made` only, so
    // this merge's memos are not saved.
    let mut m = Merge::new(repo, None, &s, &ws.memo);
    let root = m.dir(&[], ws.base_tree().as_ref(), &s.root)?;
    stale(&ws.upper, &m)?;
    Ok((root, m.made))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dirty_set_names_changed_directories_their_ancestors_and_what_is_below_trees() {
        let d = DirtySet::new([b"a/b".to_vec()], [b"n".to_vec(), Vec::new()]);
        // Changed, and the ancestors of what changed.
        for rel in [&b"a/b"[..], b"a", b""] {
            assert!(!d.unchanged(rel), "{rel:?}");
        }
        // A new tree and everything below it.
        for rel in [&b"n"[..], b"n/x", b"n/x/y"] {
            assert!(!d.unchanged(rel), "{rel:?}");
        }
        // The root read whole does not cover every directory below it.
        for rel in [&b"c"[..], b"a/c", b"nn", b"a/b2"] {
            assert!(d.unchanged(rel), "{rel:?}");
        }
    }

    #[test]
    fn memo_round_trips_and_anything_wrong_loads_as_empty() {
        let id = |b: u8| ObjectId::compute(Kind::Blob, &[b]);
        let mut m = MergeMemo {
            stamp: Some(Stamp { watch: 9, seq: 11 }),
            ..Default::default()
        };
        for (p, base) in [(&b""[..], None), (&b"a/b"[..], Some(id(2)))] {
            m.entries.insert(
                p.to_vec(),
                Memo {
                    sig: [7; 32],
                    upper: id(1),
                    base,
                    merged: id(3),
                    delta: (-2, 4096),
                },
            );
        }
        let bytes = m.encode(5);
        let back = MergeMemo::decode(&bytes, 5).unwrap();
        assert_eq!(back.entries, m.entries);
        assert_eq!(back.stamp, m.stamp);
        // Another gc generation, a flipped byte, a truncation: all ignored.
        assert!(MergeMemo::decode(&bytes, 6).is_none());
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 1;
            assert!(MergeMemo::decode(&b, 5).is_none(), "flip at {i}");
        }
        assert!(MergeMemo::decode(&bytes[..bytes.len() - 1], 5).is_none());
    }
}
