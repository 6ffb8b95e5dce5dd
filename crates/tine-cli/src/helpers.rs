//! The processes tine starts for itself, hosted by the same binary: a
//! sandbox's init (`__sandbox-init`), a native fork's adopting init
//! (`__sandbox-adopt`), the furnishing of a fork's namespaces
//! (`__sandbox-furnish`), a sandbox's supervisor (`__supervise`) and the
//! daemon's exec helper (`__exec`). They are tine-sandbox's and
//! tine-engine's own processes, not commands: they bypass the CLI's parser,
//! take their spec as one JSON argument (or on stdin) and exit with a code.

use std::process::ExitCode;

use tine_engine::helpers::FirstRun;

/// Runs the helper named by the first argument, if it names one: its exit code.
pub fn run() -> Option<ExitCode> {
    let mut args = std::env::args_os().skip(1);
    match args.next() {
        Some(a) if a == "__sandbox-init" => Some(sandbox_init(args.next())),
        Some(a) if a == "__sandbox-furnish" => Some(sandbox_furnish(args.next())),
        Some(a) if a == "__sandbox-adopt" => Some(sandbox_adopt(args)),
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
            Some(internal_exit("exec", result))
        }
        Some(a) if a == "__supervise" => {
            let (repo, id) = (args.next(), args.next());
            let first_run = match args.next() {
                Some(a) if a == "--held" => FirstRun::Held,
                Some(a) if a == "--adopt" || a == "--prepared" => {
                    match args.next().and_then(|p| p.to_str()?.parse().ok()) {
                        Some(pid) if a == "--adopt" => FirstRun::Adopt(pid),
                        Some(pid) => FirstRun::Prepared(pid),
                        None => {
                            eprintln!("tine: __supervise {} needs a PID", a.to_string_lossy());
                            return Some(ExitCode::from(2));
                        }
                    }
                }
                _ => FirstRun::Start,
            };
            let code = supervise(repo, id, first_run);
            Some(ExitCode::from(code as u8))
        }
        _ => None,
    }
}

/// Marks every descriptor this process was given close-on-exec.
pub fn cloexec_inherited() {
    let _ = tine_engine::helpers::cloexec_inherited();
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
    // `-`: the spec in the memory file the spawner handed over (never on
    // the command line: it holds the sandbox's environment).
    let spec = match spec {
        Some(a) if a == "-" => tine_engine::helpers::read_init_spec().map_err(|e| e.to_string()),
        other => json_arg::<tine_engine::helpers::InitSpec>(other),
    };
    let result = spec.and_then(|s| tine_engine::helpers::run_init(&s).map_err(|e| e.to_string()));
    internal_exit("sandbox init", result)
}

/// `tine __sandbox-adopt [--held] MAIN [OTHER...]`: what the init of a
/// native fork executes (its command, and the other processes of its tree);
/// `--held` for a fork prepared ahead.
fn sandbox_adopt(args: impl Iterator<Item = std::ffi::OsString>) -> ExitCode {
    let mut args = args.peekable();
    let held = args.next_if(|a| a == "--held").is_some();
    let pids: Option<Vec<u32>> = args.map(|p| p.to_str()?.parse::<u32>().ok()).collect();
    let result = match pids.as_deref() {
        Some([main, others @ ..]) => {
            tine_engine::helpers::run_adopted(*main, others, held).map_err(|e| e.to_string())
        }
        _ => Err("no process given".to_string()),
    };
    internal_exit("sandbox init", result)
}

/// `tine __sandbox-furnish SPEC`: furnishes namespaces made by a nested
/// clone (a process of its own: it forks into their PID namespace).
fn sandbox_furnish(spec: Option<std::ffi::OsString>) -> ExitCode {
    let result = json_arg::<tine_engine::helpers::FurnishSpec>(spec).and_then(|s| {
        tine_engine::helpers::furnish_here(&s)
            .map(|()| 0)
            .map_err(|e| e.to_string())
    });
    internal_exit("sandbox furnish", result)
}

/// `tine __supervise REPO ID [--held | --adopt PID | --prepared PID]`: the supervisor process itself.
fn supervise(
    repo: Option<std::ffi::OsString>,
    id: Option<std::ffi::OsString>,
    first_run: FirstRun,
) -> i32 {
    let (Some(repo), Some(id)) = (repo, id) else {
        eprintln!("tine: __supervise needs REPO and ID");
        return 2;
    };
    let exe = match crate::output::tine_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("tine: supervisor: {}", e.message);
            return 1;
        }
    };
    let stdout = std::io::stdout();
    match tine_engine::helpers::supervise(
        std::path::Path::new(&repo),
        &id.to_string_lossy(),
        &exe,
        first_run,
        stdout.lock(),
    ) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("tine: supervisor: {e}");
            1
        }
    }
}
