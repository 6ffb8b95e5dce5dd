//! `tine`: fork() for an agent's whole world. This file holds the command
//! line's schema, the entry points of the helper processes tine starts
//! (supervisors, a sandbox's init, adopters), and the dispatch of each
//! command to its handler in `commands/`. The handlers go through one
//! interface, `tine_engine::Operations`: the engine here, or a daemon
//! through `tine-client` (`--url`).
// The CLI is the one place that prints (libraries are linted against it).
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod commands;
mod helpers;
mod output;
mod render;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use serde_json::json;
use tine_store::{ErrorKind, OpenError, Repository, WriteLock};

use output::{Bars, CliError};

#[derive(Parser, Debug)]
#[command(
    name = "tine",
    version,
    about = "fork() for an agent's whole world: snapshot, roll back, diff, fork and merge sandboxes (files and processes) and directories.",
    max_term_width = 100
)]
pub(crate) struct Cli {
    /// Repository directory (default: the nearest .tine in this or a parent directory).
    #[arg(long, global = true, env = "TINE_REPO", value_name = "DIR")]
    repo: Option<PathBuf>,
    /// Print one JSON document on stdout instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// Fail at once instead of waiting when another tine process holds the repository lock.
    #[arg(long, global = true)]
    no_wait: bool,
    /// Talk to a daemon (`tine serve`) at this URL instead of a local repository.
    #[arg(long, global = true, env = "TINE_URL", value_name = "URL")]
    url: Option<String>,
    /// The daemon's bearer token, read from this file (or set TINE_TOKEN).
    #[arg(long, global = true, env = "TINE_TOKEN_FILE", value_name = "FILE")]
    token_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Create a repository (in ./.tine, or where --repo points).
    Init,
    /// Snapshot a directory (default: the directory that holds the repository).
    Snapshot(commands::snapshot::Args),
    /// List snapshots, newest first.
    Log(commands::log::Args),
    /// Show one snapshot.
    Show(commands::show::Args),
    /// Changes between two snapshots, or from a snapshot to the live directory.
    Diff(commands::diff::Args),
    /// Put a directory back into a snapshot's state, touching only what differs.
    Restore(commands::restore::Args),
    /// Fork a snapshot into N new sandboxes (its processes too, where it holds
    /// them), or with --into into N independent directories DIR/1 .. DIR/N.
    Fork(commands::fork::Args),
    /// Three-way merge of snapshot B into A (against their common ancestor)
    /// into a new directory or a running sandbox, snapshotted with both as
    /// parents. Exits 11 when conflicts are left (marked in text files, listed).
    Merge(commands::merge::Args),
    /// Container images: import (OCI layouts and archives, docker/podman
    /// save archives), ls, show, rm; `tine run --image NAME` runs one.
    Image {
        #[command(subcommand)]
        cmd: commands::image::ImageCmd,
    },
    /// Take a running process tine did not start (--pid PID; its files: a
    /// host directory, by default its working directory): checkpoint it with
    /// `tine snapshot --sandbox NAME`, roll it back in place with `tine
    /// restore SNAP --sandbox NAME`. --list, --detach NAME.
    Attach(commands::attach::Args),
    /// Build an image from a Dockerfile (FROM an image `tine image ls`
    /// lists; RUN, COPY, ADD, ENV, WORKDIR, USER, CMD, ENTRYPOINT, LABEL,
    /// EXPOSE): each step a snapshot, RUN in a sandbox, an unchanged prefix
    /// taken from the build cache.
    Build(commands::build::Args),
    /// Remotes: object stores (s3://bucket/prefix) or directories (file:///path)
    /// that snapshots are pushed to and pulled from.
    Remote {
        #[command(subcommand)]
        cmd: commands::sync::RemoteCmd,
    },
    /// Send snapshots (default: all, with every tag) and their ancestors to a
    /// remote (default: origin, or the only one). Only what it lacks is sent;
    /// an interrupted upload resumes.
    Push {
        remote: Option<String>,
        #[arg(value_name = "SNAPSHOT|TAG")]
        snapshots: Vec<String>,
        #[command(flatten)]
        conn: commands::sync::ConnectArgs,
        #[command(flatten)]
        upload: commands::sync::UploadArgs,
    },
    /// Fetch snapshots (default: all the remote has) and their tags from a
    /// remote; every object is verified by its hash before it is used.
    Pull {
        remote: Option<String>,
        #[arg(value_name = "SNAPSHOT|TAG")]
        snapshots: Vec<String>,
        #[command(flatten)]
        conn: commands::sync::ConnectArgs,
    },
    /// A new repository in DIR/.tine (default DIR: the URL's last part) with
    /// everything a remote holds; the remote becomes `origin`.
    Clone {
        #[arg(value_name = "URL")]
        address: String,
        dir: Option<PathBuf>,
        #[command(flatten)]
        conn: commands::sync::ConnectArgs,
    },
    /// List tags, or point TAG at SNAPSHOT, or delete a tag.
    Tag(commands::tag::Args),
    /// Remove unreferenced data; with --keep-last, also old snapshots.
    Gc(commands::gc::Args),
    /// Re-hash every stored object and report exactly what is damaged.
    Fsck(commands::fsck::Args),
    /// Start a sandbox: an isolated, supervised process over an overlay workspace.
    Run(commands::sandbox::RunArgs),
    /// List sandboxes (live ones; --all includes ended ones).
    Ps {
        #[arg(short, long)]
        all: bool,
    },
    /// Stop a sandbox: SIGTERM, then SIGKILL after the timeout.
    Stop {
        sandbox: String,
        /// Seconds to wait before SIGKILL (default: the sandbox's --stop-timeout).
        #[arg(long)]
        timeout: Option<u64>,
    },
    /// Run a command inside a running sandbox; its exit code becomes tine's.
    Exec {
        sandbox: String,
        /// Pass this terminal's stdin to the command.
        #[arg(short, long)]
        interactive: bool,
        /// Give the command a terminal (with -i: this terminal's keys, in raw mode).
        #[arg(short, long)]
        tty: bool,
        /// Environment variable (repeatable).
        #[arg(short, long = "env", value_name = "KEY=VALUE")]
        env: Vec<String>,
        #[arg(last = true, required = true, value_name = "CMD")]
        command: Vec<String>,
    },
    /// Print a sandbox's stdout and stderr.
    Logs {
        sandbox: String,
        /// Keep printing as it writes, until it ends.
        #[arg(short, long)]
        follow: bool,
    },
    /// Remove sandboxes and their files.
    Rm {
        #[arg(required = true, value_name = "SANDBOX")]
        sandboxes: Vec<String>,
        /// Stop it first if it is running.
        #[arg(short, long)]
        force: bool,
    },
    /// The effects ledger: what sandboxes did to the outside world.
    Ledger {
        #[command(subcommand)]
        cmd: commands::ledger::LedgerCmd,
    },
    /// Workspaces: named sandboxes that suspend and resume.
    Workspace {
        #[command(subcommand)]
        cmd: commands::workspace::WorkspaceCmd,
    },
    /// Make a workspace's state durable (files; processes through CRIU), then stop it.
    Suspend {
        name: String,
        /// Kill this process right after a step (tests of crash safety).
        #[arg(long, hide = true, value_enum)]
        crash_after: Option<commands::workspace::StepArg>,
        /// Also push the state to this remote, so that another host can resume it.
        #[arg(long, value_name = "REMOTE", conflicts_with = "crash_after")]
        to: Option<String>,
        #[command(flatten)]
        conn: commands::sync::ConnectArgs,
    },
    /// Bring a suspended workspace back; with --from, from the state a remote
    /// holds (suspended on another host: its files come back, its command
    /// starts afresh).
    Resume {
        name: String,
        #[arg(long, value_name = "REMOTE")]
        from: Option<String>,
        #[command(flatten)]
        conn: commands::sync::ConnectArgs,
    },
    /// Serve the HTTP API (docs/openapi.yaml) until SIGINT or SIGTERM.
    Serve(commands::serve::ServeArgs),
    /// Serve tine's tools to an agent over MCP (Model Context Protocol) on
    /// stdin and stdout, until the client closes them (a daemon serves MCP
    /// over HTTP at /mcp). With --url, the tools act through that daemon.
    Mcp,
    /// Measure tine against the targets (and against peers that are installed).
    Bench {
        #[command(subcommand)]
        which: tine_bench::BenchCommand,
    },
}

