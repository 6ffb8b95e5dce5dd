//! The Podman containers `tine attach --container` takes: what `podman
//! container inspect` says of one (its first process, its root as mounted
//! on the host), and which of its processes is its application.

use std::path::PathBuf;

use tine_store::ErrorKind;

use super::{ContainerRef, invalid};
use crate::{Engine, EngineError};

/// What `podman container inspect` says of a running container.
#[derive(Debug)]
struct Inspected {
    id: String,
    name: String,
    /// Its first process (conmon's child).
    init: u32,
    /// Its root as Podman mounts it on the host.
    merged: PathBuf,
}

/// Reads `podman container inspect`'s JSON of one container.
fn inspected(json: &[u8], asked: &str) -> Result<Inspected, EngineError> {
    let v: serde_json::Value = serde_json::from_slice(json).map_err(|e| EngineError::Reported {
        kind: ErrorKind::Io,
        message: format!("attach --container {asked}: podman's inspect output does not parse: {e}"),
    })?;
    let c = &v[0];
    let str_of = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    if c["State"]["Running"] != serde_json::Value::Bool(true) {
        return Err(EngineError::NotRunning {
            name: asked.to_string(),
            state: format!(
                "{} (start it with `podman start {asked}`)",
                c["State"]["Status"].as_str().unwrap_or("not running")
            ),
        });
    }
    let init = c["State"]["Pid"].as_u64().unwrap_or(0) as u32;
    let merged = str_of(&c["GraphDriver"]["Data"]["MergedDir"]);
    if init == 0 || merged.is_empty() {
        return Err(invalid(format!(
            "attach --container {asked}: podman names no process or no mounted root for it (a container with an overlay root, run by root, is needed)"
        )));
    }
    Ok(Inspected {
        id: str_of(&c["Id"]),
        name: str_of(&c["Name"]),
        init,
        merged: PathBuf::from(merged),
    })
}

/// Of a container whose first process is `init`: its application process.
/// That is `init` itself, or, where `init` is an init a runtime added
/// (`podman run --init`: catatonit; tini, dumb-init) with one child, that
/// child, so that the init (which ends when its child does) is never
/// touched.
fn application_of(init: u32) -> u32 {
    let comm = std::fs::read_to_string(format!("/proc/{init}/comm")).unwrap_or_default();
    let kids = tine_proc::inspect::children_of(init);
    match (comm.trim(), kids.as_slice()) {
        ("catatonit" | "tini" | "dumb-init" | "podman-init", [only]) => *only,
        _ => init,
    }
}

impl Engine {
    /// A running Podman container: its id and name, its application
    /// process and its root.
    pub(super) fn container(
        &self,
        asked: &str,
    ) -> Result<(ContainerRef, u32, PathBuf), EngineError> {
        let bin = self.cfg.podman.as_ref().ok_or_else(|| EngineError::Reported {
            kind: ErrorKind::Unsupported,
            message: "attach --container: no podman is installed (Debian's podman); Docker is not supported yet".into(),
        })?;
        // A name or id, never an option Podman would take.
        let ok = !asked.is_empty()
            && asked.len() <= 253
            && asked.as_bytes()[0].is_ascii_alphanumeric()
            && asked
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !ok {
            return Err(invalid(format!(
                "attach --container {:?}: not a container name (letters, digits and ._-, starting with a letter or digit)",
                asked.chars().take(80).collect::<String>()
            )));
        }
        let args = ["container", "inspect", "--format", "json", asked].map(std::ffi::OsStr::new);
        let json =
            crate::podman::output(bin, &args, &format!("attach --container {asked}: podman"))?;
        let c = inspected(&json, asked)?;
        let app = application_of(c.init);
        let merged = std::fs::canonicalize(&c.merged).map_err(|source| EngineError::File {
            path: c.merged.display().to_string(),
            step: "find the container's root",
            source,
        })?;
        Ok((
            ContainerRef {
                id: c.id,
                name: c.name,
            },
            app,
            merged,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tine_store::HasKind;

    #[test]
    fn inspect_output_names_a_running_containers_process_and_root_or_says_why_not() {
        let ok =
            br#"[{"Id":"abc","Name":"web","State":{"Running":true,"Status":"running","Pid":42},
            "GraphDriver":{"Data":{"MergedDir":"/var/lib/containers/storage/overlay/x/merged"}}}]"#;
        let c = inspected(ok, "web").unwrap();
        assert_eq!((c.id.as_str(), c.name.as_str(), c.init), ("abc", "web", 42));
        assert_eq!(
            c.merged,
            PathBuf::from("/var/lib/containers/storage/overlay/x/merged")
        );
        let stopped =
            br#"[{"Id":"abc","Name":"web","State":{"Running":false,"Status":"exited","Pid":0}}]"#;
        let e = inspected(stopped, "web").unwrap_err();
        assert!(e.to_string().contains("exited"), "{e}");
        assert!(e.to_string().contains("podman start web"), "{e}");
        // A root Podman does not mount on the host (a VFS driver, rootless).
        let unmounted = br#"[{"Id":"abc","Name":"web","State":{"Running":true,"Pid":42},"GraphDriver":{"Data":{}}}]"#;
        let e = inspected(unmounted, "web").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        assert_eq!(
            inspected(b"not json", "web").unwrap_err().kind(),
            ErrorKind::Io
        );
    }
}
