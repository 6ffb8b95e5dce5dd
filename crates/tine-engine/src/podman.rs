//! Running Podman (Debian's `podman`) for what tine takes from it: an
//! image of its store, a container's state. Its failures become errors
//! that name the command and say what Podman said.

use std::path::Path;

use tine_store::ErrorKind;

use crate::EngineError;

/// Runs `bin ARGS` (no input) and gives its output; a failure is
/// `not_found` where Podman says it does not know the name, else `io`,
/// with `what` and the start of what it printed.
pub(crate) fn output(
    bin: &Path,
    args: &[&std::ffi::OsStr],
    what: &str,
) -> Result<Vec<u8>, EngineError> {
    let o = std::process::Command::new(bin)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|source| EngineError::File {
            path: bin.display().to_string(),
            step: "run podman",
            source,
        })?;
    if o.status.success() {
        return Ok(o.stdout);
    }
    let why = String::from_utf8_lossy(&o.stderr);
    let why = why.trim();
    let kind = if why.contains("unknown") || why.contains("not known") || why.contains("no such") {
        ErrorKind::NotFound
    } else {
        ErrorKind::Io
    };
    Err(EngineError::Reported {
        kind,
        message: format!("{what}: {}", why.chars().take(500).collect::<String>()),
    })
}
