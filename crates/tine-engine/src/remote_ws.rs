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
pub const WORKSPACE_VERSION: u32 = 1;

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
    pub net: tine_sandbox::Net,
    pub restart: tine_sandbox::Restart,
    pub stop_timeout_ms: u64,
    pub keep: usize,
    pub idle_suspend_s: Option<u64>,
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
        let spec: RunSpec = serde_json::from_str(&rec.spec).map_err(|e| EngineError::Internal {
            message: format!("workspace {name}: its sandbox's run options do not parse: {e}"),
        })?;
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
        let r: WorkspaceOnRemote =
            serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        if r.format != WORKSPACE_FORMAT || r.version != WORKSPACE_VERSION || r.name != name {
            return Err(bad(format!(
                "format {:?} version {} for {:?}; this tine reads {WORKSPACE_FORMAT} {WORKSPACE_VERSION}",
                r.format, r.version, r.name
            ))
            .into());
        }
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
