//! `/v1/.../ledger`: record, list, look up and verify effects.

use super::*;

pub(super) async fn ledger_record(
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
pub(super) struct LedgerBody {
    kind: String,
    key: String,
    request: Value,
    result: Value,
}

pub(super) async fn ledger_list(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    Query(q): Query<AllQuery>,
) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.ledger_list(Some(&sb), q.all)).await?)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct KeyQuery {
    key: String,
}

pub(super) async fn ledger_lookup(
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

pub(super) async fn ledger_history(State(s): State<Arc<AppState>>) -> ApiResult {
    let e = s.engine.clone();
    ok(&blocking(move || e.ledger_list(None, true)).await?)
}

pub(super) async fn ledger_verify(State(s): State<Arc<AppState>>) -> ApiResult {
    let e = s.engine.clone();
    let n = blocking(move || e.ledger_verify()).await?;
    ok(&json!({"verified": n}))
}
