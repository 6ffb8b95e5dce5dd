//! Three-way merge of two snapshots against their common ancestor.
//!
//! The result starts as `ours` (restored into the target directory); every
//! change `theirs` made since the base is then brought in, path by path.
//! Where both sides changed a path differently: text files are merged line
//! by line (conflicting hunks get markers); binary files, modes, a delete
//! against a modify, a file against a directory and other type changes are
//! reported as conflicts and never silently resolved (the target keeps ours,
//! or the modified side of a delete/modify). The result is snapshotted with
//! both snapshots as parents.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde::Serialize;
use tine_store::{
    EntryKind, ErrorKind, HasKind, ObjectError, ObjectId, Progress, Repository, WriteLock,
};

use crate::diff::{Change, EntryInfo, Trees, diff_trees};

#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    #[error(transparent)]
    Object(#[from] ObjectError),
    #[error(transparent)]
    Restore(#[from] crate::RestoreError),
    #[error(transparent)]
    Snapshot(#[from] crate::SnapshotError),
    #[error("merge into {}: the directory is not empty; give a new or empty one", dir.display())]
    NotEmpty { dir: PathBuf },
    #[error("merge into {}: {step} {}: {source}", dir.display(), path.display())]
    Io {
        dir: PathBuf,
        step: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

impl HasKind for MergeError {
    fn kind(&self) -> ErrorKind {
        match self {
            MergeError::Object(e) => e.kind(),
            MergeError::Restore(e) => e.kind(),
            MergeError::Snapshot(e) => e.kind(),
            MergeError::NotEmpty { .. } => ErrorKind::AlreadyExists,
            MergeError::Io { .. } => ErrorKind::Io,
        }
    }
}

/// What kind of disagreement a conflict is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ConflictKind {
    /// Both changed the same lines of a text file: markers written.
    Content,
    /// Both changed a binary file: ours kept.
    Binary,
    /// Both changed the mode, differently: ours kept.
    Mode,
    /// One deleted what the other modified: the modified one kept.
    DeleteModify,
    /// One has a file (or symlink) where the other has a directory: ours kept.
    FileDirectory,
    /// Both changed an entry's type, or its symlink target, differently: ours kept.
    Type,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Conflict {
    pub path: String,
    pub kind: ConflictKind,
}

/// What a merge did.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct MergeOutcome {
    /// The common ancestor (none: the two share no history; an empty tree
    /// stands in for it).
    pub base: Option<ObjectId>,
    pub ours: ObjectId,
    pub theirs: ObjectId,
    /// The merge snapshot (parents: ours, theirs).
    pub snapshot: ObjectId,
    pub target: PathBuf,
    /// Paths taken from theirs as they are.
    pub taken: usize,
    /// Text files both changed, merged line by line without conflict.
    pub merged: usize,
    pub conflicts: Vec<Conflict>,
}

/// The nearest common ancestor of snapshots `a` and `b` in the snapshot
/// graph (fewest steps from both), if they share one.
pub fn common_ancestor(
    repo: &Repository,
    a: &ObjectId,
    b: &ObjectId,
) -> Result<Option<ObjectId>, ObjectError> {
    let depths = |start: &ObjectId| -> Result<HashMap<ObjectId, usize>, ObjectError> {
        let mut seen = HashMap::new();
        let mut queue = VecDeque::from([(*start, 0usize)]);
        while let Some((id, d)) = queue.pop_front() {
            if seen.contains_key(&id) {
                continue;
            }
            seen.insert(id, d);
            // A pruned ancestor ends the walk there.
            match repo.read_snapshot(&id) {
                Ok(s) => queue.extend(s.parents.into_iter().map(|p| (p, d + 1))),
                Err(ObjectError::Missing { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(seen)
    };
    let da = depths(a)?;
    let db = depths(b)?;
    Ok(da
        .iter()
        .filter_map(|(id, x)| db.get(id).map(|y| (x + y, *id)))
        .min_by_key(|(d, id)| (*d, *id))
        .map(|(_, id)| id))
}

/// Changes by their path.
fn by_path(changes: &[Change]) -> BTreeMap<&[u8], &Change> {
    changes.iter().map(|c| (c.raw_path.as_slice(), c)).collect()
}

/// Whether a side has something (new) below `path`: it made it a directory.
fn has_below(changes: &BTreeMap<&[u8], &Change>, path: &[u8]) -> bool {
    let prefix = [path, b"/"].concat();
    changes
        .range(prefix.as_slice()..)
        .take_while(|(k, _)| k.starts_with(&prefix))
        .any(|(_, c)| c.new.is_some())
}

fn is_binary(data: &[u8]) -> bool {
    data.contains(&0)
}

/// Two sides agree on a change (same result).
fn same(x: &Change, y: &Change) -> bool {
    x.new == y.new
}

/// Merges snapshot `theirs` into `ours` against `base` (default: their
/// common ancestor), writing the result into `dir` (new or empty) and
/// snapshotting it with both as parents.
pub fn merge(
    lock: &WriteLock<'_>,
    ours: &ObjectId,
    theirs: &ObjectId,
    base: Option<&ObjectId>,
    dir: &Path,
    message: &str,
    progress: &dyn Progress,
) -> Result<MergeOutcome, MergeError> {
    let repo = lock.repo();
    let target = Target { repo, dir };
    if let Ok(mut rd) = std::fs::read_dir(dir)
        && rd.next().is_some()
    {
        return Err(MergeError::NotEmpty {
            dir: dir.to_path_buf(),
        });
    }
    let base = match base {
        Some(b) => Some(*b),
        None => common_ancestor(repo, ours, theirs)?,
    };
    let tree_of =
        |s: &ObjectId| -> Result<ObjectId, ObjectError> { Ok(repo.read_snapshot(s)?.tree) };
    let (t_ours, t_theirs) = (tree_of(ours)?, tree_of(theirs)?);
    // No shared history: an empty tree (never stored) is the base.
    let empty = tine_store::Tree::default();
    let empty_id = ObjectId::compute(tine_store::Kind::Tree, &empty.encode());
    let overlay = HashMap::from([(empty_id, empty)]);
    let t_base = match &base {
        Some(b) => tree_of(b)?,
        None => empty_id,
    };
    let trees = Trees::new(repo, Some(&overlay));
    let ours_list = diff_trees(&trees, &t_base, &t_ours)?;
    let theirs_changes = diff_trees(&trees, &t_base, &t_theirs)?;
    let ours_changes = by_path(&ours_list);
    let theirs_paths = by_path(&theirs_changes);
    std::fs::create_dir_all(dir).map_err(target.err("create", dir))?;
    // Modes as stored, set-user-ID bits included: the directory becomes a
    // snapshot, which must hold what both sides held (theirs' files are
    // written with their modes too).
    crate::restore_with(lock, ours, dir, crate::RestoreOptions::FAITHFUL, progress)?;
    // Paths ours turned into something other than a directory (a path of
    // theirs below one cannot be brought in).
    let ours_non_dirs: HashSet<&[u8]> = ours_changes
        .values()
        .filter(|c| c.new.as_ref().is_some_and(|n| n.kind != EntryKind::Dir))
        .map(|c| c.raw_path.as_slice())
        .collect();
    let mut out = MergeOutcome {
        base,
        ours: *ours,
        theirs: *theirs,
        snapshot: *ours,
        target: dir.to_path_buf(),
        taken: 0,
        merged: 0,
        conflicts: Vec::new(),
    };
    let conflict = |out: &mut MergeOutcome, c: &Change, kind| {
        out.conflicts.push(Conflict {
            path: c.path.clone(),
            kind,
        })
    };
    // Directories holding what was taken from theirs: those new to ours get
    // theirs' mode (a new directory with files is not a change of its own).
    let mut made_in: std::collections::BTreeSet<Vec<u8>> = Default::default();
    // And those that held what theirs deleted: gone when theirs has them no
    // more and nothing is left in them (a deleted directory with files is
    // not a change of its own either).
    let mut emptied: std::collections::BTreeSet<Vec<u8>> = Default::default();
    for t in &theirs_changes {
        let path = dir.join(OsStr::from_bytes(&t.raw_path));
        let under_ours_file =
            crate::paths::inner_ancestors(&t.raw_path).any(|a| ours_non_dirs.contains(a));
        let ours_below = has_below(&ours_changes, &t.raw_path);
        let Some(o) = ours_changes.get(t.raw_path.as_slice()) else {
            if under_ours_file
                || (ours_below && t.new.as_ref().is_some_and(|n| n.kind != EntryKind::Dir))
            {
                conflict(&mut out, t, ConflictKind::FileDirectory);
                continue;
            }
            target.apply(&path, t.new.as_ref())?;
            out.taken += 1;
            let parents = crate::paths::inner_ancestors(&t.raw_path).map(<[u8]>::to_vec);
            if t.new.is_some() {
                made_in.extend(parents);
            } else {
                emptied.extend(parents);
            }
            continue;
        };
        if same(o, t) {
            continue;
        }
        match (&o.new, &t.new) {
            (None, Some(_)) if ours_below => {
                // Ours made it a directory: that stays.
                conflict(&mut out, t, ConflictKind::FileDirectory);
            }
            (Some(_), None) if has_below(&theirs_paths, &t.raw_path) => {
                conflict(&mut out, t, ConflictKind::FileDirectory);
            }
            (None, Some(_)) | (Some(_), None) => {
                // The modified side stays (ours already is there when it is ours).
                if o.new.is_none() {
                    target.apply(&path, t.new.as_ref())?;
                }
                conflict(&mut out, t, ConflictKind::DeleteModify);
            }
            (Some(on), Some(tn)) => {
                if on.kind != tn.kind {
                    let kind = if on.kind == EntryKind::Dir || tn.kind == EntryKind::Dir {
                        ConflictKind::FileDirectory
                    } else {
                        ConflictKind::Type
                    };
                    conflict(&mut out, t, kind);
                    continue;
                }
                let mode = match (o.old.as_ref().map(|e| e.mode), on.mode, tn.mode) {
                    (_, a, b) if a == b => Some(a),
                    (Some(base), a, b) if a == base => Some(b),
                    (Some(base), a, b) if b == base => Some(a),
                    _ => None,
                };
                let Some(mode) = mode else {
                    conflict(&mut out, t, ConflictKind::Mode);
                    continue;
                };
                match (on.content, tn.content) {
                    (Some(oc), Some(tc)) if oc.id != tc.id => {
                        let theirs_data = crate::read_content(repo, &tc)?;
                        let ours_data = crate::read_content(repo, &oc)?;
                        let base_data = match o.old.as_ref().and_then(|e| e.content) {
                            Some(bc) => crate::read_content(repo, &bc)?,
                            None => Vec::new(),
                        };
                        if [&base_data, &ours_data, &theirs_data]
                            .iter()
                            .any(|d| is_binary(d))
                        {
                            conflict(&mut out, t, ConflictKind::Binary);
                            continue;
                        }
                        let merged = diffy::merge_bytes(&base_data, &ours_data, &theirs_data);
                        let (data, clean) = match merged {
                            Ok(d) => (d, true),
                            Err(d) => (d, false),
                        };
                        target.write_file(&path, &data, mode)?;
                        if clean {
                            out.merged += 1;
                        } else {
                            conflict(&mut out, t, ConflictKind::Content);
                        }
                    }
                    (Some(_), Some(_)) => {
                        // Same content, modes merged above.
                        target.set_mode(&path, mode)?;
                    }
                    _ => {
                        // Symlinks whose targets differ (same ones are `same`).
                        if on.target != tn.target {
                            conflict(&mut out, t, ConflictKind::Type);
                        }
                    }
                }
            }
            (None, None) => {}
        }
    }
    for d in emptied.iter().rev() {
        if entry_at(&trees, &t_theirs, d)?.is_none() {
            // Not empty: ours (or a conflict) keeps something there.
            let _ = std::fs::remove_dir(dir.join(OsStr::from_bytes(d)));
        }
    }
    for d in &made_in {
        // Ours without a directory there (nothing, or a link or file theirs
        // replaced): the directory was made for theirs.
        if entry_at(&trees, &t_ours, d)?
            .is_none_or(|o| !matches!(o.node, tine_store::Node::Dir { .. }))
            && let Some(e) = entry_at(&trees, &t_theirs, d)?
        {
            target.set_mode(&dir.join(OsStr::from_bytes(d)), e.mode)?;
        }
    }
    let opts = crate::SnapshotOptions {
        message: message.to_string(),
        parents: Some(vec![*ours, *theirs]),
        ..Default::default()
    };
    out.snapshot = crate::snapshot(lock, dir, &opts, progress)?.id;
    Ok(out)
}

/// The entry at `path` in tree `root`, if there is one.
fn entry_at(
    trees: &Trees<'_>,
    root: &ObjectId,
    path: &[u8],
) -> Result<Option<tine_store::TreeEntry>, ObjectError> {
    let mut tree = *root;
    let mut parts = path.split(|b| *b == b'/').peekable();
    while let Some(name) = parts.next() {
        let t = trees.load(&tree)?;
        let Some(e) = t.entries.iter().find(|e| e.name == name) else {
            return Ok(None);
        };
        if parts.peek().is_none() {
            return Ok(Some(e.clone()));
        }
        match &e.node {
            tine_store::Node::Dir { tree: sub } => tree = *sub,
            _ => return Ok(None),
        }
    }
    Ok(None)
}

/// The directory a merge writes, and what it writes there.
struct Target<'a> {
    repo: &'a Repository,
    dir: &'a Path,
}

impl Target<'_> {
    fn err<'p>(
        &self,
        step: &'static str,
        path: &'p Path,
    ) -> impl FnOnce(std::io::Error) -> MergeError + 'p {
        let dir = self.dir.to_path_buf();
        move |source| MergeError::Io {
            dir,
            step,
            path: path.to_path_buf(),
            source,
        }
    }

    fn set_mode(&self, path: &Path, mode: u32) -> Result<(), MergeError> {
        use std::os::unix::fs::PermissionsExt;
        // chmod follows links; the merge never changes what one points at.
        if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
            return Ok(());
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o7777))
            .map_err(self.err("chmod", path))
    }

    fn make_parent(&self, path: &Path) -> Result<(), MergeError> {
        match path.parent() {
            Some(parent) => std::fs::create_dir_all(parent).map_err(self.err("create", parent)),
            None => Ok(()),
        }
    }

    fn write_file(&self, path: &Path, data: &[u8], mode: u32) -> Result<(), MergeError> {
        self.make_parent(path)?;
        // A symlink or directory in the way is replaced, never written through.
        if let Ok(m) = std::fs::symlink_metadata(path)
            && !m.is_file()
        {
            self.remove(path)?;
        }
        std::fs::write(path, data).map_err(self.err("write", path))?;
        self.set_mode(path, mode)
    }

    fn remove(&self, path: &Path) -> Result<(), MergeError> {
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(path).map_err(self.err("remove", path)),
            Ok(_) => std::fs::remove_file(path).map_err(self.err("remove", path)),
            Err(_) => Ok(()),
        }
    }

    /// Makes `path` what `entry` says (removes it for none).
    fn apply(&self, path: &Path, entry: Option<&EntryInfo>) -> Result<(), MergeError> {
        // Every parent must be a real directory inside the target (no symlink).
        let rel = path.strip_prefix(self.dir).unwrap_or(path);
        let mut cur = self.dir.to_path_buf();
        for c in rel.parent().into_iter().flat_map(|p| p.components()) {
            cur.push(c);
            if let Ok(m) = std::fs::symlink_metadata(&cur)
                && !m.is_dir()
            {
                self.remove(&cur)?;
            }
        }
        let Some(e) = entry else {
            return self.remove(path);
        };
        match e.kind {
            EntryKind::Dir => {
                // A link there would be followed by the mkdir and the chmod.
                if std::fs::symlink_metadata(path).is_ok_and(|m| !m.is_dir()) {
                    self.remove(path)?;
                }
                std::fs::create_dir_all(path).map_err(self.err("create", path))?;
                self.set_mode(path, e.mode)
            }
            EntryKind::Symlink => {
                self.remove(path)?;
                self.make_parent(path)?;
                std::os::unix::fs::symlink(e.target.as_deref().unwrap_or_default(), path)
                    .map_err(self.err("symlink", path))
            }
            _ => {
                let data = match &e.content {
                    Some(c) => crate::read_content(self.repo, c)?,
                    None => Vec::new(),
                };
                self.write_file(path, &data, e.mode)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_is_told_by_a_nul_byte() {
        assert!(is_binary(b"a\0b"));
        assert!(!is_binary("héllo\n".as_bytes()));
    }
}
