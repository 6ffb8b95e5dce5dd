//! `tine workspace create/ls/show/rm`, `tine suspend`, `tine resume`: thin
//! shells over tine-engine's workspaces.

use std::path::PathBuf;

use clap::{Subcommand, ValueEnum};
use tine_engine::CreateSandbox;
use tine_engine::workspace::{CreateWorkspace, SuspendStep, WorkspaceView};

use crate::output::{CliError, time};

#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    name: String,
    /// Base it on this snapshot.
    #[arg(long, conflicts_with = "workspace")]
    from: Option<String>,
    /// Snapshot DIR and base it on that (DIR is never modified).
    #[arg(long, value_name = "DIR")]
    workspace: Option<PathBuf>,
    /// Memory limit, e.g. 512M or 2G (default: half of the host's).
    #[arg(long, value_parser = crate::commands::sandbox::parse_size)]
    memory: Option<u64>,
    /// Limit on the number of processes (default 4096).
    #[arg(long)]
    pids: Option<u64>,
    /// What its files may take beyond its base, e.g. 2G (default 10G;
    /// enforced where the repository's filesystem keeps project quotas).
    #[arg(long, value_parser = crate::commands::sandbox::parse_size)]
    disk: Option<u64>,
    /// Suspended states kept.
    #[arg(long, default_value_t = 3)]
    keep: usize,
    /// Suspend it after this many seconds without API activity or CPU
    /// use (done by `tine serve`).
    #[arg(long, value_name = "SECONDS")]
    idle_suspend: Option<u64>,
    /// Its command (default: sleep infinity, a sandbox for exec).
    #[arg(last = true, value_name = "CMD")]
    command: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum WorkspaceCmd {
    /// Create a workspace: a sandbox of that name, started.
    Create(CreateArgs),
    /// List workspaces.
    Ls,
    /// Show one workspace and its suspended states.
    Show { name: String },
    /// Delete a workspace: its sandbox and its states.
    Rm { name: String },
}

/// A step of a suspend to stop after (tests of crash safety).
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum StepArg {
    Snapshotted,
    Recorded,
    Stopped,
    Pruned,
}

impl StepArg {
    fn step(self) -> SuspendStep {
        match self {
            StepArg::Snapshotted => SuspendStep::Snapshotted,
            StepArg::Recorded => SuspendStep::Recorded,
            StepArg::Stopped => SuspendStep::Stopped,
            StepArg::Pruned => SuspendStep::Pruned,
        }
    }
}

fn print(json: bool, doc: &impl serde::Serialize, text: impl FnOnce() -> String) {
    crate::emit(json, serde_json::to_value(doc).unwrap_or_default(), text);
}

fn describe(w: &WorkspaceView) -> String {
    let mut s = format!(
        "workspace {} ({}), sandbox {} ({}), keeps {} states{}\n",
        w.name,
        w.state,
        w.sandbox.name,
        w.sandbox.id,
        w.keep,
        w.idle_suspend_s
            .map(|s| format!(", suspends after {s} s idle"))
            .unwrap_or_default()
    );
    for st in &w.states {
        s += &format!(
            "  state {}{}  {}  snapshot {}  processes: {}{}\n",
            st.seq,
            if w.current == Some(st.seq) {
                " (current)"
            } else {
                ""
            },
            time(st.time_ns),
            &st.snapshot.to_hex()[..12],
            match st.processes {
                tine_engine::workspace::Processes::Criu =>
                    format!("{} persisted with CRIU", st.process_count),
                tine_engine::workspace::Processes::Restart => "restart from the command".into(),
            },
            st.reason
                .as_ref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        );
    }
    s
}

