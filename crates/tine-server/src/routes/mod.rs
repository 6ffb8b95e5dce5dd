//! The routes: each handler parses its request, runs one engine call on the
//! blocking pool, and returns its result as JSON.
//!
//! This file: the router, the metrics middleware, the helpers every handler
//! uses, and the sandbox routes; `exec`, `files`, `history` (snapshots,
//! restores, forks, diffs, merges, tags), `workspaces`, `ledger`, `remotes`
//! (push, pull, clone) and `graph` (an agent framework's checkpoints) each
//! have a file.

mod exec;
mod files;
mod graph;
mod history;
mod images;
mod ledger;
mod remotes;
mod workspaces;
use exec::*;
use files::*;
use graph::*;
use history::*;
use images::*;
use ledger::*;
use remotes::*;
use workspaces::*;

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderValue, Method, header};
use axum::middleware::{Next, from_fn, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{Value, json};
use tine_engine::{
    CreateSandbox, Ctx, DiffRequest, EngineError, ExecRequest, ForkRequest, MergeInto,
    MergeRequest, SnapshotRequest, Stream, workspace::CreateWorkspace,
};
use tine_store::ErrorKind;

use crate::error::{ApiError, json_errors};
use crate::{AppState, AuditEntry};

type ApiResult = Result<Response, ApiError>;

/// JSON bodies at most (file contents have the configured limit).
const JSON_LIMIT: usize = 1 << 20;
/// Output an exec collects per stream when not streaming.
const COLLECT_LIMIT: usize = 16 << 20;

pub(crate) fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/sandboxes", get(list_sandboxes).post(create_sandbox))
        .route("/sandboxes/{sb}", get(get_sandbox).delete(delete_sandbox))
        .route("/sandboxes/{sb}/stop", post(stop_sandbox))
        .route("/sandboxes/{sb}/exec", post(exec))
        .route("/sandboxes/{sb}/files", get(list_files))
        // (A file write streams its body and checks its size itself.)
        .route(
            "/sandboxes/{sb}/files/content",
            get(read_file).put(write_file),
        )
        .route("/sandboxes/{sb}/snapshot", post(snapshot))
        .route("/sandboxes/{sb}/restore", post(restore))
        .route("/sandboxes/{sb}/fork", post(fork_sandbox))
        .route("/sandboxes/{sb}/merge", post(merge))
        .route(
            "/sandboxes/{sb}/ledger",
            get(ledger_list).post(ledger_record),
        )
        .route("/sandboxes/{sb}/ledger/lookup", get(ledger_lookup))
        .route("/ledger", get(ledger_history))
        .route("/ledger/verify", get(ledger_verify))
        .route("/snapshots", get(list_snapshots))
        .route(
            "/snapshots/{snap}",
            get(get_snapshot).delete(delete_snapshot),
        )
        .route("/snapshots/{snap}/diff", get(diff))
        .route("/snapshots/{snap}/fork", post(fork_snapshot))
        .route("/snapshots/{snap}/tags", post(tag))
        .route("/tags/{name}", delete(untag))
        .route("/workspaces", get(list_workspaces).post(create_workspace))
        .route(
            "/workspaces/{name}",
            get(get_workspace).delete(delete_workspace),
        )
        .route("/graph/threads/{thread}", delete(graph_delete_thread))
        .route(
            "/graph/threads/{thread}/checkpoints",
            post(graph_put).layer(DefaultBodyLimit::max(GRAPH_LIMIT)),
        )
        .route("/graph/threads/{thread}/checkpoint", get(graph_get))
        .route(
            "/graph/threads/{thread}/writes",
            post(graph_put_writes).layer(DefaultBodyLimit::max(GRAPH_LIMIT)),
        )
        .route("/graph/threads/{thread}/copy", post(graph_copy_thread))
        .route("/graph/list", post(graph_list))
        .route("/graph/runs/delete", post(graph_delete_runs))
        .route("/graph/prune", post(graph_prune))
        .route("/images", get(list_images).post(import_image))
        .route("/images/{name}", get(show_image).delete(remove_image))
        .route("/builds", post(build_image))
        .route("/remotes", get(list_remotes).post(add_remote))
        .route("/remotes/{name}", get(show_remote).delete(remove_remote))
        .route("/push", post(push))
        .route("/pull", post(pull))
        .route("/clone", post(clone_remote))
        .route("/workspaces/{name}/suspend", post(suspend))
        .route("/workspaces/{name}/resume", post(resume))
        .route("/openapi.yaml", get(openapi));
    // MCP over streamable HTTP: the same tools as `tine mcp`, behind the
    // same token (Host checked too, against DNS rebinding from a browser:
    // loopback names, and those the daemon was told it is reached by).
    let mcp = tine_mcp::http_service(
        std::sync::Arc::new(state.engine.clone()),
        state.mcp_hosts.clone(),
    );
    Router::new()
        .route("/healthz", get(healthz))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .nest_service("/mcp", mcp)
        .nest("/v1", v1)
        .layer(DefaultBodyLimit::max(JSON_LIMIT))
        .layer(from_fn_with_state(
            state.clone(),
            crate::auth::require_token,
        ))
        .layer(from_fn(json_errors))
        .layer(from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

/// Audit entries for mutating requests, response counts, and the activity
/// the idle check reads.
async fn observe(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let t0 = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    state.metrics.response(status);
    if status != 401 {
        let mut parts = path.trim_start_matches('/').split('/');
        if let (Some("v1"), Some("sandboxes" | "workspaces"), Some(name), rest) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        {
            // Reading a record (a dashboard polling states) is not using it.
            if !(method == Method::GET && rest.is_none()) {
                state.touch(name);
            }
        }
    }
    if !matches!(method, Method::GET | Method::HEAD | Method::OPTIONS) {
        state.log.audit(&AuditEntry {
            time_ns: tine_store::now_ns(),
            method: method.to_string(),
            path,
            status,
            duration_ms: t0.elapsed().as_secs_f64() * 1e3,
        });
    }
    resp
}

/// Runs an engine call on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, EngineError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::new(ErrorKind::Internal, format!("the operation panicked: {e}")))?
        .map_err(ApiError::from)
}

/// [`blocking`], counted and timed in the metrics as `op`.
async fn timed<T: Send + 'static>(
    state: &AppState,
    op: &str,
    f: impl FnOnce() -> Result<T, EngineError> + Send + 'static,
) -> Result<T, ApiError> {
    let t0 = Instant::now();
    let r = blocking(f).await;
    state
        .metrics
        .observe(op, r.is_ok(), t0.elapsed().as_secs_f64());
    r
}

