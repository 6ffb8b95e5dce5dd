//! The routes: each handler parses its request, runs one engine call on the
//! blocking pool, and returns its result as JSON.

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
        .route("/workspaces/{name}/suspend", post(suspend))
        .route("/workspaces/{name}/resume", post(resume))
        .route("/openapi.yaml", get(openapi));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExecQuery {
    #[serde(default)]
    stream: bool,
}

/// Splits output into text (valid UTF-8, across chunk boundaries) and
/// bytes that are not text.
#[derive(Default)]
struct Utf8Carry(Vec<u8>);

enum Piece {
    Text(String),
    Bytes(Vec<u8>),
}

impl Utf8Carry {
    fn push(&mut self, chunk: &[u8]) -> Vec<Piece> {
        let mut buf = std::mem::take(&mut self.0);
        buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        let mut at = 0;
        while at < buf.len() {
            match std::str::from_utf8(&buf[at..]) {
                Ok(s) => {
                    out.push(Piece::Text(s.to_string()));
                    at = buf.len();
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    if valid > 0 {
                        let s = std::str::from_utf8(&buf[at..at + valid]).unwrap_or_default();
                        out.push(Piece::Text(s.to_string()));
                    }
                    match e.error_len() {
                        // An incomplete character at the end: wait for the rest.
                        None => {
                            self.0 = buf[at + valid..].to_vec();
                            return out;
                        }
                        Some(n) => {
                            out.push(Piece::Bytes(buf[at + valid..at + valid + n].to_vec()));
                            at += valid + n;
                        }
                    }
                }
            }
        }
        out
    }

    /// What is left at the end (an incomplete character) as bytes.
    fn finish(&mut self) -> Option<Piece> {
        (!self.0.is_empty()).then(|| Piece::Bytes(std::mem::take(&mut self.0)))
    }
}

fn event_line(stream: Stream, piece: Piece) -> Bytes {
    let v = match piece {
        Piece::Text(t) => json!({"stream": stream, "data": t}),
        Piece::Bytes(b) => json!({
            "stream": stream,
            "data_b64": base64::engine::general_purpose::STANDARD.encode(b),
        }),
    };
    Bytes::from(format!("{v}\n"))
}