fn main() -> ExitCode {
    // The processes tine starts for itself (a sandbox's init, its supervisor,
    // exec helpers) are not user commands: they bypass the CLI parser.
    if let Some(code) = helpers::run() {
        return code;
    }
    // Descriptors tine was started with (a shell's `exec 7<dir`) are the
    // caller's: nothing tine starts — a sandbox's command, a daemon's
    // helpers, CRIU — may inherit them.
    helpers::cloexec_inherited();
    let cli = Cli::parse();
    let json = cli.json;
    match run_on_walk_stack(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.exit.is_some() => ExitCode::from(e.exit.unwrap_or(1)),
        Err(e) => {
            if json {
                let doc = json!({"error": {"code": e.kind.code(), "message": e.message}});
                println!("{doc}");
            } else {
                eprintln!("tine: error: {}", e.message);
            }
            ExitCode::from(e.kind.exit_code())
        }
    }
}

fn locate_repo(cli: &Cli) -> Result<PathBuf, CliError> {
    if let Some(r) = &cli.repo {
        return Ok(r.clone());
    }
    let cwd = std::env::current_dir()
        .map_err(|e| CliError::new(ErrorKind::Io, format!("current directory: {e}")))?;
    for dir in cwd.ancestors() {
        if dir.join(".tine").join("FORMAT").exists() {
            return Ok(dir.join(".tine"));
        }
    }
    Err(OpenError::NotARepository {
        path: cwd.join(".tine"),
    }
    .into())
}

