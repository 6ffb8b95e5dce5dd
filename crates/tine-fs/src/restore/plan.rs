//! A restore's plan: the operations that take a target from what it holds
//! to a snapshot's tree, found by descending only where tree ids differ.

use super::*;

#[derive(Debug, Clone)]
pub(super) enum Op {
    /// Remove an entry the target has and the snapshot does not (a directory
    /// recursively, but only what the scan saw: ignored files stay).
    Remove {
        path: Vec<u8>,
        current: TreeEntry,
    },
    Mkdir {
        path: Vec<u8>,
        owner: Owner,
    },
    /// Create a symlink, replacing whatever is at its path.
    Symlink {
        path: Vec<u8>,
        target: Vec<u8>,
        owner: Owner,
    },
    Write {
        path: Vec<u8>,
        content: Content,
        size: u64,
        mode: u32,
        existing: bool,
        owner: Owner,
    },
    /// Give an entry that stays its recorded owner, then its mode again (a
    /// `chown` clears set-user-ID bits).
    Chown {
        path: Vec<u8>,
        owner: Owner,
        mode: u32,
        dir: bool,
    },
    Chmod {
        path: Vec<u8>,
        mode: u32,
        dir: bool,
    },
}

#[derive(Debug, Default)]
pub(super) struct Plan {
    pub(super) ops: Vec<Op>,
    pub(super) added: u64,
    pub(super) modified: u64,
    pub(super) deleted: u64,
    pub(super) mode_changed: u64,
    pub(super) owner_changed: u64,
    pub(super) opts: RestoreOptions,
    /// Files whose set-user-ID or set-group-ID bits are not given.
    pub(super) setid_dropped: Vec<Vec<u8>>,
}

impl Plan {
    pub(super) fn sync(
        &mut self,
        trees: &Trees<'_>,
        cur: Option<&ObjectId>,
        tgt: &ObjectId,
        prefix: &[u8],
    ) -> Result<(), RestoreError> {
        if cur == Some(tgt) {
            return Ok(());
        }
        if crate::paths::depth(prefix) > crate::paths::MAX_DEPTH {
            return Err(RestoreError::TooDeep {
                path: String::from_utf8_lossy(prefix).into_owned(),
            });
        }
        let ct = cur.map(|c| trees.load(c)).transpose()?;
        let tt = trees.load(tgt)?;
        let empty = Tree::default();
        let ce = ct.as_deref().unwrap_or(&empty);
        // Removals first so that a name can change type.
        let pairs = pair_up(&ce.entries, &tt.entries);
        for (c, t) in &pairs {
            if let Some(c) = c {
                let same_type = t.is_some_and(|t| {
                    std::mem::discriminant(&t.node) == std::mem::discriminant(&c.node)
                });
                if !same_type {
                    self.deleted += u64::from(t.is_none());
                    self.ops.push(Op::Remove {
                        path: join(prefix, &c.name),
                        current: (*c).clone(),
                    });
                }
            }
        }
        for (c, t) in pairs {
            let Some(t) = t else { continue };
            let path = join(prefix, &t.name);
            let c =
                c.filter(|c| std::mem::discriminant(&t.node) == std::mem::discriminant(&c.node));
            let file_mode = self.opts.file_mode(t.mode);
            if matches!(t.node, Node::File { .. }) && file_mode != t.mode {
                self.setid_dropped.push(path.clone());
            }
            let owner = t.owner;
            // Only a restore that restores owners compares them.
            if let Some(c) = c
                && self.opts.owners.is_some()
                && c.owner != owner
            {
                self.owner_changed += 1;
                self.ops.push(Op::Chown {
                    path: path.clone(),
                    owner,
                    mode: match t.node {
                        Node::File { .. } => file_mode,
                        _ => t.mode,
                    },
                    dir: matches!(t.node, Node::Dir { .. }),
                });
            }
            match (&t.node, c) {
                (Node::File { content, size }, Some(c)) => {
                    if let Node::File {
                        content: cc,
                        size: cs,
                    } = &c.node
                        && (cc.id != content.id || cs != size)
                    {
                        self.modified += 1;
                        self.ops.push(Op::Write {
                            path,
                            content: *content,
                            size: *size,
                            mode: file_mode,
                            existing: true,
                            owner,
                        });
                    } else if c.mode != file_mode {
                        self.mode_changed += 1;
                        self.ops.push(Op::Chmod {
                            path,
                            mode: file_mode,
                            dir: false,
                        });
                    }
                }
                (Node::File { content, size }, None) => {
                    self.added += 1;
                    self.ops.push(Op::Write {
                        path,
                        content: *content,
                        size: *size,
                        mode: file_mode,
                        existing: false,
                        owner,
                    });
                }
                (Node::Symlink { target }, c) => {
                    let changed = match c.map(|c| &c.node) {
                        Some(Node::Symlink { target: ct }) => ct != target,
                        _ => true,
                    };
                    if changed {
                        if c.is_some() {
                            self.modified += 1
                        } else {
                            self.added += 1
                        }
                        self.ops.push(Op::Symlink {
                            path,
                            target: target.clone(),
                            owner,
                        });
                    }
                }
                (Node::Dir { tree }, c) => {
                    let ctree = match c.map(|c| &c.node) {
                        Some(Node::Dir { tree }) => Some(*tree),
                        _ => None,
                    };
                    if ctree.is_none() {
                        self.ops.push(Op::Mkdir {
                            path: path.clone(),
                            owner,
                        });
                    }
                    self.sync(trees, ctree.as_ref(), tree, &path)?;
                    if c.is_none_or(|c| c.mode != t.mode) {
                        if c.is_some() {
                            self.mode_changed += 1;
                        }
                        self.ops.push(Op::Chmod {
                            path,
                            mode: t.mode,
                            dir: true,
                        });
                    }
                }
            }
        }
        Ok(())
    }
}
