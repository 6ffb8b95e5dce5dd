//! tine-client: [`Client`], tine's operations over a daemon's HTTP API
//! (`tine serve`), as the same [`Operations`] trait the engine implements
//! in process, returning the same typed results. Errors keep the daemon's
//! kinds (so the CLI's exit codes are those of a local call). The caller
//! gives the address and the token; this crate reads no environment.
#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Read};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tine_engine::exec::{ExecOutcome, ExecRequest, Sink, Stream};
use tine_engine::graph::{
    GraphChange, GraphPage, GraphPut, GraphPutOutcome, GraphTuple, GraphWrites,
};
use tine_engine::workspace::{CreateWorkspace, Resumed, SuspendStep, Suspended, WorkspaceView};
use tine_engine::{AddRemote, PullRequest, Pulled, PushRequest, Pushed, RemoteShow};
use tine_engine::{
    CreateSandbox, Ctx, DiffRequest, DiffResult, EngineError, FileEntry, ForkRequest, ForkResult,
    MergeInto, MergeRequest, MergeResult, Operations, Removed, SandboxOp, SandboxView,
    SnapshotDetail, SnapshotEntry, SnapshotRequest,
};
use tine_engine::{ImageView, ImportImage, Imported};
use tine_fs::{RestoreOutcome, SnapshotOutcome};
use tine_store::graph::GraphQuery;
use tine_store::{ErrorKind, ObjectId, RemoteRecord};

/// The largest JSON answer read (a diff of a large tree with patches).
const MAX_ANSWER: u64 = 256 << 20;
/// The largest file read through `read_file` (the daemon has its own limit).
const MAX_FILE: u64 = 1 << 30;

/// A daemon to talk to.
pub struct Client {
    url: String,
    token: String,
    agent: ureq::Agent,
}

impl std::fmt::Debug for Client {
    // Never the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("url", &self.url).finish()
    }
}

fn error(kind: ErrorKind, message: impl Into<String>) -> EngineError {
    EngineError::Reported {
        kind,
        message: message.into(),
    }
}

/// What a client not on the repository's host cannot do.
pub fn unavailable(what: &str) -> EngineError {
    error(
        ErrorKind::Unsupported,
        format!(
            "{what} is not available through the daemon; run it on the daemon's host without --url/TINE_URL"
        ),
    )
}

/// `s` as one percent-encoded path segment or query value.
pub fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A request's body.
enum Body<'a> {
    None,
    Json(Value),
    Stream(&'a mut dyn Read),
}

