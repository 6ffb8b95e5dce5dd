//! Workspaces that travel: suspended to a remote on one host, resumed from it
//! on another. The state's snapshot is pushed first, then a record
//! (`workspaces/NAME` on the remote) that says how to run it again; resuming
//! pulls the snapshot and starts the workspace over it. Process images stay on
//! the host that made them, so on another host the command starts afresh (the
//! result says so).

use serde::{Deserialize, Serialize};
use tine_remote::{PushOptions, PushReport, Remote, RemoteError};
use tine_sandbox::supervisor::RunSpec;
use tine_store::{ErrorKind, HasKind, ObjectId, Progress, WorkspaceState, now_ns};

use crate::workspace::{CreateWorkspace, Detail, Processes, Resumed, SuspendStep, Suspended};
use crate::{CreateSandbox, Engine, EngineError};

pub const WORKSPACE_FORMAT: &str = "tine-workspace";
/// 2 added `disk_bytes`; records of version 1 are still read.
pub const WORKSPACE_VERSION: u32 = 2;

/// What is read of a record before the rest: its format and version, so
/// that a record of another format or a newer version is named as such.
#[derive(Debug, Deserialize)]
struct RecordHeader {
    format: String,
    version: u32,
}

/// What a remote keeps of a suspended workspace.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WorkspaceOnRemote {
    pub format: String,
    pub version: u32,
    pub name: String,
    /// The state's snapshot (pushed before this record).
    pub snapshot: String,
    pub time_ns: u64,
    /// The repository that suspended it.
    pub origin: String,
    pub command: Vec<String>,
    pub env: Vec<(String, String)>,
    pub memory_bytes: Option<u64>,
    pub pids: Option<u64>,
    /// Version 2 on.
    #[serde(default)]
    pub disk_bytes: Option<u64>,
    pub net: tine_sandbox::Net,
    pub restart: tine_sandbox::Restart,
    pub stop_timeout_ms: u64,
    pub keep: usize,
    pub idle_suspend_s: Option<u64>,
}

/// A workspace record as read from a remote: of format
/// [`WORKSPACE_FORMAT`], a version this tine reads, and for `name`.
fn parse_record(bytes: &[u8], name: &str) -> Result<WorkspaceOnRemote, String> {
    let h: RecordHeader = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    if h.format != WORKSPACE_FORMAT || !(1..=WORKSPACE_VERSION).contains(&h.version) {
        return Err(format!(
            "format {:?} version {}; this tine reads {WORKSPACE_FORMAT} versions 1 to {WORKSPACE_VERSION}",
            h.format, h.version
        ));
    }
    let r: WorkspaceOnRemote = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    if r.name != name {
        return Err(format!("it is the record of workspace {:?}", r.name));
    }
    if r.version < 2 && r.disk_bytes.is_some() {
        return Err("a version 1 record cannot carry disk_bytes".into());
    }
    Ok(r)
}

/// A suspend whose state went to a remote.
#[derive(Debug, Clone, Serialize)]
pub struct SuspendedTo {
    #[serde(flatten)]
    pub suspended: Suspended,
    pub push: PushReport,
}

#[derive(Debug, thiserror::Error)]
pub enum RemoteWorkspaceError {
    #[error(transparent)]
    Remote(#[from] RemoteError),
    #[error(
        "remote {url} has no workspace {name:?} (suspend it there with `tine suspend {name} --to REMOTE`)"
    )]
    NotOnRemote { url: String, name: String },
    #[error("remote {url}: the record of workspace {name:?} is damaged: {reason}")]
    BadRecord {
        url: String,
        name: String,
        reason: String,
    },
    #[error(
        "workspace {name} is running here; suspend it (or delete it) before resuming the remote's state over it"
    )]
    RunningHere { name: String },
}

impl HasKind for RemoteWorkspaceError {
    fn kind(&self) -> ErrorKind {
        match self {
            RemoteWorkspaceError::Remote(e) => e.kind(),
            RemoteWorkspaceError::NotOnRemote { .. } => ErrorKind::NotFound,
            RemoteWorkspaceError::BadRecord { .. } => ErrorKind::Corrupt,
            RemoteWorkspaceError::RunningHere { .. } => ErrorKind::Conflict,
        }
    }
}

impl From<RemoteError> for EngineError {
    fn from(e: RemoteError) -> EngineError {
        EngineError::RemoteWorkspace(e.into())
    }
}

impl Engine {
    /// Suspends workspace `name` (the four durable steps), then pushes its
    /// state's snapshot and a record of how to run it to `remote`.
    pub fn suspend_workspace_to(
        &self,
        name: &str,
        remote: &Remote,
        opts: &PushOptions,
        progress: &dyn Progress,
    ) -> Result<SuspendedTo, EngineError> {
        let suspended = self.suspend_workspace(name, &mut |_: SuspendStep| {})?;
        let repo = self.open()?;
        let (w, rec) = self.workspace_record(&repo, name)?;
        let spec = RunSpec::of(&rec).map_err(tine_sandbox::SandboxError::from)?;
        let settings = crate::workspace::settings_of(&w);
        let snapshot = suspended.state.snapshot;
        let push = remote.push(&repo, &[snapshot], &[], opts, progress)?;
        let record = WorkspaceOnRemote {
            format: WORKSPACE_FORMAT.into(),
            version: WORKSPACE_VERSION,
            name: name.to_string(),
            snapshot: snapshot.to_hex(),
            time_ns: suspended.state.time_ns,
            origin: repo.repo_id().to_string(),
            command: spec.command,
            env: spec.env,
            memory_bytes: spec.limits.memory_bytes,
            pids: spec.limits.pids,
            disk_bytes: spec.limits.disk_bytes,
            net: spec.net,
            restart: spec.restart,
            stop_timeout_ms: spec.stop_timeout_ms,
            keep: settings.keep,
            idle_suspend_s: settings.idle_suspend_s,
        };
        remote.put_workspace(
            name,
            &serde_json::to_vec(&record).expect("record serializes"),
        )?;
        Ok(SuspendedTo { suspended, push })
    }

