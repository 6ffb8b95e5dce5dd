//! `/v1/images`: import an image (an archive or layout under one of the
//! daemon's `--import-root` directories), list, show and remove them;
//! and `/v1/builds`: build one from a Dockerfile.

use super::*;
use tine_engine::ImportImage;

pub(super) async fn list_images(State(s): State<Arc<AppState>>) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.images()).await?)
}

pub(super) async fn import_image(State(s): State<Arc<AppState>>, body: Bytes) -> ApiResult {
    let req: ImportImage = json_object(&body)?;
    let e = s.engine.clone();
    created(
        &timed(&s, "image_import", move || {
            e.import_image(&req, &Ctx::QUIET)
        })
        .await?,
    )
}

pub(super) async fn show_image(
    State(s): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.image(&name)).await?)
}

pub(super) async fn remove_image(
    State(s): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.remove_image(&name, &Ctx::QUIET)).await?)
}

/// `POST /v1/builds`: an image from a Dockerfile whose context is under one
/// of the daemon's import roots; each step's output comes back in its tail.
pub(super) async fn build_image(State(s): State<Arc<AppState>>, body: Bytes) -> ApiResult {
    let req: tine_engine::BuildImage = json_object(&body)?;
    let e = s.engine.clone();
    created(
        &timed(&s, "image_build", move || {
            e.build_image(&req, &Ctx::QUIET, &mut |_| {})
        })
        .await?,
    )
}
