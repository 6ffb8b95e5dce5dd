//! Property test: snapshots of an overlay upper layer that read only the
//! directories a change tracker names give the same trees as full reads, over
//! any sequence of changes and snapshots.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use proptest::prelude::*;
use proptest::sample::Index;
use tine_fs::{DirtySet, SnapshotOptions, Stamp, Tracked};
use tine_store::NoProgress;

use crate::common::Env;

#[derive(Debug, Clone)]
enum Op {
    Write { dir: Index, name: u8, len: u8 },
    Delete { pick: Index },
    Mkdir { dir: Index, name: u8 },
    RemoveDir { pick: Index },
    RenameDir { pick: Index, dir: Index, name: u8 },
    Chmod { pick: Index },
    Snapshot,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (any::<Index>(), 0u8..5, any::<u8>()).prop_map(|(dir, name, len)| Op::Write { dir, name, len }),
        2 => any::<Index>().prop_map(|pick| Op::Delete { pick }),
        2 => (any::<Index>(), 0u8..3).prop_map(|(dir, name)| Op::Mkdir { dir, name }),
        1 => any::<Index>().prop_map(|pick| Op::RemoveDir { pick }),
        1 => (any::<Index>(), any::<Index>(), 0u8..3).prop_map(|(pick, dir, name)| Op::RenameDir { pick, dir, name }),
        1 => any::<Index>().prop_map(|pick| Op::Chmod { pick }),
        3 => Just(Op::Snapshot),
    ]
}

/// Relative paths of the directories (with "" for the root) and files under `root`.
fn listing(root: &Path) -> (Vec<String>, Vec<String>) {
    let (mut dirs, mut files) = (vec![String::new()], Vec::new());
    let mut stack = vec![String::new()];
    while let Some(rel) = stack.pop() {
        let mut names: Vec<_> = fs::read_dir(root.join(&rel))
            .unwrap()
            .map(|e| e.unwrap())
            .collect();
        names.sort_by_key(|e| e.file_name());
        for e in names {
            let p = if rel.is_empty() {
                e.file_name().to_string_lossy().into_owned()
            } else {
                format!("{rel}/{}", e.file_name().to_string_lossy())
            };
            if e.file_type().unwrap().is_dir() {
                dirs.push(p.clone());
                stack.push(p);
            } else {
                files.push(p);
            }
        }
    }
    (dirs, files)
}

fn parent(p: &str) -> String {
    p.rsplit_once('/')
        .map(|(d, _)| d.to_string())
        .unwrap_or_default()
}

fn join(d: &str, n: &str) -> String {
    if d.is_empty() {
        n.to_string()
    } else {
        format!("{d}/{n}")
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn tracked_snapshots_equal_full_reads(ops in prop::collection::vec(op(), 1..30)) {
        let env = Env::new();
        let lower = env.dir("lower");
        for d in ["a", "a/b", "c"] {
            fs::create_dir_all(lower.join(d)).unwrap();
        }
        for f in ["a/x", "a/b/y", "c/z", "top"] {
            fs::write(lower.join(f), f).unwrap();
        }
        let base = env.snapshot(&lower).id;
        let upper = env.dir("upper");
        fs::create_dir_all(upper.join("a/b")).unwrap();
        fs::write(upper.join("a/b/y"), "changed").unwrap();
        let memo = env.tmp.path().join("merge.cache");
        let mut seq = 0u64;
        let mut since: Option<Stamp> = None;
        let (mut dirs, mut trees): (BTreeSet<String>, BTreeSet<String>) = Default::default();
        for op in ops {
            let (ds, fs_) = listing(&upper);
            match op {
                Op::Write { dir, name, len } => {
                    let d = dir.get(&ds).clone();
                    let p = join(&d, &format!("f{name}"));
                    if !upper.join(&p).is_dir() {
                        fs::write(upper.join(&p), vec![len; usize::from(len) * 40]).unwrap();
                        dirs.insert(d);
                    }
                }
                Op::Delete { pick } if !fs_.is_empty() => {
                    let p = pick.get(&fs_);
                    fs::remove_file(upper.join(p)).unwrap();
                    dirs.insert(parent(p));
                }
                Op::Mkdir { dir, name } => {
                    let d = dir.get(&ds).clone();
                    let p = join(&d, &format!("d{name}"));
                    if !upper.join(&p).exists() {
                        fs::create_dir(upper.join(&p)).unwrap();
                        dirs.insert(d);
                        trees.insert(p);
                    }
                }
                Op::RemoveDir { pick } if ds.len() > 1 => {
                    let p = pick.get(&ds[1..]);
                    fs::remove_dir_all(upper.join(p)).unwrap();
                    dirs.insert(parent(p));
                }
                Op::RenameDir { pick, dir, name } if ds.len() > 1 => {
                    let from = pick.get(&ds[1..]).clone();
                    let to_dir = dir.get(&ds).clone();
                    let to = join(&to_dir, &format!("m{name}"));
                    let inside = to_dir == from || to_dir.starts_with(&format!("{from}/"));
                    if !inside && !upper.join(&to).exists() {
                        fs::rename(upper.join(&from), upper.join(&to)).unwrap();
                        dirs.insert(parent(&from));
                        dirs.insert(to_dir);
                        trees.insert(to);
                    }
                }
                Op::Chmod { pick } if !fs_.is_empty() => {
                    let p = pick.get(&fs_);
                    let m = fs::metadata(upper.join(p)).unwrap().permissions().mode();
                    fs::set_permissions(upper.join(p), fs::Permissions::from_mode(m ^ 0o100)).unwrap();
                    dirs.insert(parent(p));
                }
                Op::Snapshot => {
                    seq += 1;
                    let now = Stamp { watch: 1, seq };
                    let tracked = since.map(|since| Tracked {
                        now,
                        since,
                        dirty: Some(DirtySet::new(
                            dirs.iter().map(|d| d.as_bytes().to_vec()),
                            trees.iter().map(|d| d.as_bytes().to_vec()),
                        )),
                        rehash: false,
                    });
                    let first = Tracked { now, since: now, dirty: None, rehash: false };
                    let ws = tine_fs::Layered::load(&env.repo, Some(&base), &upper, &memo, None).unwrap();
                    let full = tine_fs::layered_tree(&env.repo, &ws, None, &NoProgress).unwrap().0;
                    let lock = env.repo.lock(true).unwrap();
                    let out = tine_fs::snapshot_layered(
                        &lock,
                        lock.pack().unwrap(),
                        &ws,
                        "layered",
                        Some(tracked.as_ref().unwrap_or(&first)),
                        &SnapshotOptions::default(),
                        || true,
                        &NoProgress,
                    )
                    .unwrap();
                    prop_assert_eq!(out.tree, full);
                    if since.is_some() {
                        // Only what changed (and its ancestors) was read.
                        let (all_dirs, _) = listing(&upper);
                        let mut read: BTreeSet<String> = BTreeSet::new();
                        for d in dirs.iter().chain(&trees) {
                            let mut p = d.clone();
                            loop {
                                read.insert(p.clone());
                                if p.is_empty() { break; }
                                p = parent(&p);
                            }
                        }
                        let below = |d: &String| trees.iter().any(|t| d == t || d.starts_with(&format!("{t}/")));
                        let bound = all_dirs.iter().filter(|d| read.contains(*d) || below(d)).count();
                        prop_assert!(out.stats.dirs as usize <= bound.max(1),
                            "read {} directories, {} changed", out.stats.dirs, bound);
                    }
                    since = Some(now);
                    dirs.clear();
                    trees.clear();
                }
                _ => {}
            }
        }
    }
}
