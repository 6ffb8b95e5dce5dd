//! `tine remote add/ls/show/rm`, `tine push`, `tine pull`, `tine clone`: the
//! CLI over tine-remote. This is where the `AWS_*` variables are read (the
//! library never reads the environment).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use serde_json::json;
use tine_remote::{Connect, Credentials, Location, PushOptions, Remote};
use tine_store::{ErrorKind, ObjectId, RemoteRecord, Repository};

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

/// Settings to keep for a new remote: the flags, else the environment.
fn settings(url: &str, place: &Place) -> Result<BTreeMap<String, String>, CliError> {
    let mut s = BTreeMap::new();
    if matches!(Location::parse(url)?, Location::S3 { .. }) {
        if let Some(e) = place.endpoint.clone().or_else(|| env("AWS_ENDPOINT_URL")) {
            s.insert("endpoint".to_string(), e);
        }
        if let Some(r) = place
            .region
            .clone()
            .or_else(|| env("AWS_REGION"))
            .or_else(|| env("AWS_DEFAULT_REGION"))
        {
            s.insert("region".to_string(), r);
        }
    }
    Ok(s)
}

/// Everything to reach `rec` now: its kept settings (flags override them),
/// and credentials from the flags or the environment.
fn connect(rec: &RemoteRecord, args: &ConnectArgs) -> Result<Connect, CliError> {
    let mut c = Connect::new(&rec.url);
    c.settings = rec.settings.clone();
    if let Some(e) = &args.place.endpoint {
        c.settings.insert("endpoint".into(), e.clone());
    }
    if let Some(r) = &args.place.region {
        c.settings.insert("region".into(), r.clone());
    }
    c.retries = args.retries;
    let key = args
        .access_key_id
        .clone()
        .or_else(|| env("AWS_ACCESS_KEY_ID"));
    let secret = match &args.secret_access_key_file {
        Some(f) => Some(crate::output::read_secret("--secret-access-key-file", f)?),
        None => env("AWS_SECRET_ACCESS_KEY"),
    };
    c.credentials = match (key, secret) {
        (Some(access_key_id), Some(secret_access_key)) => Some(Credentials {
            access_key_id,
            secret_access_key,
            session_token: env("AWS_SESSION_TOKEN"),
        }),
        (None, None) => None,
        (Some(_), None) => {
            return Err(CliError::new(
                ErrorKind::InvalidInput,
                "an access key id without its secret: set AWS_SECRET_ACCESS_KEY or pass --secret-access-key-file",
            ));
        }
        (None, Some(_)) => {
            return Err(CliError::new(
                ErrorKind::InvalidInput,
                "a secret access key without its id: set AWS_ACCESS_KEY_ID or pass --access-key-id",
            ));
        }
    };
    Ok(c)
}

/// Remote names are directory names under the repository: the same plain
/// words as sandbox and workspace names.
fn check_name(name: &str) -> Result<(), CliError> {
    if tine_engine::valid_name(name) {
        return Ok(());
    }
    Err(CliError::new(
        ErrorKind::InvalidInput,
        format!(
            "remote name {name:?}: use 1-64 letters, digits, '-', '_' or '.', starting with a letter or digit"
        ),
    ))
}

fn state_dir(repo: &Repository, name: &str) -> PathBuf {
    repo.path().join("remotes").join(name)
}