impl Client {
    /// A client of the daemon at `url` (`http://HOST:PORT`) with its bearer token.
    pub fn new(url: &str, token: String) -> Result<Client, EngineError> {
        if !url.starts_with("http://") {
            return Err(error(
                ErrorKind::InvalidInput,
                format!(
                    "--url {url:?}: give http://HOST:PORT (for TLS, put a proxy in front of tine serve and reach it through an http:// tunnel)"
                ),
            ));
        }
        Ok(Client {
            url: url.trim_end_matches('/').to_string(),
            token,
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .build()
                .into(),
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn transport(&self, e: impl std::fmt::Display) -> EngineError {
        error(ErrorKind::Io, format!("daemon at {}: {e}", self.url))
    }

    /// One request; the response, or the daemon's error with its kind.
    fn send(
        &self,
        method: &str,
        path: &str,
        body: Body<'_>,
    ) -> Result<ureq::http::Response<ureq::Body>, EngineError> {
        let b = ureq::http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url))
            .header("Authorization", format!("Bearer {}", self.token));
        let bad = |e: ureq::http::Error| error(ErrorKind::InvalidInput, e.to_string());
        let sent = match body {
            Body::None => self.agent.run(b.body(String::new()).map_err(bad)?),
            Body::Json(v) => self.agent.run(
                b.header("Content-Type", "application/json")
                    .body(v.to_string())
                    .map_err(bad)?,
            ),
            Body::Stream(r) => self.agent.run(
                b.header("Content-Type", "application/octet-stream")
                    .body(ureq::SendBody::from_reader(r))
                    .map_err(bad)?,
            ),
        };
        let mut resp = sent.map_err(|e| self.transport(e))?;
        if resp.status().as_u16() >= 400 {
            let text = resp
                .body_mut()
                .with_config()
                .limit(1 << 20)
                .read_to_string()
                .unwrap_or_default();
            let v: Value = serde_json::from_str(&text).unwrap_or_default();
            let code = v["error"]["code"].as_str().unwrap_or("internal");
            let message = v["error"]["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| format!("HTTP {}: {text}", resp.status()));
            return Err(error(ErrorKind::from_code(code), message));
        }
        Ok(resp)
    }

    /// One request; its JSON answer as `T`.
    fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<T, EngineError> {
        let body = body.map(Body::Json).unwrap_or(Body::None);
        let mut resp = self.send(method, path, body)?;
        let text = resp
            .body_mut()
            .with_config()
            .limit(MAX_ANSWER)
            .read_to_string()
            .map_err(|e| self.transport(e))?;
        serde_json::from_str(&text).map_err(|e| {
            error(
                ErrorKind::Internal,
                format!(
                    "daemon at {}: its answer to {method} {path} is not what this tine expects ({e}); is it the same version?",
                    self.url
                ),
            )
        })
    }

    fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &impl Serialize,
    ) -> Result<T, EngineError> {
        let v =
            serde_json::to_value(body).map_err(|e| error(ErrorKind::Internal, e.to_string()))?;
        self.call("POST", path, Some(v))
    }

    fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, EngineError> {
        self.call("GET", path, None)
    }
}

/// An id the daemon answered under `key`.
fn id_at(v: &Value, key: &str) -> Result<ObjectId, EngineError> {
    v[key].as_str().and_then(ObjectId::from_hex).ok_or_else(|| {
        error(
            ErrorKind::Internal,
            format!("the daemon's answer has no {key} id"),
        )
    })
}

impl Operations for Client {
    fn create_sandbox(
        &self,
        req: &CreateSandbox,
        _ctx: &Ctx<'_>,
    ) -> Result<SandboxView, EngineError> {
        self.post("/v1/sandboxes", req)
    }

    fn sandboxes(&self, all: bool) -> Result<Vec<SandboxView>, EngineError> {
        self.get(&format!("/v1/sandboxes?all={all}"))
    }

    fn sandbox(&self, sb: &str) -> Result<SandboxView, EngineError> {
        self.get(&format!("/v1/sandboxes/{}", enc(sb)))
    }

    fn stop_sandbox(
        &self,
        sb: &str,
        timeout: Option<Duration>,
    ) -> Result<SandboxView, EngineError> {
        let q = timeout
            .map(|t| format!("?timeout_s={}", t.as_secs()))
            .unwrap_or_default();
        self.call("POST", &format!("/v1/sandboxes/{}/stop{q}", enc(sb)), None)
    }

    fn remove_sandbox(&self, sb: &str, force: bool) -> Result<Removed, EngineError> {
        self.call(
            "DELETE",
            &format!("/v1/sandboxes/{}?force={force}", enc(sb)),
            None,
        )
    }