    /// Resumes workspace `name` from the state `remote` holds: pulls its
    /// snapshot, then starts the workspace over it — a new workspace when
    /// this repository has none of that name, or a new state of the one it
    /// has (which must not be running).
    pub fn resume_workspace_from(
        &self,
        name: &str,
        remote: &Remote,
        progress: &dyn Progress,
    ) -> Result<Resumed, EngineError> {
        let t0 = std::time::Instant::now();
        let bytes = remote
            .workspace(name)?
            .ok_or_else(|| RemoteWorkspaceError::NotOnRemote {
                url: remote.url().to_string(),
                name: name.to_string(),
            })?;
        let bad = |reason: String| RemoteWorkspaceError::BadRecord {
            url: remote.url().to_string(),
            name: name.to_string(),
            reason,
        };
        let r = parse_record(&bytes, name).map_err(bad)?;
        let snapshot =
            ObjectId::from_hex(&r.snapshot).ok_or_else(|| bad("bad snapshot id".into()))?;
        let repo = self.open()?;
        remote.pull(&repo, std::slice::from_ref(&r.snapshot), progress)?;
        let note = format!(
            "resumed from remote {} (suspended by repository {}): its files are that state's; its command started afresh (process images stay on the host that suspended it)",
            remote.name(),
            &r.origin[..r.origin.len().min(12)]
        );
        if repo.workspace(name)?.is_some() {
            let (w, rec) = self.workspace_record(&repo, name)?;
            if tine_sandbox::manager::view(&repo, &rec).live() {
                return Err(RemoteWorkspaceError::RunningHere {
                    name: name.to_string(),
                }
                .into());
            }
            let states = repo.workspace_states(name)?;
            let current = w.current.and_then(|c| states.iter().find(|s| s.seq == c));
            // The state it sits in is the remote's already: an ordinary resume.
            if current.is_some_and(|s| s.snapshot == snapshot) {
                drop(repo);
                return self.resume_workspace(name);
            }
            let seq = states.iter().map(|s| s.seq).max().unwrap_or(0) + 1;
            let detail = Detail {
                processes: Processes::Restart,
                count: 0,
                reason: Some(note),
            };
            self.lock(&repo)?.add_workspace_state(&WorkspaceState {
                workspace: name.to_string(),
                seq,
                snapshot,
                time_ns: now_ns(),
                detail: serde_json::to_string(&detail).expect("detail serializes"),
            })?;
            drop(repo);
            let mut out = self.resume_workspace(name)?;
            out.duration_ms = t0.elapsed().as_secs_f64() * 1e3;
            return Ok(out);
        }
        drop(repo);
        let env = r.env.iter().cloned().collect();
        let view = self.create_workspace(&CreateWorkspace {
            name: name.to_string(),
            sandbox: CreateSandbox {
                from: Some(r.snapshot.clone()),
                command: r.command.clone(),
                env,
                memory_bytes: r.memory_bytes,
                pids: r.pids,
                disk_bytes: r.disk_bytes,
                net: r.net,
                restart: r.restart,
                stop_timeout_s: Some(r.stop_timeout_ms.div_ceil(1000)),
                ..CreateSandbox::default()
            },
            keep: Some(r.keep),
            idle_suspend_s: r.idle_suspend_s,
        })?;
        Ok(Resumed {
            workspace: view,
            from: None,
            processes: Processes::Restart,
            process_count: 0,
            already: false,
            note: Some(note),
            duration_ms: t0.elapsed().as_secs_f64() * 1e3,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(version: u32, extra: &str) -> Vec<u8> {
        format!(
            r#"{{"format":"tine-workspace","version":{version},"name":"w","snapshot":"00",
            "time_ns":1,"origin":"r","command":[],"env":[],"memory_bytes":null,"pids":4,
            {extra}"net":"none","restart":"no","stop_timeout_ms":1000,"keep":3,
            "idle_suspend_s":null}}"#
        )
        .into_bytes()
    }

    #[test]
    fn records_of_version_1_and_2_are_read_and_newer_ones_are_named() {
        let v1 = parse_record(&record(1, ""), "w").unwrap();
        assert_eq!((v1.pids, v1.disk_bytes), (Some(4), None));
        let v2 = parse_record(&record(2, r#""disk_bytes":1048576,"#), "w").unwrap();
        assert_eq!(v2.disk_bytes, Some(1 << 20));
        let e = parse_record(&record(3, r#""cpus":2,"#), "w").unwrap_err();
        assert!(
            e.contains("version 3") && e.contains("versions 1 to 2"),
            "{e}"
        );
        let e = parse_record(&record(1, r#""disk_bytes":1,"#), "w").unwrap_err();
        assert!(e.contains("version 1"), "{e}");
        let e = parse_record(&record(2, ""), "other").unwrap_err();
        assert!(e.contains("\"w\""), "{e}");
        assert!(parse_record(&record(2, r#""surprise":1,"#), "w").is_err());
    }
}
