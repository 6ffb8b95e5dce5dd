//! Errors as `{"error": {"code", "message"}}`, with the status from the one
//! kind-to-status mapping (`ErrorKind::http_status`). Responses axum makes
//! itself (a body that does not parse, is too large, an unknown route) are
//! rewritten into the same shape by [`json_errors`].

use axum::Json;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tine_store::{ErrorKind, HasKind};

#[derive(Debug, Clone)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    /// A status other than the kind's (422 for a body whose JSON is well
    /// formed but does not fit, as axum's extractor answers).
    pub status: Option<StatusCode>,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError {
            kind,
            message: message.into(),
            status: None,
        }
    }

    pub fn with_status(mut self, status: StatusCode) -> ApiError {
        self.status = Some(status);
        self
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {"code": self.kind.code(), "message": self.message}})
    }
}

impl From<tine_engine::EngineError> for ApiError {
    fn from(e: tine_engine::EngineError) -> ApiError {
        ApiError::new(e.kind(), e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status.unwrap_or(
            StatusCode::from_u16(self.kind.http_status())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        );
        let mut resp = (status, Json(self.body())).into_response();
        if self.kind == ErrorKind::Capacity {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("5"));
        }
        resp
    }
}

/// The kind a status axum chose stands for.
fn kind_of(status: StatusCode) -> ErrorKind {
    match status.as_u16() {
        401 => ErrorKind::Unauthorized,
        404 => ErrorKind::NotFound,
        409 => ErrorKind::AlreadyExists,
        503 => ErrorKind::Capacity,
        s if (400..500).contains(&s) => ErrorKind::InvalidInput,
        _ => ErrorKind::Internal,
    }
}

/// Rewrites error responses that are not JSON yet (axum's rejections, the
/// router's 404 and 405) into the API's error shape, keeping their status.
pub(crate) async fn json_errors(req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 64 * 1024)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let message = match status {
        StatusCode::NOT_FOUND if text.is_empty() => {
            format!("no route {path} (see /v1/openapi.yaml)")
        }
        StatusCode::METHOD_NOT_ALLOWED => format!("{path} does not take this method"),
        StatusCode::PAYLOAD_TOO_LARGE => format!("request body too large: {text}"),
        _ if text.is_empty() => status.canonical_reason().unwrap_or("error").to_string(),
        _ => text,
    };
    let err = ApiError::new(kind_of(status), message);
    let mut out = Response::from_parts(parts, Body::from(err.body().to_string()));
    out.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    out.headers_mut().remove(header::CONTENT_LENGTH);
    *out.status_mut() = status;
    out
}
