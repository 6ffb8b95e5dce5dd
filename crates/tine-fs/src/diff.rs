//! Comparing trees: stored snapshots with each other or with a scanned directory.

use std::borrow::Cow;
use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use tine_store::{Content, Node, ObjectError, ObjectId, Repository, Tree, TreeEntry};

use crate::paths::join;

/// Loads trees from an in-memory overlay (a fresh scan) or the repository.
#[derive(Debug, Clone, Copy)]
pub struct Trees<'a> {
    pub repo: &'a Repository,
    pub overlay: Option<&'a HashMap<ObjectId, Tree>>,
}

impl<'a> Trees<'a> {
    pub fn new(repo: &'a Repository, overlay: Option<&'a HashMap<ObjectId, Tree>>) -> Self {
        Trees { repo, overlay }
    }

    pub fn load(&self, id: &ObjectId) -> Result<Cow<'a, Tree>, ObjectError> {
        if let Some(t) = self.overlay.and_then(|o| o.get(id)) {
            return Ok(Cow::Borrowed(t));
        }
        Ok(Cow::Owned(self.repo.read_tree(id)?))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    Added,
    Deleted,
    Modified,
    TypeChanged,
    ModeChanged,
}

impl ChangeKind {
    /// One-letter code, as in `git diff --name-status`.
    pub fn letter(self) -> char {
        match self {
            ChangeKind::Added => 'A',
            ChangeKind::Deleted => 'D',
            ChangeKind::Modified => 'M',
            ChangeKind::TypeChanged => 'T',
            ChangeKind::ModeChanged => 'P',
        }
    }
}

/// One side of a change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct EntryInfo {
    #[serde(rename = "type")]
    pub kind: tine_store::EntryKind,
    pub mode: u32,
    /// Its owner inside the sandbox, where the snapshot records one.
    #[serde(default, skip_serializing_if = "is_root")]
    pub owner: tine_store::Owner,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

fn is_root(o: &tine_store::Owner) -> bool {
    o.is_root()
}

impl EntryInfo {
    pub fn of(e: &TreeEntry) -> EntryInfo {
        let (size, content, target) = match &e.node {
            Node::File { content, size } => (Some(*size), Some(*content), None),
            Node::Dir { .. } => (None, None, None),
            Node::Symlink { target } => (
                None,
                None,
                Some(String::from_utf8_lossy(target).into_owned()),
            ),
        };
        EntryInfo {
            kind: e.node.kind(),
            mode: e.mode,
            owner: e.owner,
            size,
            content,
            target,
        }
    }
}

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Change {
    pub path: String,
    #[serde(skip)]
    pub raw_path: Vec<u8>,
    pub kind: ChangeKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub old: Option<EntryInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new: Option<EntryInfo>,
}

/// Merge-joins two sorted entry lists.
pub(crate) fn pair_up<'t>(
    a: &'t [TreeEntry],
    b: &'t [TreeEntry],
) -> Vec<(Option<&'t TreeEntry>, Option<&'t TreeEntry>)> {
    let (mut i, mut j) = (0, 0);
    let mut out = Vec::with_capacity(a.len().max(b.len()));
    while i < a.len() || j < b.len() {
        match (a.get(i), b.get(j)) {
            (Some(x), Some(y)) if x.name == y.name => {
                out.push((Some(x), Some(y)));
                i += 1;
                j += 1;
            }
            (Some(x), Some(y)) if x.name < y.name => {
                out.push((Some(x), None));
                i += 1;
            }
            (Some(x), None) => {
                out.push((Some(x), None));
                i += 1;
            }
            (_, Some(y)) => {
                out.push((None, Some(y)));
                j += 1;
            }
            (None, None) => unreachable!(),
        }
    }
    out
}

/// Every file-level change from tree `a` to tree `b`, sorted by path.
pub fn diff_trees(
    trees: &Trees<'_>,
    a: &ObjectId,
    b: &ObjectId,
) -> Result<Vec<Change>, ObjectError> {
    let mut out = Vec::new();
    diff_dir(trees, Some(a), Some(b), &[], &mut out)?;
    Ok(out)
}

