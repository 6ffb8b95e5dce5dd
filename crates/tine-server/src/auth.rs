//! The bearer token: read from a file, or generated at first start into one
//! only its owner can read; compared in constant time.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;
use tine_store::ErrorKind;

use crate::AppState;
use crate::error::ApiError;

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("token file {}: {step}: {source}", path.display())]
    Io {
        path: PathBuf,
        step: &'static str,
        source: std::io::Error,
    },
    #[error(
        "token file {} can be read by others (mode {mode:o}); `chmod 600` it",
        path.display()
    )]
    Exposed { path: PathBuf, mode: u32 },
    #[error("token file {} holds no token (it is empty or shorter than 16 characters)", path.display())]
    Empty { path: PathBuf },
}

/// Where the token came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenSource {
    /// Read from an existing file.
    Read,
    /// Generated now and written to the file (mode 0600).
    Generated,
}

/// The token in `path`, or a new random one written there (mode 0600,
/// atomically: a temporary file, fsync, then a link that fails if another
/// start made one meanwhile).
pub fn load_or_create_token(path: &Path) -> Result<(String, TokenSource), TokenError> {
    let io = |step| {
        move |source| TokenError::Io {
            path: path.to_path_buf(),
            step,
            source,
        }
    };
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let mode = std::fs::metadata(path)
                .map_err(io("stat"))?
                .permissions()
                .mode()
                & 0o777;
            if mode & 0o077 != 0 {
                return Err(TokenError::Exposed {
                    path: path.to_path_buf(),
                    mode,
                });
            }
            let token = text.trim().to_string();
            if token.len() < 16 {
                return Err(TokenError::Empty {
                    path: path.to_path_buf(),
                });
            }
            return Ok((token, TokenSource::Read));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("read")(e)),
    }
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)
        .map_err(|e| io("random bytes")(std::io::Error::other(e.to_string())))?;
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io("create directory"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        std::process::id()
    ));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io("create"))?;
    let written = f
        .write_all(format!("{token}\n").as_bytes())
        .and_then(|()| f.sync_all());
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io("write")(e));
    }
    // A link, unlike a rename, does not replace a token another start wrote.
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
            Ok((token, TokenSource::Generated))
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => load_or_create_token(path),
        Err(e) => Err(io("link")(e)),
    }
}

/// Refuses every request but `/healthz` without the right bearer token.
pub(crate) async fn require_token(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    if req.uri().path() == "/healthz" {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let ok = given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(state.token.as_bytes())));
    if ok {
        return next.run(req).await;
    }
    let message = if given.is_some() {
        "the bearer token is wrong (it is in the token file `tine serve` printed at its start)"
    } else {
        "no bearer token: send `Authorization: Bearer TOKEN` (the token is in the token file `tine serve` printed at its start)"
    };
    let mut resp = ApiError::new(ErrorKind::Unauthorized, message).into_response();
    resp.headers_mut().insert(
        axum::http::header::WWW_AUTHENTICATE,
        axum::http::HeaderValue::from_static("Bearer"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_token_is_private_and_read_back() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("sub/token");
        let (tok, how) = load_or_create_token(&p).unwrap();
        assert_eq!(how, TokenSource::Generated);
        assert_eq!(tok.len(), 64);
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (again, how) = load_or_create_token(&p).unwrap();
        assert_eq!((again, how), (tok, TokenSource::Read));
        // No temporary file stays behind.
        assert_eq!(std::fs::read_dir(t.path().join("sub")).unwrap().count(), 1);
    }

    #[test]
    fn a_token_file_others_can_read_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("token");
        std::fs::write(&p, "0123456789abcdef0123").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            load_or_create_token(&p),
            Err(TokenError::Exposed { mode: 0o644, .. })
        ));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(load_or_create_token(&p).unwrap().0, "0123456789abcdef0123");
        std::fs::write(&p, "short").unwrap();
        assert!(matches!(
            load_or_create_token(&p),
            Err(TokenError::Empty { .. })
        ));
    }
}
