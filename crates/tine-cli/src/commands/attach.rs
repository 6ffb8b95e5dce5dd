//! `tine attach`: take a running process tine did not start (its files a
//! host directory), or a Podman container (its application process and its
//! root), for checkpoints and rollbacks through the sandbox verbs
//! (`tine snapshot --sandbox NAME`, `tine restore SNAP --sandbox NAME`);
//! list them; let one go.

use std::path::PathBuf;

use clap::Args as ClapArgs;
use tine_engine::{Attach, AttachedView};

use super::Cx;
use crate::output::{CliError, time};

#[derive(Debug, ClapArgs)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["pid", "container", "list", "detach"])))]
pub struct Args {
    /// The process to attach (without child processes, for now).
    #[arg(long)]
    pub pid: Option<u32>,
    /// A running Podman container (name or id): its application process
    /// (the child of `--init`'s catatonit, else its first process) and its
    /// root are checkpointed and rolled back in place; Podman goes on
    /// running it. Its volumes, network and cgroup stay Podman's.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["pid", "workspace"])]
    pub container: Option<String>,
    /// List the attached processes.
    #[arg(long)]
    pub list: bool,
    /// Let an attached process go: its checkpoints' templates are discarded
    /// (their snapshots stay); the process runs on.
    #[arg(long, value_name = "NAME")]
    pub detach: Option<String>,
    /// With --pid: its files (default: its working directory).
    #[arg(long, value_name = "DIR", requires = "pid")]
    pub workspace: Option<PathBuf>,
    /// Its name (default: pid-PID, or the container's name).
    #[arg(long)]
    pub name: Option<String>,
}

fn line(v: &AttachedView) -> String {
    format!(
        "{:<20} {:>8}  {:<8} {:>3}  {}  {}\n",
        v.name,
        v.pid,
        if v.running { "running" } else { "gone" },
        v.checkpoints,
        time(v.created_ns),
        v.workspace.display()
    )
}

pub fn run(cx: &Cx<'_>, a: Args) -> Result<(), CliError> {
    let ops = cx.ops()?;
    let json = cx.json;
    if a.pid.is_some() || a.container.is_some() {
        let v = ops.attach(&Attach {
            pid: a.pid.unwrap_or(0),
            container: a.container,
            workspace: a.workspace.map(super::sandbox::absolute),
            name: a.name,
        })?;
        crate::emit(json, serde_json::to_value(&v).unwrap_or_default(), || {
            let what = match &v.container {
                Some(c) => format!(
                    "container {c}'s process {} and its root {} (not its volumes; its network and cgroup stay Podman's)",
                    v.pid,
                    v.workspace.display()
                ),
                None => format!("process {}, files {}", v.pid, v.workspace.display()),
            };
            format!(
                "attached {} ({what}): checkpoint it with `tine snapshot --sandbox {}`\n",
                v.name, v.name
            )
        });
    } else if let Some(name) = a.detach {
        let v = ops.detach(&name)?;
        crate::emit(json, serde_json::to_value(&v).unwrap_or_default(), || {
            format!("detached {} (process {} runs on)\n", v.name, v.pid)
        });
    } else {
        let all = ops.attached()?;
        crate::emit(json, serde_json::to_value(&all).unwrap_or_default(), || {
            if all.is_empty() {
                return "(no attached processes: `tine attach --pid PID` or `--container NAME`)\n"
                    .into();
            }
            let mut s = format!(
                "{:<20} {:>8}  {:<8} {:>3}  {:<19}  {}\n",
                "NAME", "PID", "STATE", "CPS", "ATTACHED", "FILES"
            );
            for v in &all {
                s.push_str(&line(v));
            }
            s
        });
    }
    Ok(())
}
