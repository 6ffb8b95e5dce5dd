//! Commands run inside a live sandbox. Joining a sandbox's mount namespace
//! needs a single-threaded process, so a multi-threaded caller (the daemon)
//! runs `tine __exec` (its spec on stdin), which joins the sandbox and starts the command with
//! the helper's output pipes; the helper reports its own failures (the
//! sandbox is gone, no such command) in a status file, so that they are never
//! mistaken for the command's exit code.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tine_sandbox::manager;
use tine_sandbox::rollback_mark::RollbackWatch;
use tine_sandbox::{Isolation, SandboxDirs};
use tine_store::{ErrorKind, HasKind, Repository};

use crate::EngineError;

/// What to run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    pub command: Vec<String>,
    /// Set on top of the sandbox's environment.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// Killed (SIGKILL, the whole process group) after this many seconds.
    #[serde(default)]
    pub timeout_s: Option<f64>,
}

/// Which output a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stream {
    Stdout,
    Stderr,
}

/// How a command ended.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct ExecOutcome {
    /// Its exit code, or 128 + the signal that ended it.
    pub exit_code: i32,
    /// It ran past its timeout and was killed.
    pub timed_out: bool,
    pub duration_ms: f64,
    /// Why it ended, when a rollback of the sandbox's processes killed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolled_back: Option<String>,
}

/// The helper's instructions (`tine __exec`, on its stdin).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecSpec {
    pub repo: PathBuf,
    pub sandbox: String,
    pub env: Vec<(String, String)>,
    pub command: Vec<String>,
    /// Where the helper writes `{"exit_code": N}` or `{"error": {...}}`.
    pub status: PathBuf,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum HelperStatus {
    ExitCode(i32),
    /// Killed by a rollback of the sandbox's processes: why.
    RolledBack {
        exit_code: i32,
        note: String,
    },
    Error {
        code: String,
        message: String,
    },
}

/// `base` with each `(key, value)` of `overrides` set, replacing the same key.
pub fn merge_env(
    mut base: Vec<(String, String)>,
    overrides: &[(String, String)],
) -> Vec<(String, String)> {
    for (k, v) in overrides {
        base.retain(|(key, _)| key != k);
        base.push((k.clone(), v.clone()));
    }
    base
}

/// A command ready to start inside a sandbox, and what tells whether a
/// rollback of the sandbox's processes ended it.
#[derive(Debug)]
pub struct Entered {
    pub command: Command,
    /// Isolated sandboxes (a rollback kills their processes).
    pub rollbacks: Option<RollbackWatch>,
}

impl Entered {
    /// Why a command that ended with `code` ended, when a rollback ended it.
    pub fn ended_by_rollback(&self, sb: &str, code: i32) -> Option<String> {
        if code != 128 + libc_sigkill() {
            return None;
        }
        let snap = self.rollbacks.as_ref()?.rolled_back_to()?;
        Some(format!(
            "sandbox {sb} was rolled back to snapshot {} while the command ran: its processes, the command's too, were replaced by the snapshot's",
            snap.get(..12).unwrap_or(&snap)
        ))
    }
}

fn libc_sigkill() -> i32 {
    rustix::process::Signal::KILL.as_raw()
}

