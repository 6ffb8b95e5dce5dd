//! Processes tine did not start (`tine attach --pid PID`, `tine attach
//! --container NAME`): a running program outside any sandbox, taken as it
//! is, its files a host directory (by default its working directory; a
//! Podman container's: its root as Podman mounts it). A checkpoint stops it
//! (ptrace), forks a template of it (copy-on-write, parked stopped) and
//! snapshots the directory while it is stopped, then lets it run. A
//! rollback stops it again, kills what it started since, puts the directory
//! back (only what differs) and grafts the template onto it in place: it
//! keeps its PID, its parent never sees it end, and a container's runtime
//! goes on with it. One whose process ended is made again from the template
//! instead, under its old PID where that is free. Its namespaces, cgroup,
//! parent and the kernel objects it shares with the world (pipes, sockets)
//! stay what they are: nothing of it moves into a sandbox. The records live
//! in `REPO/attached/NAME.json`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tine_proc::template::{FdFix, Respawn, Template, fixes_for, respawn};
use tine_store::{ErrorKind, HasKind, ObjectId, Repository, now_ns};

use crate::history::{SandboxOp, SnapshotRequest};
use crate::{Ctx, Engine, EngineError, Frozen};

mod container;
mod tree;

/// What `tine attach --pid` asks for.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Attach {
    /// The process (0 with `container`).
    pub pid: u32,
    /// A Podman container (name or id): its application process, its root
    /// as its files.
    pub container: Option<String>,
    /// Its files (default: its working directory).
    pub workspace: Option<PathBuf>,
    /// Default: `pid-PID`.
    pub name: Option<String>,
}

/// The version of the records this build writes and reads.
const RECORD_VERSION: u32 = 1;

fn record_version() -> u32 {
    RECORD_VERSION
}

/// An attached process as recorded (docs/FORMAT.md, "Attached processes").
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    /// The format's version (records written before it had one are 1).
    #[serde(default = "record_version")]
    version: u32,
    name: String,
    pid: u32,
    /// Its start time (`/proc/PID/stat`), so a reused PID is never taken for it.
    start_time: u64,
    dir: PathBuf,
    created_ns: u64,
    /// The templates of its checkpoints, by snapshot id.
    checkpoints: BTreeMap<String, Template>,
    /// The Podman container it runs in, when attached as one.
    #[serde(default)]
    container: Option<ContainerRef>,
    /// Of each checkpoint (by snapshot id) whose process had a tree below
    /// it: those processes, parents first.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    below: BTreeMap<String, Vec<tree::Below>>,
}

/// A Podman container, as attached.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ContainerRef {
    id: String,
    name: String,
}

/// An attached process, as shown.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AttachedView {
    pub name: String,
    pub pid: u32,
    pub workspace: PathBuf,
    /// It still runs (the PID is its).
    pub running: bool,
    pub checkpoints: usize,
    pub created_ns: u64,
    /// The Podman container's name, when attached as one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

/// What a fork of an attached checkpoint made.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AttachedForks {
    pub snapshot: String,
    pub forks: Vec<AttachedView>,
    pub duration_ms: f64,
}

fn invalid(message: String) -> EngineError {
    EngineError::Invalid { message }
}

/// Its start time, if `pid` runs (field 22 of `/proc/PID/stat`).
fn start_time(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = after.split(' ').collect();
    // State is field 3; a zombie is not running.
    if f.first() == Some(&"Z") {
        return None;
    }
    f.get(19)?.parse().ok()
}

/// The largest record read (a tree of 512 processes' templates, each
/// with its descriptors, stays well below).
const MAX_RECORD: usize = 64 << 20;

/// Where the records are, in the repository at `root`.
fn records(root: &Path) -> PathBuf {
    root.join("attached")
}

fn record_path(root: &Path, name: &str) -> PathBuf {
    records(root).join(format!("{name}.json"))
}