/// What `tine workspace create` asks for, locally or of a daemon.
pub fn create_request(a: CreateArgs) -> CreateWorkspace {
    CreateWorkspace {
        name: a.name,
        sandbox: CreateSandbox {
            from: a.from,
            directory: a.workspace.map(crate::commands::sandbox::absolute),
            command: a.command,
            memory_bytes: a.memory,
            pids: a.pids,
            disk_bytes: a.disk,
            ..Default::default()
        },
        keep: Some(a.keep),
        idle_suspend_s: a.idle_suspend,
    }
}

pub fn workspace(cx: &super::Cx<'_>, cmd: WorkspaceCmd) -> Result<(), CliError> {
    let (engine, json) = (cx.ops()?, cx.json);
    match cmd {
        WorkspaceCmd::Create(a) => {
            let w = engine.create_workspace(&create_request(a))?;
            print(json, &w, || describe(&w));
        }
        WorkspaceCmd::Ls => {
            let all = engine.workspaces()?;
            print(json, &all, || {
                if all.is_empty() {
                    return "(no workspaces; `tine workspace create NAME` makes one)\n".into();
                }
                all.iter().map(describe).collect()
            });
        }
        WorkspaceCmd::Show { name } => {
            let w = engine.workspace(&name)?;
            print(json, &w, || describe(&w));
        }
        WorkspaceCmd::Rm { name } => {
            engine.delete_workspace(&name)?;
            print(json, &serde_json::json!({"deleted": name}), || {
                format!("deleted workspace {name}\n")
            });
        }
    }
    Ok(())
}

pub fn suspend(
    cx: &super::Cx<'_>,
    name: &str,
    crash_after: Option<StepArg>,
) -> Result<(), CliError> {
    if crash_after.is_some() {
        cx.local("--crash-after")?;
    }
    let (engine, json) = (cx.ops()?, cx.json);
    let crash = crash_after.map(StepArg::step);
    let s = engine.suspend_workspace(name, &mut |step| {
        if Some(step) == crash {
            // A crash at this very point: nothing after it runs.
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::KILL,
            );
        }
    })?;
    print(json, &s, || suspended_text(name, &s));
    Ok(())
}

/// What `tine suspend` says.
pub fn suspended_text(name: &str, s: &tine_engine::workspace::Suspended) -> String {
    if s.already {
        return format!(
            "workspace {name} is suspended already (state {})\n",
            s.state.seq
        );
    }
    format!(
        "suspended workspace {name}: state {} (snapshot {}), {} in {:.1} ms{}\n",
        s.state.seq,
        &s.state.snapshot.to_hex()[..12],
        match s.state.processes {
            tine_engine::workspace::Processes::Criu =>
                format!("{} process(es) persisted with CRIU", s.state.process_count),
            tine_engine::workspace::Processes::Restart => format!(
                "its command restarts on resume ({})",
                s.state.reason.as_deref().unwrap_or("")
            ),
        },
        s.duration_ms,
        if s.pruned.is_empty() {
            String::new()
        } else {
            format!("; forgot states {:?}", s.pruned)
        }
    )
}

pub fn resume(cx: &super::Cx<'_>, name: &str) -> Result<(), CliError> {
    let (engine, json) = (cx.ops()?, cx.json);
    let r = engine.resume_workspace(name)?;
    print(json, &r, || resumed_text(name, &r));
    Ok(())
}

/// What `tine resume` says.
pub fn resumed_text(name: &str, r: &tine_engine::workspace::Resumed) -> String {
    if r.already {
        return format!("workspace {name} is running already\n");
    }
    format!(
        "resumed workspace {name}{}: {} in {:.1} ms{}\n",
        r.from
            .map(|f| format!(" from state {f}"))
            .unwrap_or_default(),
        match r.processes {
            tine_engine::workspace::Processes::Criu =>
                format!("{} process(es) back from CRIU images", r.process_count),
            tine_engine::workspace::Processes::Restart => "its command started afresh".into(),
        },
        r.duration_ms,
        r.note
            .as_ref()
            .map(|n| format!("\nnote: {n}"))
            .unwrap_or_default()
    )
}