/// The remote `name`, or the only one / `origin` when no name is given.
fn pick(repo: &Repository, name: Option<&str>) -> Result<RemoteRecord, CliError> {
    let all = repo.remotes()?;
    let names = || {
        if all.is_empty() {
            "there are none; add one with `tine remote add NAME URL`".to_string()
        } else {
            format!(
                "known: {}",
                all.iter()
                    .map(|r| r.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    };
    match name {
        Some(n) => all.iter().find(|r| r.name == n).cloned().ok_or_else(|| {
            CliError::new(
                ErrorKind::NotFound,
                format!("no remote named {n:?} ({})", names()),
            )
        }),
        None => match all.iter().find(|r| r.name == "origin") {
            Some(r) => Ok(r.clone()),
            None if all.len() == 1 => Ok(all[0].clone()),
            None => Err(CliError::new(
                ErrorKind::InvalidInput,
                format!("name the remote to use ({})", names()),
            )),
        },
    }
}

fn open(repo: &Repository, rec: &RemoteRecord, conn: &ConnectArgs) -> Result<Remote, CliError> {
    Ok(Remote::open(
        &rec.name,
        &connect(rec, conn)?,
        &state_dir(repo, &rec.name),
    )?)
}

fn rate(bytes: u64, took: Duration) -> String {
    let s = took.as_secs_f64();
    if s <= 0.0 {
        return String::new();
    }
    format!(", {:.1} MB/s", bytes as f64 / s / 1e6)
}

pub fn remote(repo: &Repository, cmd: RemoteCmd, json: bool) -> Result<(), CliError> {
    match cmd {
        RemoteCmd::Add {
            name,
            address: url,
            place,
        } => {
            check_name(&name)?;
            let rec = RemoteRecord {
                name: name.clone(),
                url: url.clone(),
                settings: settings(&url, &place)?,
            };
            tine_remote::check_settings(&rec.settings)?;
            let lock = repo.lock(true)?;
            lock.add_remote(&rec)?;
            crate::emit(json, serde_json::to_value(&rec).unwrap_or_default(), || {
                format!("remote {name} -> {url}\n")
            });
        }
        RemoteCmd::Ls => {
            let all = repo.remotes()?;
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
            let rec = pick(repo, Some(&name))?;
            let listing = open(repo, &rec, &conn)?.listing()?;
            crate::emit(
                json,
                json!({"remote": rec, "snapshots": listing.snapshots, "tags": listing.tags}),
                || {
                    let mut s = format!(
                        "{} ({}): {}, {}\n",
                        rec.name,
                        rec.url,
                        plural(listing.snapshots.len() as u64, "snapshot"),
                        plural(listing.tags.len() as u64, "tag")
                    );
                    for r in listing.snapshots.iter().rev() {
                        let tags: Vec<&str> = listing
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
                },
            );
        }
        RemoteCmd::Rm { name } => {
            let lock = repo.lock(true)?;
            if !lock.remove_remote(&name)? {
                return Err(CliError::new(
                    ErrorKind::NotFound,
                    format!("no remote named {name:?}"),
                ));
            }
            let _ = std::fs::remove_dir_all(state_dir(repo, &name));
            crate::emit(json, json!({"removed": name}), || {
                format!("removed remote {name}\n")
            });
        }
    }
    Ok(())
}

pub fn push(
    repo: &Repository,
    remote: Option<&str>,
    specs: &[String],
    conn: &ConnectArgs,
    up: &UploadArgs,
    json: bool,
    bars: &Bars,
) -> Result<(), CliError> {
    let rec = pick(repo, remote)?;
    // Nothing named: every snapshot and every tag.
    let tags_now = repo.tags()?;
    let (snapshots, tags): (Vec<ObjectId>, Vec<(String, ObjectId)>) = if specs.is_empty() {
        (
            repo.snapshots()?.into_iter().map(|s| s.id).collect(),
            tags_now,
        )
    } else {
        let mut snaps = Vec::new();
        let mut tags = Vec::new();
        for s in specs {
            let id = repo.resolve(s)?;
            snaps.push(id);
            if let Some((n, _)) = tags_now.iter().find(|(n, _)| n == s) {
                tags.push((n.clone(), id));
            }
        }
        (snaps, tags)
    };
    let opts = PushOptions {
        part_size: up.part_size,
        concurrency: up.concurrency,
        part_pause: Duration::from_millis(up.part_pause_ms),
    };
    let r = open(repo, &rec, conn)?;
    let start = Instant::now();
    let report = r.push(repo, &snapshots, &tags, &opts, bars)?;
    let took = start.elapsed();
    let mut doc = serde_json::to_value(&report).unwrap_or_default();
    doc["duration_ms"] = json!(took.as_secs_f64() * 1e3);
    crate::emit(json, doc, || {
        let mut s = String::new();
        if let Some(p) = &report.finished_earlier_pack {
            s.push_str(&format!(
                "finished pack {} left by an interrupted push{}\n",
                &p[..12],
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
                rec.name,
                plural(report.snapshots_already as u64, "snapshot"),
                size(report.bytes_sent)
            ));
        } else {
            s.push_str(&format!(
                "pushed {} to {} ({}): {} in {}, {} sent in {}{}\n",
                plural(report.snapshots_sent.len() as u64, "snapshot"),
                rec.name,
                rec.url,
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
    });
    Ok(())
}

fn pull_text(report: &tine_remote::PullReport, took: Duration) -> String {
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
    repo: &Repository,
    remote: Option<&str>,
    specs: &[String],
    conn: &ConnectArgs,
    json: bool,
    bars: &Bars,
) -> Result<(), CliError> {
    let rec = pick(repo, remote)?;
    let r = open(repo, &rec, conn)?;
    let start = Instant::now();
    let report = r.pull(repo, specs, bars)?;
    let took = start.elapsed();
    let mut doc = serde_json::to_value(&report).unwrap_or_default();
    doc["duration_ms"] = json!(took.as_secs_f64() * 1e3);
    crate::emit(json, doc, || pull_text(&report, took));
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
    let start = Instant::now();
    let result = (|| -> Result<tine_remote::PullReport, CliError> {
        std::fs::create_dir_all(&dir)
            .map_err(|e| CliError::new(ErrorKind::Io, format!("create {}: {e}", dir.display())))?;
        let repo = Repository::init(&repo_path)?;
        let rec = RemoteRecord {
            name: "origin".into(),
            url: url.to_string(),
            settings: settings(url, &conn.place)?,
        };
        tine_remote::check_settings(&rec.settings)?;
        repo.lock(true)?.add_remote(&rec)?;
        let r = open(&repo, &rec, conn)?;
        Ok(r.pull(&repo, &[], bars)?)
    })();
    match result {
        Ok(report) => {
            let took = start.elapsed();
            let abs = std::fs::canonicalize(&repo_path).unwrap_or(repo_path);
            let mut doc = serde_json::to_value(&report).unwrap_or_default();
            doc["repository"] = json!(abs);
            crate::emit(json, doc, || {
                format!(
                    "cloned {} into {}\n{}",
                    url,
                    abs.display(),
                    pull_text(&report, took)
                )
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
    let rec = pick(repo, Some(remote))?;
    let r = open(repo, &rec, conn)?;
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
