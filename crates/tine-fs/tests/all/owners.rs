//! Owners inside a sandbox's ID range: recorded by scans given the range,
//! given back by restores given it, compared by diffs. Needs root (chown).

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use tine_fs::{IdMap, RestoreOptions, SnapshotOptions};
use tine_store::{NoProgress, Node, ObjectId, Owner};

use crate::common::{Env, is_root, write_file};

const MAP: IdMap = IdMap {
    host_uid: 1 << 30,
    host_gid: 1 << 30,
    count: 65536,
};
const PG: Owner = Owner { uid: 105, gid: 108 };

fn chown(p: &Path, o: Owner) {
    let (u, g) = MAP.host(o);
    std::os::unix::fs::lchown(p, Some(u), Some(g)).unwrap();
}

/// (uid, gid, mode) of every entry below `root`, by relative path.
fn owners(root: &Path) -> Vec<(String, u32, u32, u32)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let md = fs::symlink_metadata(&p).unwrap();
            if md.is_dir() {
                stack.push(p.clone());
            }
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            out.push((rel, md.uid(), md.gid(), md.mode() & 0o7777));
        }
    }
    out.sort();
    out
}

/// Snapshots `dir` as a sandbox's upper layer, owners in [`MAP`].
fn snapshot_owned(env: &Env, dir: &Path) -> (ObjectId, ObjectId) {
    let memo = env.tmp.path().join("memo");
    let ws = tine_fs::Layered::load(&env.repo, None, dir, &memo, Some(MAP)).unwrap();
    let lock = env.repo.lock(true).unwrap();
    let out = tine_fs::snapshot_layered(
        &lock,
        lock.pack().unwrap(),
        &ws,
        "owned",
        None,
        &SnapshotOptions::default(),
        || true,
        &NoProgress,
    )
    .unwrap();
    (out.id, out.tree)
}

fn restore(
    env: &Env,
    snap: &ObjectId,
    dir: &Path,
    opts: RestoreOptions,
) -> tine_fs::RestoreOutcome {
    let lock = env.repo.lock(true).unwrap();
    tine_fs::restore_with(&lock, snap, dir, opts, &NoProgress).unwrap()
}

#[test]
fn owners_in_a_sandboxs_range_survive_a_snapshot_and_restores() {
    if !is_root() {
        tine_testkit::skip("giving files owners needs root");
        return;
    }
    let env = Env::new();
    let ws = env.dir("ws");
    write_file(&ws.join("pgdata/PG_VERSION"), b"15\n", 0o600);
    write_file(&ws.join("pgdata/base/1"), b"rows", 0o600);
    write_file(&ws.join("suid"), b"#!/bin/sh\n", 0o4755);
    write_file(&ws.join("rootfile"), b"root", 0o644);
    std::os::unix::fs::symlink("pgdata", ws.join("link")).unwrap();
    fs::set_permissions(ws.join("pgdata"), fs::Permissions::from_mode(0o700)).unwrap();
    for p in [
        "pgdata",
        "pgdata/PG_VERSION",
        "pgdata/base",
        "pgdata/base/1",
        "link",
    ] {
        chown(&ws.join(p), PG);
    }
    chown(
        &ws.join("suid"),
        Owner {
            uid: 1000,
            gid: 1000,
        },
    );
    chown(&ws.join("rootfile"), Owner::ROOT);
    // The chown cleared the set-user-ID bit.
    fs::set_permissions(ws.join("suid"), fs::Permissions::from_mode(0o4755)).unwrap();
    chown(&ws, Owner::ROOT);

    let (snap, tree) = snapshot_owned(&env, &ws);
    let top = env.repo.read_tree(&tree).unwrap();
    let by_name = |n: &str| top.entries.iter().find(|e| e.name == n.as_bytes()).unwrap();
    assert_eq!(by_name("pgdata").owner, PG);
    assert_eq!(by_name("link").owner, PG);
    assert_eq!(by_name("rootfile").owner, Owner::ROOT);
    assert_eq!(
        by_name("suid").owner,
        Owner {
            uid: 1000,
            gid: 1000
        }
    );
    assert!(matches!(by_name("pgdata").node, Node::Dir { .. }));

    // Restored with the range: every entry as it was, set-user-ID bit kept.
    let copy = env.dir("copy");
    chown(&copy, Owner::ROOT);
    restore(&env, &snap, &copy, RestoreOptions::sandbox(Some(MAP)));
    assert_eq!(owners(&copy), owners(&ws));

    // An owner changed alone comes back, mode and all.
    chown(&copy.join("suid"), Owner::ROOT);
    chown(&copy.join("pgdata/base"), Owner::ROOT);
    assert_ne!(owners(&copy), owners(&ws));
    let out = restore(&env, &snap, &copy, RestoreOptions::sandbox(Some(MAP)));
    assert_eq!(out.owner_changed, 2, "{out:?}");
    assert_eq!((out.added, out.modified, out.deleted), (0, 0, 0));
    assert_eq!(owners(&copy), owners(&ws));

    // A diff names an owner change as a change of mode and owner.
    chown(&ws.join("pgdata/PG_VERSION"), Owner { uid: 105, gid: 0 });
    let (_, tree2) = snapshot_owned(&env, &ws);
    let trees = tine_fs::Trees::new(&env.repo, None);
    let changes = tine_fs::diff_trees(&trees, &tree, &tree2).unwrap();
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert_eq!(changes[0].path, "pgdata/PG_VERSION");
    assert_eq!(changes[0].kind, tine_fs::ChangeKind::ModeChanged);
    assert_eq!(changes[0].old.as_ref().unwrap().owner, PG);

    // Without a range, a restore leaves owners to whoever restores.
    let plain = env.dir("plain");
    restore(&env, &snap, &plain, RestoreOptions::FAITHFUL);
    assert!(owners(&plain).iter().all(|(_, u, g, _)| (*u, *g) == (0, 0)));
}
