//! tine-mcp: tine as an MCP server (Model Context Protocol, through the
//! official Rust SDK `rmcp`). Its tools — sandboxes, exec, files,
//! snapshot/restore/fork/diff/log and the effects ledger — each make one
//! call of `tine_engine::Operations` (the engine over a local repository,
//! or a daemon through tine-client), on the blocking pool, and answer its
//! result as JSON. Every tool has an input schema and the hints clients
//! show (`readOnlyHint`, `destructiveHint`, `idempotentHint`;
//! `openWorldHint` false: nothing outside tine is touched). A failed call
//! is a tool result with `isError` and the error's code and message, so the
//! model reads it; a malformed request is a protocol error. Served over
//! stdio (`tine mcp`, [`serve_stdio`]) or streamable HTTP (`tine serve`'s
//! `/mcp`, [`http_service`], behind the daemon's bearer token).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use base64::Engine as _;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Implementation, ServerCapabilities, ServerConfig};
use rmcp::schemars::{self, JsonSchema};
use rmcp::{ErrorData, ServerHandler, ServiceExt, tool, tool_handler, tool_router};
use serde::Deserialize;
use serde_json::{Value, json};
use tine_engine::{
    CreateSandbox, Ctx, DiffRequest, EngineError, ExecRequest, ForkRequest, Operations,
    SnapshotRequest, Stream,
};
use tine_store::HasKind;

/// An exec's output kept per stream by default, and at most.
pub const OUTPUT_DEFAULT: usize = 64 << 10;
pub const OUTPUT_MAX: usize = 1 << 20;
/// An exec's timeout by default, and at most (seconds).
pub const EXEC_TIMEOUT_DEFAULT: f64 = 60.0;
pub const EXEC_TIMEOUT_MAX: f64 = 3600.0;
/// A file read returns at most this much.
pub const READ_MAX: usize = 1 << 20;

/// The operations the tools call, shared by every session.
pub type Ops = Arc<dyn Operations + Send + Sync>;

/// The MCP tools over `ops`.
#[derive(Clone)]
pub struct TineTools {
    ops: Ops,
    tool_router: ToolRouter<TineTools>,
}