/// Joins sandbox `sb` (when it is isolated: its cgroup and namespaces, for
/// good — the caller must be single-threaded) and returns `command` ready to
/// start inside it, with the sandbox's environment plus `env`. The
/// repository is closed before this returns, so a long command does not hold
/// it open.
pub fn enter_sandbox(
    repo_path: &Path,
    sb: &str,
    env: &[(String, String)],
    command: &[String],
) -> Result<Entered, EngineError> {
    let Some(program) = command.first() else {
        return Err(EngineError::Invalid {
            message: "exec: no command given".into(),
        });
    };
    let (rec, v) = {
        let repo = Repository::open(repo_path)?;
        let rec = repo.sandbox(sb)?;
        let v = manager::view(&repo, &rec);
        (rec, v)
    };
    if v.state != tine_store::SandboxState::Running {
        return Err(EngineError::NotRunning {
            name: v.name,
            state: v.state.to_string(),
        });
    }
    let spec = tine_sandbox::RunSpec::of(&rec).map_err(tine_sandbox::SandboxError::from)?;
    let envs = merge_env(spec.env, env);
    let mut cmd = Command::new(program);
    cmd.args(&command[1..])
        .env_clear()
        .envs(envs.iter().map(|(k, v)| (k, v)));
    // Never in a session with a terminal: its caller's is not the sandbox's
    // (a helper started in a session of its own keeps the command in its
    // process group, which a timeout kills).
    if tine_sandbox::ns::session_has_terminal() {
        tine_sandbox::ns::in_new_session(&mut cmd);
    }
    let mut rollbacks = None;
    match &spec.isolation {
        Isolation::Full => {
            // Before joining: the sandbox's root hides its directory.
            rollbacks = RollbackWatch::open(&SandboxDirs::new(repo_path, &rec.id)).ok();
            let init = v.init_pid.ok_or_else(|| EngineError::NotRunning {
                name: v.name.clone(),
                state: "without an init process".into(),
            })?;
            let cg = tine_sandbox::cgroup::CgroupRoot::detect(Path::new(
                tine_sandbox::cgroup::DEFAULT_ROOT,
            ))
            .and_then(|r| r.open(&rec.id))
            .map_err(|e| EngineError::Internal {
                message: format!("sandbox {}: {e}", v.name),
            })?;
            // Joining a group left frozen would hang this process: thaw
            // one whose freezer was killed first.
            tine_sandbox::manager::thaw_abandoned(&SandboxDirs::new(repo_path, &rec.id), &cg);
            let procs = cg.procs_files();
            tine_sandbox::ns::enter(init, &procs, spec.image.as_ref()).map_err(|e| {
                EngineError::Internal {
                    message: format!("sandbox {}: {e}", v.name),
                }
            })?;
            if let Some(img) = &spec.image {
                // As whom the image's commands run (std drops the
                // supplementary groups with it).
                use std::os::unix::process::CommandExt;
                cmd.uid(img.uid).gid(img.gid);
            }
        }
        Isolation::None { .. } => {
            cmd.current_dir(SandboxDirs::new(repo_path, &rec.id).plain());
        }
    }
    Ok(Entered {
        command: cmd,
        rollbacks,
    })
}

/// The exit code of a finished process: its code, or 128 + its signal.
pub fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// The helper (`tine __exec`, its spec read from stdin): joins the sandbox, runs the command on
/// the helper's own stdout and stderr (stdin: nothing), and records how it
/// ended in the status file. Returns the helper's exit code.
pub fn run_helper(spec: &ExecSpec) -> i32 {
    use std::io::Write;
    // Opened before joining the sandbox, whose root hides the repository.
    let Ok(mut status_file) = std::fs::File::create(&spec.status) else {
        return 1;
    };
    let mut rolled_back = None;
    let result =
        enter_sandbox(&spec.repo, &spec.sandbox, &spec.env, &spec.command).and_then(|mut e| {
            let code = e
                .command
                .stdin(Stdio::null())
                .status()
                .map(exit_code)
                .map_err(|err| EngineError::NoCommand {
                    program: spec.command[0].clone(),
                    source: err,
                })?;
            rolled_back = e.ended_by_rollback(&spec.sandbox, code);
            Ok(code)
        });
    let status = match (&result, rolled_back) {
        (Ok(code), Some(note)) => HelperStatus::RolledBack {
            exit_code: *code,
            note,
        },
        (Ok(code), None) => HelperStatus::ExitCode(*code),
        (Err(e), _) => HelperStatus::Error {
            code: e.kind().code().into(),
            message: e.to_string(),
        },
    };
    // Read by the engine only after this process ended: no rename needed.
    let doc = serde_json::to_vec(&status).unwrap_or_default();
    if status_file.write_all(&doc).is_err() {
        return 1;
    }
    result.unwrap_or(1)
}

