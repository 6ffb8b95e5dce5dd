//! `/v1/sandboxes/{sb}/files`: list, read and write a sandbox's files; uploads
//! streamed to their file through a short queue.

use super::*;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PathQuery {
    path: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct WriteQuery {
    path: String,
    /// Octal, e.g. 755.
    mode: Option<String>,
}

pub(super) async fn list_files(
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

pub(super) async fn read_file(
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

pub(super) async fn write_file(
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
pub(super) struct QueueReader {
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
