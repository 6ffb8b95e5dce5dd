//! tine-remote: snapshots that travel between machines through object storage.
//!
//! A remote is an S3-compatible bucket (`s3://bucket/prefix`) or a directory
//! (`file:///path`), reached through the `object_store` crate. Push sends only
//! the objects the remote lacks, as one new pack (frames copied as stored);
//! large packs go up in parts and an interrupted upload resumes from a local
//! state file. Pull fetches the packs that hold what is missing and verifies
//! every object by its hash before anything refers to it. The layout is in
//! [`layout`] and docs/FORMAT.md.
//!
//! The library is synchronous: a [`Remote`] owns a small tokio runtime.
#![forbid(unsafe_code)]

pub mod layout;
pub mod location;
mod pull;
mod push;
mod transport;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use object_store::ObjectStore;
use object_store::multipart::MultipartStore;
use object_store::path::Path as Key;
use tine_store::{ErrorKind, HasKind, ObjectError, ObjectId, OpenError, RecordError, WriteError};

pub use location::Location;
pub use pull::{PullReport, TagConflict};
pub use push::{PushOptions, PushReport, Resumed};

/// Connection settings a remote keeps (not secret).
pub const SETTING_KEYS: [&str; 2] = ["endpoint", "region"];

/// S3 credentials (never stored by tine; the CLI takes them from the usual
/// `AWS_*` variables or flags at each use).
#[derive(Clone)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .finish_non_exhaustive()
    }
}

/// Everything needed to reach a remote.
#[derive(Debug, Clone)]
pub struct Connect {
    pub url: String,
    /// `endpoint` (e.g. `http://127.0.0.1:8333`) and `region`.
    pub settings: BTreeMap<String, String>,
    /// None: anonymous requests (a public bucket, or a file remote).
    pub credentials: Option<Credentials>,
    /// Attempts after the first for a failing request.
    pub retries: usize,
    /// Longest wait for one request.
    pub timeout: Duration,
}

impl Connect {
    pub fn new(url: &str) -> Connect {
        Connect {
            url: url.to_string(),
            settings: BTreeMap::new(),
            credentials: None,
            retries: 3,
            timeout: Duration::from_secs(60),
        }
    }
}

