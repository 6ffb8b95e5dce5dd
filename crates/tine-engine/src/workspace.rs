//! Workspaces: named, long-lived sandboxes that suspend (their state made
//! durable in the repository, then stopped) and resume (also after a daemon
//! restart or a reboot).
//!
//! A suspend is four steps, each durable before the next starts:
//! 1. snapshot the files, and the processes persisted with CRIU where that
//!    works (otherwise the state records that they restart from the
//!    command, and why);
//! 2. record the state and make it the workspace's current one (one SQLite
//!    transaction, with a head that keeps its snapshot from `gc`);
//! 3. stop the sandbox;
//! 4. forget states beyond the retention (never the current one).
//!
//! A crash between any two leaves a restorable workspace: before 2 it still
//! runs (or, after a reboot, its previous state is current); after 2 the new
//! state is complete. Whether a workspace runs is read from its sandbox, not
//! stored, so no step can leave a stale claim behind.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tine_sandbox::SandboxError;
use tine_sandbox::manager::{self, SandboxView};
use tine_store::{
    ErrorKind, HasKind, ObjectId, Repository, SandboxRecord, WorkspaceRecord, WorkspaceState,
    now_ns,
};

use crate::{CreateSandbox, Ctx, Engine, EngineError, SnapshotRequest};

#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error(
        "no workspace named {name:?} (list them with GET /v1/workspaces or `tine workspace ls`)"
    )]
    NotFound { name: String },
    #[error(
        "workspace name {name:?} is not valid: use 1-64 letters, digits, '-', '_' or '.', starting with a letter or digit"
    )]
    BadName { name: String },
    #[error("sandbox {sandbox} belongs to workspace {workspace}; delete the workspace instead")]
    Owned { sandbox: String, workspace: String },
    #[error(
        "workspace {name} is not running and has no suspended state (it ended or its host restarted while it ran); resume it first"
    )]
    NotRunning { name: String },
    #[error("workspace {name}: its sandbox {sandbox} is gone ({reason})")]
    Broken {
        name: String,
        sandbox: String,
        reason: String,
    },
    #[error("workspace {name}: `keep` must be at least 1")]
    BadKeep { name: String },
}

impl HasKind for WorkspaceError {
    fn kind(&self) -> ErrorKind {
        match self {
            WorkspaceError::NotFound { .. } => ErrorKind::NotFound,
            WorkspaceError::BadName { .. }
            | WorkspaceError::BadKeep { .. }
            | WorkspaceError::NotRunning { .. } => ErrorKind::InvalidInput,
            WorkspaceError::Owned { .. } => ErrorKind::AlreadyExists,
            WorkspaceError::Broken { .. } => ErrorKind::Internal,
        }
    }
}

/// The steps of a suspend, in order (a test can stop the process after any).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SuspendStep {
    Snapshotted,
    Recorded,
    Stopped,
    Pruned,
}

impl SuspendStep {
    pub const ALL: [SuspendStep; 4] = [
        SuspendStep::Snapshotted,
        SuspendStep::Recorded,
        SuspendStep::Stopped,
        SuspendStep::Pruned,
    ];
}

/// A workspace's settings (stored as JSON with it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Settings {
    /// Suspended states kept (the newest ones).
    pub keep: usize,
    /// Suspend after this many seconds without API activity or CPU use.
    pub idle_suspend_s: Option<u64>,
}

/// How a new workspace is made.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CreateWorkspace {
    pub name: String,
    /// Its sandbox (its name is the workspace's).
    pub sandbox: CreateSandbox,
    /// Suspended states kept (default 3).
    pub keep: Option<usize>,
    pub idle_suspend_s: Option<u64>,
}

/// How a state's processes come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Processes {
    /// From CRIU images: they continue where they were.
    Criu,
    /// Their command starts afresh over the state's files.
    Restart,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Detail {
    pub(crate) processes: Processes,
    pub(crate) count: usize,
    pub(crate) reason: Option<String>,
}

/// One suspended state.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct StateView {
    pub seq: u64,
    pub snapshot: ObjectId,
    pub time_ns: u64,
    pub processes: Processes,
    /// Processes persisted (with `criu`).
    pub process_count: usize,
    /// Why the processes restart instead (with `restart`).
    pub reason: Option<String>,
}

/// A workspace as the API shows it.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct WorkspaceView {
    pub name: String,
    /// `running`, `suspended`, or `stale` (not running and not suspended:
    /// it ended, or its host restarted while it ran).
    pub state: String,
    pub sandbox: SandboxView,
    pub keep: usize,
    pub idle_suspend_s: Option<u64>,
    /// The state it sits in while suspended.
    pub current: Option<u64>,
    pub states: Vec<StateView>,
    pub created_ns: u64,
}

