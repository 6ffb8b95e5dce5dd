//! `tine bench api`: what the HTTP API adds to the library call, measured
//! end to end against a real `tine serve` on loopback, on the same sandbox,
//! alternating the two so that both see the same machine.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tine_engine::{CreateSandbox, Engine, ExecRequest, SnapshotRequest};

use crate::BenchError;
use crate::sandbox::{judged, require_isolation};
use crate::{Report, Rng, bench_dir, err, gen_c, logger, median_f64, row};

#[derive(clap::Args, Debug)]
pub struct ApiArgs {
    /// Fewer repetitions (a check that it runs; targets are not judged).
    #[arg(long)]
    quick: bool,
    /// Snapshots and rollbacks measured each way.
    #[arg(long, default_value_t = 40)]
    runs: usize,
    /// Sequential `exec` of `true` through the API.
    #[arg(long, default_value_t = 1000)]
    execs: usize,
}

/// The daemon under test, stopped when dropped.
struct Daemon {
    child: Child,
    url: String,
    token: String,
    agent: ureq::Agent,
}

impl Daemon {
    fn start(exe: &Path, repo: &Path) -> Result<Daemon, BenchError> {
        let mut child = Command::new(exe)
            .arg("--repo")
            .arg(repo)
            .args(["--json", "serve", "--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| err(format!("bench api: starting tine serve: {e}")))?;
        let mut line = String::new();
        let _ = BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line);
        let v: Value = serde_json::from_str(&line)
            .map_err(|_| err(format!("bench api: tine serve did not start: {line:?}")))?;
        let token = std::fs::read_to_string(v["token_file"].as_str().unwrap_or_default())
            .map_err(|e| err(format!("bench api: token file: {e}")))?;
        Ok(Daemon {
            child,
            url: v["url"].as_str().unwrap_or_default().to_string(),
            token: token.trim().to_string(),
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .build()
                .into(),
        })
    }

    /// POSTs `body`; the time from request to parsed answer.
    fn post(&self, path: &str, body: &Value) -> Result<(Duration, Value), BenchError> {
        let t0 = Instant::now();
        let mut resp = self
            .agent
            .post(format!("{}{path}", self.url))
            .header("Authorization", format!("Bearer {}", self.token))
            .send_json(body)
            .map_err(|e| err(format!("bench api: POST {path}: {e}")))?;
        let status = resp.status().as_u16();
        let v: Value = resp
            .body_mut()
            .read_json()
            .map_err(|e| err(format!("bench api: POST {path}: {e}")))?;
        let took = t0.elapsed();
        if status >= 300 {
            return Err(err(format!("bench api: POST {path}: {status} {v}")));
        }
        Ok((took, v))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(p) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(p, rustix::process::Signal::TERM);
        }
        let _ = self.child.wait();
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * p).round() as usize]
}