/// Why a remote operation failed. Every variant names the remote's URL and,
/// where there is one, the key.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("remote URL {url:?} is not valid: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("remote setting {key:?} is not known (known: endpoint, region)")]
    BadSetting { key: String },
    #[error("cannot set up remote {url}: {reason}")]
    Setup { url: String, reason: String },
    #[error("remote endpoint {endpoint:?} refused: {reason}")]
    BadEndpoint { endpoint: String, reason: String },
    #[error(
        "remote {url} could not be reached ({op} {key}): {reason}; check the endpoint and that the server is up, then run the command again (an interrupted push resumes)"
    )]
    Unreachable {
        url: String,
        op: &'static str,
        key: String,
        reason: String,
    },
    #[error(
        "remote {url} refused the credentials ({op} {key}): {reason}; set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or pass --access-key-id/--secret-access-key-file"
    )]
    Denied {
        url: String,
        op: &'static str,
        key: String,
        reason: String,
    },
    #[error(
        "remote {url}: bucket {bucket} does not exist; create it first (for example `aws s3 mb s3://{bucket}`), tine never creates buckets"
    )]
    NoBucket { url: String, bucket: String },
    #[error("{url} is not a tine remote: {reason}")]
    NotARemote { url: String, reason: String },
    #[error("remote {url} has {key} damaged: {reason}; nothing of it was used")]
    Corrupt {
        url: String,
        key: String,
        reason: String,
    },
    #[error("remote {url} has no snapshot or tag {spec:?} (see `tine remote show`)")]
    NoSuchSnapshot { url: String, spec: String },
    #[error("{spec:?} matches several snapshots of remote {url}: {}; give more digits", candidates.join(", "))]
    Ambiguous {
        url: String,
        spec: String,
        candidates: Vec<String>,
    },
    #[error("another tine process is pushing to or pulling from remote {name} (lock {path})")]
    Busy { name: String, path: PathBuf },
    #[error("{step} {path}: {source}")]
    Io {
        step: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Write(#[from] WriteError),
    #[error(transparent)]
    Object(#[from] ObjectError),
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error(transparent)]
    Open(#[from] OpenError),
}

impl HasKind for RemoteError {
    fn kind(&self) -> ErrorKind {
        match self {
            RemoteError::BadUrl { .. }
            | RemoteError::BadSetting { .. }
            | RemoteError::BadEndpoint { .. }
            | RemoteError::Setup { .. } => ErrorKind::InvalidInput,
            RemoteError::Unreachable { .. } => ErrorKind::Unavailable,
            RemoteError::Denied { .. } => ErrorKind::Unauthorized,
            RemoteError::NotARemote { .. }
            | RemoteError::NoSuchSnapshot { .. }
            | RemoteError::NoBucket { .. } => ErrorKind::NotFound,
            RemoteError::Corrupt { .. } => ErrorKind::Corrupt,
            RemoteError::Ambiguous { .. } => ErrorKind::Ambiguous,
            RemoteError::Busy { .. } => ErrorKind::Locked,
            RemoteError::Io { .. } => ErrorKind::Io,
            RemoteError::Write(e) => e.kind(),
            RemoteError::Object(e) => e.kind(),
            RemoteError::Record(e) => e.kind(),
            RemoteError::Open(e) => e.kind(),
        }
    }
}

tine_store::from_io_at!(RemoteError, fn io);

/// An open remote: its store, its key prefix, and the local directory where
/// this repository keeps what it knows of it (cached indexes, upload state).
pub struct Remote {
    name: String,
    url: String,
    store: Arc<dyn ObjectStore>,
    /// The resumable part API (S3); None for a directory.
    multipart: Option<Arc<dyn MultipartStore>>,
    prefix: Key,
    state_dir: PathBuf,
    rt: tokio::runtime::Runtime,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("name", &self.name)
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// Checks that `settings` names only known keys, and that an `endpoint` is
/// an `http://` or `https://` URL of a host (no other scheme, no user
/// name, nothing a URL parser could read two ways).
pub fn check_settings(settings: &BTreeMap<String, String>) -> Result<(), RemoteError> {
    if let Some(k) = settings
        .keys()
        .find(|k| !SETTING_KEYS.contains(&k.as_str()))
    {
        return Err(RemoteError::BadSetting { key: k.clone() });
    }
    if let Some(e) = settings.get("endpoint") {
        endpoint_host(e)?;
    }
    if let Some(r) = settings.get("region")
        && (r.is_empty()
            || r.len() > 64
            || !r
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'))
    {
        // It becomes part of a host name where no endpoint is given.
        return Err(RemoteError::BadSetting {
            key: format!(
                "region (a-z, 0-9 and -, as AWS names them; {} bytes given)",
                r.len()
            ),
        });
    }
    Ok(())
}

/// The `host[:port]` requests for an S3 remote with `settings` go to: its
/// endpoint's, or AWS's for its region.
pub fn s3_host(settings: &BTreeMap<String, String>) -> Result<String, RemoteError> {
    match settings.get("endpoint") {
        Some(e) => endpoint_host(e),
        None => Ok(format!(
            "s3.{}.amazonaws.com",
            settings.get("region").map_or("us-east-1", |r| r.as_str())
        )),
    }
}

/// The `host[:port]` of endpoint URL `e`, refused unless it is a plain
/// `http(s)://host[:port][/path]`.
pub fn endpoint_host(e: &str) -> Result<String, RemoteError> {
    let bad = |reason: &str| RemoteError::BadEndpoint {
        endpoint: e.chars().take(200).collect(),
        reason: reason.to_string(),
    };
    if e.len() > 2048 {
        return Err(bad("over 2048 bytes"));
    }
    if e.chars()
        .any(|c| c.is_whitespace() || c.is_control() || c == '\\')
    {
        return Err(bad("it holds spaces, control characters or backslashes"));
    }
    // (Lower case, as the S3 client compares it.)
    let lower = e.to_ascii_lowercase();
    let rest = e
        .strip_prefix("https://")
        .or_else(|| e.strip_prefix("http://"))
        .map(|r| &lower[e.len() - r.len()..])
        .ok_or_else(|| bad("only http:// and https:// endpoints are reached"))?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    if authority.is_empty() {
        return Err(bad("it names no host"));
    }
    if authority.contains('@') {
        return Err(bad("a user name or password in the URL is not taken"));
    }
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        // [IPv6] or [IPv6]:port
        let (addr, after) = rest
            .split_once(']')
            .ok_or_else(|| bad("an IPv6 address without its closing bracket"))?;
        if addr.is_empty()
            || !addr
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        {
            return Err(bad("not an IPv6 address in brackets"));
        }
        match after {
            "" => (authority, None),
            a => (
                &authority[..authority.len() - a.len()],
                Some(
                    a.strip_prefix(':')
                        .ok_or_else(|| bad("junk after the IPv6 address"))?,
                ),
            ),
        }
    } else {
        if authority.contains('[') || authority.contains(']') {
            return Err(bad("brackets outside an IPv6 address"));
        }
        match authority.rsplit_once(':') {
            Some((h, _)) if h.contains(':') => {
                return Err(bad("an IPv6 address must be in brackets"));
            }
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err(bad("it names no host"));
    }
    if let Some(p) = port
        && p.parse::<u16>().is_err()
    {
        return Err(bad("its port is not a number up to 65535"));
    }
    Ok(authority.to_string())
}

impl Remote {
    /// Connects to the remote `name` described by `c`; `state_dir` is this
    /// repository's private directory for it (created if missing). Nothing is
    /// sent until an operation runs.
    pub fn open(name: &str, c: &Connect, state_dir: &Path) -> Result<Remote, RemoteError> {
        check_settings(&c.settings)?;
        let location = Location::parse(&c.url)?;
        let setup = |reason: String| RemoteError::Setup {
            url: c.url.clone(),
            reason,
        };
        let (store, multipart, prefix): (
            Arc<dyn ObjectStore>,
            Option<Arc<dyn MultipartStore>>,
            Key,
        ) = match &location {
            Location::S3 { bucket, prefix } => {
                let endpoint = c.settings.get("endpoint");
                let mut b = object_store::aws::AmazonS3Builder::new()
                    .with_bucket_name(bucket)
                    .with_region(c.settings.get("region").map_or("us-east-1", |r| r.as_str()))
                    .with_virtual_hosted_style_request(false)
                    .with_retry(object_store::RetryConfig {
                        backoff: object_store::BackoffConfig {
                            init_backoff: Duration::from_millis(100),
                            max_backoff: Duration::from_secs(2),
                            base: 2.0,
                        },
                        max_retries: c.retries,
                        retry_timeout: c.timeout,
                    })
                    .with_client_options(
                        object_store::ClientOptions::new()
                            .with_timeout(c.timeout)
                            .with_connect_timeout(Duration::from_secs(5))
                            .with_allow_http(endpoint.is_some_and(|e| e.starts_with("http://"))),
                    );
                if let Some(e) = endpoint {
                    b = b.with_endpoint(e);
                }
                match &c.credentials {
                    Some(cr) => {
                        b = b
                            .with_access_key_id(&cr.access_key_id)
                            .with_secret_access_key(&cr.secret_access_key);
                        if let Some(t) = &cr.session_token {
                            b = b.with_token(t);
                        }
                    }
                    None => b = b.with_skip_signature(true),
                }
                let s3 = Arc::new(b.build().map_err(|e| setup(e.to_string()))?);
                let key = Key::parse(prefix).map_err(|e| setup(e.to_string()))?;
                (s3.clone(), Some(s3), key)
            }
            Location::File { path } => {
                // Keys are absolute paths: opening creates nothing, a missing
                // directory reads as empty, and a first push makes it.
                let rel = path.to_string_lossy();
                let key =
                    Key::parse(rel.trim_start_matches('/')).map_err(|e| setup(e.to_string()))?;
                (
                    Arc::new(object_store::local::LocalFileSystem::new()),
                    None,
                    key,
                )
            }
        };
        Remote::with_store(name, &c.url, store, multipart, prefix, state_dir)
    }

    /// A remote over any store (tests use `object_store::memory::InMemory`).
    pub fn with_store(
        name: &str,
        url: &str,
        store: Arc<dyn ObjectStore>,
        multipart: Option<Arc<dyn MultipartStore>>,
        prefix: Key,
        state_dir: &Path,
    ) -> Result<Remote, RemoteError> {
        // The index cache lives here too.
        std::fs::create_dir_all(state_dir.join("idx"))
            .map_err(io("create remote state directory", state_dir))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(io("start the remote runtime", state_dir))?;
        Ok(Remote {
            name: name.to_string(),
            url: url.to_string(),
            store,
            multipart,
            prefix,
            state_dir: state_dir.to_path_buf(),
            rt,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// One push or pull at a time per remote and repository: the upload state
    /// and the index cache are shared.
    fn lock(&self) -> Result<File, RemoteError> {
        let path = self.state_dir.join("lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io("open remote lock", &path))?;
        match f.try_lock() {
            Ok(()) => Ok(f),
            Err(std::fs::TryLockError::WouldBlock) => Err(RemoteError::Busy {
                name: self.name.clone(),
                path,
            }),
            Err(std::fs::TryLockError::Error(e)) => Err(io("lock remote state", &path)(e)),
        }
    }

    /// Writes the record of a suspended workspace (after its snapshot was pushed).
    pub fn put_workspace(&self, name: &str, record: &[u8]) -> Result<u64, RemoteError> {
        let _lock = self.lock()?;
        self.rt.block_on(async {
            self.check_marker(true).await?;
            let key = self.key(&[layout::WORKSPACES, name]);
            self.put_small(&key, record.to_vec()).await
        })
    }

    /// The record of workspace `name`, if the remote has one.
    pub fn workspace(&self, name: &str) -> Result<Option<Vec<u8>>, RemoteError> {
        self.rt.block_on(async {
            self.check_marker(false).await?;
            let key = self.key(&[layout::WORKSPACES, name]);
            self.get_small(&key, layout::MAX_WORKSPACE).await
        })
    }

    /// The snapshots and tags the remote holds.
    pub fn listing(&self) -> Result<Listing, RemoteError> {
        self.rt.block_on(async {
            self.check_marker(false).await?;
            let snapshots = self.records().await?;
            let tags = self.tags().await?;
            Ok(Listing { snapshots, tags })
        })
    }
}

/// What a remote holds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Listing {
    pub snapshots: Vec<layout::SnapshotRecord>,
    pub tags: Vec<(String, ObjectId)>,
}

#[cfg(test)]
mod endpoint_tests {
    use super::*;

    #[test]
    fn endpoints_are_http_urls_of_a_host_and_nothing_else() {
        for (e, host) in [
            ("http://127.0.0.1:8333", "127.0.0.1:8333"),
            ("https://S3.Example.com/path", "s3.example.com"),
            ("http://[::1]", "[::1]"),
            ("http://[::1]:9000/x", "[::1]:9000"),
        ] {
            assert_eq!(endpoint_host(e).unwrap(), host, "{e}");
        }
        for e in [
            "file:///etc/passwd",
            "HTTP://127.0.0.1",
            "http://user@host",
            "http://",
            "http://h:99999",
            "http://a]:80",
            "http://[x]y:80",
            "http://[::1",
            "http://::1:80",
            "http://h\r\n:80",
            "gopher://h",
        ] {
            assert!(endpoint_host(e).is_err(), "{e}");
        }
        let mut s = BTreeMap::new();
        s.insert("region".to_string(), "x@10.0.0.5:443/".to_string());
        assert!(check_settings(&s).is_err());
        s.insert("region".to_string(), "eu-west-3".to_string());
        assert!(check_settings(&s).is_ok());
        assert_eq!(s3_host(&s).unwrap(), "s3.eu-west-3.amazonaws.com");
    }
}