impl std::fmt::Debug for TineTools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TineTools").finish_non_exhaustive()
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateArgs {
    /// A name for it (default: its id).
    pub name: Option<String>,
    /// A snapshot (tag or id prefix) to start from (default: an empty workspace).
    pub snapshot: Option<String>,
    /// Its main command (default: one that only keeps it up for exec).
    pub command: Option<Vec<String>>,
    /// Environment variables of its command.
    pub env: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListArgs {
    /// Ended sandboxes too.
    #[serde(default)]
    pub all: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxArg {
    /// The sandbox's name or id prefix.
    pub sandbox: String,
}

/// A command: a string runs through `sh -c`, a list runs as it is.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum Command {
    Shell(String),
    Argv(Vec<String>),
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecArgs {
    /// The sandbox's name or id prefix.
    pub sandbox: String,
    /// A string (run by `sh -c`, in /workspace) or an argument list.
    pub command: Command,
    /// Environment variables set for it.
    pub env: Option<BTreeMap<String, String>>,
    /// Killed after this many seconds (default 60, at most 3600).
    pub timeout_s: Option<f64>,
    /// Output kept per stream, in bytes (default 65536, at most 1048576);
    /// the rest is counted, not returned.
    pub max_output_bytes: Option<usize>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileArgs {
    /// The sandbox's name or id prefix.
    pub sandbox: String,
    /// A path the sandbox sees, under /workspace (relative: to it).
    pub path: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteArgs {
    /// The sandbox's name or id prefix.
    pub sandbox: String,
    /// A path the sandbox sees, under /workspace (relative: to it).
    pub path: String,
    /// The file's new content, as text.
    pub content: Option<String>,
    /// The file's new content, base64 (instead of `content`).
    pub content_b64: Option<String>,
    /// Its mode (octal digits, e.g. "755"; default 644).
    pub mode: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListFilesArgs {
    /// The sandbox's name or id prefix.
    pub sandbox: String,
    /// A directory the sandbox sees (default /workspace).
    pub path: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotArgs {
    /// The sandbox's name or id prefix.
    pub sandbox: String,
    /// What the snapshot is (shown by log).
    pub message: Option<String>,
    /// Tags to give it.
    pub tags: Option<Vec<String>>,
    /// Its files only, not its running processes.
    #[serde(default)]
    pub files_only: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RestoreArgs {
    /// The sandbox's name or id prefix.
    pub sandbox: String,
    /// The snapshot (tag or id prefix) to roll it back (or forward) to.
    pub snapshot: String,
    /// Its files only: its processes run on.
    #[serde(default)]
    pub files_only: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkArgs {
    /// The snapshot (tag or id prefix) the forks start from.
    pub snapshot: String,
    /// How many (default 1, at most 256).
    pub n: Option<usize>,
    /// Names NAME-1 .. NAME-N (default: their ids).
    pub name: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DiffArgs {
    /// The snapshot (tag or id prefix) to compare.
    pub snapshot: String,
    /// Another snapshot to compare it with (default: the live files it was
    /// taken of).
    pub to: Option<String>,
    /// Unified diffs of text files too.
    #[serde(default)]
    pub patch: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LogArgs {
    /// At most this many, newest first (default 50).
    pub limit: Option<usize>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RecordArgs {
    /// The sandbox's name or id prefix.
    pub sandbox: String,
    /// What kind of effect (email, payment, api_call, ...).
    pub kind: String,
    /// Its idempotency key: look it up before doing the effect again.
    pub key: String,
    /// The request made (any JSON).
    pub request: Value,
    /// What came back (any JSON).
    pub result: Value,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LookupArgs {
    /// The sandbox's name or id prefix.
    pub sandbox: String,
    /// The idempotency key.
    pub key: String,
}

#[tool_router]
impl TineTools {
    pub fn new(ops: Ops) -> TineTools {
        TineTools {
            ops,
            tool_router: Self::tool_router(),
        }
    }

    /// Runs `f` on the blocking pool; its value as the tool's JSON result,
    /// its error as an error result.
    async fn call<T: serde::Serialize + Send + 'static>(
        &self,
        f: impl FnOnce(&dyn Operations) -> Result<T, EngineError> + Send + 'static,
    ) -> Result<CallToolResult, ErrorData> {
        let ops = Arc::clone(&self.ops);
        let done = tokio::task::spawn_blocking(move || f(ops.as_ref()))
            .await
            .map_err(|e| ErrorData::internal_error(format!("the call panicked: {e}"), None))?;
        Ok(match done {
            Ok(v) => {
                let v = serde_json::to_value(v).unwrap_or(Value::Null);
                CallToolResult::success(vec![ContentBlock::text(v.to_string())])
            }
            Err(e) => failed(e),
        })
    }

    #[tool(
        description = "Create and start a sandbox: an isolated workspace (/workspace) with its own processes, empty or from a snapshot",
        annotations(
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn sandbox_create(
        &self,
        Parameters(a): Parameters<CreateArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let req = CreateSandbox {
            name: a.name,
            from: a.snapshot,
            command: a.command.unwrap_or_default(),
            env: a.env.unwrap_or_default(),
            ..Default::default()
        };
        self.call(move |o| o.create_sandbox(&req, &Ctx::QUIET))
            .await
    }

    #[tool(
        description = "List the sandboxes (all: ended ones too)",
        annotations(
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_list(
        &self,
        Parameters(a): Parameters<ListArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        self.call(move |o| o.sandboxes(a.all)).await
    }

    #[tool(
        description = "Remove a sandbox: its processes are killed and its workspace deleted (its snapshots stay)",
        annotations(
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn sandbox_remove(
        &self,
        Parameters(a): Parameters<SandboxArg>,
    ) -> Result<CallToolResult, ErrorData> {
        self.call(move |o| o.remove_sandbox(&a.sandbox, true)).await
    }

    #[tool(
        description = "Run a command in a sandbox (a string runs through sh -c in /workspace); returns its exit code and output (bounded, with the bytes left out counted)",
        annotations(
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn exec(&self, Parameters(a): Parameters<ExecArgs>) -> Result<CallToolResult, ErrorData> {
        let command = match a.command {
            Command::Shell(s) => vec!["sh".into(), "-c".into(), s],
            Command::Argv(v) => v,
        };
        if command.is_empty() {
            return Ok(failed_with("invalid_input", "exec: the command is empty"));
        }
        let req = ExecRequest {
            command,
            env: a.env.unwrap_or_default(),
            timeout_s: Some(
                a.timeout_s
                    .filter(|t| t.is_finite() && *t > 0.0)
                    .unwrap_or(EXEC_TIMEOUT_DEFAULT)
                    .min(EXEC_TIMEOUT_MAX),
            ),
        };
        let keep = a.max_output_bytes.unwrap_or(OUTPUT_DEFAULT).min(OUTPUT_MAX);
        let sb = a.sandbox;
        self.call(move |o| {
            let mut kept = [Vec::new(), Vec::new()];
            let mut dropped = [0usize; 2];
            let outcome = o.exec(&sb, &req, &mut |stream, data| {
                let k = usize::from(stream == Stream::Stderr);
                let room = keep.saturating_sub(kept[k].len());
                kept[k].extend_from_slice(&data[..room.min(data.len())]);
                dropped[k] += data.len().saturating_sub(room);
                true
            })?;
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            Ok(json!({
                "exit_code": outcome.exit_code,
                "timed_out": outcome.timed_out,
                "duration_ms": outcome.duration_ms,
                "rolled_back": outcome.rolled_back,
                "stdout": text(&kept[0]),
                "stderr": text(&kept[1]),
                "stdout_bytes_left_out": dropped[0],
                "stderr_bytes_left_out": dropped[1],
            }))
        })
        .await
    }

    #[tool(
        description = "Read a file of a sandbox (text, or base64 when it is not UTF-8; at most 1 MiB)",
        annotations(
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn file_read(
        &self,
        Parameters(a): Parameters<FileArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        self.call(move |o| {
            let data = o.read_file(&a.sandbox, &workspace_path(&a.path))?;
            if data.len() > READ_MAX {
                return Err(EngineError::TooLarge {
                    what: format!("file {}", a.path),
                    size: data.len() as u64,
                    limit: READ_MAX as u64,
                });
            }
            Ok(match String::from_utf8(data) {
                Ok(text) => json!({ "path": a.path, "content": text }),
                Err(e) => json!({
                    "path": a.path,
                    "content_b64": base64::engine::general_purpose::STANDARD.encode(e.as_bytes()),
                }),
            })
        })
        .await
    }

    #[tool(
        description = "Write a file of a sandbox (replacing it; directories made as needed)",
        annotations(
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn file_write(
        &self,
        Parameters(a): Parameters<WriteArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let data = match (a.content, a.content_b64) {
            (Some(text), None) => text.into_bytes(),
            (None, Some(b64)) => match base64::engine::general_purpose::STANDARD.decode(b64) {
                Ok(d) => d,
                Err(e) => return Ok(failed_with("invalid_input", &format!("content_b64: {e}"))),
            },
            _ => {
                return Ok(failed_with(
                    "invalid_input",
                    "give the file's content as exactly one of content and content_b64",
                ));
            }
        };
        let mode = match a.mode.as_deref().map(|m| u32::from_str_radix(m, 8)) {
            None => None,
            Some(Ok(m)) if m <= 0o7777 => Some(m),
            Some(_) => {
                return Ok(failed_with(
                    "invalid_input",
                    "mode: octal digits, e.g. \"644\" or \"755\"",
                ));
            }
        };
        self.call(move |o| o.write_file(&a.sandbox, &workspace_path(&a.path), &mut &data[..], mode))
            .await
    }

    #[tool(
        description = "List a directory of a sandbox (default /workspace)",
        annotations(
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn file_list(
        &self,
        Parameters(a): Parameters<ListFilesArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let path = workspace_path(a.path.as_deref().unwrap_or("/workspace"));
        self.call(move |o| o.list_files(&a.sandbox, &path)).await
    }

    #[tool(
        description = "Snapshot a sandbox: its files, its running processes (unless files_only) and its ledger head; returns the snapshot's id",
        annotations(
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn snapshot(
        &self,
        Parameters(a): Parameters<SnapshotArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let req = SnapshotRequest {
            message: a.message.unwrap_or_default(),
            tags: a.tags.unwrap_or_default(),
            files_only: a.files_only,
            ..Default::default()
        };
        self.call(move |o| o.snapshot_sandbox(&a.sandbox, &req, &Ctx::QUIET))
            .await
    }

    #[tool(
        description = "Roll a running sandbox back (or forward) to a snapshot, in place: its files, its processes (unless files_only) and its ledger; what changed since is lost",
        annotations(
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn restore(
        &self,
        Parameters(a): Parameters<RestoreArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        self.call(move |o| o.restore_sandbox(&a.sandbox, &a.snapshot, a.files_only, &Ctx::QUIET))
            .await
    }

    #[tool(
        description = "Fork n new running sandboxes from a snapshot, each going its own way (processes too where they can be copied)",
        annotations(
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn fork(&self, Parameters(a): Parameters<ForkArgs>) -> Result<CallToolResult, ErrorData> {
        let req = ForkRequest {
            n: a.n,
            name: a.name,
            ..Default::default()
        };
        self.call(move |o| o.fork(&a.snapshot, &req, &Ctx::QUIET))
            .await
    }

    #[tool(
        description = "What changed from a snapshot to another one, or to the live files it was taken of (patch: unified diffs of text files)",
        annotations(
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn diff(&self, Parameters(a): Parameters<DiffArgs>) -> Result<CallToolResult, ErrorData> {
        let req = DiffRequest {
            to: a.to,
            dir: None,
            patch: a.patch,
        };
        self.call(move |o| o.diff(&a.snapshot, &req, &Ctx::QUIET))
            .await
    }

    #[tool(
        description = "The snapshots, newest first, with their messages, tags and the processes they hold",
        annotations(
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn log(&self, Parameters(a): Parameters<LogArgs>) -> Result<CallToolResult, ErrorData> {
        let limit = a.limit.unwrap_or(50);
        self.call(move |o| o.snapshots(Some(limit))).await
    }

    #[tool(
        description = "Record an effect a sandbox had on the outside world (an email sent, a payment, an API call) on its ledger, under an idempotency key; a rollback rewinds the ledger, a fork inherits it",
        annotations(
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn ledger_record(
        &self,
        Parameters(a): Parameters<RecordArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let rec = tine_ledger::Record {
            kind: a.kind,
            key: a.key,
            request: a.request.to_string(),
            result: a.result.to_string(),
        };
        self.call(move |o| o.ledger_record(&a.sandbox, &rec)).await
    }

    #[tool(
        description = "Look up the effect recorded under an idempotency key on a sandbox's ledger, as of its current state (null: not done yet)",
        annotations(
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn ledger_lookup(
        &self,
        Parameters(a): Parameters<LookupArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        self.call(move |o| o.ledger_lookup(&a.sandbox, &a.key))
            .await
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for TineTools {
    fn get_info(&self) -> ServerConfig {
        let mut info = ServerConfig::default();
        info.capabilities = ServerCapabilities::builder().enable_tools().build();
        info.server_info = Implementation::new("tine", env!("CARGO_PKG_VERSION"));
        info.instructions = Some(
            "tine: sandboxes an agent can snapshot, roll back and fork, processes included. Create a sandbox, exec in it, snapshot before a risky step, restore on a bad branch, fork to explore in parallel; record external effects on the ledger and look them up after a rollback."
                .into(),
        );
        info
    }
}

/// A relative path as one under /workspace.
fn workspace_path(p: &str) -> String {
    if p.starts_with('/') {
        p.to_string()
    } else {
        format!("/workspace/{p}")
    }
}

/// An error result: the error's code and message, for the model to read.
fn failed(e: EngineError) -> CallToolResult {
    failed_with(e.kind().code(), &e.to_string())
}

fn failed_with(code: &str, message: &str) -> CallToolResult {
    let v = json!({ "error": { "code": code, "message": message } });
    CallToolResult::error(vec![ContentBlock::text(v.to_string())])
}

/// [`serve_stdio`] on a runtime of its own, until the client closes them.
pub fn run_stdio(ops: Ops) -> Result<(), std::io::Error> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(serve_stdio(ops))
}

/// Serves the tools over stdin and stdout until the client closes them.
pub async fn serve_stdio(ops: Ops) -> Result<(), std::io::Error> {
    let running = TineTools::new(ops)
        .serve(rmcp::transport::stdio())
        .await
        .map_err(std::io::Error::other)?;
    running.waiting().await.map_err(std::io::Error::other)?;
    Ok(())
}

/// The tools as a streamable HTTP service (a tower service to mount, at
/// `/mcp`), sessions kept in memory; only loopback `Host`s are taken
/// unless `hosts` names others.
pub fn http_service(
    ops: Ops,
    hosts: Vec<String>,
) -> rmcp::transport::streamable_http_server::StreamableHttpService<
    TineTools,
    rmcp::transport::streamable_http_server::session::local::LocalSessionManager,
> {
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
    };
    let mut config = StreamableHttpServerConfig::default();
    if !hosts.is_empty() {
        config.allowed_hosts.extend(hosts);
    }
    StreamableHttpService::new(
        move || Ok(TineTools::new(Arc::clone(&ops))),
        LocalSessionManager::default().into(),
        config,
    )
}
