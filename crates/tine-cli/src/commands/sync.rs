//! `tine remote add/ls/show/rm`, `tine push`, `tine pull`, `tine clone`: the
//! CLI over the engine's remotes (local, or a daemon's with `--url`). This is
//! where the `AWS_*` variables are read (the libraries never read the
//! environment).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Subcommand};
use serde_json::json;
use tine_engine::{AddRemote, PullRequest, Pulled, PushRequest, Pushed, RemoteAccess, RemoteShow};
use tine_remote::{Credentials, Location, PushOptions, Remote};
use tine_store::{ErrorKind, RemoteRecord, Repository};

use crate::commands::{Cx, Ops};
use crate::output::{Bars, CliError, duration, plural, size};

#[derive(Debug, Subcommand)]
pub enum RemoteCmd {
    /// Name a remote: s3://bucket/prefix or file:///path.
    Add {
        name: String,
        #[arg(value_name = "URL")]
        address: String,
        #[command(flatten)]
        place: Place,
    },
    /// List the remotes.
    Ls,
    /// What a remote holds: its snapshots and tags.
    Show {
        name: String,
        #[command(flatten)]
        conn: ConnectArgs,
    },
    /// Forget a remote (what it holds stays where it is).
    Rm { name: String },
}

/// Where an S3-compatible service is (kept with the remote).
#[derive(Debug, Clone, Args, Default)]
pub struct Place {
    /// The S3 endpoint, e.g. http://127.0.0.1:8333 (default: AWS_ENDPOINT_URL, else AWS itself).
    #[arg(long, value_name = "URL")]
    pub endpoint: Option<String>,
    /// The S3 region (default: AWS_REGION, else us-east-1).
    #[arg(long)]
    pub region: Option<String>,
}

/// How to reach a remote for one command. Credentials are never stored: they
/// come from these flags or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
/// AWS_SESSION_TOKEN.
#[derive(Debug, Clone, Args, Default)]
pub struct ConnectArgs {
    #[command(flatten)]
    pub place: Place,
    /// S3 access key id (default: AWS_ACCESS_KEY_ID).
    #[arg(long, value_name = "ID")]
    pub access_key_id: Option<String>,
    /// File holding the S3 secret access key (default: AWS_SECRET_ACCESS_KEY).
    #[arg(long, value_name = "FILE")]
    pub secret_access_key_file: Option<PathBuf>,
    /// Attempts after the first for a failing request.
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub retries: usize,
}