/// What a suspend did.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Suspended {
    pub workspace: String,
    pub state: StateView,
    /// It was suspended already; nothing was done.
    pub already: bool,
    /// States forgotten by the retention.
    pub pruned: Vec<u64>,
    pub duration_ms: f64,
}

/// What a resume did.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Resumed {
    pub workspace: WorkspaceView,
    /// The state it resumed from (none: it was stale, and runs again over
    /// the files it had).
    pub from: Option<u64>,
    pub processes: Processes,
    /// Processes brought back from CRIU images.
    pub process_count: usize,
    /// It was running already; nothing was done.
    pub already: bool,
    pub note: Option<String>,
    pub duration_ms: f64,
}

/// How a resume brought a workspace back.
struct Back {
    from: Option<u64>,
    processes: Processes,
    count: usize,
    note: Option<String>,
}

/// What the daemon found at its start.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Reconciled {
    /// Live sandboxes whose supervisors answer (the daemon serves them again).
    pub adopted: Vec<String>,
    /// Sandboxes recorded as live whose supervisors are gone: marked stale.
    pub stale: Vec<String>,
}

pub(crate) fn settings_of(w: &WorkspaceRecord) -> Settings {
    serde_json::from_str(&w.settings).unwrap_or(Settings {
        keep: 3,
        idle_suspend_s: None,
    })
}

fn state_view(s: &WorkspaceState) -> StateView {
    let d: Detail = serde_json::from_str(&s.detail).unwrap_or(Detail {
        processes: Processes::Restart,
        count: 0,
        reason: Some("its record does not say".into()),
    });
    StateView {
        seq: s.seq,
        snapshot: s.snapshot,
        time_ns: s.time_ns,
        processes: d.processes,
        process_count: d.count,
        reason: d.reason,
    }
}

/// Refuses to remove a sandbox that a workspace lives in.
pub(crate) fn refuse_if_owned(repo: &Repository, rec: &SandboxRecord) -> Result<(), EngineError> {
    if let Some(w) = repo.workspaces()?.into_iter().find(|w| w.sandbox == rec.id) {
        return Err(WorkspaceError::Owned {
            sandbox: rec.name.clone(),
            workspace: w.name,
        }
        .into());
    }
    Ok(())
}

/// The workspace states whose snapshot is `id` ("workspace W state N").
pub(crate) fn states_using(repo: &Repository, id: &ObjectId) -> Result<Vec<String>, EngineError> {
    let mut out = Vec::new();
    for w in repo.workspaces()? {
        for s in repo.workspace_states(&w.name)? {
            if s.snapshot == *id {
                out.push(format!("workspace {} state {}", w.name, s.seq));
            }
        }
    }
    Ok(out)
}

impl Engine {
    pub(crate) fn workspace_record(
        &self,
        repo: &Repository,
        name: &str,
    ) -> Result<(WorkspaceRecord, SandboxRecord), EngineError> {
        let w = repo
            .workspace(name)?
            .ok_or_else(|| WorkspaceError::NotFound { name: name.into() })?;
        let rec = repo
            .sandbox(&w.sandbox)
            .map_err(|e| WorkspaceError::Broken {
                name: w.name.clone(),
                sandbox: w.sandbox.clone(),
                reason: e.to_string(),
            })?;
        Ok((w, rec))
    }

    fn workspace_view_of(
        &self,
        repo: &Repository,
        w: &WorkspaceRecord,
        rec: &SandboxRecord,
    ) -> Result<WorkspaceView, EngineError> {
        let sandbox = manager::view(repo, rec);
        let settings = settings_of(w);
        let state = if sandbox.live() {
            "running"
        } else if w.current.is_some() {
            "suspended"
        } else {
            "stale"
        };
        Ok(WorkspaceView {
            name: w.name.clone(),
            state: state.into(),
            sandbox,
            keep: settings.keep,
            idle_suspend_s: settings.idle_suspend_s,
            current: w.current,
            states: repo
                .workspace_states(&w.name)?
                .iter()
                .map(state_view)
                .collect(),
            created_ns: w.created_ns,
        })
    }

