//! Snapshots, restores, forks, diffs, merges and tags: the history routes.

use super::*;

pub(super) async fn snapshot(
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RestoreBody {
    snapshot: String,
    #[serde(default)]
    files_only: bool,
}

pub(super) async fn restore(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    body: Bytes,
) -> ApiResult {
    let req: RestoreBody = json_object(&body)?;
    let e = s.engine.clone();
    ok(&timed(&s, "restore", move || {
        e.restore_sandbox(&sb, &req.snapshot, req.files_only, &Ctx::QUIET)
    })
    .await?)
}

pub(super) async fn fork_sandbox(
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
pub(super) struct LimitQuery {
    limit: Option<usize>,
}

pub(super) async fn list_snapshots(
    State(s): State<Arc<AppState>>,
    Query(q): Query<LimitQuery>,
) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.snapshots(q.limit)).await?)
}

pub(super) async fn get_snapshot(
    State(s): State<Arc<AppState>>,
    Path(snap): Path<String>,
) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.snapshot(&snap)).await?)
}

pub(super) async fn delete_snapshot(
    State(s): State<Arc<AppState>>,
    Path(snap): Path<String>,
) -> ApiResult {
    let e = s.engine.clone();
    let id = blocking(move || e.delete_snapshot(&snap, &Ctx::QUIET)).await?;
    ok(&json!({"deleted": id}))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DiffQuery {
    to: Option<String>,
    #[serde(default)]
    patch: bool,
}

pub(super) async fn diff(
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

pub(super) async fn merge(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    body: Bytes,
) -> ApiResult {
    let req: MergeRequest = json_object(&body)?;
    let e = s.engine.clone();
    ok(&timed(&s, "merge", move || {
        e.merge(&req, &MergeInto::Sandbox(sb), &Ctx::QUIET)
    })
    .await?)
}

pub(super) async fn fork_snapshot(
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
pub(super) struct TagBody {
    name: String,
    #[serde(default)]
    force: bool,
}

pub(super) async fn tag(
    State(s): State<Arc<AppState>>,
    Path(snap): Path<String>,
    body: Bytes,
) -> ApiResult {
    let req: TagBody = json_object(&body)?;
    let e = s.engine.clone();
    let name = req.name.clone();
    let id = blocking(move || e.tag(&snap, &req.name, req.force, &Ctx::QUIET)).await?;
    ok(&json!({"tag": name, "snapshot": id}))
}

pub(super) async fn untag(State(s): State<Arc<AppState>>, Path(name): Path<String>) -> ApiResult {
    let e = s.engine.clone();
    let n = name.clone();
    let was = blocking(move || e.untag(&n, &Ctx::QUIET)).await?;
    ok(&json!({"deleted": name, "was": was}))
}