/// The directory a repository belongs to: the parent of `.tine`, else the current directory.
pub(crate) fn default_dir(repo: &Path) -> PathBuf {
    if repo.file_name().is_some_and(|n| n == ".tine")
        && let Some(p) = repo.parent()
    {
        return if p.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            p.to_path_buf()
        };
    }
    PathBuf::from(".")
}

pub(crate) fn write_lock<'r>(
    repo: &'r Repository,
    no_wait: bool,
) -> Result<WriteLock<'r>, CliError> {
    let quiet = Bars::new(false);
    let ctx = tine_engine::Ctx {
        progress: &quiet,
        wait: !no_wait,
    };
    Ok(ctx.lock(repo)?)
}

pub(crate) fn emit(json: bool, doc: serde_json::Value, text: impl FnOnce() -> String) {
    let mut out = std::io::stdout().lock();
    let s = if json {
        format!(
            "{}\n",
            serde_json::to_string_pretty(&doc).unwrap_or_default()
        )
    } else {
        text()
    };
    let _ = out.write_all(s.as_bytes());
}

/// Emits an operation's result, with how long it took added to the JSON.
pub(crate) fn emit_timed<T: serde::Serialize>(
    json: bool,
    out: &T,
    took: std::time::Duration,
    text: impl FnOnce() -> String,
) {
    let mut doc = serde_json::to_value(out).unwrap_or_default();
    doc["duration_ms"] = json!(took.as_secs_f64() * 1e3);
    emit(json, doc, text);
}

pub(crate) fn warn_all(json: bool, warnings: &[tine_fs::Warning]) {
    if json {
        return;
    }
    for w in warnings {
        eprintln!("tine: warning: {}: {}", w.path, w.message);
    }
}