async fn exec(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    Query(q): Query<ExecQuery>,
    body: Bytes,
) -> ApiResult {
    let req: ExecRequest = json_object(&body)?;
    if req.command.is_empty() {
        return Err(ApiError::new(
            ErrorKind::InvalidInput,
            "exec: `command` is empty; give the program and its arguments",
        ));
    }
    let e = s.engine.clone();
    if !q.stream {
        let state = s.clone();
        let (outcome, out, err, truncated) = timed(&state, "exec", move || {
            let (mut out, mut err, mut truncated) = (Vec::new(), Vec::new(), false);
            let outcome = e.exec(&sb, &req, &mut |stream, data| {
                let buf = if stream == Stream::Stdout {
                    &mut out
                } else {
                    &mut err
                };
                let room = COLLECT_LIMIT.saturating_sub(buf.len());
                truncated |= data.len() > room;
                buf.extend_from_slice(&data[..data.len().min(room)]);
                true
            })?;
            Ok((outcome, out, err, truncated))
        })
        .await?;
        let mut doc = serde_json::to_value(&outcome).unwrap_or_default();
        for (key, bytes) in [("stdout", out), ("stderr", err)] {
            match String::from_utf8(bytes) {
                Ok(t) => doc[key] = Value::String(t),
                Err(e) => {
                    let b = e.into_bytes();
                    doc[key] = Value::String(String::from_utf8_lossy(&b).into_owned());
                    doc[format!("{key}_b64")] =
                        Value::String(base64::engine::general_purpose::STANDARD.encode(&b));
                }
            }
        }
        doc["truncated"] = Value::Bool(truncated);
        return Ok(Json(doc).into_response());
    }
    // Refused before the stream starts: a status code, not a stream line.
    let e2 = s.engine.clone();
    let name = sb.clone();
    let v = blocking(move || e2.sandbox(&name)).await?;
    if v.state != tine_store::SandboxState::Running {
        return Err(EngineError::NotRunning {
            name: v.name,
            state: v.state.to_string(),
        }
        .into());
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    let state = s.clone();
    tokio::spawn(async move {
        let t0 = Instant::now();
        let tx2 = tx.clone();
        let r = tokio::task::spawn_blocking(move || {
            let (mut o, mut er) = (Utf8Carry::default(), Utf8Carry::default());
            let result = e.exec(&sb, &req, &mut |stream, data| {
                let carry = if stream == Stream::Stdout {
                    &mut o
                } else {
                    &mut er
                };
                // A send fails once the client is gone: the command is stopped.
                carry
                    .push(data)
                    .into_iter()
                    .all(|p| tx2.blocking_send(event_line(stream, p)).is_ok())
            });
            for (stream, carry) in [(Stream::Stdout, &mut o), (Stream::Stderr, &mut er)] {
                if let Some(p) = carry.finish() {
                    let _ = tx2.blocking_send(event_line(stream, p));
                }
            }
            result
        })
        .await;
        let last = match r {
            Ok(Ok(outcome)) => serde_json::to_value(&outcome).unwrap_or_default(),
            Ok(Err(e)) => ApiError::from(e).body(),
            Err(e) => ApiError::new(ErrorKind::Internal, e.to_string()).body(),
        };
        state.metrics.observe(
            "exec",
            last.get("error").is_none(),
            t0.elapsed().as_secs_f64(),
        );
        let _ = tx.send(Bytes::from(format!("{last}\n"))).await;
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-ndjson"),
        )],
        Body::from_stream(stream),
    )
        .into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PathQuery {
    path: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WriteQuery {
    path: String,
    /// Octal, e.g. 755.
    mode: Option<String>,
}

async fn list_files(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    Query(q): Query<PathQuery>,
) -> ApiResult {
    let e = s.engine.clone();
    let path = q
        .path
        .unwrap_or_else(|| tine_engine::files::SANDBOX_ROOT.to_string());
    ok(&blocking(move || e.list_files(&sb, &path)).await?)
}

async fn read_file(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    Query(q): Query<PathQuery>,
) -> ApiResult {
    let Some(path) = q.path else {
        return Err(ApiError::new(
            ErrorKind::InvalidInput,
            "give the file as ?path=/workspace/...",
        ));
    };
    let e = s.engine.clone();
    let data = blocking(move || e.read_file(&sb, &path)).await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        )],
        data,
    )
        .into_response())
}

async fn write_file(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    Query(q): Query<WriteQuery>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> ApiResult {
    let too_large = || {
        ApiError::new(
            ErrorKind::InvalidInput,
            format!(
                "the file is too large: over the daemon's limit of {} bytes (tine serve --max-body)",
                s.max_body
            ),
        )
        .with_status(axum::http::StatusCode::PAYLOAD_TOO_LARGE)
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > s.max_body as u64) {
        return Err(too_large());
    }
    let mode = match &q.mode {
        None => None,
        Some(m) => Some(
            u32::from_str_radix(m, 8)
                .ok()
                .filter(|m| *m <= 0o7777)
                .ok_or_else(|| {
                    ApiError::new(
                        ErrorKind::InvalidInput,
                        format!("mode {m:?}: give octal permissions, e.g. 644 or 755"),
                    )
                })?,
        ),
    };
    // Streamed: the body goes to the file through a short queue as it
    // comes, so memory stays bounded whatever the size and the number of
    // uploads.
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    let e = s.engine.clone();
    let job = blocking(move || {
        let mut reader = QueueReader {
            rx,
            chunk: Bytes::new(),
        };
        e.write_file(&sb, &q.path, &mut reader, mode)
    });
    let max = s.max_body;
    let pump = async move {
        use futures_util::StreamExt;
        let mut stream = body.into_data_stream();
        let mut total = 0usize;
        while let Some(chunk) = stream.next().await {
            let item = match chunk {
                Ok(c) => {
                    total += c.len();
                    if total > max {
                        let _ = tx
                            .send(Err(std::io::Error::other("the body is over the limit")))
                            .await;
                        return Err(true);
                    }
                    Ok(c)
                }
                Err(e) => Err(std::io::Error::other(format!("the request body: {e}"))),
            };
            let failed = item.is_err();
            if tx.send(item).await.is_err() || failed {
                return Err(false);
            }
        }
        Ok(())
    };
    let (written, pumped) = tokio::join!(job, pump);
    if pumped == Err(true) {
        return Err(too_large());
    }
    ok(&written?)
}

/// Reads what the upload's queue brings, for the blocking writer.
struct QueueReader {
    rx: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
    chunk: Bytes,
}

impl std::io::Read for QueueReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.chunk.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(c)) => self.chunk = c,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len());
        buf[..n].copy_from_slice(&self.chunk[..n]);
        self.chunk = self.chunk.slice(n..);
        Ok(n)
    }
}

