//! `/v1/graph/...`: an agent framework's checkpoints (LangGraph's saver,
//! `tine.langgraph`), by thread: store, load (and rewind the thread's
//! sandbox), list, task writes, copy, prune and delete.

use super::*;
use tine_engine::graph::{GraphPut, GraphWrites};
use tine_store::graph::GraphQuery;

/// A checkpoint or a task's writes at most (values come base64-encoded).
pub(super) const GRAPH_LIMIT: usize = 64 << 20;

pub(super) async fn graph_put(
    State(s): State<Arc<AppState>>,
    Path(thread): Path<String>,
    body: Bytes,
) -> ApiResult {
    let req: GraphPut = json_object(&body)?;
    let e = s.engine.clone();
    created(
        &timed(&s, "graph_put", move || {
            e.graph_put(&thread, &req, &Ctx::QUIET)
        })
        .await?,
    )
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct GetQuery {
    #[serde(default)]
    ns: String,
    id: Option<String>,
    /// Loaded to run from: rolls the thread's sandbox back to it.
    #[serde(default)]
    rewind: bool,
}

pub(super) async fn graph_get(
    State(s): State<Arc<AppState>>,
    Path(thread): Path<String>,
    Query(q): Query<GetQuery>,
) -> ApiResult {
    let e = s.engine.clone();
    let t = thread.clone();
    let found = timed(&s, "graph_get", move || {
        e.graph_get(&t, &q.ns, q.id.as_deref(), q.rewind, &Ctx::QUIET)
    })
    .await?;
    match found {
        Some(tuple) => ok(&tuple),
        None => Err(ApiError::new(
            ErrorKind::NotFound,
            format!("no such checkpoint in graph thread {thread:?}"),
        )),
    }
}

pub(super) async fn graph_list(State(s): State<Arc<AppState>>, body: Bytes) -> ApiResult {
    let q: GraphQuery = json_or_default(&body)?;
    let e = s.engine.clone();
    ok(&blocking(move || e.graph_list(&q)).await?)
}

pub(super) async fn graph_put_writes(
    State(s): State<Arc<AppState>>,
    Path(thread): Path<String>,
    body: Bytes,
) -> ApiResult {
    let req: GraphWrites = json_object(&body)?;
    let e = s.engine.clone();
    timed(&s, "graph_writes", move || {
        e.graph_put_writes(&thread, &req, &Ctx::QUIET)
    })
    .await?;
    ok(&json!({}))
}

pub(super) async fn graph_delete_thread(
    State(s): State<Arc<AppState>>,
    Path(thread): Path<String>,
) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.graph_delete_thread(&thread, &Ctx::QUIET)).await?)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CopyBody {
    to: String,
}

pub(super) async fn graph_copy_thread(
    State(s): State<Arc<AppState>>,
    Path(thread): Path<String>,
    body: Bytes,
) -> ApiResult {
    let req: CopyBody = json_object(&body)?;
    let e = s.engine.clone();
    ok(&timed(&s, "graph_copy", move || {
        e.graph_copy_thread(&thread, &req.to, &Ctx::QUIET)
    })
    .await?)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RunsBody {
    run_ids: Vec<String>,
}

pub(super) async fn graph_delete_runs(State(s): State<Arc<AppState>>, body: Bytes) -> ApiResult {
    let req: RunsBody = json_object(&body)?;
    let e = s.engine.clone();
    ok(&blocking(move || e.graph_delete_runs(&req.run_ids, &Ctx::QUIET)).await?)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PruneBody {
    threads: Vec<String>,
    /// `keep_latest` (default) or `delete`.
    #[serde(default)]
    strategy: Option<String>,
}

pub(super) async fn graph_prune(State(s): State<Arc<AppState>>, body: Bytes) -> ApiResult {
    let req: PruneBody = json_object(&body)?;
    let keep_latest = match req.strategy.as_deref() {
        None | Some("keep_latest") => true,
        Some("delete") => false,
        Some(other) => {
            return Err(ApiError::new(
                ErrorKind::InvalidInput,
                format!("prune strategy {other:?}: expected \"keep_latest\" or \"delete\""),
            ));
        }
    };
    let e = s.engine.clone();
    ok(&blocking(move || e.graph_prune(&req.threads, keep_latest, &Ctx::QUIET)).await?)
}