    /// Makes a workspace: a sandbox of the same name, started.
    pub fn create_workspace(&self, req: &CreateWorkspace) -> Result<WorkspaceView, EngineError> {
        if !manager::valid_name(&req.name) {
            return Err(WorkspaceError::BadName {
                name: req.name.clone(),
            }
            .into());
        }
        let keep = req.keep.unwrap_or(3);
        if keep == 0 {
            return Err(WorkspaceError::BadKeep {
                name: req.name.clone(),
            }
            .into());
        }
        if let Some(n) = &req.sandbox.name
            && n != &req.name
        {
            return Err(EngineError::Invalid {
                message: format!(
                    "workspace {}: its sandbox takes the workspace's name; leave sandbox.name out (it was {n:?})",
                    req.name
                ),
            });
        }
        {
            let repo = self.open()?;
            if repo.workspace(&req.name)?.is_some() {
                return Err(tine_store::RecordError::WorkspaceTaken {
                    name: req.name.clone(),
                }
                .into());
            }
        }
        let mut sb = req.sandbox.clone();
        sb.name = Some(req.name.clone());
        // Suspending a workspace persists its processes with CRIU, which
        // cannot dump them under a seccomp filter from inside their user
        // namespace: off unless asked for (then suspends restart them).
        sb.seccomp.get_or_insert(false);
        let view = self.create_sandbox(&sb, &Ctx::QUIET)?;
        let repo = self.open()?;
        let t = now_ns();
        let rec = WorkspaceRecord {
            name: req.name.clone(),
            sandbox: view.id.clone(),
            created_ns: t,
            updated_ns: t,
            settings: serde_json::to_string(&Settings {
                keep,
                idle_suspend_s: req.idle_suspend_s,
            })
            .unwrap_or_default(),
            current: None,
        };
        let inserted = self.lock(&repo).and_then(|l| Ok(l.insert_workspace(&rec)?));
        if let Err(e) = inserted {
            // Raced with another create of the same name: leave no orphan.
            if let Ok(r) = repo.sandbox(&view.id) {
                let _ = manager::remove(&repo, &r, true);
            }
            return Err(e);
        }
        let sbrec = repo.sandbox(&view.id)?;
        self.workspace_view_of(&repo, &rec, &sbrec)
    }

    pub fn workspaces(&self) -> Result<Vec<WorkspaceView>, EngineError> {
        let repo = self.open()?;
        let mut out = Vec::new();
        for w in repo.workspaces()? {
            if let Ok(rec) = repo.sandbox(&w.sandbox) {
                out.push(self.workspace_view_of(&repo, &w, &rec)?);
            }
        }
        Ok(out)
    }

    pub fn workspace(&self, name: &str) -> Result<WorkspaceView, EngineError> {
        let repo = self.open()?;
        let (w, rec) = self.workspace_record(&repo, name)?;
        self.workspace_view_of(&repo, &w, &rec)
    }