    fn exec(
        &self,
        sb: &str,
        req: &ExecRequest,
        sink: &mut Sink<'_>,
    ) -> Result<ExecOutcome, EngineError> {
        let body =
            serde_json::to_value(req).map_err(|e| error(ErrorKind::Internal, e.to_string()))?;
        let resp = self.send(
            "POST",
            &format!("/v1/sandboxes/{}/exec?stream=true", enc(sb)),
            Body::Json(body),
        )?;
        // JSON lines: output events, then the outcome or an error.
        let reader = BufReader::new(resp.into_body().into_reader());
        for line in reader.lines() {
            let line = line.map_err(|e| self.transport(format!("exec stream: {e}")))?;
            let Ok(ev) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if let Some(e) = ev.get("error") {
                return Err(error(
                    ErrorKind::from_code(e["code"].as_str().unwrap_or("internal")),
                    e["message"].as_str().unwrap_or_default(),
                ));
            }
            let stream = match ev["stream"].as_str() {
                Some("stdout") => Stream::Stdout,
                Some("stderr") => Stream::Stderr,
                _ => {
                    return serde_json::from_value(ev).map_err(|e| {
                        error(
                            ErrorKind::Internal,
                            format!("exec: the daemon's outcome: {e}"),
                        )
                    });
                }
            };
            let data = match (ev["data"].as_str(), ev["data_b64"].as_str()) {
                (Some(t), _) => t.as_bytes().to_vec(),
                (None, Some(b)) => {
                    use base64::Engine as _;
                    base64::engine::general_purpose::STANDARD
                        .decode(b)
                        .map_err(|e| error(ErrorKind::Internal, format!("exec stream: {e}")))?
                }
                (None, None) => continue,
            };
            if !sink(stream, &data) {
                // Dropping the connection stops the command.
                return Err(error(ErrorKind::Io, "exec: output no longer wanted"));
            }
        }
        Err(self.transport("exec: the stream ended before the command's outcome"))
    }

    fn read_file(&self, sb: &str, path: &str) -> Result<Vec<u8>, EngineError> {
        let mut resp = self.send(
            "GET",
            &format!("/v1/sandboxes/{}/files/content?path={}", enc(sb), enc(path)),
            Body::None,
        )?;
        resp.body_mut()
            .with_config()
            .limit(MAX_FILE)
            .read_to_vec()
            .map_err(|e| self.transport(e))
    }

    fn write_file(
        &self,
        sb: &str,
        path: &str,
        data: &mut dyn Read,
        mode: Option<u32>,
    ) -> Result<FileEntry, EngineError> {
        let mode = mode.map(|m| format!("&mode={m:o}")).unwrap_or_default();
        let mut resp = self.send(
            "PUT",
            &format!(
                "/v1/sandboxes/{}/files/content?path={}{mode}",
                enc(sb),
                enc(path)
            ),
            Body::Stream(data),
        )?;
        resp.body_mut()
            .with_config()
            .limit(MAX_ANSWER)
            .read_json()
            .map_err(|e| self.transport(e))
    }

    fn list_files(&self, sb: &str, path: &str) -> Result<Vec<FileEntry>, EngineError> {
        self.get(&format!(
            "/v1/sandboxes/{}/files?path={}",
            enc(sb),
            enc(path)
        ))
    }

    fn snapshot_sandbox(
        &self,
        sb: &str,
        req: &SnapshotRequest,
        _ctx: &Ctx<'_>,
    ) -> Result<SandboxOp<SnapshotOutcome>, EngineError> {
        self.post(&format!("/v1/sandboxes/{}/snapshot", enc(sb)), req)
    }

    fn restore_sandbox(
        &self,
        sb: &str,
        snapshot: &str,
        files_only: bool,
        _ctx: &Ctx<'_>,
    ) -> Result<SandboxOp<RestoreOutcome>, EngineError> {
        self.post(
            &format!("/v1/sandboxes/{}/restore", enc(sb)),
            &json!({"snapshot": snapshot, "files_only": files_only}),
        )
    }

    fn fork(
        &self,
        snapshot: &str,
        req: &ForkRequest,
        _ctx: &Ctx<'_>,
    ) -> Result<ForkResult, EngineError> {
        self.post(&format!("/v1/snapshots/{}/fork", enc(snapshot)), req)
    }

