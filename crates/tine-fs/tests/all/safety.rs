//! Restores can never write outside their target.

use std::fs;

use tine_store::{Content, Kind, NewSnapshot, Node, ObjectId, Owner, Tree, TreeEntry};

use crate::common::{Env, read_tree, write_file};

fn hostile_snapshot(env: &Env, name: &[u8]) -> ObjectId {
    let lock = env.repo.lock(true).unwrap();
    let pack = lock.pack().unwrap();
    let blob = pack.put(Kind::Blob, b"pwned").unwrap();
    let tree = Tree {
        entries: vec![TreeEntry {
            name: name.to_vec(),
            mode: 0o644,
            owner: Owner::ROOT,
            node: Node::File {
                content: Content {
                    kind: Kind::Blob,
                    id: blob,
                },
                size: 5,
            },
        }],
    };
    // Tree::encode does not validate names, so a hostile tree can be stored as-is.
    let tid = pack.put(Kind::Tree, &tree.encode()).unwrap();
    let outer = Tree {
        entries: vec![TreeEntry {
            name: b"sub".to_vec(),
            mode: 0o755,
            owner: Owner::ROOT,
            node: Node::Dir { tree: tid },
        }],
    };
    let root = pack.put(Kind::Tree, &outer.encode()).unwrap();
    lock.commit(
        pack,
        Some(NewSnapshot {
            message: "hostile".into(),
            ..NewSnapshot::new(root)
        }),
    )
    .unwrap()
    .snapshot
    .unwrap()
}

#[test]
fn hostile_names_are_refused_and_nothing_is_touched() {
    let env = Env::new();
    let outside = env.dir("outside");
    write_file(&outside.join("keep"), b"original", 0o644);
    for name in [
        &b".."[..],
        b"../../outside/keep",
        b"/etc/passwd",
        b"a/b",
        b"x\0y",
        b".",
        b"",
    ] {
        let target = env.dir("target");
        write_file(&target.join("existing"), b"mine", 0o644);
        let before_out = read_tree(&outside);
        let before_tgt = read_tree(&target);
        let snap = hostile_snapshot(&env, name);
        let err = env
            .restore(&snap, &target)
            .expect_err("hostile tree must be refused");
        let msg = err.to_string();
        assert!(msg.contains("entry name"), "{name:?}: {msg}");
        assert_eq!(err_kind(&err), tine_store::ErrorKind::Corrupt);
        assert_eq!(
            read_tree(&outside),
            before_out,
            "outside changed for {name:?}"
        );
        assert_eq!(
            read_tree(&target),
            before_tgt,
            "target changed for {name:?}"
        );
        assert!(!env.tmp.path().join("keep").exists());
    }
}

fn err_kind(e: &tine_fs::RestoreError) -> tine_store::ErrorKind {
    use tine_store::HasKind;
    e.kind()
}

#[test]
fn symlinks_in_the_target_are_never_followed() {
    let env = Env::new();
    let outside = env.dir("outside");
    write_file(&outside.join("f"), b"outside", 0o644);
    // Snapshot: a directory `s` with a file `f`.
    let src = env.dir("src");
    write_file(&src.join("s/f"), b"inside", 0o644);
    let snap = env.snapshot(&src).id;
    // Target: `s` is a symlink to the outside directory, and hidden from scans.
    let target = env.dir("target");
    std::os::unix::fs::symlink(&outside, target.join("s")).unwrap();
    fs::write(target.join(".tineignore"), "s\n").unwrap();
    let r = env.restore(&snap, &target);
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(fs::read(outside.join("f")).unwrap(), b"outside");
    assert!(
        !fs::symlink_metadata(target.join("s"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(fs::read(target.join("s/f")).unwrap(), b"inside");
}

#[test]
fn restoring_over_a_symlinked_file_replaces_the_link_not_its_target() {
    let env = Env::new();
    let outside = env.dir("outside");
    write_file(&outside.join("victim"), b"outside", 0o644);
    let src = env.dir("src");
    write_file(&src.join("f"), b"restored", 0o644);
    let snap = env.snapshot(&src).id;
    let target = env.dir("target");
    std::os::unix::fs::symlink(outside.join("victim"), target.join("f")).unwrap();
    env.restore(&snap, &target).unwrap();
    assert_eq!(fs::read(outside.join("victim")).unwrap(), b"outside");
    assert_eq!(fs::read(target.join("f")).unwrap(), b"restored");
}

#[test]
fn the_repository_inside_the_target_is_never_touched() {
    let tmp = tempfile::tempdir().unwrap();
    let work = tmp.path().join("w");
    fs::create_dir(&work).unwrap();
    let repo = tine_store::Repository::init(&work.join(".tine")).unwrap();
    write_file(&work.join("a"), b"1", 0o644);
    let lock = repo.lock(true).unwrap();
    let s1 = tine_fs::snapshot(&lock, &work, &Default::default(), &tine_store::NoProgress).unwrap();
    assert_eq!(s1.stats.files, 1, ".tine must not be captured");
    write_file(&work.join("b"), b"2", 0o644);
    tine_fs::restore(&lock, &s1.id, &work, &tine_store::NoProgress).unwrap();
    assert!(!work.join("b").exists());
    assert!(work.join(".tine/FORMAT").exists());
    let _ = ObjectId::compute(Kind::Blob, b"");
}