fn diff_dir(
    trees: &Trees<'_>,
    a: Option<&ObjectId>,
    b: Option<&ObjectId>,
    prefix: &[u8],
    out: &mut Vec<Change>,
) -> Result<(), ObjectError> {
    if a == b {
        return Ok(());
    }
    let ta = a.map(|id| trees.load(id)).transpose()?;
    let tb = b.map(|id| trees.load(id)).transpose()?;
    let empty = Tree::default();
    let ea = ta.as_deref().unwrap_or(&empty);
    let eb = tb.as_deref().unwrap_or(&empty);
    for (x, y) in pair_up(&ea.entries, &eb.entries) {
        let name = x.or(y).map(|e| e.name.as_slice()).unwrap_or_default();
        let path = join(prefix, name);
        match (x, y) {
            (Some(x), Some(y)) => match (&x.node, &y.node) {
                (Node::Dir { tree: ta }, Node::Dir { tree: tb }) => {
                    if x.mode != y.mode || x.owner != y.owner {
                        push(out, &path, ChangeKind::ModeChanged, Some(x), Some(y));
                    }
                    diff_dir(trees, Some(ta), Some(tb), &path, out)?;
                }
                (
                    Node::File {
                        content: ca,
                        size: sa,
                    },
                    Node::File {
                        content: cb,
                        size: sb,
                    },
                ) => {
                    if ca.id != cb.id || sa != sb {
                        push(out, &path, ChangeKind::Modified, Some(x), Some(y));
                    } else if x.mode != y.mode || x.owner != y.owner {
                        push(out, &path, ChangeKind::ModeChanged, Some(x), Some(y));
                    }
                }
                (Node::Symlink { target: a }, Node::Symlink { target: b }) => {
                    if a != b {
                        push(out, &path, ChangeKind::Modified, Some(x), Some(y));
                    } else if x.owner != y.owner {
                        push(out, &path, ChangeKind::ModeChanged, Some(x), Some(y));
                    }
                }
                _ => {
                    if matches!(x.node, Node::Dir { .. }) || matches!(y.node, Node::Dir { .. }) {
                        removed_or_added(trees, x, &path, ChangeKind::Deleted, out)?;
                        removed_or_added(trees, y, &path, ChangeKind::Added, out)?;
                    } else {
                        push(out, &path, ChangeKind::TypeChanged, Some(x), Some(y));
                    }
                }
            },
            (Some(x), None) => removed_or_added(trees, x, &path, ChangeKind::Deleted, out)?,
            (None, Some(y)) => removed_or_added(trees, y, &path, ChangeKind::Added, out)?,
            (None, None) => {}
        }
    }
    Ok(())
}

fn removed_or_added(
    trees: &Trees<'_>,
    e: &TreeEntry,
    path: &[u8],
    kind: ChangeKind,
    out: &mut Vec<Change>,
) -> Result<(), ObjectError> {
    if let Node::Dir { tree } = &e.node {
        let t = trees.load(tree)?;
        if t.entries.is_empty() {
            let (o, n) = if kind == ChangeKind::Added {
                (None, Some(e))
            } else {
                (Some(e), None)
            };
            push(out, path, kind, o, n);
        }
        for c in &t.entries {
            removed_or_added(trees, c, &join(path, &c.name), kind, out)?;
        }
        return Ok(());
    }
    let (o, n) = if kind == ChangeKind::Added {
        (None, Some(e))
    } else {
        (Some(e), None)
    };
    push(out, path, kind, o, n);
    Ok(())
}

fn push(
    out: &mut Vec<Change>,
    path: &[u8],
    kind: ChangeKind,
    old: Option<&TreeEntry>,
    new: Option<&TreeEntry>,
) {
    out.push(Change {
        path: String::from_utf8_lossy(path).into_owned(),
        raw_path: path.to_vec(),
        kind,
        old: old.map(EntryInfo::of),
        new: new.map(EntryInfo::of),
    });
}

/// Largest file shown as a text diff.
pub const MAX_TEXT_DIFF: usize = 8 << 20;

fn is_text(b: &[u8]) -> bool {
    !b[..b.len().min(8192)].contains(&0) && std::str::from_utf8(b).is_ok()
}

/// A unified diff of two versions of a file, or a one-line note when it is not text.
pub fn text_diff(path: &str, old: Option<&[u8]>, new: Option<&[u8]>) -> String {
    let (o, n) = (old.unwrap_or_default(), new.unwrap_or_default());
    if o.len() > MAX_TEXT_DIFF || n.len() > MAX_TEXT_DIFF {
        return format!("Large file {path} differs (not shown)\n");
    }
    if !is_text(o) || !is_text(n) {
        return format!("Binary file {path} differs\n");
    }
    let (os, ns) = (
        std::str::from_utf8(o).unwrap_or(""),
        std::str::from_utf8(n).unwrap_or(""),
    );
    let a = if old.is_some() {
        format!("a/{path}")
    } else {
        "/dev/null".into()
    };
    let b = if new.is_some() {
        format!("b/{path}")
    } else {
        "/dev/null".into()
    };
    similar::TextDiff::from_lines(os, ns)
        .unified_diff()
        .context_radius(3)
        .header(&a, &b)
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_diff_shows_changed_lines() {
        let d = text_diff("f.txt", Some(b"a\nb\nc\n"), Some(b"a\nB\nc\n"));
        assert!(d.contains("-b\n") && d.contains("+B\n"), "{d}");
        assert!(d.contains("--- a/f.txt"));
        assert_eq!(
            text_diff("x", Some(b"\0\x01"), Some(b"y")),
            "Binary file x differs\n"
        );
    }
}