/// How a push uploads.
#[derive(Debug, Clone, Args)]
pub struct UploadArgs {
    /// Packs larger than this go up in parts of this size, resumable (S3 needs >= 5M).
    #[arg(long, default_value = "16M", value_name = "SIZE", value_parser = crate::commands::sandbox::parse_size)]
    pub part_size: u64,
    /// Parts in flight at once.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub concurrency: usize,
    /// Wait this long before each part (tests interrupt an upload with it).
    #[arg(long, default_value_t = 0, hide = true, value_name = "MS")]
    pub part_pause_ms: u64,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Place {
    /// The flags, else the environment.
    fn endpoint(&self) -> Option<String> {
        self.endpoint.clone().or_else(|| env("AWS_ENDPOINT_URL"))
    }
    fn region(&self) -> Option<String> {
        self.region
            .clone()
            .or_else(|| env("AWS_REGION"))
            .or_else(|| env("AWS_DEFAULT_REGION"))
    }
}

impl ConnectArgs {
    /// Whether any flag says how to reach a remote (a daemon reaches its
    /// remotes its own way).
    fn given(&self) -> bool {
        self.place.endpoint.is_some()
            || self.place.region.is_some()
            || self.access_key_id.is_some()
            || self.secret_access_key_file.is_some()
    }
}

/// S3 credentials from the environment alone (the daemon's, at start).
pub fn env_credentials() -> Result<Option<Credentials>, CliError> {
    credentials(env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY"))
}

fn credentials(
    key: Option<String>,
    secret: Option<String>,
) -> Result<Option<Credentials>, CliError> {
    match (key, secret) {
        (Some(access_key_id), Some(secret_access_key)) => Ok(Some(Credentials {
            access_key_id,
            secret_access_key,
            session_token: env("AWS_SESSION_TOKEN"),
        })),
        (None, None) => Ok(None),
        (Some(_), None) => Err(CliError::new(
            ErrorKind::InvalidInput,
            "an access key id without its secret: set AWS_SECRET_ACCESS_KEY or pass --secret-access-key-file",
        )),
        (None, Some(_)) => Err(CliError::new(
            ErrorKind::InvalidInput,
            "a secret access key without its id: set AWS_ACCESS_KEY_ID or pass --access-key-id",
        )),
    }
}

/// How to reach remotes for one command: the flags (over each remote's kept
/// settings), and credentials from the flags or the environment. Credentials
/// are never stored.
fn access(args: &ConnectArgs) -> Result<RemoteAccess, CliError> {
    let key = args
        .access_key_id
        .clone()
        .or_else(|| env("AWS_ACCESS_KEY_ID"));
    let secret = match &args.secret_access_key_file {
        Some(f) => Some(crate::output::read_secret("--secret-access-key-file", f)?),
        None => env("AWS_SECRET_ACCESS_KEY"),
    };
    let mut overrides = BTreeMap::new();
    if let Some(e) = &args.place.endpoint {
        overrides.insert("endpoint".into(), e.clone());
    }
    if let Some(r) = &args.place.region {
        overrides.insert("region".into(), r.clone());
    }
    Ok(RemoteAccess {
        credentials: credentials(key, secret)?,
        overrides,
        retries: args.retries,
        file_roots: None,
        endpoints: None,
    })
}

/// The operations for a remote command: a local engine reaching remotes as
/// `conn` says, or the daemon (which reaches them with its own settings).
fn ops<'a>(cx: &'a Cx<'_>, conn: &ConnectArgs) -> Result<Ops<'a>, CliError> {
    let mut ops = cx.ops()?;
    match &mut ops {
        Ops::Local(engine) => engine.config_mut().remote_access = access(conn)?,
        Ops::Daemon(c) if conn.given() => {
            return Err(CliError::new(
                ErrorKind::InvalidInput,
                format!(
                    "the daemon at {} reaches remotes with its own credentials and settings; drop --endpoint, --region, --access-key-id and --secret-access-key-file",
                    c.url()
                ),
            ));
        }
        Ops::Daemon(_) => {}
    }
    Ok(ops)
}

fn add_request(name: &str, url: &str, place: &Place) -> Result<AddRemote, CliError> {
    let s3 = matches!(Location::parse(url)?, Location::S3 { .. });
    Ok(AddRemote {
        name: name.to_string(),
        url: url.to_string(),
        endpoint: if s3 { place.endpoint() } else { None },
        region: if s3 { place.region() } else { None },
    })
}

fn rate(bytes: u64, took: Duration) -> String {
    let s = took.as_secs_f64();
    if s <= 0.0 {
        return String::new();
    }
    format!(", {:.1} MB/s", bytes as f64 / s / 1e6)
}

fn show_text(show: &RemoteShow) -> String {
    let mut s = format!(
        "{} ({}): {}, {}\n",
        show.remote.name,
        show.remote.url,
        plural(show.snapshots.len() as u64, "snapshot"),
        plural(show.tags.len() as u64, "tag")
    );
    for r in show.snapshots.iter().rev() {
        let tags: Vec<&str> = show
            .tags
            .iter()
            .filter(|(_, id)| id.to_hex() == r.id)
            .map(|(n, _)| n.as_str())
            .collect();
        s.push_str(&format!(
            "{} {} {:>10} {}{}\n",
            &r.id[..12],
            crate::output::time(r.time_ns),
            size(r.bytes),
            r.message,
            if tags.is_empty() {
                String::new()
            } else {
                format!(" ({})", tags.join(", "))
            }
        ));
    }
    s
}

pub fn remote(cx: &Cx<'_>, cmd: RemoteCmd) -> Result<(), CliError> {
    let json = cx.json;
    match cmd {
        RemoteCmd::Add {
            name,
            address: url,
            place,
        } => {
            let rec = cx
                .ops()?
                .add_remote(&add_request(&name, &url, &place)?, &cx.ctx)?;
            crate::emit(json, serde_json::to_value(&rec).unwrap_or_default(), || {
                format!("remote {name} -> {url}\n")
            });
        }
        RemoteCmd::Ls => {
            let all = cx.ops()?.remotes()?;
            crate::emit(json, serde_json::to_value(&all).unwrap_or_default(), || {
                if all.is_empty() {
                    return "(no remotes)\n".to_string();
                }
                all.iter()
                    .map(|r| {
                        let extra: Vec<String> =
                            r.settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
                        format!("{:<12} {} {}\n", r.name, r.url, extra.join(" "))
                    })
                    .collect()
            });
        }
        RemoteCmd::Show { name, conn } => {
            let show = ops(cx, &conn)?.remote_show(&name)?;
            crate::emit(
                json,
                serde_json::to_value(&show).unwrap_or_default(),
                || show_text(&show),
            );
        }
        RemoteCmd::Rm { name } => {
            cx.ops()?.remove_remote(&name, &cx.ctx)?;
            crate::emit(json, json!({"removed": name}), || {
                format!("removed remote {name}\n")
            });
        }
    }
    Ok(())
}

fn push_text(p: &Pushed) -> String {
    let report = &p.report;
    let took = Duration::from_secs_f64(p.duration_ms / 1e3);
    let mut s = String::new();
    if let Some(pack) = &report.finished_earlier_pack {
        s.push_str(&format!(
            "finished pack {} left by an interrupted push{}\n",
            &pack[..12],
            match &report.resumed {
                Some(r) => format!(
                    " ({} of {} parts, {}, were already there)",
                    r.parts_already_sent,
                    r.parts,
                    size(r.bytes_already_sent)
                ),
                None => String::new(),
            }
        ));
    }
    if report.snapshots_sent.is_empty() && report.tags_sent.is_empty() {
        s.push_str(&format!(
            "{} is up to date ({} there already); sent {}\n",
            report.remote,
            plural(report.snapshots_already as u64, "snapshot"),
            size(report.bytes_sent)
        ));
    } else {
        s.push_str(&format!(
            "pushed {} to {} ({}): {} in {}, {} sent in {}{}\n",
            plural(report.snapshots_sent.len() as u64, "snapshot"),
            report.remote,
            report.url,
            plural(report.objects_sent, "new object"),
            if report.pack.is_some() {
                "1 pack"
            } else {
                "no pack"
            },
            size(report.bytes_sent),
            duration(took),
            rate(report.bytes_sent, took)
        ));
        if !report.tags_sent.is_empty() {
            s.push_str(&format!("tags: {}\n", report.tags_sent.join(", ")));
        }
    }
    s
}

pub fn push(
    cx: &Cx<'_>,
    remote: Option<&str>,
    specs: &[String],
    conn: &ConnectArgs,
    up: &UploadArgs,
) -> Result<(), CliError> {
    let req = PushRequest {
        remote: remote.map(str::to_string),
        snapshots: specs.to_vec(),
        part_size: up.part_size,
        concurrency: up.concurrency,
        part_pause: Duration::from_millis(up.part_pause_ms),
    };
    let out = ops(cx, conn)?.push(&req, &cx.ctx)?;
    crate::emit(
        cx.json,
        serde_json::to_value(&out).unwrap_or_default(),
        || push_text(&out),
    );
    Ok(())
}

fn pull_text(p: &Pulled) -> String {
    let report = &p.report;
    let took = Duration::from_secs_f64(p.duration_ms / 1e3);
    let mut s = if report.snapshots_received.is_empty() {
        format!(
            "up to date with {} ({} here already)\n",
            report.remote,
            plural(report.snapshots_already as u64, "snapshot")
        )
    } else {
        format!(
            "pulled {} from {}: {}, {} received in {}{}, {} verified\n",
            plural(report.snapshots_received.len() as u64, "snapshot"),
            report.remote,
            plural(report.packs.len() as u64, "pack"),
            size(report.bytes_received),
            duration(took),
            rate(report.bytes_received, took),
            plural(report.objects_verified, "object")
        )
    };
    if !report.tags_set.is_empty() {
        s.push_str(&format!("tags: {}\n", report.tags_set.join(", ")));
    }
    for c in &report.tags_kept {
        s.push_str(&format!(
            "tag {} kept at {} (the remote has it at {})\n",
            c.name,
            &c.local[..12],
            &c.remote[..12]
        ));
    }
    s
}

pub fn pull(
    cx: &Cx<'_>,
    remote: Option<&str>,
    specs: &[String],
    conn: &ConnectArgs,
) -> Result<(), CliError> {
    let req = PullRequest {
        remote: remote.map(str::to_string),
        snapshots: specs.to_vec(),
    };
    let out = ops(cx, conn)?.pull(&req, &cx.ctx)?;
    crate::emit(
        cx.json,
        serde_json::to_value(&out).unwrap_or_default(),
        || pull_text(&out),
    );
    Ok(())
}

/// `tine clone URL [DIR]`: a new repository in DIR/.tine (DIR new or empty)
/// with the remote as `origin`, and everything it holds. A clone that fails
/// removes what it made.
pub fn clone(
    url: &str,
    dir: Option<&Path>,
    conn: &ConnectArgs,
    json: bool,
    bars: &Bars,
) -> Result<(), CliError> {
    let loc = Location::parse(url)?;
    let dir = dir
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(loc.default_dir_name()));
    let existed = dir.exists();
    if existed
        && std::fs::read_dir(&dir)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        return Err(CliError::new(
            ErrorKind::AlreadyExists,
            format!(
                "{} exists and is not empty; clone into a new or empty directory",
                dir.display()
            ),
        ));
    }
    let repo_path = dir.join(".tine");
    let result = (|| -> Result<Pulled, CliError> {
        std::fs::create_dir_all(&dir)
            .map_err(|e| CliError::new(ErrorKind::Io, format!("create {}: {e}", dir.display())))?;
        Repository::init(&repo_path)?;
        let mut engine = crate::commands::local_engine(&repo_path)?;
        engine.config_mut().remote_access = access(conn)?;
        let ctx = tine_engine::Ctx {
            progress: bars,
            wait: true,
        };
        Ok(engine.clone_remote(&add_request("origin", url, &conn.place)?, &ctx)?)
    })();
    match result {
        Ok(out) => {
            let abs = std::fs::canonicalize(&repo_path).unwrap_or(repo_path);
            let mut doc = serde_json::to_value(&out).unwrap_or_default();
            doc["repository"] = json!(abs);
            crate::emit(json, doc, || {
                format!("cloned {} into {}\n{}", url, abs.display(), pull_text(&out))
            });
            Ok(())
        }
        Err(e) => {
            if existed {
                let _ = std::fs::remove_dir_all(&repo_path);
            } else {
                let _ = std::fs::remove_dir_all(&dir);
            }
            Err(e)
        }
    }
}