fn ok<T: serde::Serialize>(v: &T) -> ApiResult {
    Ok(Json(v).into_response())
}

fn created<T: serde::Serialize>(v: &T) -> ApiResult {
    Ok((axum::http::StatusCode::CREATED, Json(v)).into_response())
}

/// A body that may be empty (then every field takes its default).
fn json_or_default<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    json_object(body)
}

/// A JSON object's body. Only an object: serde would also read a struct
/// from an array (`[]` made a sandbox with every default).
fn json_object<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let invalid = |why: String| {
        ApiError::new(
            ErrorKind::InvalidInput,
            format!("request body is not valid JSON: {why}"),
        )
    };
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(invalid("expected a JSON object ({...})".into()));
    }
    serde_json::from_slice(body).map_err(|e| {
        let err = invalid(e.to_string());
        if e.classify() == serde_json::error::Category::Data {
            err.with_status(axum::http::StatusCode::UNPROCESSABLE_ENTITY)
        } else {
            err
        }
    })
}

async fn healthz() -> Response {
    Json(json!({"ok": true})).into_response()
}

async fn version() -> Response {
    Json(json!({"version": env!("CARGO_PKG_VERSION"), "api": "v1"})).into_response()
}

async fn openapi() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/yaml"),
        )],
        crate::OPENAPI,
    )
        .into_response()
}

async fn metrics(State(state): State<Arc<AppState>>) -> ApiResult {
    let engine = state.engine.clone();
    let (live, bytes) = blocking(move || {
        let repo = engine.open()?;
        Ok((engine.live_count(&repo)?, engine.template_bytes()))
    })
    .await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
        )],
        state.metrics.render(live, bytes),
    )
        .into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AllQuery {
    #[serde(default)]
    all: bool,
}

async fn list_sandboxes(State(s): State<Arc<AppState>>, Query(q): Query<AllQuery>) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.sandboxes(q.all)).await?)
}

async fn create_sandbox(State(s): State<Arc<AppState>>, body: Bytes) -> ApiResult {
    let req: CreateSandbox = json_object(&body)?;
    let e = s.engine.clone();
    created(&timed(&s, "create", move || e.create_sandbox(&req, &Ctx::QUIET)).await?)
}

async fn get_sandbox(State(s): State<Arc<AppState>>, Path(sb): Path<String>) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.sandbox(&sb)).await?)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ForceQuery {
    #[serde(default)]
    force: bool,
}

async fn delete_sandbox(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    Query(q): Query<ForceQuery>,
) -> ApiResult {
    let e = s.engine.clone();
    ok(&timed(&s, "delete", move || e.remove_sandbox(&sb, q.force)).await?)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StopQuery {
    timeout_s: Option<u64>,
}

async fn stop_sandbox(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    Query(q): Query<StopQuery>,
) -> ApiResult {
    let e = s.engine.clone();
    let timeout = q.timeout_s.map(std::time::Duration::from_secs);
    ok(&blocking(move || e.stop_sandbox(&sb, timeout)).await?)
}
