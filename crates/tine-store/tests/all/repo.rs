//! Repository behaviour: naming, locking, leftovers, gc of leftovers, formats.

use std::fs;
use tine_store::pack::Density;

use tine_store::{
    ErrorKind, HasKind, Kind, NewSnapshot, NoProgress, ObjectId, OpenError, Repository, Tree,
};

fn snap(repo: &Repository, msg: &str, tags: &[&str]) -> ObjectId {
    let lock = repo.lock(true).unwrap();
    let pack = lock.pack().unwrap();
    let tree = pack.put(Kind::Tree, &Tree::default().encode()).unwrap();
    lock.commit(
        pack,
        Some(NewSnapshot {
            message: msg.into(),
            tags: tags.iter().map(|t| t.to_string()).collect(),
            ..NewSnapshot::new(tree)
        }),
    )
    .unwrap()
    .snapshot
    .unwrap()
}

#[test]
fn resolve_by_tag_and_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::init(&tmp.path().join("r")).unwrap();
    let a = snap(&repo, "a", &["first"]);
    assert_eq!(repo.resolve("first").unwrap(), a);
    assert_eq!(repo.resolve(&a.to_hex()[..8]).unwrap(), a);
    assert_eq!(repo.resolve(&a.to_hex().to_uppercase()[..10]).unwrap(), a);
    assert_eq!(
        repo.resolve("abc").unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
    assert_eq!(
        repo.resolve("nope").unwrap_err().kind(),
        ErrorKind::NotFound
    );
    // Many snapshots: a one-digit-longer prefix is eventually ambiguous.
    let ids: Vec<ObjectId> = (0..40)
        .map(|i| snap(&repo, &format!("s{i}"), &[]))
        .collect();
    let mut seen = std::collections::HashMap::new();
    let mut ambiguous = None;
    for id in ids.iter().chain([&a]) {
        if let Some(other) = seen.insert(id.to_hex()[..4].to_string(), *id) {
            ambiguous = Some((id.to_hex()[..4].to_string(), other));
        }
    }
    if let Some((prefix, _)) = ambiguous {
        let e = repo.resolve(&prefix).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Ambiguous);
        assert!(e.to_string().contains("give more digits"));
    }
}

#[test]
fn one_snapshots_info_is_what_the_listing_says_of_it() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::init(&tmp.path().join("r")).unwrap();
    // A history with merges and tags on several snapshots: one's parents
    // and tags are its own, not its neighbours'.
    let mut ids = Vec::new();
    for i in 0..6u64 {
        let lock = repo.lock(true).unwrap();
        let pack = lock.pack().unwrap();
        let tree = pack.put(Kind::Tree, &Tree::default().encode()).unwrap();
        let parents: Vec<ObjectId> = ids.iter().rev().take(i.min(2) as usize).copied().collect();
        let tags: Vec<String> = (0..i % 3).map(|t| format!("t{i}-{t}")).collect();
        let id = lock
            .commit(
                pack,
                Some(NewSnapshot {
                    message: format!("s{i}"),
                    parents,
                    tags,
                    files: i,
                    ..NewSnapshot::new(tree)
                }),
            )
            .unwrap()
            .snapshot
            .unwrap();
        ids.push(id);
    }
    let listed = repo.snapshots().unwrap();
    assert_eq!(listed.len(), ids.len());
    for info in &listed {
        let one = repo.snapshot_info(&info.id).unwrap().unwrap();
        assert_eq!(&one, info);
    }
    assert_eq!(listed[4].parents, [ids[3], ids[2]]);
    assert_eq!(listed[5].tags, ["t5-0", "t5-1"]);
    assert!(listed[3].tags.is_empty());
    assert!(
        repo.snapshot_info(&ObjectId::from_slice(&[7; 32]).unwrap())
            .unwrap()
            .is_none()
    );
}

#[test]
fn tags_are_checked_and_do_not_move_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::init(&tmp.path().join("r")).unwrap();
    let a = snap(&repo, "a", &["v1"]);
    let b = snap(&repo, "b", &[]);
    let lock = repo.lock(true).unwrap();
    assert_eq!(
        lock.set_tag("v1", &b, false).unwrap_err().kind(),
        ErrorKind::AlreadyExists
    );
    lock.set_tag("v1", &b, true).unwrap();
    assert_eq!(repo.resolve("v1").unwrap(), b);
    for bad in ["", "dead", "-x", "a b", "../x"] {
        assert_eq!(
            lock.set_tag(bad, &a, false).unwrap_err().kind(),
            ErrorKind::InvalidInput,
            "{bad:?}"
        );
    }
    assert_eq!(lock.delete_tag("v1").unwrap(), b);
    assert_eq!(
        lock.delete_tag("v1").unwrap_err().kind(),
        ErrorKind::NotFound
    );
}

