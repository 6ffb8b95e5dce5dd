//! tine-server: the HTTP API under `/v1` (docs/openapi.yaml), thin over
//! tine-engine. Handlers parse a request, run one engine call on the blocking
//! pool and turn its result (or error, through the one kind-to-status
//! mapping in tine-store) into JSON. Around them: bearer-token auth on every
//! route but `/healthz`, one audit entry per mutating request, Prometheus
//! metrics, and a task that suspends idle workspaces.
#![forbid(unsafe_code)]

mod auth;
mod error;
mod listen;
mod metrics;
mod routes;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tine_engine::Engine;

pub use auth::{TokenError, TokenSource, load_or_create_token};
pub use error::ApiError;
pub use listen::ConnLimits;

/// The OpenAPI description of the routes (served at `/v1/openapi.yaml`).
pub const OPENAPI: &str = include_str!("../../../docs/openapi.yaml");

/// One line of the audit log: a mutating request, without its body or
/// headers (so without secrets).
#[derive(Debug, Clone, Serialize)]
pub struct AuditEntry {
    pub time_ns: u64,
    pub method: String,
    pub path: String,
    pub status: u16,
    pub duration_ms: f64,
}

/// Something the daemon did on its own (auto-suspend, reconcile), for its log.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    pub time_ns: u64,
    pub event: String,
    pub detail: serde_json::Value,
}

/// Where audit entries and events go (the CLI prints them on stderr).
pub trait Log: Send + Sync {
    fn audit(&self, entry: &AuditEntry);
    fn event(&self, event: &Event);
}

/// How the daemon runs.
pub struct ServerConfig {
    pub engine: Engine,
    pub listen: SocketAddr,
    /// A Unix socket to listen on as well (made mode 0600; a stale one is
    /// replaced).
    pub socket: Option<std::path::PathBuf>,
    /// Connections at most, and how long a client may take to send headers.
    pub conn: ConnLimits,
    pub token: String,
    /// Largest request body (file writes); JSON bodies are limited to 1 MiB.
    pub max_body_bytes: usize,
    /// How often idle workspaces are looked for.
    pub idle_check: Duration,
    pub log: Arc<dyn Log>,
    /// `Host` values `/mcp` takes besides loopback names (MCP's check
    /// against DNS rebinding): the names a daemon on another address is
    /// reached by.
    pub mcp_hosts: Vec<String>,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is never printed.
        f.debug_struct("ServerConfig")
            .field("listen", &self.listen)
            .field("max_body_bytes", &self.max_body_bytes)
            .finish_non_exhaustive()
    }
}

/// Shared by every handler.
pub(crate) struct AppState {
    pub engine: Engine,
    /// Largest file write (streamed: never held whole in memory).
    pub max_body: usize,
    pub token: String,
    pub metrics: metrics::Metrics,
    pub log: Arc<dyn Log>,
    /// Last API activity per sandbox or workspace name (the idle check).
    pub activity: Mutex<HashMap<String, Instant>>,
    pub started: Instant,
    pub mcp_hosts: Vec<String>,
}

impl AppState {
    pub(crate) fn touch(&self, name: &str) {
        self.activity
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), Instant::now());
    }

    fn last_activity(&self, names: &[&str]) -> Instant {
        let map = self.activity.lock().unwrap_or_else(|e| e.into_inner());
        names
            .iter()
            .filter_map(|n| map.get(*n).copied())
            .max()
            .unwrap_or(self.started)
            .max(self.started)
    }
}

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("serving: {0}")]
    Serve(std::io::Error),
    #[error("listen on {}: {source}", path.display())]
    Socket {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Start(String),
}

/// The router with all routes and layers, for `serve` and for tests.
pub fn app(cfg: &ServerConfig) -> axum::Router {
    routes::router(state_of(cfg))
}

fn state_of(cfg: &ServerConfig) -> Arc<AppState> {
    Arc::new(AppState {
        engine: cfg.engine.clone(),
        max_body: cfg.max_body_bytes,
        token: cfg.token.clone(),
        metrics: metrics::Metrics::new(),
        log: cfg.log.clone(),
        activity: Mutex::new(HashMap::new()),
        started: Instant::now(),
        mcp_hosts: cfg.mcp_hosts.clone(),
    })
}