fn load(root: &Path, name: &str) -> Result<Option<Record>, EngineError> {
    if !tine_sandbox::manager::valid_name(name) {
        return Ok(None);
    }
    let p = record_path(root, name);
    match std::fs::read(&p) {
        Ok(b) if b.len() > MAX_RECORD => Err(EngineError::Reported {
            kind: ErrorKind::Corrupt,
            message: format!(
                "{}: the attached record is larger than {MAX_RECORD} bytes",
                p.display()
            ),
        }),
        Ok(b) => match serde_json::from_slice::<Record>(&b) {
            Ok(r) if r.version > RECORD_VERSION => Err(EngineError::Reported {
                kind: ErrorKind::Unsupported,
                message: format!(
                    "{}: the attached record is of version {}, newer than this tine's {RECORD_VERSION}: upgrade tine",
                    p.display(),
                    r.version
                ),
            }),
            Ok(r) => Ok(Some(r)),
            Err(e) => Err(EngineError::Reported {
                kind: ErrorKind::Corrupt,
                message: format!("{}: the attached record does not parse: {e}", p.display()),
            }),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(EngineError::File {
            path: p.display().to_string(),
            step: "read",
            source,
        }),
    }
}

/// Every record in the repository at `root`.
fn all(root: &Path) -> Result<Vec<Record>, EngineError> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(records(root)) {
        for e in rd.filter_map(|e| e.ok()) {
            let n = e.file_name().to_string_lossy().into_owned();
            if let Some(name) = n.strip_suffix(".json")
                && let Some(r) = load(root, name)?
            {
                out.push(r);
            }
        }
    }
    Ok(out)
}

/// Writes `rec` atomically (temp, fsync, rename).
fn save(root: &Path, rec: &Record) -> Result<(), EngineError> {
    let dir = records(root);
    let io = |step: &'static str, p: &Path| {
        let path = p.display().to_string();
        move |source| EngineError::File { path, step, source }
    };
    std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
    let mut tmp = tempfile::NamedTempFile::new_in(&dir).map_err(io("create", &dir))?;
    tmp.write_all(&serde_json::to_vec_pretty(rec).expect("a record serializes"))
        .map_err(io("write", &dir))?;
    tmp.as_file().sync_all().map_err(io("fsync", &dir))?;
    let p = record_path(root, &rec.name);
    tmp.persist(&p).map_err(|e| io("rename", &p)(e.error))?;
    Ok(())
}

impl Record {
    /// The PIDs of its checkpoints' templates, its tree's included.
    fn templates(&self) -> Vec<u32> {
        let below = self.below.values().flatten().map(|b| b.template.pid);
        self.checkpoints
            .values()
            .map(|t| t.pid)
            .chain(below)
            .collect()
    }
}

fn view(rec: &Record) -> AttachedView {
    AttachedView {
        name: rec.name.clone(),
        pid: rec.pid,
        workspace: rec.dir.clone(),
        running: start_time(rec.pid) == Some(rec.start_time),
        checkpoints: rec.checkpoints.len(),
        created_ns: rec.created_ns,
        container: rec.container.as_ref().map(|c| c.name.clone()),
    }
}

fn proc_error(name: &str, what: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Reported {
        kind: ErrorKind::Unsupported,
        message: format!("attached {name}: {what}: {e}"),
    }
}

