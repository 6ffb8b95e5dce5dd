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
        eprintln!("skipped: mounting tmpfs needs root");
        return None;
    }
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", opts, "tmpfs"])
        .arg(dir)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("skipped: cannot mount tmpfs here");
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