/// Runs the daemon until `shutdown` resolves: reconciles the sandboxes it
/// finds, listens, and checks for idle workspaces. `ready` is called with
/// the address once it listens.
pub async fn serve(
    cfg: ServerConfig,
    ready: impl FnOnce(SocketAddr),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let state = state_of(&cfg);
    let engine = cfg.engine.clone();
    let reconciled = tokio::task::spawn_blocking(move || engine.reconcile())
        .await
        .map_err(|e| ServeError::Start(e.to_string()))?
        .map_err(|e| ServeError::Start(format!("reconciling sandboxes: {e}")))?;
    state.log.event(&Event {
        time_ns: tine_store::now_ns(),
        event: "reconciled".into(),
        detail: serde_json::to_value(&reconciled).unwrap_or_default(),
    });
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: cfg.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(ServeError::Serve)?;
    let unix = cfg.socket.as_deref().map(bind_socket).transpose()?;
    ready(addr);
    let idle = tokio::spawn(idle_loop(state.clone(), cfg.idle_check));
    let acceptor = listen::Acceptor::new(routes::router(state), cfg.conn);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut loops = vec![tokio::spawn(listen::accept(
        listener,
        acceptor.clone(),
        stopped.clone(),
    ))];
    if let Some(u) = unix {
        loops.push(tokio::spawn(listen::accept(u, acceptor.clone(), stopped)));
    }
    shutdown.await;
    let _ = stop.send(true);
    for l in loops {
        let _ = l.await;
    }
    acceptor.drain(Duration::from_secs(10)).await;
    idle.abort();
    if let Some(p) = &cfg.socket {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

/// Binds the Unix socket at `path`, mode 0600 (a socket left by an earlier
/// daemon is replaced; anything else there is refused).
fn bind_socket(path: &std::path::Path) -> Result<tokio::net::UnixListener, ServeError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let err = |source| ServeError::Socket {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path).map_err(err)?,
        Ok(_) => {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "something that is not a socket is there; remove it or give another --socket",
            )));
        }
        Err(_) => {}
    }
    let l = tokio::net::UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    Ok(l)
}

/// Suspends workspaces that asked for it once they have had no API activity
/// and used no CPU for their idle time.
async fn idle_loop(state: Arc<AppState>, every: Duration) {
    // Per workspace: CPU ticks last seen, and when they last changed.
    let mut cpu: HashMap<String, (u64, Instant)> = HashMap::new();
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(100)));
    loop {
        tick.tick().await;
        let engine = state.engine.clone();
        let Ok(Ok(candidates)) = tokio::task::spawn_blocking(move || {
            engine.idle_candidates().map(|c| {
                c.into_iter()
                    .map(|(w, id, s)| {
                        let t = engine.cpu_ticks(&id);
                        (w, id, s, t)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .await
        else {
            continue;
        };
        let now = Instant::now();
        for (name, id, idle_s, ticks) in candidates {
            let ticks = ticks.unwrap_or(0);
            let entry = cpu.entry(name.clone()).or_insert((ticks, now));
            if entry.0 != ticks {
                *entry = (ticks, now);
            }
            let quiet_since = state.last_activity(&[&name, &id]).max(entry.1);
            if now.duration_since(quiet_since) < Duration::from_secs(idle_s) {
                continue;
            }
            let engine = state.engine.clone();
            let n = name.clone();
            let result =
                tokio::task::spawn_blocking(move || engine.suspend_workspace(&n, &mut |_| {}))
                    .await;
            let detail = match result {
                Ok(Ok(s)) => serde_json::json!({"workspace": name, "suspended": s}),
                Ok(Err(e)) => serde_json::json!({"workspace": name, "error": e.to_string()}),
                Err(e) => serde_json::json!({"workspace": name, "error": e.to_string()}),
            };
            cpu.remove(&name);
            state.log.event(&Event {
                time_ns: tine_store::now_ns(),
                event: "auto-suspend".into(),
                detail,
            });
        }
    }
}

/// Runs the daemon on a runtime of its own until SIGINT or SIGTERM (for
/// callers without one, like the CLI).
pub fn run_blocking(cfg: ServerConfig, ready: impl FnOnce(SocketAddr)) -> Result<(), ServeError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // Handlers walk sandboxes' trees (snapshots, restores, diffs) on
        // blocking threads: a deep tree must not overflow their stacks.
        .thread_stack_size(tine_engine::WALK_STACK)
        .build()
        .map_err(ServeError::Serve)?;
    rt.block_on(async move {
        let shutdown = async {
            let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
            match term {
                Ok(mut t) => {
                    tokio::select! {
                        _ = tokio::signal::ctrl_c() => {}
                        _ = t.recv() => {}
                    }
                }
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        };
        serve(cfg, ready, shutdown).await
    })
}
