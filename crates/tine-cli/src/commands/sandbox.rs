//! `tine run / ps / stop / logs / rm / exec`: sandboxes from the command line, through the operations (`exec` joins a local sandbox itself: entering its namespaces needs this single-threaded process).

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde_json::json;
use tine_engine::{Isolation, Net, Restart};
use tine_store::ErrorKind;

use super::{Cx, Route};
use crate::output::CliError;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum NetArg {
    None,
    Host,
    Private,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum RestartArg {
    No,
    OnFailure,
    Always,
}

impl From<NetArg> for Net {
    fn from(n: NetArg) -> Net {
        match n {
            NetArg::None => Net::None,
            NetArg::Host => Net::Host,
            NetArg::Private => Net::Private,
        }
    }
}

impl From<RestartArg> for Restart {
    fn from(r: RestartArg) -> Restart {
        match r {
            RestartArg::No => Restart::No,
            RestartArg::OnFailure => Restart::OnFailure,
            RestartArg::Always => Restart::Always,
        }
    }
}

/// A directory named on the command line, absolute (a daemon has its own
/// working directory).
pub fn absolute(dir: PathBuf) -> PathBuf {
    std::path::absolute(&dir).unwrap_or(dir)
}

/// What `tine run` asks a daemon for: the engine's own request type.
pub fn create_request(a: &RunArgs) -> Result<tine_engine::CreateSandbox, CliError> {
    Ok(tine_engine::CreateSandbox {
        name: a.name.clone(),
        from: a.from.clone(),
        directory: a.workspace.clone().map(absolute),
        rootfs: a.rootfs.clone().map(absolute),
        command: a.command.clone(),
        env: parse_env(&a.env)?.into_iter().collect(),
        memory_bytes: a.memory,
        pids: a.pids,
        disk_bytes: a.disk,
        net: a.net.into(),
        restart: a.restart.into(),
        stop_timeout_s: Some(a.stop_timeout),
        seccomp: Some(!a.no_seccomp),
        image: a.image.clone(),
        entrypoint: a.entrypoint.clone().map(|e| vec![e]),
    })
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// A name for the sandbox (default: its id).
    #[arg(long)]
    pub name: Option<String>,
    /// Base the workspace on this snapshot (id prefix or tag).
    #[arg(long, conflicts_with_all = ["workspace", "image"])]
    pub from: Option<String>,
    /// Run an imported image (`tine image import`): its files are the
    /// sandbox's whole root, snapshotted, rolled back and forked with it;
    /// its entrypoint, cmd, environment, working directory and user apply.
    /// A command given replaces its cmd, as with Docker.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["workspace", "rootfs"])]
    pub image: Option<String>,
    /// With --image: this program instead of the image's entrypoint.
    #[arg(long, value_name = "PROGRAM", requires = "image")]
    pub entrypoint: Option<String>,
    /// Snapshot DIR and base the workspace on it; DIR itself is never modified.
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<PathBuf>,
    /// Memory limit, e.g. 512M or 2G.
    #[arg(long, value_parser = parse_size)]
    pub memory: Option<u64>,
    /// Limit on the number of processes.
    #[arg(long)]
    pub pids: Option<u64>,
    /// What the sandbox's files may take beyond its base, e.g. 2G (default
    /// 10G; enforced where the repository's filesystem keeps project
    /// quotas: XFS or ext4 mounted with prjquota).
    #[arg(long, value_parser = parse_size)]
    pub disk: Option<u64>,
    /// none: its own network with loopback only; private: its own network
    /// with outbound access through slirp4netns, not reaching the host's
    /// loopback; host: the host's network (no raw sockets).
    #[arg(long, value_enum, default_value = "none")]
    pub net: NetArg,
    #[arg(long, value_enum, default_value = "no")]
    pub restart: RestartArg,
    /// Root filesystem (default: the host's, read-only).
    #[arg(long, value_name = "DIR")]
    pub rootfs: Option<PathBuf>,
    /// Environment variable for the command (repeatable).
    #[arg(short, long = "env", value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// Seconds between SIGTERM and SIGKILL when stopping.
    #[arg(long, default_value_t = 10)]
    pub stop_timeout: u64,
    /// Run without the seccomp filter (which refuses new namespaces, mounts,
    /// keyrings, BPF, io_uring, ...): for programs that need those, or whose
    /// processes must be persisted with CRIU (`snapshot --persist`)
    #[arg(long)]
    pub no_seccomp: bool,
    /// The command and its arguments (with --image: default the image's).
    #[arg(last = true, required_unless_present = "image", value_name = "CMD")]
    pub command: Vec<String>,
}

/// Parses sizes like 512M, 2G, 1048576 (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return Err(format!("{s:?}: unknown unit {c:?} (use K, M, G or T)")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 512M, 2G)"))?;
    if !(n.is_finite() && n > 0.0) {
        return Err(format!("{s:?}: a size must be positive"));
    }
    Ok((n * mult as f64) as u64)
}