pub(crate) fn parse_attach(s: &str) -> Result<(String, PathBuf), CliError> {
    match s.split_once('=') {
        Some((n, f)) if !n.is_empty() && !f.is_empty() => Ok((n.to_string(), PathBuf::from(f))),
        _ => Err(CliError::new(
            ErrorKind::InvalidInput,
            format!("--attach {s:?}: expected NAME=FILE"),
        )),
    }
}

/// [`run`] on a thread whose stack holds walks of the deepest tree tine
/// accepts (a sandbox's tree is the sandbox's to make; the main thread's
/// 8 MiB overflow at about a thousand levels). `exec` stays on the main
/// thread: joining a sandbox's mount namespace needs a single-threaded process.
fn run_on_walk_stack(cli: Cli) -> Result<(), CliError> {
    if matches!(cli.command, Command::Exec { .. }) {
        return run(cli);
    }
    std::thread::Builder::new()
        .name("tine".into())
        .stack_size(tine_fs::paths::WALK_STACK)
        .spawn(move || run(cli))
        .map_err(|e| CliError::new(ErrorKind::Internal, format!("starting a thread: {e}")))?
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// What a command needs that only the repository's host has, if that is
/// all it does (options of other commands are checked by their handlers).
fn host_only(c: &Command) -> Option<&'static str> {
    Some(match c {
        Command::Init => "init",
        Command::Clone { .. } => "clone",
        Command::Gc(_) => "gc",
        Command::Fsck(_) => "fsck",
        Command::Logs { .. } => "logs",
        Command::Suspend { to: Some(_), .. } => "suspend --to",
        Command::Resume { from: Some(_), .. } => "resume --from",
        _ => return None,
    })
}

