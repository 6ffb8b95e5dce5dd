//! `tine bench sandbox`: snapshot, rollback and fork of a running sandbox over
//! workspace (c), measured through the real CLI, with the freeze-to-thaw window
//! each command reports; then the same with the workspace grown tenfold, and
//! with as many files changed by the sandbox itself (its upper layer holding
//! them: the change tracker must keep snapshots from reading them all again).

use std::fs;
use std::path::{Path, PathBuf};

use crate::BenchError;
use crate::{
    Report, Rng, Row, Tine, bench_dir, err, gen_c, ioe, logger, median, median_f64, ms, row, timed,
    which, write,
};

#[derive(clap::Args, Debug)]
pub struct SandboxArgs {
    /// Smaller workspaces (600 and 6,000 files) for a quick check.
    #[arg(long)]
    quick: bool,
    /// Repetitions for each median.
    #[arg(long, default_value_t = 15)]
    runs: usize,
    /// Where to generate workloads (default: a temporary directory, removed afterwards).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

/// Writes back what generating the workload (and materializing its base) left
/// dirty, so that the VM's writeback of it is not counted in the steps measured.
pub(crate) fn settle() {
    let _ = std::process::Command::new("sync").status();
}

pub(crate) fn json_of(out: &str) -> Result<serde_json::Value, BenchError> {
    serde_json::from_str(out).map_err(|e| err(format!("bench: bad JSON from tine: {e}: {out}")))
}

/// Medians of one workspace size: (snapshot frozen, snapshot CLI, rollback
/// frozen, rollback CLI, fork x16), all in ms.
struct Figures {
    snap_frozen: f64,
    snap_cli: f64,
    roll_frozen: f64,
    roll_cli: f64,
    fork16: f64,
}

/// One workspace to measure.
struct Setup {
    /// Files in the workspace the sandbox starts from.
    files: usize,
    /// Files the sandbox then writes itself, before the steps measured.
    churn: usize,
    forks: bool,
}

impl Setup {
    fn new(files: usize, churn: usize, forks: bool) -> Setup {
        Setup {
            files,
            churn,
            forks,
        }
    }
}

impl Figures {
    /// Each figure with its metric name, in table order.
    fn named(&self) -> [(&'static str, f64); 5] {
        [
            ("snapshot: freeze to thaw", self.snap_frozen),
            ("snapshot: whole CLI call", self.snap_cli),
            ("rollback one step: freeze to thaw", self.roll_frozen),
            ("rollback: whole CLI call", self.roll_cli),
            ("fork x16 into running sandboxes", self.fork16),
        ]
    }
}

fn measure(
    exe: &Path,
    root: &Path,
    setup: &Setup,
    runs: usize,
    log: &dyn Fn(&str),
) -> Result<Figures, BenchError> {
    let files = setup.files;
    let _ = fs::remove_dir_all(root);
    let work = root.join("work");
    let mut rng = Rng(0x5a4d_b0c5_1234_0001 ^ files as u64);
    log(&format!("generating a workspace of {files} files"));
    let paths = gen_c(&work, files, &mut rng)?;
    settle();
    let t = Tine {
        exe: exe.to_path_buf(),
        repo: root.join("repo"),
    };
    timed(&mut t.cmd(&["init"]))?;
    log("starting a sandbox over it");
    let (_, out) = timed(
        t.cmd(&["--json", "run", "--name", "bench", "--workspace"])
            .arg(&work)
            .args(["--", "sleep", "1000000"]),
    )?;
    let v = json_of(&out)?;
    let merged = PathBuf::from(v["workspace"].as_str().unwrap_or_default());
    settle();
    let result = (|| {
        // Files as the sandbox sees them, changed from the host through its overlay.
        let rel: Vec<PathBuf> = paths
            .iter()
            .filter_map(|p| p.strip_prefix(&work).ok().map(Path::to_path_buf))
            .collect();
        if setup.churn > 0 {
            log(&format!(
                "writing {} new files in the sandbox's workspace",
                setup.churn
            ));
            for i in 0..setup.churn {
                let d = merged.join(format!("new/d{:03}", i / 100));
                if i % 100 == 0 {
                    fs::create_dir_all(&d).map_err(ioe("create"))?;
                }
                write(&d.join(format!("f{i}")), &rng.text(64))?;
            }
            settle();
            // Reads them all once (the tracker's first snapshot reads everything).
            timed(&mut t.cmd(&["snapshot", "--sandbox", "bench", "--files-only"]))?;
        }
        log("snapshots, one file changed each");
        let (mut frozen, mut cli, mut ids) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..=runs {
            write(&merged.join(&rel[(i * 7919) % rel.len()]), &rng.text(4096))?;
            // Files only: this measures the workspace path (`bench proc` the processes).
            let (d, out) =
                timed(&mut t.cmd(&["--json", "snapshot", "--sandbox", "bench", "--files-only"]))?;
            let s = json_of(&out)?;
            ids.push(s["id"].as_str().unwrap_or_default().to_string());
            // The first one settles the upper layer's stat cache.
            if i > 0 {
                frozen.push(s["frozen_ms"].as_f64().unwrap_or(f64::NAN));
                cli.push(ms(d));
            }
        }
        log("rollbacks of one step");
        let (mut rf, mut rc) = (Vec::new(), Vec::new());
        for i in 0..runs {
            let id = &ids[ids.len() - 2 + (i % 2)];
            let (d, out) = timed(&mut t.cmd(&[
                "--json",
                "restore",
                id,
                "--sandbox",
                "bench",
                "--files-only",
            ]))?;
            let r = json_of(&out)?;
            rf.push(r["frozen_ms"].as_f64().unwrap_or(f64::NAN));
            rc.push(ms(d));
        }
        log("forks x16 into running sandboxes");
        settle();
        let last = ids.last().cloned().unwrap_or_default();
        let mut forks = Vec::new();
        let rounds = if setup.forks { 3.min(runs) } else { 0 };
        for k in 0..rounds {
            let (d, _) =
                timed(&mut t.cmd(&["fork", &last, "-n", "16", "--name", &format!("f{k}")]))?;
            forks.push(d);
            // Earlier rounds' forks keep running: removing them right before
            // would make this machine's ext4 (no journal) skip their freed
            // inodes for 30 s, and every new file of the next round scan past them.
            settle();
        }
        let med = median_f64;
        Ok(Figures {
            snap_frozen: med(frozen),
            snap_cli: med(cli),
            roll_frozen: med(rf),
            roll_cli: med(rc),
            fork16: if forks.is_empty() {
                f64::NAN
            } else {
                ms(median(forks))
            },
        })
    })();
    remove_all(&t);
    result
}

/// Fails with `what` when isolated sandboxes are not available here.
pub(crate) fn require_isolation(what: &str) -> Result<(), BenchError> {
    if let tine_sandbox::Isolation::None { reason } = tine_sandbox::manager::isolation_available() {
        return Err(BenchError::new(
            tine_store::ErrorKind::Unsupported,
            format!("{what}, which are not available here: {reason}"),
        ));
    }
    Ok(())
}

/// Removes every sandbox of the bench's repository, also after a failure half-way.
pub(crate) fn remove_all(t: &Tine) {
    if let Ok((_, out)) = timed(&mut t.cmd(&["--json", "ps", "--all"])) {
        for sb in json_of(&out)
            .ok()
            .as_ref()
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
        {
            if let Some(id) = sb["id"].as_str() {
                let _ = timed(&mut t.cmd(&["rm", "-f", id]));
            }
        }
    }
}

/// Median `podman commit` of a container whose image holds the workspace `work`,
/// one file changed before each, in podman storage of its own under `dir`.
fn podman_commit(
    work: &Path,
    dir: &Path,
    runs: usize,
    log: &dyn Fn(&str),
) -> Result<f64, BenchError> {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir).map_err(ioe("create"))?;
    let podman = |args: &[&str]| {
        let mut c = std::process::Command::new("podman");
        c.arg("--root")
            .arg(dir.join("root"))
            .arg("--runroot")
            .arg(dir.join("run"))
            .args(args);
        c
    };
    let out = |c: &mut std::process::Command| -> Result<String, BenchError> {
        let o = c.output().map_err(ioe("run podman"))?;
        if !o.status.success() {
            return Err(err(format!(
                "podman failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )));
        }
        Ok(String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    log("podman: importing the workspace as an image");
    let tar = dir.join("ws.tar");
    out(std::process::Command::new("tar")
        .arg("-C")
        .arg(work)
        .arg("-cf")
        .arg(&tar)
        .arg("."))?;
    let result = (|| {
        out(&mut podman(&[
            "import",
            "-q",
            tar.to_str().unwrap_or_default(),
            "tine-bench-ws",
        ]))?;
        let ctr = out(&mut podman(&[
            "create",
            "--runtime",
            "runc",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=4096:4096",
            "tine-bench-ws",
            "/true",
        ]))?;
        let merged = PathBuf::from(out(&mut podman(&["mount", &ctr]))?);
        let files: Vec<PathBuf> = walk_files(work);
        let mut rng = Rng(0x0d0d_cafe);
        log("podman: commits, one file changed each");
        let mut times = Vec::new();
        for i in 0..runs {
            let f = &files[(i * 7919) % files.len().max(1)];
            let rel = f.strip_prefix(work).unwrap_or(f);
            write(&merged.join(rel), &rng.text(4096))?;
            let (d, _) = timed(&mut podman(&[
                "commit",
                "-q",
                &ctr,
                &format!("tine-bench-{i}"),
            ]))?;
            times.push(ms(d));
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    })();
    let _ = podman(&["rm", "-a", "-f"]).output();
    let _ = podman(&["rmi", "-a", "-f"]).output();
    let _ = podman(&["system", "reset", "-f"]).output();
    let _ = fs::remove_dir_all(dir);
    result
}

/// Every regular file under `dir`.
fn walk_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => out.push(e.path()),
                _ => {}
            }
        }
    }
    out.sort();
    out
}

pub(crate) fn judged(workload: impl Into<String>, metric: &'static str, v: f64, limit: f64) -> Row {
    let mut r = row(workload, metric, v, "ms", format!("<= {limit} ms"));
    r.pass = Some(v <= limit);
    r
}

fn grown(workload: &'static str, metric: &'static str, small: f64, big: f64) -> Row {
    let mut r =
        row(workload, metric, big, "ms", "<= 1.5x").compared("same at 1x", small, big / small);
    r.pass = r.ratio.map(|x| x <= 1.5);
    r
}

pub fn run(args: &SandboxArgs, json: bool, tools: &crate::Tools) -> Result<(), BenchError> {
    let exe = tools.exe.clone();
    let runs = args.runs.max(2);
    let mut report = Report::new("sandbox", args.quick, runs);
    let log = logger(json);
    require_isolation("bench sandbox measures isolated sandboxes")?;
    let (base, _cleanup) = bench_dir(args.dir.as_ref(), "tine-bench-sandbox-", false)?;
    let (small, big) = if args.quick {
        (600, 6_000)
    } else {
        (6_000, 60_000)
    };
    let measure = |dir: &str, setup: Setup| measure(&exe, &base.join(dir), &setup, runs, &log);
    let one = measure("1x", Setup::new(small, 0, true))?;
    // The targets, in `Figures::named` order (none for the rollback CLI call).
    let limits = [Some(3.0), Some(10.0), Some(3.0), None, Some(200.0)];
    for ((metric, v), limit) in one.named().into_iter().zip(limits) {
        report.rows.push(match limit {
            Some(l) => judged("1x", metric, v, l),
            None => row("1x", metric, v, "ms", ""),
        });
    }
    let ten = measure("10x", Setup::new(big, 0, true))?;
    let churned = measure("churn", Setup::new(small, big - small, false))?;
    for (workload, grown_fig) in [("10x", &ten), ("10x changed", &churned)] {
        for ((metric, small), (_, big)) in one.named().into_iter().zip(grown_fig.named()) {
            // A setup without forks measured none.
            if !big.is_nan() {
                report.rows.push(grown(workload, metric, small, big));
            }
        }
    }
    report.notes.push(format!(
        "workspaces: 1x = {small} files (workload c), 10x = {big} files; 10x changed = 1x plus {} files the sandbox wrote itself (its upper layer holds them); one file changed per step",
        big - small
    ));
    if which("podman").is_none() {
        report
            .notes
            .push("podman is not installed: `podman commit` comparison skipped".into());
    } else {
        match podman_commit(
            &base.join("1x").join("work"),
            &base.join("podman"),
            runs,
            &log,
        ) {
            Ok(p) => {
                report.rows.push(
                    row(
                        "1x",
                        "snapshot CLI vs `podman commit`",
                        one.snap_cli,
                        "ms",
                        "",
                    )
                    .compared("podman commit", p, one.snap_cli / p),
                );
                report.notes.push(
                    "podman: a container (runc) created from an image of the same workspace, one file changed through its mount before each `podman commit`; it is not running, so podman pauses nothing".into(),
                );
            }
            Err(e) => report.notes.push(format!(
                "podman is installed but the comparison failed: {}",
                e.message
            )),
        }
    }
    report.finish(json);
    Ok(())
}