/// The engine and the named remote, for a workspace's trip.
fn engine_and_remote(
    repo_path: &Path,
    repo: &Repository,
    remote: &str,
    conn: &ConnectArgs,
) -> Result<(tine_engine::Engine, RemoteRecord, Remote), CliError> {
    let rec = tine_engine::remotes::pick(repo, Some(remote))?;
    let r = tine_engine::remotes::open(repo, &rec, &access(conn)?)?;
    Ok((crate::commands::local_engine(repo_path)?, rec, r))
}

/// `tine suspend NAME --to REMOTE`.
pub fn suspend_to(
    (repo_path, repo): (&Path, &Repository),
    name: &str,
    remote: &str,
    conn: &ConnectArgs,
    json: bool,
    bars: &Bars,
) -> Result<(), CliError> {
    let (engine, rec, r) = engine_and_remote(repo_path, repo, remote, conn)?;
    let out = engine.suspend_workspace_to(name, &r, &PushOptions::default(), bars)?;
    crate::emit(json, serde_json::to_value(&out).unwrap_or_default(), || {
        format!(
            "{}pushed its state to {} ({}): {} sent\n",
            crate::commands::workspace::suspended_text(name, &out.suspended),
            rec.name,
            rec.url,
            size(out.push.bytes_sent)
        )
    });
    Ok(())
}

/// `tine resume NAME --from REMOTE`.
pub fn resume_from(
    (repo_path, repo): (&Path, &Repository),
    name: &str,
    remote: &str,
    conn: &ConnectArgs,
    json: bool,
    bars: &Bars,
) -> Result<(), CliError> {
    let (engine, _, r) = engine_and_remote(repo_path, repo, remote, conn)?;
    let out = engine.resume_workspace_from(name, &r, bars)?;
    crate::emit(json, serde_json::to_value(&out).unwrap_or_default(), || {
        crate::commands::workspace::resumed_text(name, &out)
    });
    Ok(())
}
