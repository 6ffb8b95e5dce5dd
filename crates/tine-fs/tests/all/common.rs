use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use tine_fs::{SnapshotOptions, SnapshotOutcome};
use tine_store::{NoProgress, ObjectId, Repository};

/// A repository in its own temporary directory, apart from the directories under test.
pub struct Env {
    pub tmp: tempfile::TempDir,
    pub repo: Repository,
}

impl Env {
    pub fn new() -> Env {
        let tmp = tempfile::tempdir().unwrap();
        let repo = Repository::init(&tmp.path().join("repo")).unwrap();
        Env { tmp, repo }
    }

    pub fn dir(&self, name: &str) -> std::path::PathBuf {
        let d = self.tmp.path().join(name);
        fs::create_dir_all(&d).unwrap();
        d
    }

    pub fn snapshot(&self, dir: &Path) -> SnapshotOutcome {
        let lock = self.repo.lock(true).unwrap();
        tine_fs::snapshot(&lock, dir, &SnapshotOptions::default(), &NoProgress).unwrap()
    }

    pub fn restore(
        &self,
        id: &ObjectId,
        dir: &Path,
    ) -> Result<tine_fs::RestoreOutcome, tine_fs::RestoreError> {
        let lock = self.repo.lock(true).unwrap();
        // Exactly what was stored (the default drops set-user-ID bits; the
        // CLI's escape tests cover that).
        tine_fs::restore_with(
            &lock,
            id,
            dir,
            tine_fs::RestoreOptions::FAITHFUL,
            &NoProgress,
        )
    }
}

/// What a directory holds: path -> description of content, mode and type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    File(Vec<u8>, u32),
    Dir(u32),
    Symlink(Vec<u8>),
}

pub fn read_tree(root: &Path) -> BTreeMap<String, Entry> {
    let mut m = BTreeMap::new();
    walk(root, root, &mut m);
    m
}

fn walk(root: &Path, dir: &Path, m: &mut BTreeMap<String, Entry>) {
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let p = e.path();
        let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
        let md = fs::symlink_metadata(&p).unwrap();
        let mode = md.mode() & 0o7777;
        if md.file_type().is_symlink() {
            m.insert(
                rel,
                Entry::Symlink(
                    fs::read_link(&p)
                        .unwrap()
                        .into_os_string()
                        .into_encoded_bytes(),
                ),
            );
        } else if md.is_dir() {
            m.insert(rel, Entry::Dir(mode));
            walk(root, &p, m);
        } else {
            m.insert(rel, Entry::File(fs::read(&p).unwrap(), mode));
        }
    }
}

pub fn write_file(path: &Path, data: &[u8], mode: u32) {
    if let Some(p) = path.parent() {
        fs::create_dir_all(p).unwrap();
    }
    fs::write(path, data).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}