async fn snapshot(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    body: Bytes,
) -> ApiResult {
    let req: SnapshotRequest = json_or_default(&body)?;
    let e = s.engine.clone();
    created(
        &timed(&s, "snapshot", move || {
            e.snapshot_sandbox(&sb, &req, &Ctx::QUIET)
        })
        .await?,
    )
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RestoreBody {
    snapshot: String,
    #[serde(default)]
    files_only: bool,
}

async fn restore(State(s): State<Arc<AppState>>, Path(sb): Path<String>, body: Bytes) -> ApiResult {
    let req: RestoreBody = json_object(&body)?;
    let e = s.engine.clone();
    ok(&timed(&s, "restore", move || {
        e.restore_sandbox(&sb, &req.snapshot, req.files_only, &Ctx::QUIET)
    })
    .await?)
}

async fn fork_sandbox(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    body: Bytes,
) -> ApiResult {
    let req: ForkRequest = json_or_default(&body)?;
    let e = s.engine.clone();
    let state = s.clone();
    // The sandbox as it is now, then the forks of that snapshot.
    let snap = timed(&state, "snapshot", {
        let e = e.clone();
        let files_only = req.files_only;
        move || {
            e.snapshot_sandbox(
                &sb,
                &SnapshotRequest {
                    message: "fork".into(),
                    files_only,
                    ..Default::default()
                },
                &Ctx::QUIET,
            )
        }
    })
    .await?;
    let id = snap.outcome.id.to_hex();
    created(&timed(&s, "fork", move || e.fork(&id, &req, &Ctx::QUIET)).await?)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitQuery {
    limit: Option<usize>,
}

async fn list_snapshots(State(s): State<Arc<AppState>>, Query(q): Query<LimitQuery>) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.snapshots(q.limit)).await?)
}

async fn get_snapshot(State(s): State<Arc<AppState>>, Path(snap): Path<String>) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.snapshot(&snap)).await?)
}

