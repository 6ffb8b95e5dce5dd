//! Property test: the store against a simple model (a map of id -> bytes and a
//! list of snapshots). Random puts, commits (with and without snapshots),
//! aborted packs, reopenings and gc; every committed object reads back
//! verified, nothing uncommitted is visible, and gc keeps what snapshots need.

use std::collections::{BTreeMap, HashSet};

use proptest::prelude::*;
use tine_store::{
    GcOptions, Kind, NewSnapshot, NoProgress, Node, ObjectId, Repository, Tree, TreeEntry,
};

#[derive(Debug, Clone)]
enum Op {
    /// Store some blobs and commit them with a snapshot whose tree lists them.
    Commit {
        blobs: Vec<Vec<u8>>,
        tag: bool,
    },
    /// Store blobs, then drop the pack without committing (an aborted write).
    Abort {
        blobs: Vec<Vec<u8>>,
    },
    Reopen,
    Gc {
        keep_last: Option<usize>,
        compact: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let blobs = prop::collection::vec(prop::collection::vec(0u8..4, 0..300), 0..6);
    prop_oneof![
        4 => (blobs.clone(), any::<bool>()).prop_map(|(blobs, tag)| Op::Commit { blobs, tag }),
        1 => blobs.prop_map(|blobs| Op::Abort { blobs }),
        1 => Just(Op::Reopen),
        1 => (prop::option::of(0usize..4), any::<bool>())
            .prop_map(|(keep_last, compact)| Op::Gc { keep_last, compact }),
    ]
}

fn tree_of(blobs: &[ObjectId], sizes: &[usize]) -> Tree {
    let mut entries: Vec<TreeEntry> = blobs
        .iter()
        .zip(sizes)
        .enumerate()
        .map(|(i, (id, size))| TreeEntry {
            name: format!("f{i:03}").into_bytes(),
            mode: 0o644,
            // Some trees have owners (version 2), most do not.
            owner: tine_store::Owner {
                uid: (*size % 3 == 0) as u32 * (1000 + i as u32),
                gid: 0,
            },
            node: Node::File {
                content: tine_store::Content {
                    kind: Kind::Blob,
                    id: *id,
                },
                size: *size as u64,
            },
        })
        .collect();
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Tree { entries }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model(ops in prop::collection::vec(op(), 1..25)) {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("repo");
        let mut repo = Repository::init(&path).unwrap();
        // Model: snapshots in order, each with its blob contents, and whether tagged.
        let mut snaps: Vec<(ObjectId, Vec<Vec<u8>>, bool)> = Vec::new();
        let mut aborted: HashSet<ObjectId> = HashSet::new();
        for (n, op) in ops.iter().enumerate() {
            match op {
                Op::Commit { blobs, tag } => {
                    let lock = repo.lock(true).unwrap();
                    let pack = lock.pack().unwrap();
                    let ids: Vec<ObjectId> = blobs.iter().map(|b| pack.put(Kind::Blob, b).unwrap()).collect();
                    let sizes: Vec<usize> = blobs.iter().map(|b| b.len()).collect();
                    let tree = pack.put(Kind::Tree, &tree_of(&ids, &sizes).encode()).unwrap();
                    let out = lock.commit(pack, Some(NewSnapshot {
                        tree, parents: snaps.last().map(|s| s.0).into_iter().collect(),
                        message: format!("op {n}"), source: "/m".into(),
                        tags: if *tag { vec![format!("t{n}")] } else { vec![] },
                        attachments: vec![], files: blobs.len() as u64, bytes: 0, head: None, force_tags: false,
                    })).unwrap();
                    snaps.push((out.snapshot.unwrap(), blobs.clone(), *tag));
                }
                Op::Abort { blobs } => {
                    let lock = repo.lock(true).unwrap();
                    let pack = lock.pack().unwrap();
                    for b in blobs {
                        let id = pack.put(Kind::Blob, b).unwrap();
                        aborted.insert(id);
                    }
                    drop(pack);
                }
                Op::Reopen => {
                    drop(repo);
                    repo = Repository::open(&path).unwrap();
                }
                Op::Gc { keep_last, compact } => {
                    let lock = repo.lock(true).unwrap();
                    let report = tine_store::gc(&lock, &GcOptions { keep_last: *keep_last, dry_run: false, compact: *compact }, &NoProgress).unwrap();
                    let removed: HashSet<ObjectId> = report.snapshots_removed.iter().copied().collect();
                    if let Some(k) = keep_last {
                        // Model of retention: the k newest plus tagged ones survive.
                        let keep: HashSet<ObjectId> = snaps.iter().rev().take(*k).map(|s| s.0)
                            .chain(snaps.iter().filter(|s| s.2).map(|s| s.0)).collect();
                        let expect: HashSet<ObjectId> = snaps.iter().map(|s| s.0).filter(|id| !keep.contains(id)).collect();
                        prop_assert_eq!(&removed, &expect);
                    } else {
                        prop_assert!(removed.is_empty());
                    }
                    snaps.retain(|s| !removed.contains(&s.0));
                }
            }
            // Invariants after every step.
            let listed: Vec<ObjectId> = repo.snapshots().unwrap().iter().map(|s| s.id).collect();
            prop_assert_eq!(listed, snaps.iter().map(|s| s.0).collect::<Vec<_>>());
            let mut live = HashSet::new();
            for (id, blobs, _) in &snaps {
                let s = repo.read_snapshot(id).unwrap();
                let t = repo.read_tree(&s.tree).unwrap();
                let got: BTreeMap<Vec<u8>, Vec<u8>> = t.entries.iter().map(|e| {
                    let Node::File { content, .. } = &e.node else { unreachable!() };
                    live.insert(content.id);
                    (e.name.clone(), repo.read_kind(&content.id, Kind::Blob).unwrap())
                }).collect();
                let want: BTreeMap<Vec<u8>, Vec<u8>> = blobs.iter().enumerate().map(|(i, b)| (format!("f{i:03}").into_bytes(), b.clone())).collect();
                prop_assert_eq!(got, want);
            }
            for id in &aborted {
                if !live.contains(id) && !snaps.iter().any(|s| s.1.iter().any(|b| ObjectId::compute(Kind::Blob, b) == *id)) {
                    prop_assert!(!repo.has_object(id).unwrap(), "aborted object {} is visible", id.short());
                }
            }
        }
        let report = tine_store::fsck(&repo, &NoProgress).unwrap();
        prop_assert!(report.is_clean(), "{:?}", report);
        prop_assert!(report.leftover_files.is_empty(), "{:?}", report.leftover_files);
    }
}
