//! The bearer token: read from a file, or generated at first start into one
//! only its owner can read; compared in constant time.

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
    #[error("token file {0}")]
    File(#[from] tine_store::secret::SecretError),
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

/// The token in `path`, or a new random one (32 bytes, hex) written there.
pub fn load_or_create_token(path: &Path) -> Result<(String, TokenSource), TokenError> {
    let make = || -> std::io::Result<Vec<u8>> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Ok(format!("{hex}\n").into_bytes())
    };
    let (bytes, made) = tine_store::secret::load_or_create(path, &make)?;
    let token = String::from_utf8_lossy(&bytes).trim().to_string();
    if token.len() < 16 {
        return Err(TokenError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok((
        token,
        if made {
            TokenSource::Generated
        } else {
            TokenSource::Read
        },
    ))
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
    use std::os::unix::fs::PermissionsExt;

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
            Err(TokenError::File(tine_store::secret::SecretError::Exposed {
                mode: 0o644,
                ..
            }))
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
