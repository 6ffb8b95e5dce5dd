//! Damaged data is detected and never written out.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;

use tine_store::{ErrorKind, HasKind, NoProgress, Node};

use crate::common::{Env, read_tree, write_file};

#[test]
fn a_corrupted_byte_is_named_by_fsck_and_fails_restore_without_writing() {
    let env = Env::new();
    let src = env.dir("src");
    write_file(&src.join("good.txt"), b"fine", 0o644);
    // Over 16 KiB, so it is stored in a frame of its own (smaller objects share blocks).
    write_file(&src.join("bad.txt"), &b"precious data ".repeat(2000), 0o644);
    let s1 = env.snapshot(&src);
    write_file(&src.join("other.txt"), b"unrelated", 0o644);
    std::fs::remove_file(src.join("bad.txt")).unwrap();
    let s2 = env.snapshot(&src);

    // Find bad.txt's blob and flip one byte of its stored data.
    let tree = env.repo.read_tree(&s1.tree).unwrap();
    let bad = tree.entries.iter().find(|e| e.name == b"bad.txt").unwrap();
    let Node::File { content, .. } = &bad.node else {
        panic!()
    };
    let loc = env.repo.locate(&content.id).unwrap().unwrap();
    let pack_name = {
        let r = tine_store::fsck(&env.repo, &NoProgress).unwrap();
        assert!(r.is_clean(), "{r:?}");
        std::fs::read_dir(env.repo.packs_dir()).unwrap().count()
    };
    assert!(pack_name >= 2);
    let mut flipped = false;
    for e in std::fs::read_dir(env.repo.packs_dir()).unwrap() {
        let path = e.unwrap().path();
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        if let Ok(idx) = tine_store::pack::read_index(&f)
            && idx
                .iter()
                .any(|x| x.id == content.id && x.offset == loc.entry.offset)
        {
            let at = loc.entry.offset + 3;
            let mut b = [0u8; 1];
            f.read_exact_at(&mut b, at).unwrap();
            f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
            flipped = true;
        }
    }
    assert!(flipped);

    let r = tine_store::fsck(&env.repo, &NoProgress).unwrap();
    assert!(!r.is_clean());
    assert_eq!(r.damaged_objects.len(), 1, "{r:?}");
    assert_eq!(r.damaged_objects[0].id, content.id);
    let affected: Vec<_> = r.affected_snapshots.iter().map(|a| a.id).collect();
    assert_eq!(
        affected,
        vec![s1.id],
        "only the first snapshot needs bad.txt"
    );

    // Restoring the affected snapshot fails clearly and writes nothing.
    let target = env.dir("target");
    let err = env.restore(&s1.id, &target).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt);
    assert!(err.to_string().contains(&content.id.to_hex()), "{err}");
    assert!(
        read_tree(&target).is_empty(),
        "nothing may be written: {:?}",
        read_tree(&target)
    );
    // The unaffected snapshot still restores.
    let t2 = env.dir("target2");
    env.restore(&s2.id, &t2).unwrap();
    assert_eq!(std::fs::read(t2.join("other.txt")).unwrap(), b"unrelated");
}

#[test]
fn a_damaged_block_names_every_object_in_it_and_the_snapshots_that_need_them() {
    let env = Env::new();
    let src = env.dir("src");
    write_file(&src.join("a.txt"), &b"small file a ".repeat(50), 0o644);
    write_file(&src.join("b.txt"), &b"small file b ".repeat(50), 0o644);
    let s1 = env.snapshot(&src);
    let tree = env.repo.read_tree(&s1.tree).unwrap();
    let Node::File { content, .. } = &tree.entries[0].node else {
        panic!()
    };
    let loc = env.repo.locate(&content.id).unwrap().unwrap();
    assert_eq!(loc.entry.codec, tine_store::pack::CODEC_BLOCK);
    // A later snapshot in its own pack that shares nothing with the damaged block.
    let other = env.dir("other");
    write_file(&other.join("c.txt"), b"unrelated", 0o644);
    let s2 = env.snapshot(&other);
    for e in std::fs::read_dir(env.repo.packs_dir()).unwrap() {
        let path = e.unwrap().path();
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        if tine_store::pack::read_index(&f)
            .unwrap()
            .iter()
            .any(|x| x.id == content.id)
        {
            f.write_all_at(&[0xff], loc.entry.offset + 10).unwrap();
        }
    }
    let r = tine_store::fsck(&env.repo, &NoProgress).unwrap();
    let damaged: Vec<_> = r.damaged_objects.iter().map(|d| d.id).collect();
    assert!(damaged.contains(&content.id), "{r:?}");
    assert!(
        r.damaged_objects
            .iter()
            .all(|d| d.offset == loc.entry.offset),
        "all in the one block"
    );
    let affected: Vec<_> = r.affected_snapshots.iter().map(|a| a.id).collect();
    assert_eq!(affected, vec![s1.id]);
    assert!(env.restore(&s2.id, &env.dir("t2")).is_ok());
    let t1 = env.dir("t1");
    assert_eq!(
        env.restore(&s1.id, &t1).unwrap_err().kind(),
        ErrorKind::Corrupt
    );
    assert!(read_tree(&t1).is_empty());
}