#[test]
fn one_writer_at_a_time() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("r");
    let r1 = Repository::init(&path).unwrap();
    let r2 = Repository::open(&path).unwrap();
    let _l = r1.lock(false).unwrap();
    let e = r2.lock(false).unwrap_err();
    assert!(matches!(e, OpenError::Locked { .. }), "{e}");
    assert!(
        e.to_string()
            .contains(&format!("pid {}", std::process::id()))
    );
}

#[test]
fn opening_a_non_repository_or_future_format_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let e = Repository::open(tmp.path()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(e.to_string().contains("tine init"));
    let path = tmp.path().join("r");
    drop(Repository::init(&path).unwrap());
    assert_eq!(
        Repository::init(&path).unwrap_err().kind(),
        ErrorKind::AlreadyExists
    );
    fs::write(path.join("FORMAT"), "tine-repository 99\n").unwrap();
    let e = Repository::open(&path).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
}

#[test]
fn leftovers_are_reported_by_fsck_and_removed_by_gc() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::init(&tmp.path().join("r")).unwrap();
    let keep = snap(&repo, "keep", &[]);
    // A crash after a pack was made durable but before it was registered.
    {
        let mut w = tine_store::pack::PackWriter::create(&repo.packs_dir(), Density::Fast).unwrap();
        let raw = b"orphan";
        w.add(&tine_store::pack::encode(
            Kind::Blob,
            ObjectId::compute(Kind::Blob, raw),
            raw,
            Density::Fast,
        ))
        .unwrap();
        w.finish().unwrap();
    }
    // And a crash in the middle of writing one.
    fs::write(
        repo.packs_dir().join("tmp-999-0-0.pack"),
        b"TINEPACK partial",
    )
    .unwrap();
    let r = tine_store::fsck(&repo, &NoProgress).unwrap();
    assert!(r.is_clean());
    assert_eq!(r.leftover_files.len(), 2, "{r:?}");
    let lock = repo.lock(true).unwrap();
    let g = tine_store::gc(&lock, &Default::default(), &NoProgress).unwrap();
    assert_eq!(g.leftover_files_removed.len(), 2);
    let r = tine_store::fsck(&repo, &NoProgress).unwrap();
    assert!(r.is_clean() && r.leftover_files.is_empty(), "{r:?}");
    assert!(repo.read_snapshot(&keep).is_ok());
}

#[test]
fn gc_dry_run_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::init(&tmp.path().join("r")).unwrap();
    for i in 0..5 {
        snap(&repo, &format!("s{i}"), &[]);
    }
    let lock = repo.lock(true).unwrap();
    let before = repo.snapshots().unwrap().len();
    let g = tine_store::gc(
        &lock,
        &tine_store::GcOptions {
            keep_last: Some(2),
            dry_run: true,
            compact: true,
        },
        &NoProgress,
    )
    .unwrap();
    assert_eq!(g.snapshots_removed.len(), 3);
    assert_eq!(repo.snapshots().unwrap().len(), before);
}

/// Source-like text: compressible, and differently so at each level.
fn text(seed: u64, len: usize) -> Vec<u8> {
    const WORDS: [&str; 8] = [
        "fn", "let", "self", "match", "value", "impl", "Some", "None",
    ];
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 16);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(WORDS[(x % 8) as usize].as_bytes());
        v.extend_from_slice(if x.is_multiple_of(7) { b"\n" } else { b" " });
        if x.is_multiple_of(5) {
            v.extend_from_slice((x % 100_000).to_string().as_bytes());
        }
    }
    v.truncate(len);
    v
}