    /// Deletes a workspace: its sandbox (stopped first) and its states.
    pub fn delete_workspace(&self, name: &str) -> Result<(), EngineError> {
        let repo = self.open()?;
        let w = repo
            .workspace(name)?
            .ok_or_else(|| WorkspaceError::NotFound { name: name.into() })?;
        match repo.sandbox(&w.sandbox) {
            Ok(rec) => manager::remove(&repo, &rec, true)?,
            Err(tine_store::RecordError::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        self.lock(&repo)?.delete_workspace(name)?;
        Ok(())
    }

    /// Suspends a running workspace (see the module's documentation);
    /// `on_step` is called after each step.
    pub fn suspend_workspace(
        &self,
        name: &str,
        on_step: &mut dyn FnMut(SuspendStep),
    ) -> Result<Suspended, EngineError> {
        let t0 = Instant::now();
        let repo = self.open()?;
        let (w, rec) = self.workspace_record(&repo, name)?;
        let view = manager::view(&repo, &rec);
        if !view.live() {
            let states = repo.workspace_states(name)?;
            return match w.current.and_then(|c| states.iter().find(|s| s.seq == c)) {
                Some(s) => Ok(Suspended {
                    workspace: w.name.clone(),
                    state: state_view(s),
                    already: true,
                    pruned: vec![],
                    duration_ms: t0.elapsed().as_secs_f64() * 1e3,
                }),
                None => Err(WorkspaceError::NotRunning { name: w.name }.into()),
            };
        }
        drop(repo);
        // 1. The state, durable in the repository.
        let (snapshot, detail) = self.snapshot_for_suspend(&rec, name)?;
        on_step(SuspendStep::Snapshotted);
        // 2. Recorded as current, in one transaction.
        let repo = self.open()?;
        let states = repo.workspace_states(name)?;
        let seq = states.iter().map(|s| s.seq).max().unwrap_or(0) + 1;
        let state = WorkspaceState {
            workspace: name.to_string(),
            seq,
            snapshot,
            time_ns: now_ns(),
            detail: serde_json::to_string(&detail).unwrap_or_default(),
        };
        self.lock(&repo)?.add_workspace_state(&state)?;
        on_step(SuspendStep::Recorded);
        // 3. Stopped.
        manager::stop(&repo, &rec, None)?;
        on_step(SuspendStep::Stopped);
        // 4. Retention, only now that the new state is durable.
        let keep = settings_of(&w).keep.max(1);
        let mut pruned = Vec::new();
        let mut all = states;
        all.push(state.clone());
        if all.len() > keep {
            let lock = self.lock(&repo)?;
            for s in &all[..all.len() - keep] {
                if s.seq != seq {
                    lock.delete_workspace_state(name, s.seq)?;
                    pruned.push(s.seq);
                }
            }
        }
        on_step(SuspendStep::Pruned);
        Ok(Suspended {
            workspace: name.to_string(),
            state: state_view(&state),
            already: false,
            pruned,
            duration_ms: t0.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Step 1 of a suspend: the files, and the processes through CRIU when
    /// they can be; otherwise the files only, with the reason.
    fn snapshot_for_suspend(
        &self,
        rec: &SandboxRecord,
        name: &str,
    ) -> Result<(ObjectId, Detail), EngineError> {
        let message = format!("suspend of workspace {name}");
        let files_only = SnapshotRequest {
            message: message.clone(),
            files_only: true,
            ..Default::default()
        };
        let restart = |reason: String| Detail {
            processes: Processes::Restart,
            count: 0,
            reason: Some(reason),
        };
        if self.cfg.criu.is_none() {
            let out = self.snapshot_sandbox(&rec.id, &files_only, &Ctx::QUIET)?;
            return Ok((
                out.outcome.id,
                restart(
                    "no CRIU (4.1 or later) is installed, so processes cannot outlive a stop: the command starts afresh on resume".into(),
                ),
            ));
        }
        let with_processes = SnapshotRequest {
            message,
            persist: true,
            ..Default::default()
        };
        match self.snapshot_sandbox(&rec.id, &with_processes, &Ctx::QUIET) {
            Ok(out) if out.frozen.processes > 0 => Ok((
                out.outcome.id,
                Detail {
                    processes: Processes::Criu,
                    count: out.frozen.processes,
                    reason: None,
                },
            )),
            Ok(out) => Ok((
                out.outcome.id,
                restart("no process was running to persist".into()),
            )),
            // The snapshot was taken; only its processes could not be persisted.
            Err(EngineError::Sandbox(SandboxError::Persist {
                snapshot, source, ..
            })) => {
                let repo = self.open()?;
                Ok((
                    repo.resolve(&snapshot)?,
                    restart(format!("CRIU could not persist its processes: {source}")),
                ))
            }
            Err(EngineError::Sandbox(e @ SandboxError::Process { .. }))
                if e.kind() == ErrorKind::Unsupported =>
            {
                let out = self.snapshot_sandbox(&rec.id, &files_only, &Ctx::QUIET)?;
                Ok((
                    out.outcome.id,
                    restart(format!("its processes cannot be captured: {e}")),
                ))
            }
            Err(e) => Err(e),
        }
    }

    /// Resumes a suspended (or stale) workspace.
    pub fn resume_workspace(&self, name: &str) -> Result<Resumed, EngineError> {
        let t0 = Instant::now();
        let repo = self.open()?;
        let (w, rec) = self.workspace_record(&repo, name)?;
        let view = manager::view(&repo, &rec);
        let already = view.live();
        let back = if already {
            Back {
                from: None,
                processes: Processes::Criu,
                count: 0,
                note: None,
            }
        } else {
            self.bring_back(&repo, &w, &rec, view.state)?
        };
        let (w, rec) = self.workspace_record(&repo, name)?;
        Ok(Resumed {
            workspace: self.workspace_view_of(&repo, &w, &rec)?,
            from: back.from,
            processes: back.processes,
            process_count: back.count,
            already,
            note: back.note,
            duration_ms: t0.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Starts a workspace's sandbox that is not running (in `state`): from
    /// its current suspended state, or over the files it had when stale.
    fn bring_back(
        &self,
        repo: &Repository,
        w: &WorkspaceRecord,
        rec: &SandboxRecord,
        state: tine_store::SandboxState,
    ) -> Result<Back, EngineError> {
        // What a dead supervisor left (processes, the mount) goes first.
        if state == tine_store::SandboxState::Stale {
            manager::stop(repo, rec, Some(Duration::ZERO))?;
        }
        let rec = repo.sandbox(&rec.id)?;
        let current = match w.current {
            Some(c) => repo
                .workspace_states(&w.name)?
                .into_iter()
                .find(|s| s.seq == c),
            None => None,
        };
        let Some(current) = current else {
            manager::start(repo, &rec, &self.cfg.exe, None)?;
            return Ok(Back {
                from: None,
                processes: Processes::Restart,
                count: 0,
                note: Some("it was not suspended (it ended, or its host restarted while it ran): its files are as it left them and its command started afresh".into()),
            });
        };
        let sv = state_view(&current);
        // The state's files (differential: normally nothing changed since).
        {
            let lock = self.lock(repo)?;
            manager::restore(
                &lock,
                &rec,
                &current.snapshot,
                true,
                None,
                &tine_store::NoProgress,
            )?;
        }
        let criu = self
            .cfg
            .criu
            .as_ref()
            .filter(|_| sv.processes == Processes::Criu);
        let afresh = |note: String| Back {
            from: Some(current.seq),
            processes: Processes::Restart,
            count: 0,
            note: Some(note),
        };
        let back = match criu {
            Some(c) => {
                match manager::start(repo, &rec, &self.cfg.exe, Some((&current.snapshot, c))) {
                    Ok(n) if n > 0 => Back {
                        from: Some(current.seq),
                        processes: Processes::Criu,
                        count: n,
                        note: None,
                    },
                    Ok(_) => afresh("its CRIU images are gone: its command started afresh".into()),
                    Err(e) => {
                        let _ = manager::stop(repo, &repo.sandbox(&rec.id)?, Some(Duration::ZERO));
                        manager::start(repo, &repo.sandbox(&rec.id)?, &self.cfg.exe, None)?;
                        afresh(format!(
                            "its processes could not be brought back ({e}): its command started afresh"
                        ))
                    }
                }
            }
            None => {
                manager::start(repo, &rec, &self.cfg.exe, None)?;
                afresh(match sv.processes {
                    Processes::Criu => {
                        "no CRIU is installed here: its command started afresh".to_string()
                    }
                    Processes::Restart => format!(
                        "its command started afresh ({})",
                        sv.reason
                            .as_deref()
                            .unwrap_or("its processes were not persisted")
                    ),
                })
            }
        };
        self.lock(repo)?.set_workspace_current(&w.name, None)?;
        Ok(back)
    }

    /// At the daemon's start: sandboxes recorded as live whose supervisors
    /// answer are served again; the others are marked stale.
    pub fn reconcile(&self) -> Result<Reconciled, EngineError> {
        let repo = self.open()?;
        let mut out = Reconciled::default();
        for rec in repo.sandboxes()? {
            if !rec.state.is_live() {
                continue;
            }
            let v = manager::view(&repo, &rec);
            if v.live() {
                out.adopted.push(rec.name);
            } else if v.state == tine_store::SandboxState::Stale {
                let mut r = rec.clone();
                r.state = tine_store::SandboxState::Stale;
                r.supervisor_pid = None;
                repo.save_sandbox(&r)?;
                out.stale.push(rec.name);
            }
        }
        Ok(out)
    }

    /// CPU time (clock ticks) the processes of a sandbox have used, for
    /// the idle check; `None` when it has none running.
    pub fn cpu_ticks(&self, sandbox_id: &str) -> Option<u64> {
        let cg = tine_sandbox::CgroupRoot::detect(std::path::Path::new(
            tine_sandbox::cgroup::DEFAULT_ROOT,
        ))
        .ok()?
        .open(sandbox_id)
        .ok()?;
        let pids = cg.processes().ok()?;
        if pids.is_empty() {
            return None;
        }
        Some(
            pids.iter()
                .filter_map(|p| tine_proc::stat(*p).ok())
                .map(|s| s.cpu_ticks)
                .sum(),
        )
    }

    /// Workspaces that ask to be suspended when idle: (name, sandbox id,
    /// idle seconds), running ones only.
    pub fn idle_candidates(&self) -> Result<Vec<(String, String, u64)>, EngineError> {
        let repo = self.open()?;
        let mut out = Vec::new();
        for w in repo.workspaces()? {
            let Some(idle) = settings_of(&w).idle_suspend_s else {
                continue;
            };
            if let Ok(rec) = repo.sandbox(&w.sandbox)
                && manager::view(&repo, &rec).live()
            {
                out.push((w.name, rec.id, idle));
            }
        }
        Ok(out)
    }
}
