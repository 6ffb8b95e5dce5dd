//! `tine serve`: the HTTP daemon, over the same engine the CLI uses.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tine_server::{AuditEntry, Event, Log, ServerConfig, TokenSource};
use tine_store::ErrorKind;

use crate::output::CliError;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on; anything but loopback needs --token-file.
    #[arg(long, default_value = "127.0.0.1:7777", value_name = "ADDR:PORT")]
    pub listen: SocketAddr,
    /// The bearer token's file (default: REPO/server.token, made at the first
    /// start with a random token, mode 0600).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Live sandboxes at most; creating or forking more answers 503 (capacity).
    #[arg(long, value_name = "N")]
    pub max_sandboxes: Option<usize>,
    /// A host directory sandboxes may be created from (repeatable; none by
    /// default: a client with the token could otherwise read any directory).
    #[arg(long = "import-root", value_name = "DIR")]
    pub import_roots: Vec<PathBuf>,
    /// A host directory that `file://` remotes named through the API may be
    /// under (repeatable; none by default: a client with the token could
    /// otherwise write anywhere the daemon can). S3 remotes are reached with
    /// the AWS_* credentials of the daemon's environment at start.
    #[arg(long = "remote-root", value_name = "DIR")]
    pub remote_roots: Vec<PathBuf>,
    /// An S3 endpoint (`HOST[:PORT]`, repeatable) that remotes may name;
    /// given, no other is reached (default: any http:// or https:// one).
    #[arg(long = "remote-endpoint", value_name = "HOST[:PORT]")]
    pub remote_endpoints: Vec<String>,
    /// A name this daemon is reached by (`Host`, with or without the port),
    /// which `/mcp` takes besides loopback names (repeatable). The address
    /// given to --listen, when it is not loopback or unspecified, is taken
    /// anyway.
    #[arg(long = "mcp-host", value_name = "NAME")]
    pub mcp_hosts: Vec<String>,
    /// Largest request body (file writes).
    #[arg(long, default_value = "256M", value_parser = crate::commands::sandbox::parse_size, value_name = "SIZE")]
    pub max_body: u64,
    /// A Unix socket to listen on as well, mode 0600, for local clients
    /// (default: REPO/server.sock; the token is still required)
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Connections at most; one more is closed at once.
    #[arg(long, default_value_t = 512, value_name = "N")]
    pub max_connections: usize,
    /// Seconds a client may take to send a request's headers (also the next
    /// request on a kept-alive connection) and between parts of its body.
    #[arg(long, default_value_t = 10, value_name = "SECONDS")]
    pub header_timeout: u64,
    /// Seconds between looks for idle workspaces to suspend.
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    pub idle_check: u64,
    #[command(flatten)]
    pub pool: crate::commands::PoolArgs,
}

/// Audit entries and events as JSON lines on stderr.
struct StderrLog;

impl Log for StderrLog {
    fn audit(&self, entry: &AuditEntry) {
        eprintln!("{}", serde_json::json!({ "audit": entry }));
    }
    fn event(&self, event: &Event) {
        eprintln!("{}", serde_json::json!({ "event": event }));
    }
}

/// `name` found on `PATH`.
fn on_path(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// The engine the CLI's commands and the daemon run on.
pub fn engine_config(repo: &Path) -> Result<tine_engine::EngineConfig, CliError> {
    let mut cfg = tine_engine::EngineConfig::new(repo.to_path_buf(), crate::output::tine_exe()?);
    cfg.criu = crate::output::criu_at_hand();
    cfg.podman = on_path("podman");
    Ok(cfg)
}

/// The `Host` values `/mcp` takes besides loopback names: the flags', and
/// the listening address when it names one host (not loopback, not 0.0.0.0).
fn mcp_hosts(args: &ServeArgs) -> Vec<String> {
    let mut hosts = args.mcp_hosts.clone();
    let ip = args.listen.ip();
    if !ip.is_loopback() && !ip.is_unspecified() {
        let host = match ip {
            std::net::IpAddr::V4(v4) => v4.to_string(),
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        };
        hosts.push(host);
    }
    hosts
}

pub fn serve(repo: &Path, args: &ServeArgs, json: bool) -> Result<(), CliError> {
    let loopback = args.listen.ip().is_loopback();
    if !loopback && args.token_file.as_ref().is_none_or(|f| !f.is_file()) {
        return Err(CliError::new(
            ErrorKind::InvalidInput,
            format!(
                "refusing to listen on {} (not loopback) without a token: give --token-file FILE, a file holding it (mode 0600)",
                args.listen
            ),
        ));
    }
    // Fails early, with the usual message, when there is no repository.
    let repo_abs = tine_store::Repository::open(repo)?.path().to_path_buf();
    let repo_abs = std::fs::canonicalize(&repo_abs).unwrap_or(repo_abs);
    let token_file = args
        .token_file
        .clone()
        .unwrap_or_else(|| repo_abs.join("server.token"));
    let (token, how) = tine_server::load_or_create_token(&token_file)
        .map_err(|e| CliError::new(ErrorKind::InvalidInput, e.to_string()))?;
    let mut engine = engine_config(&repo_abs)?;
    engine.pool = args.pool.into();
    engine.max_sandboxes = args.max_sandboxes;
    engine.import_roots = args.import_roots.clone();
    engine.remote_access = tine_engine::RemoteAccess {
        credentials: crate::commands::sync::env_credentials()?,
        file_roots: Some(args.remote_roots.clone()),
        endpoints: (!args.remote_endpoints.is_empty()).then(|| args.remote_endpoints.clone()),
        ..tine_engine::RemoteAccess::default()
    };
    let socket = args
        .socket
        .clone()
        .unwrap_or_else(|| repo_abs.join("server.sock"));
    let cfg = ServerConfig {
        engine: tine_engine::Engine::new(engine),
        listen: args.listen,
        socket: Some(socket.clone()),
        conn: tine_server::ConnLimits {
            max_connections: args.max_connections.max(1),
            header_timeout: Duration::from_secs(args.header_timeout.clamp(1, 3600)),
        },
        token,
        max_body_bytes: args.max_body.min(usize::MAX as u64) as usize,
        idle_check: Duration::from_secs(args.idle_check.max(1)),
        log: Arc::new(StderrLog),
        mcp_hosts: mcp_hosts(args),
    };
    let token_path = token_file.clone();
    tine_server::run_blocking(cfg, move |addr| {
        if json {
            println!(
                "{}",
                serde_json::json!({"listening": addr.to_string(), "url": format!("http://{addr}"), "socket": socket, "token_file": token_path})
            );
        } else {
            eprintln!(
                "tine serve: listening on http://{addr} and {}; bearer token in {}{}",
                socket.display(),
                token_path.display(),
                if how == TokenSource::Generated { " (made now)" } else { "" }
            );
        }
    })
    .map_err(|e| CliError::new(ErrorKind::Io, e.to_string()))
}
