//! `POST /v1/sandboxes/{sb}/exec`: a command in a sandbox, its output collected
//! or streamed as JSON lines (UTF-8 kept whole across chunks).

use super::*;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ExecQuery {
    #[serde(default)]
    stream: bool,
}

/// Splits output into text (valid UTF-8, across chunk boundaries) and
/// bytes that are not text.
#[derive(Default)]
pub(super) struct Utf8Carry(Vec<u8>);

pub(super) enum Piece {
    Text(String),
    Bytes(Vec<u8>),
}

impl Utf8Carry {
    fn push(&mut self, chunk: &[u8]) -> Vec<Piece> {
        let mut buf = std::mem::take(&mut self.0);
        buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        let mut at = 0;
        while at < buf.len() {
            match std::str::from_utf8(&buf[at..]) {
                Ok(s) => {
                    out.push(Piece::Text(s.to_string()));
                    at = buf.len();
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    if valid > 0 {
                        let s = std::str::from_utf8(&buf[at..at + valid]).unwrap_or_default();
                        out.push(Piece::Text(s.to_string()));
                    }
                    match e.error_len() {
                        // An incomplete character at the end: wait for the rest.
                        None => {
                            self.0 = buf[at + valid..].to_vec();
                            return out;
                        }
                        Some(n) => {
                            out.push(Piece::Bytes(buf[at + valid..at + valid + n].to_vec()));
                            at += valid + n;
                        }
                    }
                }
            }
        }
        out
    }

    /// What is left at the end (an incomplete character) as bytes.
    fn finish(&mut self) -> Option<Piece> {
        (!self.0.is_empty()).then(|| Piece::Bytes(std::mem::take(&mut self.0)))
    }
}

pub(super) fn event_line(stream: Stream, piece: Piece) -> Bytes {
    let v = match piece {
        Piece::Text(t) => json!({"stream": stream, "data": t}),
        Piece::Bytes(b) => json!({
            "stream": stream,
            "data_b64": base64::engine::general_purpose::STANDARD.encode(b),
        }),
    };
    Bytes::from(format!("{v}\n"))
}

/// Set when the handler's future is dropped: its client went away before
/// the answer (the command it waits for is stopped at its next heartbeat).
struct Gone(Arc<std::sync::atomic::AtomicBool>);

impl Drop for Gone {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

pub(super) async fn exec(
    State(s): State<Arc<AppState>>,
    Path(sb): Path<String>,
    Query(q): Query<ExecQuery>,
    body: Bytes,
) -> ApiResult {
    let req: ExecRequest = json_object(&body)?;
    if req.command.is_empty() {
        return Err(ApiError::new(
            ErrorKind::InvalidInput,
            "exec: `command` is empty; give the program and its arguments",
        ));
    }
    let e = s.engine.clone();
    if !q.stream {
        let state = s.clone();
        let gone = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let _guard = Gone(gone.clone());
        let (outcome, out, err, truncated) = timed(&state, "exec", move || {
            let (mut out, mut err, mut truncated) = (Vec::new(), Vec::new(), false);
            let outcome = e.exec(&sb, &req, &mut |stream, data| {
                if gone.load(std::sync::atomic::Ordering::Relaxed) {
                    return false;
                }
                let buf = if stream == Stream::Stdout {
                    &mut out
                } else {
                    &mut err
                };
                let room = COLLECT_LIMIT.saturating_sub(buf.len());
                truncated |= data.len() > room;
                buf.extend_from_slice(&data[..data.len().min(room)]);
                true
            })?;
            Ok((outcome, out, err, truncated))
        })
        .await?;
        let mut doc = serde_json::to_value(&outcome).unwrap_or_default();
        for (key, bytes) in [("stdout", out), ("stderr", err)] {
            match String::from_utf8(bytes) {
                Ok(t) => doc[key] = Value::String(t),
                Err(e) => {
                    let b = e.into_bytes();
                    doc[key] = Value::String(String::from_utf8_lossy(&b).into_owned());
                    doc[format!("{key}_b64")] =
                        Value::String(base64::engine::general_purpose::STANDARD.encode(&b));
                }
            }
        }
        doc["truncated"] = Value::Bool(truncated);
        return Ok(Json(doc).into_response());
    }
    // Refused before the stream starts: a status code, not a stream line.
    let e2 = s.engine.clone();
    let name = sb.clone();
    let v = blocking(move || e2.sandbox(&name)).await?;
    if v.state != tine_store::SandboxState::Running {
        return Err(EngineError::NotRunning {
            name: v.name,
            state: v.state.to_string(),
        }
        .into());
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    let state = s.clone();
    tokio::spawn(async move {
        let t0 = Instant::now();
        let tx2 = tx.clone();
        let r = tokio::task::spawn_blocking(move || {
            let (mut o, mut er) = (Utf8Carry::default(), Utf8Carry::default());
            let result = e.exec(&sb, &req, &mut |stream, data| {
                let carry = if stream == Stream::Stdout {
                    &mut o
                } else {
                    &mut er
                };
                // A send fails once the client is gone (and a heartbeat,
                // no output, finds the channel closed): the command is stopped.
                if data.is_empty() {
                    return !tx2.is_closed();
                }
                carry
                    .push(data)
                    .into_iter()
                    .all(|p| tx2.blocking_send(event_line(stream, p)).is_ok())
            });
            for (stream, carry) in [(Stream::Stdout, &mut o), (Stream::Stderr, &mut er)] {
                if let Some(p) = carry.finish() {
                    let _ = tx2.blocking_send(event_line(stream, p));
                }
            }
            result
        })
        .await;
        let last = match r {
            Ok(Ok(outcome)) => serde_json::to_value(&outcome).unwrap_or_default(),
            Ok(Err(e)) => ApiError::from(e).body(),
            Err(e) => ApiError::new(ErrorKind::Internal, e.to_string()).body(),
        };
        state.metrics.observe(
            "exec",
            last.get("error").is_none(),
            t0.elapsed().as_secs_f64(),
        );
        let _ = tx.send(Bytes::from(format!("{last}\n"))).await;
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-ndjson"),
        )],
        Body::from_stream(stream),
    )
        .into_response())
}
