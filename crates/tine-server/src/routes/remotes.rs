//! `/v1/remotes`, `/v1/push`, `/v1/pull`, `/v1/clone`: name remotes, and
//! carry snapshots to and from them (the daemon's credentials, read from its
//! environment at start, are the ones used; requests carry none).

use super::*;
use tine_engine::{AddRemote, PullRequest, PushRequest};

pub(super) async fn list_remotes(State(s): State<Arc<AppState>>) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.remotes()).await?)
}

pub(super) async fn add_remote(State(s): State<Arc<AppState>>, body: Bytes) -> ApiResult {
    let req: AddRemote = json_object(&body)?;
    let e = s.engine.clone();
    created(&blocking(move || e.add_remote(&req, &Ctx::QUIET)).await?)
}

pub(super) async fn show_remote(
    State(s): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.remote_show(&name)).await?)
}

pub(super) async fn remove_remote(
    State(s): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.remove_remote(&name, &Ctx::QUIET)).await?)
}

pub(super) async fn push(State(s): State<Arc<AppState>>, body: Bytes) -> ApiResult {
    let req: PushRequest = json_or_default(&body)?;
    let e = s.engine.clone();
    ok(&timed(&s, "push", move || e.push(&req, &Ctx::QUIET)).await?)
}

pub(super) async fn pull(State(s): State<Arc<AppState>>, body: Bytes) -> ApiResult {
    let req: PullRequest = json_or_default(&body)?;
    let e = s.engine.clone();
    ok(&timed(&s, "pull", move || e.pull(&req, &Ctx::QUIET)).await?)
}

pub(super) async fn clone_remote(State(s): State<Arc<AppState>>, body: Bytes) -> ApiResult {
    let req: AddRemote = json_object(&body)?;
    let e = s.engine.clone();
    ok(&timed(&s, "clone", move || e.clone_remote(&req, &Ctx::QUIET)).await?)
}