/// How long output is still read once the command ended, while something
/// else holds its pipes open.
const AFTER_END: Duration = Duration::from_millis(100);

/// What [`run`] hands each piece of output to; returning `false` stops the
/// command (the client went away). It is also handed nothing (an empty
/// piece) every [`HEARTBEAT`] while the command is quiet, so that a client
/// gone is noticed of a command that writes nothing.
pub type Sink<'a> = dyn FnMut(Stream, &[u8]) -> bool + 'a;

/// How often a quiet command's sink is asked whether it is still wanted.
pub const HEARTBEAT: Duration = Duration::from_millis(200);

/// Runs `req` in sandbox `id` through the helper `exe`, passing output to
/// `sink` as it comes.
pub(crate) fn run(
    exe: &Path,
    repo_path: &Path,
    id: &str,
    name: &str,
    req: &ExecRequest,
    sink: &mut Sink<'_>,
) -> Result<ExecOutcome, EngineError> {
    let t0 = Instant::now();
    let dirs = SandboxDirs::new(repo_path, id);
    let status_path = dirs.root.join(format!(
        "exec-{}-{}.status",
        std::process::id(),
        crate::unique()
    ));
    let spec = ExecSpec {
        repo: repo_path.to_path_buf(),
        sandbox: id.to_string(),
        env: req
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        command: req.command.clone(),
        status: status_path.clone(),
    };
    // The spec goes through stdin, not the command line, which every user
    // of the host can read (it holds the environment given to the command).
    let mut helper = Command::new(exe);
    // A session of its own, so the command never has the daemon's terminal;
    // also its own process group: a timeout or a cancel kills the command too.
    tine_sandbox::ns::in_new_session(&mut helper);
    let mut child = helper
        .arg("__exec")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| EngineError::Internal {
            message: format!("exec in sandbox {name}: starting {}: {e}", exe.display()),
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        use std::io::Write;
        // A helper that died at once shows in its status below.
        let _ = stdin.write_all(&serde_json::to_vec(&spec).unwrap_or_default());
    }
    let pgid = rustix::process::Pid::from_raw(child.id() as i32);
    let kill_all = || {
        if let Some(p) = pgid {
            let _ = rustix::process::kill_process_group(p, rustix::process::Signal::KILL);
        }
    };
    let deadline = req
        .timeout_s
        .filter(|t| t.is_finite() && *t > 0.0)
        .map(|t| t0 + Duration::from_secs_f64(t));
    // Both as plain files, so one loop reads either.
    let mut out = child
        .stdout
        .take()
        .map(|p| std::fs::File::from(std::os::fd::OwnedFd::from(p)));
    let mut err = child
        .stderr
        .take()
        .map(|p| std::fs::File::from(std::os::fd::OwnedFd::from(p)));
    let mut timed_out = false;
    let mut cancelled = false;
    // After a kill, output still held by escaped processes is waited for a little only.
    let mut drain_until: Option<Instant> = None;
    // The helper's end is the command's (it waits for it): the pipes may
    // stay open past it, held by what a snapshot taken while the command
    // ran made of it (templates keep their descriptors), or by processes
    // it left behind; what they hold then is read for a moment only.
    let helper_ended = child
        .id()
        .try_into()
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .and_then(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok());
    let mut ended = false;
    let mut buf = vec![0u8; 64 * 1024];
    let mut asked = t0;
    while out.is_some() || err.is_some() {
        let now = Instant::now();
        if !cancelled && now >= asked + HEARTBEAT {
            asked = now;
            if !sink(Stream::Stdout, &[]) {
                cancelled = true;
                kill_all();
                drain_until = Some(now + Duration::from_secs(1));
            }
        }
        if let Some(d) = deadline
            && now >= d
            && !timed_out
        {
            timed_out = true;
            kill_all();
            drain_until = Some(now + Duration::from_secs(1));
        }
        if drain_until.is_some_and(|d| now >= d) {
            break;
        }
        let heartbeat = (!cancelled).then_some(asked + HEARTBEAT);
        let wait = [deadline, drain_until, heartbeat]
            .into_iter()
            .flatten()
            .filter(|d| *d > now)
            .min()
            .map(|d| d - now);
        let ready = {
            use rustix::event::{PollFd, PollFlags, Timespec, poll};
            let mut fds = Vec::with_capacity(2);
            if let Some(o) = &out {
                fds.push(PollFd::new(o, PollFlags::IN));
            }
            if let Some(e) = &err {
                fds.push(PollFd::new(e, PollFlags::IN));
            }
            if let Some(h) = helper_ended.as_ref().filter(|_| !ended) {
                fds.push(PollFd::new(h, PollFlags::IN));
            }
            let ts = wait.map(|w| Timespec {
                tv_sec: w.as_secs() as i64,
                tv_nsec: w.subsec_nanos() as i64,
            });
            match poll(&mut fds, ts.as_ref()) {
                Ok(_) => fds.iter().map(|f| !f.revents().is_empty()).collect(),
                Err(rustix::io::Errno::INTR) => vec![false; fds.len()],
                Err(e) => {
                    kill_all();
                    return Err(EngineError::Internal {
                        message: format!("exec in sandbox {name}: poll: {e}"),
                    });
                }
            }
        };
        let pipes = usize::from(out.is_some()) + usize::from(err.is_some());
        if !ended && ready.get(pipes).copied().unwrap_or(false) {
            ended = true;
            if drain_until.is_none() {
                drain_until = Some(Instant::now() + AFTER_END);
            }
        }
        let mut i = 0;
        for (slot, stream) in [(&mut out, Stream::Stdout), (&mut err, Stream::Stderr)] {
            let Some(pipe) = slot.as_mut() else {
                continue;
            };
            let is_ready = ready.get(i).copied().unwrap_or(false);
            i += 1;
            if !is_ready {
                continue;
            }
            match pipe.read(&mut buf) {
                Ok(0) | Err(_) => *slot = None,
                Ok(n) => {
                    asked = Instant::now();
                    if !cancelled && !sink(stream, &buf[..n]) {
                        cancelled = true;
                        kill_all();
                        drain_until = Some(Instant::now() + Duration::from_secs(1));
                    }
                }
            }
        }
    }
    drop((out, err));
    if timed_out || cancelled {
        kill_all();
    }
    let helper = child.wait();
    let status = std::fs::read(&status_path).ok();
    let _ = std::fs::remove_file(&status_path);
    let duration_ms = t0.elapsed().as_secs_f64() * 1e3;
    if timed_out || cancelled {
        return Ok(ExecOutcome {
            exit_code: 137,
            timed_out,
            duration_ms,
            rolled_back: None,
        });
    }
    match status.and_then(|s| serde_json::from_slice::<HelperStatus>(&s).ok()) {
        Some(HelperStatus::ExitCode(code)) => Ok(ExecOutcome {
            exit_code: code,
            timed_out: false,
            duration_ms,
            rolled_back: None,
        }),
        Some(HelperStatus::RolledBack { exit_code, note }) => Ok(ExecOutcome {
            exit_code,
            timed_out: false,
            duration_ms,
            rolled_back: Some(note),
        }),
        Some(HelperStatus::Error { code, message }) => Err(EngineError::Reported {
            kind: ErrorKind::from_code(&code),
            message,
        }),
        None => Err(EngineError::Internal {
            message: format!(
                "exec in sandbox {name}: the helper ended ({}) without reporting",
                helper.map_or_else(|e| e.to_string(), |s| s.to_string())
            ),
        }),
    }
}
