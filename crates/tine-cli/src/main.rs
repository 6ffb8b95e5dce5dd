//! `tine`: fork() for an agent's whole world. This binary is a thin shell over
//! the tine-store and tine-fs libraries.
// The CLI is the one place that prints (libraries are linted against it).
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod ledger_cmd;
mod output;
mod remote;
mod render;
mod sandbox_cmd;
mod serve_cmd;
mod sync_cmd;
mod workspace_cmd;

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use serde_json::json;
use tine_fs::SnapshotOptions;
use tine_store::{ErrorKind, GcOptions, ObjectId, OpenError, Repository, WriteLock};

use output::{Bars, CliError, count, duration, plural, size, time};

#[derive(Parser, Debug)]
#[command(
    name = "tine",
    version,
    about = "Snapshot, restore, diff and fork directory trees, fast.",
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
    Snapshot {
        path: Option<PathBuf>,
        #[arg(short, long, default_value = "")]
        message: String,
        /// Tag the new snapshot (repeatable).
        #[arg(long = "tag", value_name = "TAG")]
        tags: Vec<String>,
        /// Store a file with the snapshot under a name, e.g. --attach trace=chat.jsonl (repeatable).
        #[arg(long = "attach", value_name = "NAME=FILE")]
        attach: Vec<String>,
        /// Move tags that already exist.
        #[arg(long)]
        force: bool,
        /// Snapshot a running sandbox: its files and its processes (templates
        /// made by native fork; stopped while they fork and its changes are read).
        #[arg(long, value_name = "SB", conflicts_with_all = ["path", "attach"])]
        sandbox: Option<String>,
        /// With --sandbox: capture the files only, not the processes (for
        /// processes native fork cannot copy: several threads, live children).
        #[arg(long, requires = "sandbox")]
        files_only: bool,
        /// Templates kept across the repository's sandboxes; the least
        /// recently used snapshots' go first.
        #[arg(
            long,
            env = "TINE_MAX_TEMPLATES",
            default_value_t = 64,
            value_name = "N"
        )]
        max_templates: usize,
        /// Private memory the kept templates may hold (e.g. 8G).
        #[arg(long, env = "TINE_MAX_TEMPLATE_MEMORY", default_value = "8G", value_name = "SIZE",
              value_parser = sandbox_cmd::parse_size)]
        max_template_memory: u64,
        /// With --sandbox: also persist the processes with CRIU into the
        /// repository (after they run on; takes seconds per GiB), so they
        /// can be restored after their templates were let go or a reboot.
        #[arg(long, requires = "sandbox", conflicts_with = "files_only")]
        persist: bool,
    },
    /// List snapshots, newest first.
    Log {
        /// Draw the parent graph.
        #[arg(long)]
        graph: bool,
        /// Show at most N snapshots.
        #[arg(short = 'n', long)]
        limit: Option<usize>,
    },
    /// Show one snapshot.
    Show {
        snapshot: String,
        /// Write the named attachment's content to stdout.
        #[arg(long, value_name = "NAME")]
        attachment: Option<String>,
    },
    /// Changes between two snapshots, or from a snapshot to the live directory.
    Diff {
        a: String,
        b: Option<String>,
        /// Include unified diffs of text files.
        #[arg(short = 'p', long)]
        patch: bool,
        /// Live directory to compare with when B is not given (default: the snapshot's source).
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
    /// Put a directory back into a snapshot's state, touching only what differs.
    Restore {
        snapshot: String,
        /// Target directory (default: the directory the snapshot was taken from).
        #[arg(long, value_name = "DIR")]
        to: Option<PathBuf>,
        /// Roll a sandbox back to the snapshot, in place while it runs; its
        /// processes too when the snapshot holds live templates of it.
        #[arg(long, value_name = "SB", conflicts_with = "to")]
        sandbox: Option<String>,
        /// Restore the files only; leave the running processes alone.
        #[arg(long)]
        files_only: bool,
        /// Give files their set-user-ID/set-group-ID bits (into a directory;
        /// dropped by default, and each such file named).
        #[arg(long, conflicts_with = "sandbox")]
        keep_setuid: bool,
    },
    /// Materialize a snapshot into N independent directories DIR/1 .. DIR/N.
    Fork {
        snapshot: String,
        #[arg(short = 'n', long, default_value_t = 1)]
        count: usize,
        /// Fork into directories DIR/1 .. DIR/N (default: into N new sandboxes).
        #[arg(long, value_name = "DIR")]
        into: Option<PathBuf>,
        /// With --into: give files their set-user-ID/set-group-ID bits
        /// (dropped by default, and each such file named).
        #[arg(long, requires = "into")]
        keep_setuid: bool,
        /// Sandboxes are named PREFIX-1 .. PREFIX-N (default: their ids).
        #[arg(long, value_name = "PREFIX", conflicts_with = "into")]
        name: Option<String>,
        /// Create the sandboxes without starting them.
        #[arg(long, conflicts_with = "into")]
        no_start: bool,
        /// Start the command afresh in each fork, even when the snapshot
        /// holds its sandbox's processes (which forks otherwise get: cloned
        /// from the live templates, or through CRIU images).
        #[arg(long, conflicts_with = "into")]
        files_only: bool,
        /// Bring the processes through CRIU images even where they can be
        /// cloned natively (for comparison; needs CRIU).
        #[arg(long, conflicts_with = "files_only")]
        through_criu: bool,
        /// The command the sandboxes run (default: that of the snapshot's sandbox).
        #[arg(last = true, value_name = "CMD")]
        command: Vec<String>,
    },
    /// Three-way merge of snapshot B into A (against their common ancestor)
    /// into a new directory or a running sandbox, snapshotted with both as
    /// parents. Exits 11 when conflicts are left (marked in text files, listed).
    Merge {
        a: String,
        b: String,
        /// The base to merge against (default: the nearest common ancestor).
        #[arg(long, value_name = "SNAPSHOT")]
        base: Option<String>,
        /// The directory to write the result into (new or empty).
        #[arg(long, value_name = "DIR", required_unless_present = "sandbox")]
        into: Option<PathBuf>,
        /// Put the result into this running sandbox instead (its files are
        /// restored to the merge's snapshot, in place; its processes run on).
        #[arg(long, value_name = "SB", conflicts_with = "into")]
        sandbox: Option<String>,
        #[arg(short, long)]
        message: Option<String>,
    },
    /// Remotes: object stores (s3://bucket/prefix) or directories (file:///path)
    /// that snapshots are pushed to and pulled from.
    Remote {
        #[command(subcommand)]
        cmd: sync_cmd::RemoteCmd,
    },
    /// Send snapshots (default: all, with every tag) and their ancestors to a
    /// remote (default: origin, or the only one). Only what it lacks is sent;
    /// an interrupted upload resumes.
    Push {
        remote: Option<String>,
        #[arg(value_name = "SNAPSHOT|TAG")]
        snapshots: Vec<String>,
        #[command(flatten)]
        conn: sync_cmd::ConnectArgs,
        #[command(flatten)]
        upload: sync_cmd::UploadArgs,
    },
    /// Fetch snapshots (default: all the remote has) and their tags from a
    /// remote; every object is verified by its hash before it is used.
    Pull {
        remote: Option<String>,
        #[arg(value_name = "SNAPSHOT|TAG")]
        snapshots: Vec<String>,
        #[command(flatten)]
        conn: sync_cmd::ConnectArgs,
    },
    /// A new repository in DIR/.tine (default DIR: the URL's last part) with
    /// everything a remote holds; the remote becomes `origin`.
    Clone {
        #[arg(value_name = "URL")]
        address: String,
        dir: Option<PathBuf>,
        #[command(flatten)]
        conn: sync_cmd::ConnectArgs,
    },
    /// List tags, or point TAG at SNAPSHOT, or delete a tag.
    Tag {
        name: Option<String>,
        snapshot: Option<String>,
        #[arg(short, long)]
        delete: bool,
        /// Move an existing tag.
        #[arg(short, long)]
        force: bool,
    },
    /// Remove unreferenced data; with --keep-last, also old snapshots.
    Gc {
        /// Keep the N newest snapshots (tagged snapshots and directory heads are always kept).
        #[arg(long, value_name = "N")]
        keep_last: Option<usize>,
        #[arg(long)]
        dry_run: bool,
        /// Do not recompress the packs snapshots wrote (gc compacts them by default:
        /// about 15 % smaller for text, costs seconds of CPU per 50 MB).
        #[arg(long)]
        no_compact: bool,
    },
    /// Re-hash every stored object and report exactly what is damaged.
    Fsck {
        /// First rebuild the database's index from the packs where it can:
        /// list every pack file, index every object a pack's own index names,
        /// and give every snapshot object a row that says what it says
        /// (nothing stored is removed)
        #[arg(long)]
        rebuild_index: bool,
    },
    /// Start a sandbox: an isolated, supervised process over an overlay workspace.
    Run(sandbox_cmd::RunArgs),
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
        cmd: ledger_cmd::LedgerCmd,
    },
    /// Workspaces: named sandboxes that suspend and resume.
    Workspace {
        #[command(subcommand)]
        cmd: workspace_cmd::WorkspaceCmd,
    },
    /// Make a workspace's state durable (files; processes through CRIU), then stop it.
    Suspend {
        name: String,
        /// Kill this process right after a step (tests of crash safety).
        #[arg(long, hide = true, value_enum)]
        crash_after: Option<workspace_cmd::StepArg>,
        /// Also push the state to this remote, so that another host can resume it.
        #[arg(long, value_name = "REMOTE", conflicts_with = "crash_after")]
        to: Option<String>,
        #[command(flatten)]
        conn: sync_cmd::ConnectArgs,
    },
    /// Bring a suspended workspace back; with --from, from the state a remote
    /// holds (suspended on another host: its files come back, its command
    /// starts afresh).
    Resume {
        name: String,
        #[arg(long, value_name = "REMOTE")]
        from: Option<String>,
        #[command(flatten)]
        conn: sync_cmd::ConnectArgs,
    },
    /// Serve the HTTP API (docs/openapi.yaml) until SIGINT or SIGTERM.
    Serve(serve_cmd::ServeArgs),
    /// Measure tine against the targets (and against peers that are installed).
    Bench {
        #[command(subcommand)]
        which: tine_bench::BenchCommand,
    },
}

