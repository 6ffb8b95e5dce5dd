//! Three-way merge of snapshots.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use proptest::prelude::*;
use tine_fs::ConflictKind;
use tine_store::{NoProgress, ObjectId};

use crate::common::{Env, read_tree};
use crate::model::{Model, Op, apply, op};

/// A base snapshot of `dir`, then two branches of it: `ours` changes `dir`
/// itself, `theirs` a copy restored from the base.
struct Branches {
    env: Env,
    base: ObjectId,
}

impl Branches {
    fn new(files: &[(&str, &str)]) -> Branches {
        let env = Env::new();
        let d = env.dir("ours");
        for (p, c) in files {
            write(&d.join(p), c);
        }
        let base = env.snapshot(&d).id;
        env.restore(&base, &env.dir("theirs")).unwrap();
        Branches { env, base }
    }

    fn ours(&self) -> std::path::PathBuf {
        self.env.tmp.path().join("ours")
    }

    fn theirs(&self) -> std::path::PathBuf {
        self.env.tmp.path().join("theirs")
    }

    fn merge(&self, out: &str) -> tine_fs::MergeOutcome {
        let o = self.env.snapshot(&self.ours()).id;
        let t = self.env.snapshot(&self.theirs()).id;
        let lock = self.env.repo.lock(true).unwrap();
        let target = self.env.tmp.path().join(out);
        tine_fs::merge(&lock, &o, &t, None, &target, "merge", &NoProgress).unwrap()
    }
}

fn write(p: &Path, c: &str) {
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, c).unwrap();
}

fn lines(n: usize) -> String {
    (1..=n).map(|i| format!("line {i}\n")).collect()
}