async fn delete_snapshot(State(s): State<Arc<AppState>>, Path(snap): Path<String>) -> ApiResult {
    let e = s.engine.clone();
    let id = blocking(move || e.delete_snapshot(&snap)).await?;
    ok(&json!({"deleted": id}))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DiffQuery {
    to: Option<String>,
    #[serde(default)]
    patch: bool,
}

async fn diff(
    State(s): State<Arc<AppState>>,
    Path(snap): Path<String>,
    Query(q): Query<DiffQuery>,
) -> ApiResult {
    let e = s.engine.clone();
    let req = DiffRequest {
        to: q.to,
        dir: None,
        patch: q.patch,
    };
    ok(&blocking(move || e.diff(&snap, &req, &Ctx::QUIET)).await?)
}

async fn merge(State(s): State<Arc<AppState>>, Path(sb): Path<String>, body: Bytes) -> ApiResult {
    let req: MergeRequest = json_object(&body)?;
    let e = s.engine.clone();
    ok(&timed(&s, "merge", move || {
        e.merge(&req, &MergeInto::Sandbox(sb), &Ctx::QUIET)
    })
    .await?)
}

async fn fork_snapshot(
    State(s): State<Arc<AppState>>,
    Path(snap): Path<String>,
    body: Bytes,
) -> ApiResult {
    let req: ForkRequest = json_or_default(&body)?;
    let e = s.engine.clone();
    created(&timed(&s, "fork", move || e.fork(&snap, &req, &Ctx::QUIET)).await?)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TagBody {
    name: String,
    #[serde(default)]
    force: bool,
}

async fn tag(State(s): State<Arc<AppState>>, Path(snap): Path<String>, body: Bytes) -> ApiResult {
    let req: TagBody = json_object(&body)?;
    let e = s.engine.clone();
    let name = req.name.clone();
    let id = blocking(move || e.tag(&snap, &req.name, req.force)).await?;
    ok(&json!({"tag": name, "snapshot": id}))
}

async fn untag(State(s): State<Arc<AppState>>, Path(name): Path<String>) -> ApiResult {
    let e = s.engine.clone();
    let n = name.clone();
    let was = blocking(move || e.untag(&n)).await?;
    ok(&json!({"deleted": name, "was": was}))
}

async fn list_workspaces(State(s): State<Arc<AppState>>) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.workspaces()).await?)
}

async fn create_workspace(State(s): State<Arc<AppState>>, body: Bytes) -> ApiResult {
    let req: CreateWorkspace = json_object(&body)?;
    let e = s.engine.clone();
    created(&timed(&s, "create", move || e.create_workspace(&req)).await?)
}

async fn get_workspace(State(s): State<Arc<AppState>>, Path(name): Path<String>) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.workspace(&name)).await?)
}

async fn delete_workspace(State(s): State<Arc<AppState>>, Path(name): Path<String>) -> ApiResult {
    let e = s.engine.clone();
    let n = name.clone();
    blocking(move || e.delete_workspace(&n)).await?;
    ok(&json!({"deleted": name}))
}

async fn suspend(State(s): State<Arc<AppState>>, Path(name): Path<String>) -> ApiResult {
    let e = s.engine.clone();
    ok(&timed(&s, "suspend", move || {
        e.suspend_workspace(&name, &mut |_| {})
    })
    .await?)
}

async fn resume(State(s): State<Arc<AppState>>, Path(name): Path<String>) -> ApiResult {
    let e = s.engine.clone();
    ok(&timed(&s, "resume", move || e.resume_workspace(&name)).await?)
}

async fn ledger_record(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    body: Bytes,
) -> ApiResult {
    let req: LedgerBody = json_object(&body)?;
    let e = s.engine.clone();
    let rec = tine_ledger::Record {
        kind: req.kind,
        key: req.key,
        request: req.request.to_string(),
        result: req.result.to_string(),
    };
    created(&blocking(move || e.ledger_record(&sb, &rec)).await?)
}

/// An effect to record: request and result are JSON values.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LedgerBody {
    kind: String,
    key: String,
    request: Value,
    result: Value,
}

async fn ledger_list(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    Query(q): Query<AllQuery>,
) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.ledger_list(Some(&sb), q.all)).await?)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyQuery {
    key: String,
}

async fn ledger_lookup(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    Query(q): Query<KeyQuery>,
) -> ApiResult {
    let e = s.engine.clone();
    let key = q.key.clone();
    match blocking(move || e.ledger_lookup(&sb, &q.key)).await? {
        Some(entry) => ok(&entry),
        None => Err(ApiError::new(
            ErrorKind::NotFound,
            format!(
                "no effect with key {key:?} on this sandbox's ledger (as of its current state)"
            ),
        )),
    }
}

async fn ledger_history(State(s): State<Arc<AppState>>) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.ledger_list(None, true)).await?)
}

async fn ledger_verify(State(s): State<Arc<AppState>>) -> ApiResult {
    let e = s.engine.clone();
    let n = blocking(move || e.ledger_verify()).await?;
    ok(&json!({"verified": n}))
}