fn main() -> ExitCode {
    // The first process inside a new sandbox (started by its supervisor); not a
    // user command, so it bypasses the CLI parser and exits with the command's code.
    let mut args = std::env::args_os().skip(1);
    match args.next() {
        Some(a) if a == "__sandbox-init" => return sandbox_init(args.next()),
        Some(a) if a == "__sandbox-furnish" => return sandbox_furnish(args.next()),
        Some(a) if a == "__sandbox-adopt" => return sandbox_adopt(args.next()),
        Some(a) if a == "__exec" => {
            use std::io::Read;
            let mut spec = Vec::new();
            let result = std::io::stdin()
                .read_to_end(&mut spec)
                .map_err(|e| e.to_string())
                .and_then(|_| {
                    serde_json::from_slice::<tine_engine::exec::ExecSpec>(&spec)
                        .map_err(|e| e.to_string())
                })
                .map(|spec| tine_engine::exec::run_helper(&spec));
            return internal_exit("exec", result);
        }
        Some(a) if a == "__supervise" => {
            use tine_sandbox::supervisor::FirstRun;
            let (repo, id) = (args.next(), args.next());
            let first_run = match args.next() {
                Some(a) if a == "--held" => FirstRun::Held,
                Some(a) if a == "--adopt" => {
                    match args.next().and_then(|p| p.to_str()?.parse().ok()) {
                        Some(pid) => FirstRun::Adopt(pid),
                        None => {
                            eprintln!("tine: __supervise --adopt needs a PID");
                            return ExitCode::from(2);
                        }
                    }
                }
                _ => FirstRun::Start,
            };
            let code = sandbox_cmd::supervise(repo, id, first_run);
            return ExitCode::from(code as u8);
        }
        _ => {}
    }
    // Descriptors tine was started with (a shell's `exec 7<dir`) are the
    // caller's: nothing tine starts — a sandbox's command, a daemon's
    // helpers, CRIU — may inherit them.
    let _ = tine_sandbox::ns::cloexec_inherited();
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

/// The JSON argument of an internal command.
fn json_arg<T: serde::de::DeserializeOwned>(arg: Option<std::ffi::OsString>) -> Result<T, String> {
    let arg = arg.ok_or_else(|| "no spec given".to_string())?;
    serde_json::from_slice(arg.as_encoded_bytes()).map_err(|e| e.to_string())
}

/// How an internal command (`what`) ends: with the code it returns, or,
/// like container runtimes, 125 when the sandbox itself could not be set up.
fn internal_exit(what: &str, result: Result<i32, String>) -> ExitCode {
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("tine: {what}: {e}");
            ExitCode::from(125)
        }
    }
}