/// `--env KEY=VALUE` arguments as pairs.
pub fn parse_env(env: &[String]) -> Result<Vec<(String, String)>, CliError> {
    env.iter()
        .map(|e| {
            e.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(|| {
                    CliError::new(
                        ErrorKind::InvalidInput,
                        format!("--env {e:?}: use KEY=VALUE"),
                    )
                })
        })
        .collect()
}

pub fn run(cx: &Cx<'_>, args: RunArgs) -> Result<(), CliError> {
    let req = create_request(&args)?;
    let v = cx.ops()?.create_sandbox(&req, &cx.ctx)?;
    if let Isolation::None { reason } = &v.isolation {
        eprintln!(
            "tine: warning: sandbox {} runs WITHOUT isolation ({reason}); the command runs directly in {}",
            v.name,
            v.workspace.display()
        );
    }
    if args.disk.is_some()
        && let Some(why) = v.disk.as_ref().and_then(|d| d.unlimited_because.as_ref())
    {
        eprintln!(
            "tine: warning: sandbox {}'s --disk limit is not enforced: {why}",
            v.name
        );
    }
    let doc = serde_json::to_value(&v).unwrap_or_default();
    crate::emit(cx.json, doc.clone(), || crate::render::started(&doc));
    Ok(())
}

pub fn ps(cx: &Cx<'_>, all: bool) -> Result<(), CliError> {
    let views = cx.ops()?.sandboxes(all)?;
    let doc = serde_json::to_value(&views).unwrap_or_default();
    crate::emit(cx.json, doc.clone(), || crate::render::sandboxes(&doc, all));
    Ok(())
}

pub fn stop(cx: &Cx<'_>, sb: &str, timeout: Option<u64>) -> Result<(), CliError> {
    let v = cx
        .ops()?
        .stop_sandbox(sb, timeout.map(Duration::from_secs))?;
    let doc = serde_json::to_value(&v).unwrap_or_default();
    crate::emit(cx.json, doc.clone(), || crate::render::stopped(&doc));
    Ok(())
}

/// Removes each sandbox named (one output line each); a failure does not keep
/// the others from being removed, and the first one is returned.
pub fn rm(cx: &Cx<'_>, sbs: &[String], force: bool) -> Result<(), CliError> {
    let (ops, json) = (cx.ops()?, cx.json);
    let mut first_err = None;
    // An origin named with its native forks goes after them (it refuses
    // while they run): passes over what is left while one removes something;
    // the last pass reports what still refuses.
    let mut todo: Vec<&String> = sbs.iter().collect();
    let mut last_pass = false;
    while !todo.is_empty() {
        let mut waiting = Vec::new();
        let mut progress = false;
        for sb in std::mem::take(&mut todo) {
            let removed = match ops.remove_sandbox(sb, force) {
                Ok(r) => Ok(r),
                Err(tine_engine::EngineError::Sandbox(tine_engine::SandboxError::HoldsForks {
                    ..
                })) if !last_pass => {
                    waiting.push(sb);
                    continue;
                }
                Err(e) => Err(CliError::from(e)),
            };
            match removed {
                Ok(r) => {
                    progress = true;
                    let mut out = std::io::stdout().lock();
                    let _ = if json {
                        writeln!(out, "{}", json!(r))
                    } else {
                        write!(out, "{}", crate::render::removed(&json!(r)))
                    };
                }
                Err(e) if first_err.is_none() => first_err = Some(e),
                Err(e) => eprintln!("tine: error: {}", e.message),
            }
        }
        last_pass = !progress;
        todo = waiting;
    }
    first_err.map_or(Ok(()), Err)
}