#[test]
fn disjoint_edits_merge_cleanly() {
    let b = Branches::new(&[("a.txt", &lines(10)), ("b.txt", "bee\n"), ("d/keep", "k\n")]);
    write(
        &b.ours().join("a.txt"),
        &lines(10).replace("line 2\n", "line two\n"),
    );
    write(&b.ours().join("c.txt"), "sea\n");
    write(
        &b.theirs().join("a.txt"),
        &lines(10).replace("line 9\n", "line nine\n"),
    );
    fs::remove_file(b.theirs().join("b.txt")).unwrap();
    write(&b.theirs().join("d/new"), "n\n");
    fs::set_permissions(b.theirs().join("d/keep"), fs::Permissions::from_mode(0o600)).unwrap();
    let m = b.merge("out");
    assert_eq!(m.conflicts, vec![], "{m:?}");
    assert_eq!(m.base, Some(b.base));
    assert_eq!(m.merged, 1);
    let out = b.env.tmp.path().join("out");
    let a = fs::read_to_string(out.join("a.txt")).unwrap();
    assert!(
        a.contains("line two\n") && a.contains("line nine\n") && a.contains("line 5\n"),
        "{a}"
    );
    assert_eq!(fs::read_to_string(out.join("c.txt")).unwrap(), "sea\n");
    assert!(!out.join("b.txt").exists());
    assert_eq!(fs::read_to_string(out.join("d/new")).unwrap(), "n\n");
    assert_eq!(
        fs::metadata(out.join("d/keep"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    // The result is a snapshot with both as parents.
    let snap = b.env.repo.read_snapshot(&m.snapshot).unwrap();
    assert_eq!(snap.parents, vec![m.ours, m.theirs]);
}

#[test]
fn conflicting_edits_get_markers_and_are_reported() {
    let b = Branches::new(&[("a.txt", &lines(10))]);
    write(
        &b.ours().join("a.txt"),
        &lines(10).replace("line 5\n", "ours 5\n"),
    );
    write(
        &b.theirs().join("a.txt"),
        &lines(10).replace("line 5\n", "theirs 5\n"),
    );
    let m = b.merge("out");
    assert_eq!(m.conflicts.len(), 1, "{m:?}");
    assert_eq!(
        (m.conflicts[0].path.as_str(), m.conflicts[0].kind),
        ("a.txt", ConflictKind::Content)
    );
    let a = fs::read_to_string(b.env.tmp.path().join("out/a.txt")).unwrap();
    assert!(
        a.contains("<<<<<<<")
            && a.contains("ours 5")
            && a.contains("theirs 5")
            && a.contains(">>>>>>>"),
        "{a}"
    );
}

#[test]
fn delete_against_modify_binary_mode_and_file_against_directory_are_conflicts() {
    let b = Branches::new(&[
        ("gone.txt", "x\n"),
        ("kept.txt", "x\n"),
        ("bin", "\0one"),
        ("mode.sh", "#!/bin/sh\n"),
        ("fd", "a file\n"),
    ]);
    // Delete vs modify, both ways.
    fs::remove_file(b.ours().join("gone.txt")).unwrap();
    write(&b.theirs().join("gone.txt"), "changed\n");
    write(&b.ours().join("kept.txt"), "changed\n");
    fs::remove_file(b.theirs().join("kept.txt")).unwrap();
    write(&b.ours().join("bin"), "\0ours");
    write(&b.theirs().join("bin"), "\0theirs");
    fs::set_permissions(b.ours().join("mode.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::set_permissions(
        b.theirs().join("mode.sh"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    // Ours makes `fd` a directory, theirs edits the file.
    fs::remove_file(b.ours().join("fd")).unwrap();
    write(&b.ours().join("fd/inside"), "i\n");
    write(&b.theirs().join("fd"), "edited\n");
    let m = b.merge("out");
    let mut got: Vec<(String, ConflictKind)> = m
        .conflicts
        .iter()
        .map(|c| (c.path.clone(), c.kind))
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            ("bin".to_string(), ConflictKind::Binary),
            ("fd".to_string(), ConflictKind::FileDirectory),
            ("gone.txt".to_string(), ConflictKind::DeleteModify),
            ("kept.txt".to_string(), ConflictKind::DeleteModify),
            ("mode.sh".to_string(), ConflictKind::Mode),
        ]
    );
    let out = b.env.tmp.path().join("out");
    // Never silently resolved: the modified side of delete/modify stays, ours otherwise.
    assert_eq!(
        fs::read_to_string(out.join("gone.txt")).unwrap(),
        "changed\n"
    );
    assert_eq!(
        fs::read_to_string(out.join("kept.txt")).unwrap(),
        "changed\n"
    );
    assert_eq!(fs::read(out.join("bin")).unwrap(), b"\0ours");
    assert_eq!(fs::read_to_string(out.join("fd/inside")).unwrap(), "i\n");
}

#[test]
fn a_target_that_is_not_empty_is_refused() {
    let b = Branches::new(&[("a", "1\n")]);
    write(&b.env.tmp.path().join("busy/x"), "mine\n");
    let o = b.env.snapshot(&b.ours()).id;
    let lock = b.env.repo.lock(true).unwrap();
    let e = tine_fs::merge(
        &lock,
        &o,
        &b.base,
        None,
        &b.env.tmp.path().join("busy"),
        "m",
        &NoProgress,
    )
    .unwrap_err();
    assert!(matches!(e, tine_fs::MergeError::NotEmpty { .. }), "{e}");
    assert_eq!(
        fs::read_to_string(b.env.tmp.path().join("busy/x")).unwrap(),
        "mine\n"
    );
}

/// Theirs turned a symlink ours kept into a directory (one empty, one with a
/// file): the merge makes real directories with theirs' modes and never
/// changes what the links pointed at, outside the target.
#[test]
fn a_link_theirs_made_a_directory_becomes_one_and_nothing_outside_is_touched() {
    let b = Branches::new(&[("a", "1\n")]);
    let outside = b.env.tmp.path().join("outside");
    fs::create_dir(&outside).unwrap();
    fs::set_permissions(&outside, fs::Permissions::from_mode(0o755)).unwrap();
    for side in [b.ours(), b.theirs()] {
        std::os::unix::fs::symlink(&outside, side.join("empty")).unwrap();
        std::os::unix::fs::symlink(&outside, side.join("full")).unwrap();
    }
    let base = b.env.snapshot(&b.ours()).id;
    for (name, mode) in [("empty", 0o700), ("full", 0o750)] {
        let p = b.theirs().join(name);
        fs::remove_file(&p).unwrap();
        fs::create_dir(&p).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
    }
    write(&b.theirs().join("full/f"), "inside\n");
    let o = b.env.snapshot(&b.ours()).id;
    let t = b.env.snapshot(&b.theirs()).id;
    let target = b.env.tmp.path().join("out");
    let lock = b.env.repo.lock(true).unwrap();
    let m = tine_fs::merge(&lock, &o, &t, Some(&base), &target, "m", &NoProgress).unwrap();
    drop(lock);
    assert_eq!(m.conflicts, vec![]);
    for (name, mode) in [("empty", 0o700), ("full", 0o750)] {
        let meta = fs::symlink_metadata(target.join(name)).unwrap();
        assert!(meta.is_dir(), "{name} is a directory");
        assert_eq!(meta.permissions().mode() & 0o7777, mode, "{name}'s mode");
    }
    assert_eq!(
        fs::read_to_string(target.join("full/f")).unwrap(),
        "inside\n"
    );
    let meta = fs::metadata(&outside).unwrap();
    assert_eq!(meta.permissions().mode() & 0o7777, 0o755, "outside's mode");
    assert_eq!(
        fs::read_dir(&outside).unwrap().count(),
        0,
        "outside is empty"
    );
}

/// A tree with file contents replaced by their length and hash (readable when it fails).
fn summary(root: &Path) -> Vec<(String, String)> {
    use std::hash::{DefaultHasher, Hash, Hasher};
    read_tree(root)
        .into_iter()
        .map(|(p, e)| {
            let d = match e {
                crate::common::Entry::File(c, mode) => {
                    let mut h = DefaultHasher::new();
                    c.hash(&mut h);
                    format!("file {} bytes {:x} mode {mode:o}", c.len(), h.finish())
                }
                other => format!("{other:?}"),
            };
            (p, d)
        })
        .collect()
}

fn build(root: &Path, m: &mut Model, ops: &[Op]) {
    for o in ops {
        if !matches!(o, Op::Snapshot | Op::Restore { .. }) {
            apply(root, m, o);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, max_shrink_iters: 100, ..ProptestConfig::default() })]

    /// Merging a branch with its own ancestor gives the branch, either way round.
    #[test]
    fn merging_a_branch_with_its_ancestor_gives_the_branch(
        first in prop::collection::vec(op(), 0..20),
        then in prop::collection::vec(op(), 0..20),
    ) {
        let env = Env::new();
        let root = env.dir("work");
        let mut model = Model::new();
        build(&root, &mut model, &first);
        let ancestor = env.snapshot(&root).id;
        build(&root, &mut model, &then);
        let branch = env.snapshot(&root).id;
        let want = summary(&root);
        for (k, (a, b)) in [(branch, ancestor), (ancestor, branch)].into_iter().enumerate() {
            let out = env.tmp.path().join(format!("out{k}"));
            let lock = env.repo.lock(true).unwrap();
            let m = tine_fs::merge(&lock, &a, &b, None, &out, "m", &NoProgress).unwrap();
            drop(lock);
            prop_assert_eq!(&m.conflicts, &vec![]);
            prop_assert_eq!(m.base, Some(ancestor));
            prop_assert_eq!(summary(&out), want.clone(), "merge {} into {}", k, k);
        }
    }
}