pub fn run(args: &ApiArgs, json: bool, tools: &crate::Tools) -> Result<(), BenchError> {
    require_isolation("bench api measures isolated sandboxes")?;
    let exe = tools.exe.clone();
    let log = logger(json);
    let (runs, execs) = if args.quick {
        (args.runs.min(5), args.execs.min(50))
    } else {
        (args.runs.max(3), args.execs.max(10))
    };
    let mut report = Report::new("api", args.quick, runs);
    let (base, _cleanup) = bench_dir(None, "tine-bench-api-", false)?;
    let src = base.join("src");
    gen_c(&src, 100, &mut Rng(7))?;
    let repo = base.join("repo");
    tine_store::Repository::init(&repo)?;
    let mut cfg = tine_engine::EngineConfig::new(repo.clone(), exe.clone());
    cfg.import_roots = vec![base.clone()];
    let engine = Engine::new(cfg);
    let sb = engine.create_sandbox(
        &CreateSandbox {
            name: Some("s".into()),
            directory: Some(src.clone()),
            ..Default::default()
        },
        &tine_engine::Ctx::QUIET,
    )?;
    let daemon = Daemon::start(&exe, &repo)?;
    let result = measure(&engine, &daemon, &sb.id, runs, execs, &log);
    drop(daemon);
    let _ = engine.remove_sandbox(&sb.id, true);
    let m = result?;
    let small = "small sandbox (100 files, sleep)";
    let lib_snap = median_f64(m.lib_snap.clone());
    let api_snap = median_f64(m.api_snap.clone());
    let lib_rest = median_f64(m.lib_restore.clone());
    let api_rest = median_f64(m.api_restore.clone());
    let figures: [(&'static str, f64, Option<f64>); 9] = [
        ("snapshot, library call (median)", lib_snap, None),
        ("snapshot, through the API (median)", api_snap, None),
        (
            "snapshot: API overhead (median)",
            api_snap - lib_snap,
            Some(2.0),
        ),
        ("rollback, library call (median)", lib_rest, None),
        ("rollback, through the API (median)", api_rest, None),
        (
            "rollback: API overhead (median)",
            api_rest - lib_rest,
            Some(2.0),
        ),
        (
            "exec `true`, library call (p50)",
            percentile(&m.lib_exec, 0.5),
            None,
        ),
        (
            "exec `true`, through the API (p50)",
            percentile(&m.api_exec, 0.5),
            None,
        ),
        (
            "exec `true`, through the API (p99)",
            percentile(&m.api_exec, 0.99),
            None,
        ),
    ];
    for (metric, v, limit) in figures {
        report.rows.push(match limit {
            Some(l) => judged(small, metric, v, l),
            None => row(small, metric, v, "ms", ""),
        });
    }
    report.notes.push(format!(
        "{runs} snapshots and {runs} rollbacks each way, library and API alternating on the same sandbox (one file written before each snapshot; each rollback goes back to a snapshot one file away); {execs} sequential execs of `true` through the API, {} through the library; the API times run from the request to the parsed answer, over loopback with a bearer token",
        m.lib_exec.len()
    ));
    report.finish(json);
    Ok(())
}

struct Measured {
    lib_snap: Vec<f64>,
    api_snap: Vec<f64>,
    lib_restore: Vec<f64>,
    api_restore: Vec<f64>,
    lib_exec: Vec<f64>,
    api_exec: Vec<f64>,
}

fn measure(
    engine: &Engine,
    daemon: &Daemon,
    sb: &str,
    runs: usize,
    execs: usize,
    log: &dyn Fn(&str),
) -> Result<Measured, BenchError> {
    let mut m = Measured {
        lib_snap: vec![],
        api_snap: vec![],
        lib_restore: vec![],
        api_restore: vec![],
        lib_exec: vec![],
        api_exec: vec![],
    };
    log(&format!(
        "snapshot: {runs} library calls and {runs} API calls"
    ));
    let mut snaps = Vec::new();
    for i in 0..runs * 2 {
        engine.write_file(
            sb,
            "/workspace/step.txt",
            &mut format!("{i}\n").as_bytes(),
            None,
        )?;
        if i % 2 == 0 {
            let t0 = Instant::now();
            let out = engine.snapshot_sandbox(
                sb,
                &SnapshotRequest::default(),
                &tine_engine::Ctx::QUIET,
            )?;
            m.lib_snap.push(ms(t0.elapsed()));
            snaps.push(out.outcome.id.to_hex());
        } else {
            let (d, v) = daemon.post(&format!("/v1/sandboxes/{sb}/snapshot"), &json!({}))?;
            m.api_snap.push(ms(d));
            snaps.push(v["id"].as_str().unwrap_or_default().to_string());
        }
    }
    log(&format!(
        "rollback: {runs} library calls and {runs} API calls"
    ));
    for i in 0..runs * 2 {
        // Back and forth between two snapshots one file apart.
        let target = &snaps[i % 2];
        if i % 2 == 0 {
            let t0 = Instant::now();
            engine.restore_sandbox(sb, target, false, &tine_engine::Ctx::QUIET)?;
            m.lib_restore.push(ms(t0.elapsed()));
        } else {
            let (d, _) = daemon.post(
                &format!("/v1/sandboxes/{sb}/restore"),
                &json!({"snapshot": target}),
            )?;
            m.api_restore.push(ms(d));
        }
    }
    log(&format!("exec: {execs} sequential `true` through the API"));
    let body = json!({"command": ["true"]});
    for _ in 0..execs {
        let (d, v) = daemon.post(&format!("/v1/sandboxes/{sb}/exec"), &body)?;
        if v["exit_code"] != 0 {
            return Err(err(format!("bench api: exec true: {v}")));
        }
        m.api_exec.push(ms(d));
    }
    let req = ExecRequest {
        command: vec!["true".into()],
        ..Default::default()
    };
    for _ in 0..(execs / 10).max(5) {
        let t0 = Instant::now();
        engine.exec(sb, &req, &mut |_, _| true)?;
        m.lib_exec.push(ms(t0.elapsed()));
    }
    Ok(m)
}
