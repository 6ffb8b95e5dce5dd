//! Restoring into a read-only or full filesystem fails clearly; the repository is unharmed.
//! These need root to mount tmpfs; elsewhere they say so and pass vacuously.

use std::path::Path;
use std::process::Command;

use tine_store::{ErrorKind, HasKind, NoProgress};

use crate::common::{Env, is_root, read_tree, write_file};

struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn mount_tmpfs(dir: &Path, opts: &str) -> Option<Mount> {
    if !is_root() {
        tine_testkit::skip("mounting tmpfs needs root");
        return None;
    }
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", opts, "tmpfs"])
        .arg(dir)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        tine_testkit::skip("cannot mount tmpfs here");
        return None;
    }
    Some(Mount(dir.to_path_buf()))
}

fn check_repo_unharmed(env: &Env, snap: &tine_store::ObjectId, expect: &Path) {
    let r = tine_store::fsck(&env.repo, &NoProgress).unwrap();
    assert!(r.is_clean(), "{r:?}");
    let elsewhere = env.dir("elsewhere");
    env.restore(snap, &elsewhere).unwrap();
    assert_eq!(read_tree(&elsewhere), read_tree(expect));
}

#[test]
fn read_only_target_fails_naming_the_path() {
    let env = Env::new();
    let src = env.dir("src");
    write_file(&src.join("d/a.txt"), b"hello", 0o644);
    let snap = env.snapshot(&src).id;
    let target = env.dir("ro");
    let Some(_m) = mount_tmpfs(&target, "ro,size=1m") else {
        return;
    };
    let err = env.restore(&snap, &target).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Io, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&target.display().to_string()) && msg.contains("Read-only"),
        "{msg}"
    );
    check_repo_unharmed(&env, &snap, &src);
}

#[test]
fn full_target_fails_naming_the_path() {
    let env = Env::new();
    let src = env.dir("src");
    let big: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    write_file(&src.join("big.bin"), &big, 0o644);
    let snap = env.snapshot(&src).id;
    let target = env.dir("full");
    let Some(_m) = mount_tmpfs(&target, "size=256k") else {
        return;
    };
    let err = env.restore(&snap, &target).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Io, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("big.bin") && msg.contains("No space left"),
        "{msg}"
    );
    check_repo_unharmed(&env, &snap, &src);
}

/// `fork` clones files with reflinks on a filesystem that has them (XFS on a loop device).
#[test]
fn fork_uses_reflinks_where_the_filesystem_has_them() {
    if !is_root() || Command::new("mkfs.xfs").arg("-V").output().is_err() {
        tine_testkit::skip("needs root and mkfs.xfs (xfsprogs)");
        return;
    }
    let env = Env::new();
    let img = env.tmp.path().join("xfs.img");
    // Sparse: mkfs.xfs wants at least 300 MiB, but almost none of it is written.
    std::fs::File::create(&img)
        .unwrap()
        .set_len(512 << 20)
        .unwrap();
    assert!(
        Command::new("mkfs.xfs")
            .args(["-q", "-m", "reflink=1"])
            .arg(&img)
            .status()
            .unwrap()
            .success()
    );
    let mnt = env.dir("xfs");
    if !Command::new("mount")
        .args(["-o", "loop"])
        .arg(&img)
        .arg(&mnt)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
    {
        tine_testkit::skip("cannot mount a loop device here");
        return;
    }
    let _m = Mount(mnt.clone());
    let src = env.dir("src");
    write_file(&src.join("a/big.bin"), &vec![7u8; 3 << 20], 0o640);
    write_file(&src.join("small.txt"), b"s", 0o600);
    let snap = env.snapshot(&src).id;
    let lock = env.repo.lock(true).unwrap();
    let out = tine_fs::fork(
        &lock,
        &snap,
        &mnt.join("forks"),
        3,
        Default::default(),
        &NoProgress,
    )
    .unwrap();
    assert_eq!(out.method, "reflink");
    for d in &out.dirs {
        assert_eq!(read_tree(d), read_tree(&src));
    }
}