impl Engine {
    /// Takes a running process as an attached one (nothing is done to it
    /// until its first checkpoint).
    pub fn attach(&self, req: &Attach) -> Result<AttachedView, EngineError> {
        let (container, pid, workspace) = match &req.container {
            Some(asked) => {
                if req.pid != 0 || req.workspace.is_some() {
                    return Err(invalid(
                        "attach: a container is given alone: its process and its root are its own (no pid, no workspace)".into(),
                    ));
                }
                let (c, app, root) = self.container(asked)?;
                (Some(c), app, Some(root))
            }
            None => (None, req.pid, req.workspace.clone()),
        };
        if pid == 1 {
            return Err(invalid(
                "attach: PID 1 is the host's init: stopping it stops the machine, and it cannot be killed or made again; attach a process below it".into(),
            ));
        }
        let Some(started) = start_time(pid).filter(|_| pid > 1) else {
            return Err(EngineError::Reported {
                kind: ErrorKind::NotFound,
                message: format!("attach: no running process {pid}"),
            });
        };
        if pid == std::process::id() {
            return Err(invalid("attach: that is tine itself".into()));
        }
        let dir = match &workspace {
            Some(d) => d.clone(),
            None => std::fs::read_link(format!("/proc/{pid}/cwd")).map_err(|source| {
                EngineError::File {
                    path: format!("/proc/{pid}/cwd"),
                    step: "read its working directory",
                    source,
                }
            })?,
        };
        let dir = std::fs::canonicalize(&dir).map_err(|source| EngineError::File {
            path: dir.display().to_string(),
            step: "find its files",
            source,
        })?;
        let repo = self.open()?;
        if dir == Path::new("/") || repo.path().starts_with(&dir) {
            return Err(invalid(format!(
                "attach: its files would be {} (which holds {}); give --workspace DIR, the directory that is its state",
                dir.display(),
                if dir == Path::new("/") {
                    "everything"
                } else {
                    "the repository"
                }
            )));
        }
        let name = req.name.clone().unwrap_or_else(|| match &container {
            Some(c) => c.name.clone(),
            None => format!("pid-{pid}"),
        });
        if !tine_sandbox::manager::valid_name(&name) {
            return Err(invalid(format!(
                "attach: {name:?} is not a name (letters, digits, '.', '_', '-')"
            )));
        }
        if load(repo.path(), &name)?.is_some() || repo.sandbox(&name).is_ok() {
            return Err(EngineError::Reported {
                kind: ErrorKind::AlreadyExists,
                message: format!("attach: {name} is taken; give --name"),
            });
        }
        let rec = Record {
            version: RECORD_VERSION,
            name,
            pid,
            start_time: started,
            dir,
            created_ns: now_ns(),
            checkpoints: BTreeMap::new(),
            container,
            below: BTreeMap::new(),
        };
        save(repo.path(), &rec)?;
        Ok(view(&rec))
    }

    /// The attached processes.
    pub fn attached(&self) -> Result<Vec<AttachedView>, EngineError> {
        let mut out: Vec<AttachedView> = all(&self.cfg.repo)?.iter().map(view).collect();
        out.sort_by_key(|v| v.created_ns);
        Ok(out)
    }

    /// Whether `name` is an attached process: one look for its record, no
    /// more (every sandbox checkpoint and rollback asks).
    pub(crate) fn is_attached(&self, name: &str) -> bool {
        tine_sandbox::manager::valid_name(name) && record_path(&self.cfg.repo, name).is_file()
    }