/// Copies what was appended to `path` since `pos` into `out`.
fn pump(path: &std::path::Path, pos: &mut u64, out: &mut dyn Write) -> bool {
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    if f.seek(SeekFrom::Start(*pos)).is_err() {
        return false;
    }
    let mut buf = Vec::new();
    let n = f.read_to_end(&mut buf).unwrap_or(0);
    *pos += n as u64;
    let _ = out.write_all(&buf);
    let _ = out.flush();
    n > 0
}

/// Like `exec`, follows without keeping the repository (and its gc lock) open.
pub fn logs(repo_path: &std::path::Path, sb: &str, follow: bool) -> Result<(), CliError> {
    let engine = crate::commands::local_engine(repo_path)?;
    let (id, out, err) = engine.log_files(sb)?;
    let (mut o, mut e) = (0u64, 0u64);
    loop {
        let got =
            pump(&out, &mut o, &mut std::io::stdout()) | pump(&err, &mut e, &mut std::io::stderr());
        if !follow {
            return Ok(());
        }
        if !got {
            if !engine.sandbox(&id)?.live() {
                // One last read for what was written just before the end.
                pump(&out, &mut o, &mut std::io::stdout());
                pump(&err, &mut e, &mut std::io::stderr());
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// `tine exec SB -- CMD`: runs CMD inside a running sandbox; returns its
/// exit code. Locally this process joins the sandbox itself (so that the
/// command can have this terminal); through a daemon, the command's output
/// is streamed back. The repository is closed before the command runs: an
/// open repository holds the gc lock shared, and `tine gc` must not wait for
/// a long command.
pub fn exec(
    cx: &Cx<'_>,
    sb: &str,
    interactive: bool,
    tty: bool,
    env: &[String],
    command: &[String],
) -> Result<i32, CliError> {
    let overrides = parse_env(env)?;
    // Piped or redirected input that the command will not see is said so,
    // not dropped silently.
    if !interactive && stdin_holds_data() {
        eprintln!(
            "tine: note: stdin is not forwarded to the command{}",
            match cx.route {
                Route::Local(_) => "; give -i to forward it",
                Route::Daemon(_) => " through a daemon",
            }
        );
    }
    let Route::Local(repo_path) = &cx.route else {
        if interactive || tty {
            cx.local("exec -i/-t")?;
        }
        return exec_streamed(cx, sb, overrides, command);
    };
    let mut entered = tine_engine::exec::enter_sandbox(repo_path, sb, &overrides, command)?;
    let cmd = &mut entered.command;
    let status = if tty {
        on_terminal(cmd, interactive)?
    } else {
        on_pipes(cmd, interactive).map_err(|e| {
            CliError::new(
                ErrorKind::NotFound,
                format!("exec in sandbox {sb}: {}: {e}", command[0]),
            )
        })?
    };
    let code = tine_engine::exec::exit_code(status);
    if let Some(why) = entered.ended_by_rollback(sb, code) {
        eprintln!("tine: exec: {why}");
    }
    Ok(code)
}

/// Whether this process's stdin is a pipe, a file or a socket: input a
/// caller means for the command (a terminal or /dev/null is not).
fn stdin_holds_data() -> bool {
    use rustix::fs::FileType;
    rustix::fs::fstat(std::io::stdin()).is_ok_and(|st| {
        matches!(
            FileType::from_raw_mode(st.st_mode),
            FileType::Fifo | FileType::RegularFile | FileType::Socket
        )
    })
}

/// `exec` through a daemon: the command's output as it comes, its exit code.
fn exec_streamed(
    cx: &Cx<'_>,
    sb: &str,
    env: Vec<(String, String)>,
    command: &[String],
) -> Result<i32, CliError> {
    let req = tine_engine::ExecRequest {
        command: command.to_vec(),
        env: env.into_iter().collect(),
        timeout_s: None,
    };
    let out = cx.ops()?.exec(sb, &req, &mut |stream, data| {
        let written = match stream {
            tine_engine::Stream::Stdout => {
                let mut o = std::io::stdout().lock();
                o.write_all(data).and_then(|_| o.flush())
            }
            tine_engine::Stream::Stderr => std::io::stderr().write_all(data),
        };
        // A closed stdout (`tine exec ... | head`) stops the command.
        written.is_ok()
    })?;
    Ok(out.exit_code)
}

/// Copies the terminal's output to stdout and (with `interactive`) stdin to the
/// terminal, until the terminal closes (every holder of its other side is
/// gone) or the command (`child`) has ended and its last output is copied:
/// the templates of snapshots taken meanwhile hold the terminal too.
fn relay(master: &std::fs::File, interactive: bool, child: u32) {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    use std::io::Read;
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    let mut input_open = interactive;
    let mut buf = [0u8; 8192];
    let ended = rustix::process::Pid::from_raw(child as i32)
        .and_then(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok());
    let mut exited = false;
    loop {
        let mut fds = vec![PollFd::new(master, PollFlags::IN)];
        if let Some(p) = ended.as_ref().filter(|_| !exited) {
            fds.push(PollFd::new(p, PollFlags::IN));
        }
        let stdin_at = fds.len();
        if input_open && !exited {
            fds.push(PollFd::new(&stdin, PollFlags::IN));
        }
        // Once the command ended, only what it left in the terminal is read.
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match poll(&mut fds, exited.then_some(&zero)) {
            Ok(0) => return,
            Ok(_) => {}
            Err(_) => continue,
        }
        if !exited && ended.is_some() && !fds[1].revents().is_empty() {
            exited = true;
        }
        let (out_ready, in_ready) = (
            fds[0].revents(),
            fds.get(stdin_at)
                .map(|f| f.revents())
                .unwrap_or(PollFlags::empty()),
        );
        if !out_ready.is_empty() {
            match (&*master).read(&mut buf) {
                Ok(n) if n > 0 => {
                    let _ = stdout.write_all(&buf[..n]);
                    let _ = stdout.flush();
                }
                // EIO (or end of file): nobody holds the terminal any more.
                _ => return,
            }
        }
        if !in_ready.is_empty() {
            match stdin.lock().read(&mut buf) {
                Ok(n) if n > 0 => {
                    let _ = (&*master).write_all(&buf[..n]);
                }
                _ => {
                    // End of input: the terminal's end-of-file character.
                    let _ = (&*master).write_all(&[4]);
                    input_open = false;
                }
            }
        }
    }
}

/// Runs `cmd` on pipes this process relays (never on this process's
/// terminal, which the command could push input into or read after `exec`
/// returned), in a session of its own; with `interactive`, this process's
/// stdin is copied to it.
fn on_pipes(
    cmd: &mut std::process::Command,
    interactive: bool,
) -> Result<std::process::ExitStatus, tine_engine::helpers::NsError> {
    use std::os::fd::AsFd;
    let p = tine_engine::helpers::spawn_on_pipes(cmd, interactive)?;
    let stdin = std::io::stdin();
    p.relay(
        interactive.then(|| stdin.as_fd()),
        &mut std::io::stdout(),
        &mut std::io::stderr(),
    )
}

/// Runs `cmd` on a new terminal inside the sandbox, relaying its output (and,
/// with `interactive`, this terminal's input, in raw mode) until it ends.
fn on_terminal(
    cmd: &mut std::process::Command,
    interactive: bool,
) -> Result<std::process::ExitStatus, CliError> {
    use std::os::fd::AsFd;
    let stdin = std::io::stdin();
    let is_tty = rustix::termios::isatty(stdin.as_fd());
    let mut t = tine_engine::helpers::spawn_on_terminal(cmd, is_tty.then(|| stdin.as_fd()))?;
    // Raw mode, so keys reach the command as typed; restored however this ends.
    let saved = (interactive && is_tty)
        .then(|| rustix::termios::tcgetattr(stdin.as_fd()).ok())
        .flatten();
    if let Some(orig) = &saved {
        let mut raw = orig.clone();
        raw.make_raw();
        let _ =
            rustix::termios::tcsetattr(stdin.as_fd(), rustix::termios::OptionalActions::Now, &raw);
    }
    // One thread only: a process that joined a PID namespace cannot start threads.
    relay(&t.master, interactive, t.child.id());
    let status = t.child.wait();
    if let Some(orig) = &saved {
        let _ =
            rustix::termios::tcsetattr(stdin.as_fd(), rustix::termios::OptionalActions::Now, orig);
    }
    status.map_err(|e| CliError::new(ErrorKind::Io, format!("exec: {e}")))
}
