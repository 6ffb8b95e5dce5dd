//! The mark a rollback of a sandbox's processes leaves for the `tine exec`
//! sessions whose commands it ended: a file in the sandbox's directory, one
//! line (how many such rollbacks, and the snapshot of the last). A session
//! opens the directory before it joins the sandbox (whose root hides the
//! repository) and reads the mark through it when its command is killed, so
//! that it can say why instead of ending without a word.

use std::io;
use std::os::fd::OwnedFd;

use rustix::fs::{Mode, OFlags};
use tine_store::ObjectId;

use crate::SandboxDirs;

const MARK: &str = "rolled-back";

/// Records that the sandbox's processes were rolled back to `snap`.
pub fn mark(dirs: &SandboxDirs, snap: &ObjectId) -> io::Result<()> {
    let path = dirs.root.join(MARK);
    let n = std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(0);
    std::fs::write(&path, format!("{} {}\n", n + 1, snap.to_hex()))
}

/// A sandbox's mark as it was when a session began.
#[derive(Debug)]
pub struct RollbackWatch {
    dir: OwnedFd,
    before: Option<String>,
}

impl RollbackWatch {
    /// Watches the sandbox of `dirs` (call before joining it).
    pub fn open(dirs: &SandboxDirs) -> io::Result<RollbackWatch> {
        let dir = rustix::fs::open(
            &dirs.root,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let before = read(&dir);
        Ok(RollbackWatch { dir, before })
    }

    /// The snapshot the sandbox's processes were rolled back to since the
    /// watch began, if they were (the last one, when several).
    pub fn rolled_back_to(&self) -> Option<String> {
        let now = read(&self.dir)?;
        (Some(&now) != self.before.as_ref()).then(|| {
            now.split_whitespace()
                .nth(1)
                .unwrap_or_default()
                .to_string()
        })
    }
}

fn read(dir: &OwnedFd) -> Option<String> {
    let fd = rustix::fs::openat(
        dir,
        MARK,
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::empty(),
    )
    .ok()?;
    let mut s = String::new();
    io::Read::read_to_string(&mut std::fs::File::from(fd), &mut s).ok()?;
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_sees_rollbacks_made_after_it_began_and_names_the_last() {
        let tmp = tempfile::tempdir().unwrap();
        let dirs = SandboxDirs {
            root: tmp.path().to_path_buf(),
        };
        let a = ObjectId::compute(tine_store::Kind::Blob, b"a");
        let b = ObjectId::compute(tine_store::Kind::Blob, b"b");
        mark(&dirs, &a).unwrap();
        let w = RollbackWatch::open(&dirs).unwrap();
        assert_eq!(w.rolled_back_to(), None);
        mark(&dirs, &b).unwrap();
        mark(&dirs, &a).unwrap();
        assert_eq!(w.rolled_back_to(), Some(a.to_hex()));
        // A watch begun before the first rollback ever sees it too.
        let tmp2 = tempfile::tempdir().unwrap();
        let fresh = SandboxDirs {
            root: tmp2.path().to_path_buf(),
        };
        let w = RollbackWatch::open(&fresh).unwrap();
        assert_eq!(w.rolled_back_to(), None);
        mark(&fresh, &b).unwrap();
        assert_eq!(w.rolled_back_to(), Some(b.to_hex()));
    }
}
