//! Secret files (the daemon's token, the ledger's key): read when they
//! exist, refused when others can read them, made otherwise — written to a
//! temporary file with mode 0600, fsynced, then hard-linked into place, so
//! that two processes starting at once never replace each other's secret.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("{}: {step}: {source}", path.display())]
    Io {
        path: PathBuf,
        step: &'static str,
        source: std::io::Error,
    },
    #[error("{} can be read by others (mode {mode:o}); `chmod 600` it", path.display())]
    Exposed { path: PathBuf, mode: u32 },
}

/// The bytes of secret file `path`, or those `make` gives, stored there
/// first; the flag says whether they were made now.
pub fn load_or_create(
    path: &Path,
    make: &dyn Fn() -> std::io::Result<Vec<u8>>,
) -> Result<(Vec<u8>, bool), SecretError> {
    let io = |step| {
        move |source| SecretError::Io {
            path: path.to_path_buf(),
            step,
            source,
        }
    };
    match std::fs::read(path) {
        Ok(bytes) => {
            let mode = std::fs::metadata(path)
                .map_err(io("stat"))?
                .permissions()
                .mode()
                & 0o777;
            if mode & 0o077 != 0 {
                return Err(SecretError::Exposed {
                    path: path.to_path_buf(),
                    mode,
                });
            }
            return Ok((bytes, false));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("read")(e)),
    }
    let secret = make().map_err(io("make"))?;
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
    if let Err(e) = f.write_all(&secret).and_then(|()| f.sync_all()) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io("write")(e));
    }
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            let _ = crate::pack::sync_dir(dir);
            Ok((secret, true))
        }
        // Another process made it meanwhile: theirs is the one.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => load_or_create(path, make),
        Err(e) => Err(io("link")(e)),
    }
}