    /// Checkpoints an attached process and its tree: their templates forked
    /// and its files snapshotted while they are stopped.
    pub(crate) fn snapshot_attached(
        &self,
        name: &str,
        req: &SnapshotRequest,
        ctx: &Ctx<'_>,
    ) -> Result<SandboxOp<tine_fs::SnapshotOutcome>, EngineError> {
        let repo = self.open()?;
        let mut rec =
            load(repo.path(), name)?.ok_or_else(|| invalid(format!("no attached {name}")))?;
        if start_time(rec.pid) != Some(rec.start_time) {
            return Err(EngineError::NotRunning {
                name: rec.name,
                state: "gone (its process no longer runs)".into(),
            });
        }
        let lock = ctx.lock(&repo)?;
        let t0 = Instant::now();
        let templates = rec.templates();
        let mut stopped =
            tree::stop(rec.pid, &templates).map_err(|e| proc_error(name, "stop it", e))?;
        let paused_from = Instant::now();
        let made = tree::templates(&mut stopped, &templates)
            .map_err(|e| proc_error(name, "fork its templates", e))?;
        let processes = stopped.procs.len();
        let fork_ms = paused_from.elapsed().as_secs_f64() * 1e3;
        // Read while it is stopped: the files are as the processes left them.
        let opts = tine_fs::SnapshotOptions {
            message: req.message.clone(),
            tags: req.tags.clone(),
            force_tags: req.force,
            ..Default::default()
        };
        let out = tine_fs::snapshot(&lock, &rec.dir, &opts, ctx.progress);
        drop(stopped);
        let paused_ms = paused_from.elapsed().as_secs_f64() * 1e3;
        let tree::Made {
            root: tpl,
            below,
            unsettled,
        } = made;
        // (Sessions of their own and parked, once the tree runs again.)
        let settled = unsettled
            .into_iter()
            .try_for_each(tine_proc::template::Unsettled::settle);
        let out = out.map_err(EngineError::from).and_then(|o| {
            settled
                .map(|()| o)
                .map_err(|e| proc_error(name, "park its templates", e))
        });
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                tine_proc::template::discard(&tpl);
                for b in &below {
                    tine_proc::template::discard(&b.template);
                }
                return Err(e);
            }
        };
        if !below.is_empty() {
            rec.below.insert(out.id.to_hex(), below);
        }
        rec.checkpoints.insert(out.id.to_hex(), tpl);
        save(repo.path(), &rec)?;
        Ok(SandboxOp {
            outcome: out,
            frozen: Frozen {
                processes,
                paused_ms,
                fork_ms,
                ..Default::default()
            },
            sandbox: rec.name,
            duration_ms: t0.elapsed().as_secs_f64() * 1e3,
            prepared_forks: None,
        })
    }

    /// Rolls an attached process (and its tree) back to a checkpoint in
    /// place, its files put back; one whose process ended is made again
    /// from the checkpoint's template (under its PID where that is free).
    pub(crate) fn restore_attached(
        &self,
        name: &str,
        snapshot: &str,
        files_only: bool,
        ctx: &Ctx<'_>,
    ) -> Result<SandboxOp<tine_fs::RestoreOutcome>, EngineError> {
        let repo = self.open()?;
        let mut rec =
            load(repo.path(), name)?.ok_or_else(|| invalid(format!("no attached {name}")))?;
        let id: ObjectId = repo.resolve(snapshot)?;
        let tpl = rec.checkpoints.get(&id.to_hex()).cloned();
        if tpl.is_none() && !files_only {
            return Err(invalid(format!(
                "snapshot {} holds no checkpoint of {name}'s process; give --files-only to put back only its files",
                &id.to_hex()[..12]
            )));
        }
        if let Some(t) = &tpl
            && !tine_proc::template::template_alive(t)
        {
            return Err(EngineError::Reported {
                kind: ErrorKind::NotFound,
                message: format!(
                    "the template of {name} at {} is gone (killed, or the host restarted)",
                    &id.to_hex()[..12]
                ),
            });
        }
        let lock = ctx.lock(&repo)?;
        let t0 = Instant::now();
        let old = rec.pid;
        let running = start_time(old) == Some(rec.start_time);
        let restore_files = || Ok(tine_fs::restore(&lock, &id, &rec.dir, ctx.progress)?);
        let (outcome, processes) = match (&tpl, files_only) {
            (Some(tpl), false) if running => {
                // The kernel objects it shares with the world (its output
                // pipe to a container's conmon, say) stay as they are.
                let below = rec.below.get(&id.to_hex()).cloned().unwrap_or_default();
                let mut hows = vec![Respawn {
                    parent: true,
                    keep_unchanged: true,
                    fds: fixes_for(&tpl.fds, Some(&rec.dir)),
                    ..Default::default()
                }];
                hows.extend(below.iter().map(|b| Respawn {
                    set_tid: Some(b.ns_pid),
                    keep_unchanged: true,
                    fds: fixes_for(&b.template.fds, Some(&rec.dir)),
                    ..Default::default()
                }));
                let templates = rec.templates();
                let out =
                    tree::roll_back(name, old, tpl, &below, &hows, &templates, restore_files)?;
                (out, 1 + below.len())
            }
            (Some(_), false) if rec.below.contains_key(&id.to_hex()) => {
                return Err(EngineError::NotRunning {
                    name: rec.name,
                    state: "gone (the process at the root of its tree ended; a tree comes back only under it)".into(),
                });
            }
            (Some(tpl), false) => {
                // It ended: made again from its template, beside it.
                let outcome = restore_files()?;
                let mut how = Respawn {
                    set_tid: Some(old),
                    parent: true,
                    keep_unchanged: true,
                    fds: fixes_for(&tpl.fds, Some(&rec.dir)),
                    ..Default::default()
                };
                // Its PID is still held (a parent that has not reaped it): another.
                let pid = respawn(tpl, &how).or_else(|_| {
                    how.set_tid = None;
                    respawn(tpl, &how)
                });
                let pid =
                    pid.map_err(|e| proc_error(name, "make it again from its template", e))?;
                rec.pid = pid;
                rec.start_time = start_time(pid).unwrap_or(0);
                save(repo.path(), &rec)?;
                (outcome, 1)
            }
            _ => (restore_files()?, 0),
        };
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        Ok(SandboxOp {
            outcome,
            frozen: Frozen {
                processes,
                paused_ms: ms,
                ..Default::default()
            },
            sandbox: rec.name,
            duration_ms: ms,
            prepared_forks: None,
        })
    }

    /// The attached process whose checkpoint snapshot `id` is, and its template.
    fn checkpoint_of(
        repo: &Repository,
        id: &ObjectId,
    ) -> Result<Option<(Record, Template)>, EngineError> {
        let hex = id.to_hex();
        Ok(all(repo.path())?.into_iter().find_map(|r| {
            let t = r.checkpoints.get(&hex).cloned()?;
            Some((r, t))
        }))
    }

    /// Whether snapshot `spec` is a checkpoint of an attached process.
    pub fn is_attached_checkpoint(&self, spec: &str) -> Result<bool, EngineError> {
        // No process attached: nothing to look up (a fork's usual case).
        if !records(&self.cfg.repo).is_dir() {
            return Ok(false);
        }
        let repo = self.open()?;
        let id = repo.resolve(spec)?;
        Ok(Self::checkpoint_of(&repo, &id)?.is_some())
    }

    /// Forks an attached process's checkpoint `spec` into `n` copies, each
    /// with its own copy of the files in `into/1` .. `into/N`: its working
    /// directory there, its files under the original's directory opened
    /// again there. Each copy runs beside the original (new PIDs, the same
    /// parent) and is attached itself, as NAME-1 .. NAME-N.
    pub fn fork_attached(
        &self,
        spec: &str,
        into: &Path,
        n: usize,
        ctx: &Ctx<'_>,
    ) -> Result<AttachedForks, EngineError> {
        let repo = self.open()?;
        let id = repo.resolve(spec)?;
        let (origin, tpl) = Self::checkpoint_of(&repo, &id)?.ok_or_else(|| {
            invalid(format!(
                "snapshot {} is no attached process's checkpoint",
                &id.to_hex()[..12]
            ))
        })?;
        if !tine_proc::template::template_alive(&tpl) {
            return Err(EngineError::Reported {
                kind: ErrorKind::NotFound,
                message: format!(
                    "the template of {} at {} is gone (killed, or the host restarted)",
                    origin.name,
                    &id.to_hex()[..12]
                ),
            });
        }
        if let Some(c) = &origin.container {
            return Err(EngineError::Reported {
                kind: ErrorKind::Unsupported,
                message: format!(
                    "fork: {} is a checkpoint of container {}: a copy would need a container of its own, which tine does not make yet; roll the container back (`tine restore {} --sandbox {}`), or run the image as tine sandboxes (`tine image import --podman`, `tine run --image`)",
                    &id.to_hex()[..12],
                    c.name,
                    &id.to_hex()[..12],
                    origin.name
                ),
            });
        }
        if let Some(below) = origin.below.get(&id.to_hex()) {
            return Err(EngineError::Reported {
                kind: ErrorKind::Unsupported,
                message: format!(
                    "fork: {} is a checkpoint of a tree of {} processes: beside the original, its copies could not have the PIDs their parents know them by; roll it back (`tine restore {} --sandbox {}`), or run the tree in a sandbox (`tine run`), whose forks have PID namespaces of their own",
                    &id.to_hex()[..12],
                    below.len() + 1,
                    &id.to_hex()[..12],
                    origin.name
                ),
            });
        }
        let names: Vec<String> = (1..=n).map(|k| format!("{}-{k}", origin.name)).collect();
        for name in &names {
            if load(repo.path(), name)?.is_some() || repo.sandbox(name).is_ok() {
                return Err(EngineError::Reported {
                    kind: ErrorKind::AlreadyExists,
                    message: format!("fork: {name} is taken (detach it, or remove it)"),
                });
            }
        }
        let t0 = Instant::now();
        let lock = ctx.lock(&repo)?;
        let out =
            tine_fs::fork(&lock, &id, into, n, Default::default(), ctx.progress).map_err(|e| {
                EngineError::Reported {
                    kind: e.kind(),
                    message: e.to_string(),
                }
            })?;
        let mut forks = Vec::new();
        for (dir, name) in out.dirs.iter().zip(names) {
            let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone());
            let moved = |p: &Path| -> PathBuf {
                p.strip_prefix(&origin.dir)
                    .map(|rel| dir.join(rel))
                    .unwrap_or_else(|_| p.to_path_buf())
            };
            let fds = fixes_for(&tpl.fds, Some(&origin.dir))
                .into_iter()
                .map(|f| match f {
                    FdFix::Reopen {
                        fd,
                        path,
                        flags,
                        pos,
                    } => FdFix::Reopen {
                        fd,
                        path: moved(&path),
                        flags,
                        pos,
                    },
                    other => other,
                })
                .collect();
            let cwd = tpl.cwd.as_deref().map(moved).unwrap_or_else(|| dir.clone());
            let how = Respawn {
                parent: true,
                chdir: Some(cwd),
                fds,
                ..Default::default()
            };
            let pid = respawn(&tpl, &how).map_err(|e| proc_error(&name, "make a copy", e))?;
            let rec = Record {
                version: RECORD_VERSION,
                name,
                pid,
                start_time: start_time(pid).unwrap_or(0),
                dir,
                created_ns: now_ns(),
                checkpoints: BTreeMap::new(),
                container: None,
                below: BTreeMap::new(),
            };
            save(repo.path(), &rec)?;
            forks.push(view(&rec));
        }
        Ok(AttachedForks {
            snapshot: id.to_hex(),
            forks,
            duration_ms: t0.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Lets an attached process go: its templates are discarded and its
    /// record removed; the process itself runs on.
    pub fn detach(&self, name: &str) -> Result<AttachedView, EngineError> {
        let repo = self.open()?;
        let rec = load(repo.path(), name)?.ok_or_else(|| EngineError::Reported {
            kind: ErrorKind::NotFound,
            message: format!("no attached {name} (see `tine attach --list`)"),
        })?;
        for t in rec.checkpoints.values() {
            tine_proc::template::discard(t);
        }
        for b in rec.below.values().flatten() {
            tine_proc::template::discard(&b.template);
        }
        let p = record_path(repo.path(), name);
        std::fs::remove_file(&p).map_err(|source| EngineError::File {
            path: p.display().to_string(),
            step: "remove",
            source,
        })?;
        Ok(view(&rec))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_of_a_later_version_or_too_large_are_refused_and_old_ones_read_as_version_1() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(records(dir.path())).unwrap();
        let old =
            r#"{"name":"a","pid":7,"start_time":1,"dir":"/srv","created_ns":0,"checkpoints":{}}"#;
        std::fs::write(record_path(dir.path(), "a"), old).unwrap();
        let r = load(dir.path(), "a").unwrap().unwrap();
        assert_eq!((r.version, r.pid), (1, 7));
        let later = old.replacen('{', r#"{"version":2,"#, 1);
        std::fs::write(record_path(dir.path(), "b"), later).unwrap();
        let e = load(dir.path(), "b").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.to_string().contains("version 2"), "{e}");
        let f = std::fs::File::create(record_path(dir.path(), "c")).unwrap();
        f.set_len(MAX_RECORD as u64 + 1).unwrap();
        assert_eq!(
            load(dir.path(), "c").unwrap_err().kind(),
            ErrorKind::Corrupt
        );
        // Written, a record reads back the same.
        save(dir.path(), &r).unwrap();
        assert_eq!(
            load(dir.path(), "a").unwrap().unwrap().dir,
            PathBuf::from("/srv")
        );
    }
}