    fn diff(&self, a: &str, req: &DiffRequest, _ctx: &Ctx<'_>) -> Result<DiffResult, EngineError> {
        if req.dir.is_some() {
            return Err(unavailable("diff --dir"));
        }
        let mut q = vec![];
        if let Some(b) = &req.to {
            q.push(format!("to={}", enc(b)));
        }
        if req.patch {
            q.push("patch=true".to_string());
        }
        let q = if q.is_empty() {
            String::new()
        } else {
            format!("?{}", q.join("&"))
        };
        self.get(&format!("/v1/snapshots/{}/diff{q}", enc(a)))
    }

    fn merge(
        &self,
        req: &MergeRequest,
        into: &MergeInto,
        _ctx: &Ctx<'_>,
    ) -> Result<MergeResult, EngineError> {
        match into {
            MergeInto::Sandbox(sb) => self.post(&format!("/v1/sandboxes/{}/merge", enc(sb)), req),
            MergeInto::Dir(_) => Err(unavailable("merge --into DIR (give --sandbox SB)")),
        }
    }

    fn snapshots(&self, limit: Option<usize>) -> Result<Vec<SnapshotEntry>, EngineError> {
        let q = limit.map(|n| format!("?limit={n}")).unwrap_or_default();
        self.get(&format!("/v1/snapshots{q}"))
    }

    fn snapshot(&self, spec: &str) -> Result<SnapshotDetail, EngineError> {
        self.get(&format!("/v1/snapshots/{}", enc(spec)))
    }

    fn tag(
        &self,
        snapshot: &str,
        name: &str,
        force: bool,
        _ctx: &Ctx<'_>,
    ) -> Result<ObjectId, EngineError> {
        let v: Value = self.post(
            &format!("/v1/snapshots/{}/tags", enc(snapshot)),
            &json!({"name": name, "force": force}),
        )?;
        id_at(&v, "snapshot")
    }

    fn untag(&self, name: &str, _ctx: &Ctx<'_>) -> Result<ObjectId, EngineError> {
        let v: Value = self.call("DELETE", &format!("/v1/tags/{}", enc(name)), None)?;
        id_at(&v, "was")
    }

    fn delete_snapshot(&self, spec: &str, _ctx: &Ctx<'_>) -> Result<ObjectId, EngineError> {
        let v: Value = self.call("DELETE", &format!("/v1/snapshots/{}", enc(spec)), None)?;
        id_at(&v, "deleted")
    }

    fn ledger_record(
        &self,
        sb: &str,
        rec: &tine_ledger::Record,
    ) -> Result<tine_ledger::Entry, EngineError> {
        // The API takes request and result as JSON values.
        let value = |what: &str, text: &str| {
            serde_json::from_str::<Value>(text).map_err(|e| {
                error(
                    ErrorKind::InvalidInput,
                    format!("the effect's {what} is not JSON: {e}"),
                )
            })
        };
        self.post(
            &format!("/v1/sandboxes/{}/ledger", enc(sb)),
            &json!({
                "kind": rec.kind,
                "key": rec.key,
                "request": value("request", &rec.request)?,
                "result": value("result", &rec.result)?,
            }),
        )
    }

