//! `/v1/workspaces`: create, list, show, delete, suspend and resume.

use super::*;

pub(super) async fn list_workspaces(State(s): State<Arc<AppState>>) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.workspaces()).await?)
}

pub(super) async fn create_workspace(State(s): State<Arc<AppState>>, body: Bytes) -> ApiResult {
    let req: CreateWorkspace = json_object(&body)?;
    let e = s.engine.clone();
    created(&timed(&s, "create", move || e.create_workspace(&req)).await?)
}

pub(super) async fn get_workspace(
    State(s): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.workspace(&name)).await?)
}

pub(super) async fn delete_workspace(
    State(s): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> ApiResult {
    let e = s.engine.clone();
    let n = name.clone();
    blocking(move || e.delete_workspace(&n)).await?;
    ok(&json!({"deleted": name}))
}

pub(super) async fn suspend(State(s): State<Arc<AppState>>, Path(name): Path<String>) -> ApiResult {
    let e = s.engine.clone();
    ok(&timed(&s, "suspend", move || {
        e.suspend_workspace(&name, &mut |_| {})
    })
    .await?)
}

pub(super) async fn resume(State(s): State<Arc<AppState>>, Path(name): Path<String>) -> ApiResult {
    let e = s.engine.clone();
    ok(&timed(&s, "resume", move || e.resume_workspace(&name)).await?)
}