fn run(cli: Cli) -> Result<(), CliError> {
    let json = cli.json;
    let bars = Bars::new(!json);
    let ctx = tine_engine::Ctx {
        progress: &bars,
        wait: !cli.no_wait,
    };
    if let Command::Bench { which } = &cli.command {
        let tools = tine_bench::Tools {
            exe: output::tine_exe()?,
            criu: output::criu(),
        };
        return tine_bench::run(which, json, &tools).map_err(|e| CliError::new(e.kind, e.message));
    }
    let daemon = match &cli.url {
        Some(url) if !matches!(cli.command, Command::Serve(_)) => {
            if let Some(what) = host_only(&cli.command) {
                return Err(tine_client::unavailable(what).into());
            }
            let token = match (&cli.token_file, std::env::var("TINE_TOKEN").ok()) {
                (Some(f), _) => output::read_secret("--token-file", f)?,
                (None, Some(t)) => t,
                (None, None) => {
                    return Err(CliError::new(
                        ErrorKind::Unauthorized,
                        "talking to a daemon needs its token: set TINE_TOKEN, or --token-file FILE (tine serve printed where it keeps it)",
                    ));
                }
            };
            Some(tine_client::Client::new(url, token)?)
        }
        _ => None,
    };
    if let Command::Init = cli.command {
        let path = cli.repo.clone().unwrap_or_else(|| PathBuf::from(".tine"));
        let repo = Repository::init(&path)?;
        let abs = std::fs::canonicalize(repo.path()).unwrap_or_else(|_| repo.path().to_path_buf());
        emit(json, json!({"repository": abs}), || {
            format!("Initialized empty tine repository in {}\n", abs.display())
        });
        return Ok(());
    }
    if let Command::Clone { address, dir, conn } = &cli.command {
        return commands::sync::clone(address, dir.as_deref(), conn, json, &bars);
    }
    if let Command::Mcp = cli.command {
        // (stdout is the protocol's: nothing else is printed there.)
        let ops: tine_mcp::Ops = match daemon {
            Some(c) => std::sync::Arc::new(c),
            None => std::sync::Arc::new(commands::local_engine(&locate_repo(&cli)?)?),
        };
        return tine_mcp::run_stdio(ops)
            .map_err(|e| CliError::new(ErrorKind::Io, format!("mcp over stdio: {e}")));
    }
    let route = match daemon {
        Some(c) => commands::Route::Daemon(c),
        None => commands::Route::Local(locate_repo(&cli)?),
    };
    let cx = commands::Cx {
        json,
        no_wait: cli.no_wait,
        route,
        repo: std::cell::OnceCell::new(),
        bars: &bars,
        ctx,
    };
    match cli.command {
        Command::Init | Command::Bench { .. } | Command::Clone { .. } | Command::Mcp => {
            unreachable!("handled above")
        }
        // These keep running; they open the repository only when they need it.
        Command::Exec {
            sandbox,
            interactive,
            tty,
            env,
            command,
        } => {
            let code = commands::sandbox::exec(&cx, &sandbox, interactive, tty, &env, &command)?;
            if code != 0 {
                return Err(CliError::exit(code));
            }
        }
        Command::Logs { sandbox, follow } => {
            commands::sandbox::logs(cx.local("logs")?, &sandbox, follow)?
        }
        Command::Serve(args) => commands::serve::serve(cx.local("serve")?, &args, json)?,
        Command::Image { cmd } => commands::image::run(&cx, cmd)?,
        Command::Build(args) => commands::build::run(&cx, args)?,
        Command::Attach(args) => commands::attach::run(&cx, args)?,
        Command::Remote { cmd } => commands::sync::remote(&cx, cmd)?,
        Command::Push {
            remote,
            snapshots,
            conn,
            upload,
        } => commands::sync::push(&cx, remote.as_deref(), &snapshots, &conn, &upload)?,
        Command::Pull {
            remote,
            snapshots,
            conn,
        } => commands::sync::pull(&cx, remote.as_deref(), &snapshots, &conn)?,
        Command::Workspace { cmd } => commands::workspace::workspace(&cx, cmd)?,
        Command::Ledger { cmd } => commands::ledger::ledger(&cx, cmd)?,
        Command::Suspend {
            name,
            to: Some(to),
            conn,
            ..
        } => commands::sync::suspend_to(
            (cx.local("suspend --to")?, cx.repo()?),
            &name,
            &to,
            &conn,
            json,
            &bars,
        )?,
        Command::Suspend {
            name, crash_after, ..
        } => commands::workspace::suspend(&cx, &name, crash_after)?,
        Command::Resume {
            name,
            from: Some(from),
            conn,
        } => commands::sync::resume_from(
            (cx.local("resume --from")?, cx.repo()?),
            &name,
            &from,
            &conn,
            json,
            &bars,
        )?,
        Command::Resume { name, .. } => commands::workspace::resume(&cx, &name)?,
        Command::Run(args) => commands::sandbox::run(&cx, args)?,
        Command::Ps { all } => commands::sandbox::ps(&cx, all)?,
        Command::Stop { sandbox, timeout } => commands::sandbox::stop(&cx, &sandbox, timeout)?,
        Command::Rm { sandboxes, force } => commands::sandbox::rm(&cx, &sandboxes, force)?,
        Command::Snapshot(a) => commands::snapshot::run(&cx, a)?,
        Command::Log(a) => commands::log::run(&cx, a)?,
        Command::Show(a) => commands::show::run(&cx, a)?,
        Command::Diff(a) => commands::diff::run(&cx, a)?,
        Command::Restore(a) => commands::restore::run(&cx, a)?,
        Command::Fork(a) => commands::fork::run(&cx, a)?,
        Command::Merge(a) => commands::merge::run(&cx, a)?,
        Command::Tag(a) => commands::tag::run(&cx, a)?,
        Command::Fsck(a) => commands::fsck::run(&cx, a)?,
        Command::Gc(a) => commands::gc::run(cx.local("gc")?, json, &ctx, a)?,
    }
    Ok(())
}