    fn ledger_lookup(
        &self,
        sb: &str,
        key: &str,
    ) -> Result<Option<tine_ledger::Entry>, EngineError> {
        // The daemon answers 404 both for no such sandbox and for no such
        // key; the sandbox is asked for first to tell them apart.
        self.sandbox(sb)?;
        match self.get(&format!(
            "/v1/sandboxes/{}/ledger/lookup?key={}",
            enc(sb),
            enc(key)
        )) {
            Ok(e) => Ok(Some(e)),
            Err(e) if tine_store::HasKind::kind(&e) == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn ledger_list(
        &self,
        sb: Option<&str>,
        all: bool,
    ) -> Result<Vec<tine_ledger::Entry>, EngineError> {
        match sb {
            Some(sb) => self.get(&format!("/v1/sandboxes/{}/ledger?all={all}", enc(sb))),
            None => self.get("/v1/ledger"),
        }
    }

    fn ledger_verify(&self) -> Result<usize, EngineError> {
        let v: Value = self.get("/v1/ledger/verify")?;
        v["verified"]
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| error(ErrorKind::Internal, "the daemon's answer has no count"))
    }

    fn create_workspace(&self, req: &CreateWorkspace) -> Result<WorkspaceView, EngineError> {
        self.post("/v1/workspaces", req)
    }

    fn workspaces(&self) -> Result<Vec<WorkspaceView>, EngineError> {
        self.get("/v1/workspaces")
    }

    fn workspace(&self, name: &str) -> Result<WorkspaceView, EngineError> {
        self.get(&format!("/v1/workspaces/{}", enc(name)))
    }

    fn delete_workspace(&self, name: &str) -> Result<(), EngineError> {
        let _: Value = self.call("DELETE", &format!("/v1/workspaces/{}", enc(name)), None)?;
        Ok(())
    }

    fn suspend_workspace(
        &self,
        name: &str,
        _on_step: &mut dyn FnMut(SuspendStep),
    ) -> Result<Suspended, EngineError> {
        self.call(
            "POST",
            &format!("/v1/workspaces/{}/suspend", enc(name)),
            None,
        )
    }

    fn resume_workspace(&self, name: &str) -> Result<Resumed, EngineError> {
        self.call(
            "POST",
            &format!("/v1/workspaces/{}/resume", enc(name)),
            None,
        )
    }

    fn graph_put(
        &self,
        thread: &str,
        req: &GraphPut,
        _ctx: &Ctx<'_>,
    ) -> Result<GraphPutOutcome, EngineError> {
        self.post(
            &format!("/v1/graph/threads/{}/checkpoints", enc(thread)),
            req,
        )
    }

    fn graph_get(
        &self,
        thread: &str,
        ns: &str,
        id: Option<&str>,
        rewind: bool,
        _ctx: &Ctx<'_>,
    ) -> Result<Option<GraphTuple>, EngineError> {
        let mut path = format!(
            "/v1/graph/threads/{}/checkpoint?ns={}&rewind={rewind}",
            enc(thread),
            enc(ns)
        );
        if let Some(id) = id {
            path.push_str(&format!("&id={}", enc(id)));
        }
        match self.get(&path) {
            Ok(t) => Ok(Some(t)),
            Err(e) if tine_store::HasKind::kind(&e) == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn graph_list(&self, q: &GraphQuery) -> Result<GraphPage, EngineError> {
        self.post("/v1/graph/list", q)
    }

    fn graph_put_writes(
        &self,
        thread: &str,
        req: &GraphWrites,
        _ctx: &Ctx<'_>,
    ) -> Result<(), EngineError> {
        let _: Value = self.post(&format!("/v1/graph/threads/{}/writes", enc(thread)), req)?;
        Ok(())
    }

    fn graph_delete_thread(
        &self,
        thread: &str,
        _ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError> {
        self.call(
            "DELETE",
            &format!("/v1/graph/threads/{}", enc(thread)),
            None,
        )
    }

    fn graph_copy_thread(
        &self,
        from: &str,
        to: &str,
        _ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError> {
        self.post(
            &format!("/v1/graph/threads/{}/copy", enc(from)),
            &json!({ "to": to }),
        )
    }

    fn graph_delete_runs(
        &self,
        run_ids: &[String],
        _ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError> {
        self.post("/v1/graph/runs/delete", &json!({ "run_ids": run_ids }))
    }

    fn graph_prune(
        &self,
        threads: &[String],
        keep_latest: bool,
        _ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError> {
        let strategy = if keep_latest { "keep_latest" } else { "delete" };
        self.post(
            "/v1/graph/prune",
            &json!({ "threads": threads, "strategy": strategy }),
        )
    }

    fn remotes(&self) -> Result<Vec<RemoteRecord>, EngineError> {
        self.get("/v1/remotes")
    }

    fn add_remote(&self, req: &AddRemote, _ctx: &Ctx<'_>) -> Result<RemoteRecord, EngineError> {
        self.post("/v1/remotes", req)
    }

    fn remove_remote(&self, name: &str, _ctx: &Ctx<'_>) -> Result<RemoteRecord, EngineError> {
        self.call("DELETE", &format!("/v1/remotes/{}", enc(name)), None)
    }

    fn remote_show(&self, name: &str) -> Result<RemoteShow, EngineError> {
        self.get(&format!("/v1/remotes/{}", enc(name)))
    }

    fn push(&self, req: &PushRequest, _ctx: &Ctx<'_>) -> Result<Pushed, EngineError> {
        self.post("/v1/push", req)
    }

    fn pull(&self, req: &PullRequest, _ctx: &Ctx<'_>) -> Result<Pulled, EngineError> {
        self.post("/v1/pull", req)
    }

    fn images(&self) -> Result<Vec<ImageView>, EngineError> {
        self.get("/v1/images")
    }

    fn image(&self, spec: &str) -> Result<ImageView, EngineError> {
        self.get(&format!("/v1/images/{}", enc(spec)))
    }

    fn import_image(&self, req: &ImportImage, _ctx: &Ctx<'_>) -> Result<Imported, EngineError> {
        self.post("/v1/images", req)
    }

    fn remove_image(
        &self,
        spec: &str,
        _ctx: &Ctx<'_>,
    ) -> Result<tine_store::ImageRemoved, EngineError> {
        self.call("DELETE", &format!("/v1/images/{}", enc(spec)), None)
    }

    fn clone_remote(&self, req: &AddRemote, _ctx: &Ctx<'_>) -> Result<Pulled, EngineError> {
        self.post("/v1/clone", req)
    }

    fn build_image(
        &self,
        req: &tine_engine::BuildImage,
        _ctx: &Ctx<'_>,
        _events: &mut dyn FnMut(tine_engine::BuildEvent<'_>),
    ) -> Result<tine_engine::Built, EngineError> {
        self.post("/v1/builds", req)
    }

    fn export_image(
        &self,
        _req: &tine_engine::ExportImage,
        _ctx: &Ctx<'_>,
    ) -> Result<tine_engine::Exported, EngineError> {
        Err(unavailable("image export"))
    }

    fn attach(&self, _req: &tine_engine::Attach) -> Result<tine_engine::AttachedView, EngineError> {
        // A daemon's client must not make it trace the host's processes.
        Err(unavailable("attach"))
    }

    fn attached(&self) -> Result<Vec<tine_engine::AttachedView>, EngineError> {
        Err(unavailable("attach --list"))
    }

    fn detach(&self, _name: &str) -> Result<tine_engine::AttachedView, EngineError> {
        Err(unavailable("attach --detach"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_encoded() {
        assert_eq!(enc("a b/c?d"), "a%20b%2Fc%3Fd");
        assert_eq!(enc("sb-1_x.y~"), "sb-1_x.y~");
    }

    #[test]
    fn only_http_urls_are_taken() {
        let e = Client::new("https://h:1", "t".into()).unwrap_err();
        assert_eq!(tine_store::HasKind::kind(&e), ErrorKind::InvalidInput);
        assert!(Client::new("http://127.0.0.1:1/", "t".into()).is_ok());
    }

    #[test]
    fn debug_never_shows_the_token() {
        let c = Client::new("http://127.0.0.1:1", "s3cret".into()).unwrap();
        assert!(!format!("{c:?}").contains("s3cret"));
    }

    #[test]
    fn an_unreachable_daemon_is_an_io_error_naming_it() {
        // Port 1 on loopback: nothing listens there.
        let c = Client::new("http://127.0.0.1:1", "t".into()).unwrap();
        let e = c.sandboxes(false).unwrap_err();
        assert_eq!(tine_store::HasKind::kind(&e), ErrorKind::Io);
        assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
    }
}