#[test]
fn gc_compacts_fast_packs_into_one_dense_pack() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::init(&tmp.path().join("r")).unwrap();
    // Small objects, ones that are blocked only when dense, single frames, and
    // one over 1 MiB (the cheaper dense level), over three snapshots.
    let sizes = [3_000, 9_000, 40_000, 200_000, 1_500_000];
    let mut blobs = Vec::new();
    let mut snaps = Vec::new();
    for s in 0..3u64 {
        let lock = repo.lock(true).unwrap();
        let pack = lock.pack().unwrap();
        let mut entries = Vec::new();
        for (i, n) in sizes.iter().enumerate() {
            for k in 0..4u64 {
                let raw = text(s * 1000 + i as u64 * 10 + k, *n);
                let id = pack.put(Kind::Blob, &raw).unwrap();
                entries.push(tine_store::TreeEntry {
                    name: format!("f{i}-{k}").into_bytes(),
                    mode: 0o644,
                    owner: tine_store::Owner::ROOT,
                    node: tine_store::Node::File {
                        content: tine_store::Content {
                            kind: Kind::Blob,
                            id,
                        },
                        size: raw.len() as u64,
                    },
                });
                blobs.push((id, raw));
            }
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        let tree = pack.put(Kind::Tree, &Tree { entries }.encode()).unwrap();
        let out = lock.commit(pack, Some(NewSnapshot::new(tree))).unwrap();
        snaps.push(out.snapshot.unwrap());
    }
    let dense_packs = |repo: &Repository| {
        fs::read_dir(repo.packs_dir())
            .unwrap()
            .map(|e| {
                let f = fs::File::open(e.unwrap().path()).unwrap();
                tine_store::pack::read_header(&f).unwrap().1 == Density::Dense
            })
            .collect::<Vec<bool>>()
    };
    assert_eq!(dense_packs(&repo), vec![false; 3]);

    let lock = repo.lock(true).unwrap();
    let opts = tine_store::GcOptions {
        compact: true,
        ..Default::default()
    };
    let g = tine_store::gc(&lock, &opts, &NoProgress).unwrap();
    assert_eq!(
        (g.packs_rewritten, g.packs_compacted, g.objects_removed),
        (3, 3, 0)
    );
    assert!(
        g.bytes_after < g.bytes_before - g.bytes_before / 20,
        "compaction saved too little: {} -> {}",
        g.bytes_before,
        g.bytes_after
    );
    assert_eq!(dense_packs(&repo), vec![true]);
    // Every object and snapshot reads back identical, and fsck agrees.
    for (id, raw) in &blobs {
        assert_eq!(&repo.read_object(id).unwrap(), &(Kind::Blob, raw.clone()));
    }
    for s in &snaps {
        repo.read_snapshot(s).unwrap();
    }
    let f = tine_store::fsck(&repo, &NoProgress).unwrap();
    assert!(f.is_clean() && f.leftover_files.is_empty(), "{f:?}");
    // A dense pack is left alone by the next gc.
    let again = tine_store::gc(&lock, &opts, &NoProgress).unwrap();
    assert_eq!((again.packs_rewritten, again.packs_compacted), (0, 0));
}

#[test]
fn sandbox_records_by_name_and_id_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("r");
    let repo = Repository::init(&path).unwrap();
    let rec = |id: &str, name: &str| tine_store::SandboxRecord {
        id: id.into(),
        name: name.into(),
        created_ns: 1,
        updated_ns: 1,
        state: tine_store::SandboxState::Running,
        spec: "{}".into(),
        supervisor_pid: Some(10),
        init_pid: None,
        restarts: 0,
        exit: None,
    };
    repo.insert_sandbox(&rec("abc123000000", "web")).unwrap();
    repo.insert_sandbox(&rec("abc456000000", "db")).unwrap();
    let e = repo
        .insert_sandbox(&rec("ffff00000000", "web"))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    assert_eq!(repo.sandbox("web").unwrap().id, "abc123000000");
    assert_eq!(repo.sandbox("abc4").unwrap().name, "db");
    assert_eq!(
        repo.sandbox("abc").unwrap_err().kind(),
        ErrorKind::Ambiguous
    );
    assert_eq!(repo.sandbox("zzz").unwrap_err().kind(), ErrorKind::NotFound);
    let mut r = repo.sandbox("db").unwrap();
    r.state = tine_store::SandboxState::Exited;
    r.exit = Some(r#"{"code":3}"#.into());
    r.restarts = 2;
    repo.save_sandbox(&r).unwrap();
    drop(repo);
    let repo = Repository::open(&path).unwrap();
    let got = repo.sandbox("db").unwrap();
    assert_eq!((got.state.as_str(), got.restarts), ("exited", 2));
    assert_eq!(got.exit.as_deref(), Some(r#"{"code":3}"#));
    repo.delete_sandbox(&got.id).unwrap();
    assert_eq!(repo.sandboxes().unwrap().len(), 1);
    // A state this version does not know is a damaged repository, named.
    drop(repo);
    let conn = rusqlite::Connection::open(path.join("tine.db")).unwrap();
    conn.execute("UPDATE sandboxes SET state = 'bogus'", [])
        .unwrap();
    drop(conn);
    let repo = Repository::open(&path).unwrap();
    let e = repo.sandbox("web").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(
        e.to_string().contains("unknown sandbox state \"bogus\""),
        "{e}"
    );
}