fn sandbox_init(spec: Option<std::ffi::OsString>) -> ExitCode {
    let result = json_arg::<tine_sandbox::InitSpec>(spec)
        .and_then(|s| tine_sandbox::ns::run_init(&s).map_err(|e| e.to_string()));
    internal_exit("sandbox init", result)
}

/// `tine __sandbox-adopt MAIN`: what the init of a native fork executes.
fn sandbox_adopt(main: Option<std::ffi::OsString>) -> ExitCode {
    let result = main
        .and_then(|m| m.to_str()?.parse::<u32>().ok())
        .ok_or_else(|| "no process given".to_string())
        .and_then(|m| tine_sandbox::ns::run_adopted(m).map_err(|e| e.to_string()));
    internal_exit("sandbox init", result)
}

/// `tine __sandbox-furnish SPEC`: furnishes namespaces made by a nested
/// clone (a process of its own: it forks into their PID namespace).
fn sandbox_furnish(spec: Option<std::ffi::OsString>) -> ExitCode {
    let result = json_arg::<tine_sandbox::ns::FurnishSpec>(spec).and_then(|s| {
        tine_sandbox::ns::furnish_here(&s)
            .map(|()| 0)
            .map_err(|e| e.to_string())
    });
    internal_exit("sandbox furnish", result)
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
fn default_dir(repo: &Path) -> PathBuf {
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
fn emit_timed<T: serde::Serialize>(
    json: bool,
    out: &T,
    took: std::time::Duration,
    text: impl FnOnce() -> String,
) {
    let mut doc = serde_json::to_value(out).unwrap_or_default();
    doc["duration_ms"] = json!(took.as_secs_f64() * 1e3);
    emit(json, doc, text);
}

fn warn_all(json: bool, warnings: &[tine_fs::Warning]) {
    if json {
        return;
    }
    for w in warnings {
        eprintln!("tine: warning: {}: {}", w.path, w.message);
    }
}

fn parse_attach(s: &str) -> Result<(String, PathBuf), CliError> {
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
    if let Some(url) = cli.url.clone()
        && !matches!(cli.command, Command::Serve(_) | Command::Bench { .. })
    {
        let token = match (&cli.token_file, std::env::var("TINE_TOKEN").ok()) {
            (Some(f), _) => Some(output::read_secret("--token-file", f)?),
            (None, t) => t,
        };
        let remote = remote::Remote::new(&url, token)?;
        return remote::run(cli, &remote);
    }
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
        return sync_cmd::clone(address, dir.as_deref(), conn, json, &bars);
    }
    let repo_path = locate_repo(&cli)?;
    // These two keep running; they open the repository only when they need it.
    match &cli.command {
        Command::Exec {
            sandbox,
            interactive,
            tty,
            env,
            command,
        } => {
            let code = sandbox_cmd::exec(&repo_path, sandbox, *interactive, *tty, env, command)?;
            return if code == 0 {
                Ok(())
            } else {
                Err(CliError::exit(code))
            };
        }
        Command::Logs { sandbox, follow } => {
            return sandbox_cmd::logs(&repo_path, sandbox, *follow);
        }
        Command::Serve(args) => return serve_cmd::serve(&repo_path, args, json),
        Command::Workspace { .. }
        | Command::Suspend { .. }
        | Command::Resume { .. }
        | Command::Ledger { .. } => {}
        _ => {}
    }
    let repo = Repository::open(&repo_path)?;
    let resolve = |s: &str| -> Result<ObjectId, CliError> { Ok(repo.resolve(s)?) };
    match cli.command {
        Command::Init
        | Command::Bench { .. }
        | Command::Exec { .. }
        | Command::Logs { .. }
        | Command::Clone { .. }
        | Command::Serve(_) => {
            unreachable!()
        }
        Command::Remote { cmd } => sync_cmd::remote(&repo, cmd, json)?,
        Command::Push {
            remote,
            snapshots,
            conn,
            upload,
        } => sync_cmd::push(
            &repo,
            remote.as_deref(),
            &snapshots,
            &conn,
            &upload,
            json,
            &bars,
        )?,
        Command::Pull {
            remote,
            snapshots,
            conn,
        } => sync_cmd::pull(&repo, remote.as_deref(), &snapshots, &conn, json, &bars)?,
        Command::Workspace { cmd } => workspace_cmd::workspace(&repo_path, cmd, json)?,
        Command::Ledger { cmd } => ledger_cmd::ledger(&repo_path, cmd, json)?,
        Command::Suspend {
            name,
            to: Some(to),
            conn,
            ..
        } => sync_cmd::suspend_to((&repo_path, &repo), &name, &to, &conn, json, &bars)?,
        Command::Suspend {
            name, crash_after, ..
        } => workspace_cmd::suspend(&repo_path, &name, crash_after, json)?,
        Command::Resume {
            name,
            from: Some(from),
            conn,
        } => sync_cmd::resume_from((&repo_path, &repo), &name, &from, &conn, json, &bars)?,
        Command::Resume { name, .. } => workspace_cmd::resume(&repo_path, &name, json)?,
        Command::Run(args) => sandbox_cmd::run(&repo_path, args, json, &ctx)?,
        Command::Ps { all } => sandbox_cmd::ps(&repo_path, all, json)?,
        Command::Stop { sandbox, timeout } => sandbox_cmd::stop(&repo_path, &sandbox, timeout, json)?,
        Command::Rm { sandboxes, force } => sandbox_cmd::rm(&repo, &sandboxes, force, json)?,
        Command::Snapshot {
            path,
            message,
            tags,
            attach,
            force,
            sandbox,
            files_only,
            max_templates,
            max_template_memory,
            persist,
        } => {
            if let Some(sb) = sandbox {
                let mut engine = workspace_cmd::local_engine(&repo_path)?;
                engine.config_mut().pool = tine_sandbox::processes::PoolLimits {
                    max_templates,
                    max_bytes: max_template_memory,
                };
                let req = tine_engine::SnapshotRequest {
                    message,
                    tags,
                    force,
                    files_only,
                    persist,
                };
                let out = engine.snapshot_sandbox(&sb, &req, &ctx)?;
                warn_all(json, &out.outcome.warnings);
                let doc = serde_json::to_value(&out).unwrap_or_default();
                if !json {
                    for note in render::evicted_notes(&doc) {
                        eprintln!("note: {note}");
                    }
                }
                emit(json, doc.clone(), || render::sandbox_snapshot(&doc));
                return Ok(());
            }
            let mut opts = SnapshotOptions {
                message,
                tags,
                force_tags: force,
                attachments: vec![],
                parents: None,
                notes: vec![],
            };
            let dir = path.unwrap_or_else(|| default_dir(&repo_path));
            opts.attachments = attach
                .iter()
                .map(|a| parse_attach(a))
                .collect::<Result<Vec<_>, _>>()?;
            let lock = write_lock(&repo, cli.no_wait)?;
            let t0 = Instant::now();
            let out = tine_fs::snapshot(&lock, &dir, &opts, &bars)?;
            let took = t0.elapsed();
            warn_all(json, &out.warnings);
            emit_timed(json, &out, took, || {
                format!(
                    "snapshot {}{}: {}, {}; read {} ({}), stored {} ({}) in {}\n",
                    out.id.short(),
                    out.parent
                        .map(|p| format!(" (parent {})", p.short()))
                        .unwrap_or_default(),
                    plural(out.stats.files, "file"),
                    size(out.stats.bytes),
                    plural(out.stats.hashed_files, "file"),
                    size(out.stats.hashed_bytes),
                    plural(out.commit.new_objects, "new object"),
                    size(out.commit.new_bytes),
                    duration(took),
                )
            });
        }
        Command::Log { graph, limit } => cmd_log(&repo, json, graph, limit)?,
        Command::Show {
            snapshot,
            attachment,
        } => {
            let id = resolve(&snapshot)?;
            if let Some(name) = attachment {
                let obj = repo.read_snapshot(&id)?;
                let a = obj
                    .attachments
                    .iter()
                    .find(|a| a.name == name)
                    .ok_or_else(|| {
                        let names: Vec<&str> =
                            obj.attachments.iter().map(|a| a.name.as_str()).collect();
                        CliError::new(
                            ErrorKind::NotFound,
                            format!(
                                "snapshot {} has no attachment {name:?} (it has: {})",
                                id.short(),
                                if names.is_empty() {
                                    "none".into()
                                } else {
                                    names.join(", ")
                                }
                            ),
                        )
                    })?;
                let mut out = std::io::stdout().lock();
                repo.write_content(&a.content, &mut out, Path::new("<stdout>"))?;
                return Ok(());
            }
            let d = tine_engine::snapshot_detail(&repo, &id)?;
            emit(json, serde_json::to_value(&d).unwrap_or_default(), || {
                let mut s = format!("snapshot    {id}\ntree        {}\n", d.info.tree);
                for p in &d.info.parents {
                    s += &format!(
                        "parent      {}{}\n",
                        p.short(),
                        if repo.snapshot_info(p).ok().flatten().is_none() {
                            " (pruned)"
                        } else {
                            ""
                        }
                    );
                }
                s += &format!(
                    "time        {}\nsource      {}\n",
                    time(d.info.time_ns),
                    d.info.source
                );
                if !d.info.tags.is_empty() {
                    s += &format!("tags        {}\n", d.info.tags.join(", "));
                }
                s += &format!(
                    "files       {} ({})\n",
                    count(d.info.files),
                    size(d.info.bytes)
                );
                if let Some(h) = &d.processes {
                    if h.live > 0 {
                        s += &format!(
                            "processes   {} live (templates hold {} of their own)\n",
                            plural(h.live as u64, "process"),
                            size(h.private_bytes)
                        );
                    }
                    if h.persisted > 0 {
                        s += &format!(
                            "persisted   {} with CRIU ({} of images)\n",
                            plural(h.persisted as u64, "process"),
                            size(h.persisted_bytes)
                        );
                    }
                }
                if !d.info.message.is_empty() {
                    s += &format!("message     {}\n", d.info.message);
                }
                for a in &d.attachments {
                    s += &format!("attachment  {}  {}\n", a.name, size(a.size));
                }
                s
            });
        }
        Command::Diff { a, b, patch, dir } => {
            let req = tine_engine::DiffRequest { to: b, dir, patch };
            let out = workspace_cmd::local_engine(&repo_path)?.diff(&a, &req, &ctx)?;
            let doc = serde_json::to_value(&out).unwrap_or_default();
            emit(json, doc.clone(), || render::diff(&doc));
        }
        Command::Restore {
            snapshot,
            to,
            sandbox,
            files_only,
            keep_setuid,
        } => {
            let engine = workspace_cmd::local_engine(&repo_path)?;
            // A snapshot of a sandbox goes back into that sandbox by default.
            let sandbox = match (&sandbox, &to) {
                (None, None) => engine.sandbox_of_snapshot(&snapshot)?.map(|r| r.id),
                _ => sandbox,
            };
            if let Some(sb) = sandbox {
                let out = engine.restore_sandbox(&sb, &snapshot, files_only, &ctx)?;
                warn_all(json, &out.outcome.warnings);
                let doc = serde_json::to_value(&out).unwrap_or_default();
                if !json && let Some(note) = render::let_go_note(&doc) {
                    eprintln!("note: {note}");
                }
                emit(json, doc.clone(), || render::sandbox_restore(&doc));
                return Ok(());
            }
            let id = resolve(&snapshot)?;
            let target = match to {
                Some(t) => t,
                None => PathBuf::from(repo.read_snapshot(&id)?.source),
            };
            let lock = write_lock(&repo, cli.no_wait)?;
            let t0 = Instant::now();
            let opts = tine_fs::RestoreOptions {
                keep_setuid,
                ..Default::default()
            };
            let out = tine_fs::restore_with(&lock, &id, &target, opts, &bars)?;
            let took = t0.elapsed();
            warn_all(json, &out.warnings);
            emit_timed(json, &out, took, || {
                format!(
                    "restored {} into {}: {} added, {} modified, {} deleted, {} mode changed ({} written) in {}\n",
                    id.short(),
                    out.target.display(),
                    out.added,
                    out.modified,
                    out.deleted,
                    out.mode_changed,
                    size(out.bytes_written),
                    duration(took)
                )
            });
        }
        Command::Fork {
            snapshot,
            count: n,
            into,
            keep_setuid,
            name,
            no_start,
            files_only,
            through_criu,
            command,
        } => {
            let Some(into) = into else {
                let req = tine_engine::ForkRequest {
                    n: Some(n),
                    name,
                    command,
                    no_start,
                    files_only,
                    through_criu,
                };
                let out = workspace_cmd::local_engine(&repo_path)?.fork(&snapshot, &req, &ctx)?;
                if !json && let Some(note) = &out.note {
                    eprintln!("note: {note}");
                }
                let doc = serde_json::to_value(&out).unwrap_or_default();
                emit(json, doc.clone(), || render::fork(&doc));
                return Ok(());
            };
            let id = resolve(&snapshot)?;
            let lock = write_lock(&repo, cli.no_wait)?;
            let t0 = Instant::now();
            let opts = tine_fs::RestoreOptions {
                keep_setuid,
                ..Default::default()
            };
            let out = tine_fs::fork(&lock, &id, &into, n, opts, &bars)?;
            let took = t0.elapsed();
            warn_all(json, &out.warnings);
            emit_timed(json, &out, took, || {
                let mut s = format!(
                    "forked {} into {} ({}, {} and {} each) in {}\n",
                    id.short(),
                    plural(n as u64, "directory"),
                    out.method,
                    plural(out.files, "file"),
                    size(out.bytes_per_fork),
                    duration(took)
                );
                for d in &out.dirs {
                    s += &format!("  {}\n", d.display());
                }
                s
            });
        }
        Command::Merge {
            a,
            b,
            base,
            into,
            sandbox,
            message,
        } => {
            let req = tine_engine::MergeRequest {
                ours: a,
                theirs: b,
                base,
                message,
            };
            let into = match (sandbox, into) {
                (Some(sb), _) => tine_engine::MergeInto::Sandbox(sb),
                (None, Some(dir)) => tine_engine::MergeInto::Dir(dir),
                (None, None) => unreachable!("clap requires --into or --sandbox"),
            };
            let out = workspace_cmd::local_engine(&repo_path)?.merge(&req, &into, &ctx)?;
            let doc = serde_json::to_value(&out).unwrap_or_default();
            emit(json, doc.clone(), || render::merge(&doc));
            if !out.outcome.conflicts.is_empty() {
                return Err(CliError::exit(ErrorKind::Conflict.exit_code() as i32));
            }
        }
        Command::Tag {
            name,
            snapshot,
            delete,
            force,
        } => match (name, snapshot, delete) {
            (Some(name), None, true) => {
                let lock = write_lock(&repo, cli.no_wait)?;
                let was = lock.delete_tag(&name)?;
                emit(json, json!({"deleted": name, "was": was}), || {
                    format!("deleted tag {name} (was {})\n", was.short())
                });
            }
            (Some(name), Some(snap), false) => {
                let id = resolve(&snap)?;
                let lock = write_lock(&repo, cli.no_wait)?;
                lock.set_tag(&name, &id, force)?;
                emit(json, json!({"tag": name, "snapshot": id}), || {
                    format!("tagged {} as {name}\n", id.short())
                });
            }
            (None, None, false) => {
                let tags = repo.tags()?;
                let doc = json!(
                    tags.iter()
                        .map(|(n, id)| json!({"tag": n, "snapshot": id}))
                        .collect::<Vec<_>>()
                );
                emit(json, doc, || {
                    tags.iter()
                        .map(|(n, id)| format!("{n}\t{}\n", id.short()))
                        .collect()
                });
            }
            (Some(_), None, false) => {
                return Err(CliError::new(
                    ErrorKind::InvalidInput,
                    "tag: give both TAG and SNAPSHOT, or --delete TAG",
                ));
            }
            _ => {
                return Err(CliError::new(
                    ErrorKind::InvalidInput,
                    "tag: use `tine tag`, `tine tag NAME SNAPSHOT` or `tine tag --delete NAME`",
                ));
            }
        },
        Command::Gc {
            keep_last,
            dry_run,
            no_compact,
        } => {
            let lock = write_lock(&repo, cli.no_wait)?;
            let opts = GcOptions {
                keep_last,
                dry_run,
                compact: !no_compact,
            };
            let r = tine_store::gc(&lock, &opts, &bars)?;
            // Stat caches of directories that no longer exist only take space.
            let caches = if dry_run {
                Vec::new()
            } else {
                tine_fs::prune_caches(lock.repo()).map_err(|e| {
                    CliError::new(
                        ErrorKind::Io,
                        format!(
                            "gc: pruning stat caches in {}: {e}",
                            lock.repo().cache_dir().display()
                        ),
                    )
                })?
            };
            // Process state of snapshots gc removed: templates and CRIU images.
            let procs = tine_sandbox::processes::prune(
                lock.repo().path(),
                // (On a dry run the removed snapshots are still there.)
                |hex| {
                    ObjectId::from_hex(hex).is_some_and(|id| {
                        !r.snapshots_removed.contains(&id)
                            && lock.repo().snapshot_info(&id).ok().flatten().is_some()
                    })
                },
                dry_run,
            );
            let mut doc = serde_json::to_value(&r).unwrap_or_default();
            doc["stat_caches_removed"] = json!(caches);
            doc["process_states_removed"] = json!(procs);
            emit(json, doc, || {
                let verb = if dry_run { "would remove" } else { "removed" };
                let caches = if caches.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; {} of vanished directories",
                        plural(caches.len() as u64, "stat cache")
                    )
                };
                let caches = if procs.records + procs.image_dirs == 0 {
                    caches
                } else {
                    format!(
                        "{caches}; {} of removed snapshots, {} of CRIU images ({})",
                        plural(procs.records as u64, "process-state record"),
                        plural(procs.image_dirs as u64, "directory"),
                        size(procs.image_bytes)
                    )
                };
                let rewritten = if dry_run { "to rewrite" } else { "rewritten" };
                format!(
                    "{verb} {}, {}, {} and {}; {} {rewritten} ({} compacted); store {} -> {}{caches}\n",
                    plural(r.snapshots_removed.len() as u64, "snapshot"),
                    plural(r.objects_removed, "object"),
                    plural(r.packs_removed, "pack"),
                    plural(r.leftover_files_removed.len() as u64, "leftover file"),
                    plural(r.packs_rewritten, "pack"),
                    r.packs_compacted,
                    size(r.bytes_before),
                    size(r.bytes_after)
                )
            });
        }
        Command::Fsck { rebuild_index } => {
            if rebuild_index {
                let lock = write_lock(&repo, cli.no_wait)?;
                let rb = tine_store::rebuild_index(&lock, &bars)?;
                drop(lock);
                if json {
                    eprintln!("{}", serde_json::json!({ "rebuilt": rb }));
                } else {
                    eprintln!(
                        "rebuilt the index from {}: {} listed again, {} indexed, {} recorded, {} repaired{}",
                        plural(rb.packs_read, "pack"),
                        plural(rb.packs_registered, "pack"),
                        plural(rb.objects_indexed, "object"),
                        plural(rb.snapshots_recorded.len() as u64, "snapshot"),
                        plural(rb.snapshots_repaired.len() as u64, "snapshot row"),
                        if rb.packs_unreadable.is_empty() {
                            String::new()
                        } else {
                            format!(
                                "; {} unreadable",
                                plural(rb.packs_unreadable.len() as u64, "pack")
                            )
                        }
                    );
                }
            }
            let t0 = Instant::now();
            let r = tine_store::fsck(&repo, &bars)?;
            let took = t0.elapsed();
            emit(json, serde_json::to_value(&r).unwrap_or_default(), || {
                let mut s = format!(
                    "checked {} in {} ({}) in {}\n",
                    plural(r.objects_checked, "object"),
                    plural(r.packs_checked, "pack"),
                    size(r.bytes_checked),
                    duration(took)
                );
                for p in &r.damaged_packs {
                    s += &format!("damaged pack {}: {}\n", p.pack, p.reason);
                }
                for d in &r.damaged_objects {
                    s += &format!(
                        "damaged object {} ({}) in pack {} at offset {}: {}\n",
                        d.id, d.kind, d.pack, d.offset, d.reason
                    );
                }
                for m in &r.missing_objects {
                    s += &format!(
                        "missing object {} (referenced by {})\n",
                        m.id,
                        m.referenced_by.short()
                    );
                }
                if !r.affected_snapshots.is_empty() {
                    s += "snapshots that cannot be fully restored:\n";
                    for a in &r.affected_snapshots {
                        let tags = if a.tags.is_empty() {
                            String::new()
                        } else {
                            format!(" [{}]", a.tags.join(", "))
                        };
                        s += &format!(
                            "  {}{tags} {} (needs {})\n",
                            a.id.short(),
                            a.message,
                            plural(a.bad_objects.len() as u64, "bad object")
                        );
                    }
                }
                for m in &r.mismatched_snapshots {
                    s += &format!(
                        "snapshot {}: its database row does not match its stored object ({}); `tine fsck --rebuild-index` rewrites the rows from the objects\n",
                        m.id.short(),
                        m.fields.join(", ")
                    );
                }
                if !r.leftover_files.is_empty() || r.unreachable_objects > 0 {
                    s += &format!(
                        "{} and {} left over from interrupted writes; `tine gc` removes them\n",
                        plural(r.leftover_files.len() as u64, "file"),
                        plural(r.unreachable_objects, "unreachable object")
                    );
                }
                s += if r.is_clean() {
                    "repository is clean\n"
                } else {
                    "repository is DAMAGED\n"
                };
                s
            });
            if !r.is_clean() {
                return Err(CliError::new(
                    ErrorKind::Corrupt,
                    format!(
                        "fsck found damage: {} damaged objects, {} missing, {} damaged packs, {} affected snapshots, {} snapshot rows that do not match their objects",
                        r.damaged_objects.len(),
                        r.missing_objects.len(),
                        r.damaged_packs.len(),
                        r.affected_snapshots.len(),
                        r.mismatched_snapshots.len()
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn cmd_log(
    repo: &Repository,
    json: bool,
    graph: bool,
    limit: Option<usize>,
) -> Result<(), CliError> {
    let mut snaps = repo.snapshots()?;
    snaps.reverse();
    if let Some(n) = limit {
        snaps.truncate(n);
    }
    // Counts only: `log` shows no bytes.
    let held = tine_sandbox::processes::held(repo.path(), false);
    if json {
        let mut doc = serde_json::to_value(&snaps).unwrap_or_default();
        for entry in doc.as_array_mut().into_iter().flatten() {
            let h = entry["id"]
                .as_str()
                .and_then(|h| held.get(h))
                .copied()
                .unwrap_or_default();
            entry["live_processes"] = json!(h.live);
            entry["persisted_processes"] = json!(h.persisted);
        }
        emit(true, doc, String::new);
        return Ok(());
    }
    let line = |s: &tine_store::SnapshotInfo| {
        let mut tags = if s.tags.is_empty() {
            String::new()
        } else {
            format!(" [{}]", s.tags.join(", "))
        };
        if let Some(h) = held.get(&s.id.to_hex()) {
            if h.live > 0 {
                tags += &format!(" (+{})", plural(h.live as u64, "live process"));
            } else if h.persisted > 0 {
                tags += &format!(" (+{} persisted)", plural(h.persisted as u64, "process"));
            }
        }
        format!(
            "{}  {}  {:>7}  {:>9}{tags}  {}",
            s.id.short(),
            time(s.time_ns),
            count(s.files),
            size(s.bytes),
            s.message
        )
    };
    let mut out = String::new();
    if snaps.is_empty() {
        eprintln!("no snapshots yet (take one with `tine snapshot`)");
        return Ok(());
    }
    if graph {
        use renderdag::{Ancestor, GraphRowRenderer, Renderer};
        let present: HashSet<ObjectId> = snaps.iter().map(|s| s.id).collect();
        let mut r = GraphRowRenderer::new()
            .output()
            .with_min_row_height(0)
            .build_box_drawing();
        for s in &snaps {
            let parents = s
                .parents
                .iter()
                .map(|p| {
                    if present.contains(p) {
                        Ancestor::Parent(*p)
                    } else {
                        Ancestor::Anonymous
                    }
                })
                .collect();
            out += &r.next_row(s.id, parents, "○".into(), line(s));
        }
    } else {
        for s in &snaps {
            out += &line(s);
            out.push('\n');
        }
    }
    emit(false, serde_json::Value::Null, || out);
    Ok(())
}
