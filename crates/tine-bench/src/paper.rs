//! `tine bench paper`: the paper's Table 1 workloads through every
//! mechanism installed here, in one run, side by side: a program holding
//! N MiB of memory (2 GiB; random bytes, so no mechanism gains by
//! compressing) and an N MiB change on disk, each snapshotted, its state
//! then lost, and restored. tine native (a sandbox's processes and files),
//! tine files (a directory), CRIU (`criu dump`/`restore` of the same
//! program outside any sandbox), Podman commit (the change in a
//! container's writable layer), Podman + CRIU (`podman container
//! checkpoint`/`restore`), gVisor (`runsc checkpoint`/`restore`) and
//! ProcessFork where installed. Each figure is the real command's whole
//! call; tine's also give how long the program was paused. A table, JSON,
//! and a chart (SVG and PNG).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::sandbox::{json_of, require_isolation};
use crate::{BenchError, Tine, bench_dir, err, ioe, logger, median_f64 as med, ms, timed, which};

#[derive(clap::Args, Debug)]
pub struct PaperArgs {
    /// Small workloads (64 MiB) and one run, to check that it all works.
    #[arg(long)]
    quick: bool,
    /// The workloads' size in MiB (default 2048; --quick: 64).
    #[arg(long, value_name = "MIB")]
    mib: Option<u64>,
    /// Snapshot/restore pairs per mechanism (the median is shown).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Write the chart here as paper.svg and paper.png.
    #[arg(long, value_name = "DIR")]
    chart: Option<PathBuf>,
    /// Where to run (default: a temporary directory, removed afterwards).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

/// The memory workload: fills `argv[1]` MiB with random bytes (a 1 MiB
/// block repeated, beyond any compressor's window), then writes its PID to
/// `argv[2]` and idles.
const HOLDER: &str = r#"
import os, sys, time
mib = int(sys.argv[1])
block = os.urandom(1 << 20)
buf = bytearray(mib << 20)
for i in range(mib):
    buf[i << 20:(i + 1) << 20] = block
tmp = sys.argv[2] + ".tmp"
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.rename(tmp, sys.argv[2])
while True:
    time.sleep(0.05)
"#;

/// One mechanism on one workload.
#[derive(Debug, Clone, Serialize)]
struct Cell {
    mechanism: &'static str,
    workload: &'static str,
    /// `ok`, `not installed`, `not applicable`, or what failed.
    status: String,
    snapshot_ms: Option<f64>,
    restore_ms: Option<f64>,
    /// How long the program did not run during the snapshot, where the
    /// mechanism tells (tine); else the whole snapshot.
    paused_ms: Option<f64>,
    storage_bytes: Option<u64>,
}

impl Cell {
    /// The medians of `got` (snapshot, restore, paused) and what it stored;
    /// `paused` where the mechanism tells how long the program was paused.
    fn measured(
        mechanism: &'static str,
        workload: &'static str,
        got: &[(f64, f64, f64)],
        paused: bool,
        stored: u64,
    ) -> Cell {
        let (s, r, p) = medians(got);
        Cell {
            snapshot_ms: Some(s),
            restore_ms: Some(r),
            paused_ms: paused.then_some(p),
            storage_bytes: Some(stored),
            ..Cell::new(mechanism, workload, "ok")
        }
    }

    fn new(mechanism: &'static str, workload: &'static str, status: impl Into<String>) -> Cell {
        Cell {
            mechanism,
            workload,
            status: status.into(),
            snapshot_ms: None,
            restore_ms: None,
            paused_ms: None,
            storage_bytes: None,
        }
    }
}

#[derive(Debug, Serialize)]
struct PaperReport {
    bench: &'static str,
    quick: bool,
    mib: u64,
    runs: usize,
    cpus: usize,
    kernel: String,
    cells: Vec<Cell>,
    notes: Vec<String>,
}

const MEMORY: &str = "memory";
const DISK: &str = "disk";

/// Bytes under `p` (files' lengths, links not followed).
fn bytes_under(p: &Path) -> u64 {
    let Ok(m) = fs::symlink_metadata(p) else {
        return 0;
    };
    if m.is_dir() {
        fs::read_dir(p)
            .map(|r| {
                r.filter_map(|e| e.ok())
                    .map(|e| bytes_under(&e.path()))
                    .sum()
            })
            .unwrap_or(0)
    } else if m.is_file() {
        m.len()
    } else {
        0
    }
}

fn wait_file(p: &Path, secs: u64) -> Result<String, BenchError> {
    let until = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Ok(s) = fs::read_to_string(p) {
            return Ok(s);
        }
        if Instant::now() > until {
            return Err(err(format!(
                "bench: {} did not appear in {secs} s",
                p.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The N MiB disk change: 16 files of random bytes under `dir`.
fn disk_change(dir: &Path, mib: u64) -> Result<(), BenchError> {
    fs::create_dir_all(dir).map_err(ioe("create the disk change"))?;
    let mut rng = crate::Rng(0xd15c_0c4a_2026);
    let per = (mib << 20) / 16;
    let mut block = vec![0u8; 1 << 20];
    for i in 0..16 {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(
            fs::File::create(dir.join(format!("blob-{i:02}")))
                .map_err(ioe("write the disk change"))?,
        );
        let mut left = per;
        while left > 0 {
            let n = left.min(block.len() as u64) as usize;
            rng.fill(&mut block[..n]);
            f.write_all(&block[..n])
                .map_err(ioe("write the disk change"))?;
            left -= n as u64;
        }
        f.flush().map_err(ioe("write the disk change"))?;
    }
    Ok(())
}

/// A small root for containers: the host's `/usr` is bound into it (Debian's
/// merged /usr: `bin`, `lib`, `lib64` are links into it).
fn mini_root(root: &Path) -> Result<(), BenchError> {
    for d in ["usr", "etc", "tmp", "proc", "dev", "sys", "data", "root"] {
        fs::create_dir_all(root.join(d)).map_err(ioe("make a container root"))?;
    }
    for l in ["bin", "lib", "lib64", "sbin"] {
        let _ = std::os::unix::fs::symlink(format!("usr/{l}"), root.join(l));
    }
    fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n")
        .map_err(ioe("make a container root"))?;
    Ok(())
}

fn out(c: &mut Command) -> Result<String, BenchError> {
    timed(c).map(|(_, s)| s.trim().to_string())
}

/// Medians of what `pairs` measured: (snapshot, restore, paused).
fn medians(v: &[(f64, f64, f64)]) -> (f64, f64, f64) {
    (
        med(v.iter().map(|x| x.0).collect()),
        med(v.iter().map(|x| x.1).collect()),
        med(v.iter().map(|x| x.2).collect()),
    )
}

fn tine_native(
    t: &Tine,
    base: &Path,
    mib: u64,
    runs: usize,
    disk: bool,
) -> Result<Cell, BenchError> {
    let work = base.join(if disk {
        "native-disk-ws"
    } else {
        "native-mem-ws"
    });
    fs::create_dir_all(&work).map_err(ioe("create"))?;
    let name = if disk { "paper-disk" } else { "paper-mem" };
    let size = if disk { 0 } else { mib };
    let (_, o) = timed(
        t.cmd(&["--json", "run", "--name", name, "--workspace"])
            .arg(&work)
            .args([
                "--",
                "python3",
                "-c",
                HOLDER,
                &size.to_string(),
                "/workspace/.ready",
            ]),
    )?;
    let v = json_of(&o)?;
    let merged = PathBuf::from(v["workspace"].as_str().unwrap_or_default());
    let result = (|| {
        wait_file(&merged.join(".ready"), 600)?;
        if disk {
            disk_change(&merged.join("change"), mib)?;
        }
        let before = bytes_under(&t.repo);
        let mut got = Vec::new();
        let mut stored = 0;
        for i in 0..runs {
            let (d, s) = timed(&mut t.cmd(&["--json", "snapshot", "--sandbox", name]))?;
            let s = json_of(&s)?;
            if i == 0 {
                stored = bytes_under(&t.repo).saturating_sub(before);
            }
            let id = s["id"].as_str().unwrap_or_default().to_string();
            if disk {
                // The state lost: the change removed.
                fs::remove_dir_all(merged.join("change")).map_err(ioe("remove the change"))?;
            }
            let (rd, r) = timed(&mut t.cmd(&["--json", "restore", &id, "--sandbox", name]))?;
            let r = json_of(&r)?;
            if r["processes"] != 1 {
                return Err(err(format!(
                    "bench: the rollback brought back no process: {r}"
                )));
            }
            if disk && bytes_under(&merged.join("change")) != (mib << 20) / 16 * 16 {
                return Err(err(
                    "bench: the rollback did not bring the disk change back",
                ));
            }
            got.push((ms(d), ms(rd), s["paused_ms"].as_f64().unwrap_or(f64::NAN)));
        }
        Ok(Cell::measured(
            "tine native",
            if disk { DISK } else { MEMORY },
            &got,
            true,
            stored,
        ))
    })();
    let _ = timed(&mut t.cmd(&["rm", "-f", name]));
    result
}

fn tine_files(t: &Tine, base: &Path, mib: u64, runs: usize) -> Result<Cell, BenchError> {
    let dir = base.join("files-ws");
    disk_change(&dir.join("change"), mib)?;
    let before = bytes_under(&t.repo);
    let mut got = Vec::new();
    let mut stored = 0;
    for i in 0..runs {
        let (d, s) = timed(t.cmd(&["--json", "snapshot"]).arg(&dir))?;
        if i == 0 {
            stored = bytes_under(&t.repo).saturating_sub(before);
        }
        let id = json_of(&s)?["id"].as_str().unwrap_or_default().to_string();
        fs::remove_dir_all(dir.join("change")).map_err(ioe("remove the change"))?;
        let (rd, _) = timed(t.cmd(&["--json", "restore", &id, "--to"]).arg(&dir))?;
        got.push((ms(d), ms(rd), ms(d)));
    }
    Ok(Cell::measured("tine files", DISK, &got, false, stored))
}

fn criu_plain(criu: &Path, base: &Path, mib: u64, runs: usize) -> Result<Cell, BenchError> {
    let ready = base.join("criu.ready");
    let log = fs::File::create(base.join("criu-holder.log")).map_err(ioe("create"))?;
    // Its own session, so that CRIU can take it as a whole.
    let mut child = Command::new("setsid")
        .args(["python3", "-c", HOLDER, &mib.to_string()])
        .arg(&ready)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().map_err(ioe("log"))?)
        .stderr(log)
        .spawn()
        .map_err(ioe("start the program"))?;
    let pid: String = wait_file(&ready, 600)?;
    let mut got = Vec::new();
    let mut stored = 0;
    let mut ours = Some(&mut child);
    let result = (|| {
        for _ in 0..runs {
            let images = base.join("criu-images");
            let _ = fs::remove_dir_all(&images);
            fs::create_dir_all(&images).map_err(ioe("create"))?;
            let (d, _) = timed(
                Command::new(criu)
                    .args(["dump", "-t", &pid, "--leave-running", "-D"])
                    .arg(&images),
            )?;
            stored = bytes_under(&images);
            // The state lost: the program killed (and reaped by init).
            let _ = Command::new("kill").args(["-9", &pid]).status();
            // Reaped: ours the first time; restored ones are init's.
            if let Some(c) = ours.take() {
                let _ = c.wait();
            }
            let proc_dir = PathBuf::from(format!("/proc/{pid}"));
            let until = Instant::now() + Duration::from_secs(10);
            while proc_dir.exists() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            let (rd, _) = timed(
                Command::new(criu)
                    .args(["restore", "-d", "-D"])
                    .arg(&images),
            )?;
            if !proc_dir.exists() {
                return Err(err("bench: CRIU's restore did not bring the program back"));
            }
            got.push((ms(d), ms(rd), ms(d)));
        }
        Ok(())
    })();
    let _ = Command::new("kill").args(["-9", pid.trim()]).status();
    let _ = child.try_wait();
    let _ = fs::remove_dir_all(base.join("criu-images"));
    result?;
    Ok(Cell::measured("CRIU", MEMORY, &got, false, stored))
}

/// Podman with storage of its own under `dir`, runc, the limits this
/// machine needs, and CRIU 4.1+ first in `PATH` (for checkpoints).
struct Podman {
    dir: PathBuf,
    criu_dir: Option<PathBuf>,
}

impl Podman {
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new("podman");
        c.arg("--root")
            .arg(self.dir.join("root"))
            .arg("--runroot")
            .arg(self.dir.join("run"))
            .args(["--runtime", "runc"])
            .args(args);
        if let Some(d) = &self.criu_dir {
            let path = std::env::var_os("PATH").unwrap_or_default();
            let mut all = vec![d.clone()];
            all.extend(std::env::split_paths(&path));
            c.env("PATH", std::env::join_paths(all).unwrap_or_default());
        }
        c
    }

    const LIMITS: [&'static str; 4] = [
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=4096:4096",
    ];

    fn setup(&self, base: &Path) -> Result<(), BenchError> {
        let root = base.join("mini-root");
        mini_root(&root)?;
        let tar = base.join("mini-root.tar");
        out(Command::new("tar")
            .arg("-C")
            .arg(&root)
            .arg("-cf")
            .arg(&tar)
            .arg("."))?;
        out(&mut self.cmd(&[
            "import",
            "-q",
            tar.to_str().unwrap_or_default(),
            "paper-mini",
        ]))?;
        Ok(())
    }

    fn cleanup(&self) {
        let _ = self.cmd(&["rm", "-a", "-f"]).output();
        let _ = self.cmd(&["rmi", "-a", "-f"]).output();
        let _ = self.cmd(&["system", "reset", "-f"]).output();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn podman_commit(pm: &Podman, mib: u64, runs: usize) -> Result<Cell, BenchError> {
    let mut got = Vec::new();
    let mut stored = 0;
    for i in 0..runs {
        let mut create = pm.cmd(&["create"]);
        create
            .args(Podman::LIMITS)
            .args(["-v", "/usr:/usr:ro", "paper-mini", "sleep", "1000"]);
        let ctr = out(&mut create)?;
        let merged = PathBuf::from(out(&mut pm.cmd(&["mount", &ctr]))?);
        disk_change(&merged.join("data/change"), mib)?;
        let before = bytes_under(&pm.dir.join("root"));
        let image = format!("paper-commit-{i}");
        let (d, _) = timed(&mut pm.cmd(&["commit", "-q", &ctr, &image]))?;
        stored = bytes_under(&pm.dir.join("root")).saturating_sub(before);
        // The state lost: the container gone; restored: one running from the commit.
        out(&mut pm.cmd(&["rm", "-f", &ctr]))?;
        let mut run = pm.cmd(&["run", "-d"]);
        run.args(Podman::LIMITS)
            .args(["-v", "/usr:/usr:ro", &image, "sleep", "1000"]);
        let (rd, ctr2) = timed(&mut run)?;
        out(&mut pm.cmd(&["rm", "-f", ctr2.trim()]))?;
        out(&mut pm.cmd(&["rmi", "-f", &image]))?;
        got.push((ms(d), ms(rd), ms(d)));
    }
    Ok(Cell::measured("Podman commit", DISK, &got, false, stored))
}

fn podman_checkpoint(
    pm: &Podman,
    base: &Path,
    mib: u64,
    runs: usize,
    disk: bool,
) -> Result<Cell, BenchError> {
    let ready_dir = base.join("pc-ready");
    let _ = fs::remove_dir_all(&ready_dir);
    fs::create_dir_all(&ready_dir).map_err(ioe("create"))?;
    let size = if disk { 0 } else { mib };
    let mut run = pm.cmd(&["run", "-d", "--name", "paper-pc"]);
    run.args(Podman::LIMITS)
        .args(["-v", "/usr:/usr:ro", "-v"])
        .arg(format!("{}:/ready", ready_dir.display()))
        .args([
            "paper-mini",
            "python3",
            "-c",
            HOLDER,
            &size.to_string(),
            "/ready/pid",
        ]);
    out(&mut run)?;
    let result = (|| {
        wait_file(&ready_dir.join("pid"), 600)?;
        if disk {
            let merged = PathBuf::from(out(&mut pm.cmd(&["mount", "paper-pc"]))?);
            disk_change(&merged.join("data/change"), mib)?;
        }
        let mut got = Vec::new();
        let mut stored = 0;
        for _ in 0..runs {
            let export = base.join("pc-export.tar");
            let _ = fs::remove_file(&export);
            // Exported uncompressed: its size is what the checkpoint holds.
            let (d, _) = timed(&mut pm.cmd(&[
                "container",
                "checkpoint",
                "paper-pc",
                "--compress",
                "none",
                "--export",
                export.to_str().unwrap_or_default(),
            ]))?;
            stored = fs::metadata(&export).map(|m| m.len()).unwrap_or(0);
            out(&mut pm.cmd(&["rm", "-f", "paper-pc"]))?;
            let (rd, _) = timed(&mut pm.cmd(&[
                "container",
                "restore",
                "--import",
                export.to_str().unwrap_or_default(),
            ]))?;
            let state =
                out(&mut pm.cmd(&["inspect", "--format", "{{.State.Status}}", "paper-pc"]))?;
            if state != "running" {
                return Err(err(format!(
                    "bench: podman's restore left the container {state}"
                )));
            }
            got.push((ms(d), ms(rd), ms(d)));
        }
        let _ = fs::remove_file(base.join("pc-export.tar"));
        Ok(Cell::measured(
            "Podman + CRIU",
            if disk { DISK } else { MEMORY },
            &got,
            false,
            stored,
        ))
    })();
    let _ = pm.cmd(&["rm", "-f", "paper-pc"]).output();
    result
}

fn runsc(base: &Path, mib: u64, runs: usize) -> Result<Cell, BenchError> {
    let bundle = base.join("runsc");
    let _ = fs::remove_dir_all(&bundle);
    let root = bundle.join("rootfs");
    mini_root(&root)?;
    let ready_dir = bundle.join("ready");
    fs::create_dir_all(&ready_dir).map_err(ioe("create"))?;
    let config = serde_json::json!({
        "ociVersion": "1.0.0",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["python3", "-c", HOLDER, mib.to_string(), "/ready/pid"],
            "env": ["PATH=/usr/bin:/bin"],
            "cwd": "/",
        },
        "root": {"path": "rootfs", "readonly": false},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
            {"destination": "/ready", "type": "bind", "source": ready_dir, "options": ["rbind", "rw"]},
        ],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}]},
    });
    fs::write(bundle.join("config.json"), config.to_string()).map_err(ioe("write config.json"))?;
    let state = bundle.join("state");
    let rs = |args: &[&str]| {
        let mut c = Command::new("runsc");
        c.args(["--ignore-cgroups", "--network", "none", "--root"])
            .arg(&state)
            .args(args);
        c
    };
    let b = bundle.to_str().unwrap_or_default().to_string();
    // Its sandbox keeps the descriptors it is given: a log file, not pipes
    // someone waits on.
    let logged = |mut c: Command| -> Result<Duration, BenchError> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(bundle.join("runsc.log"))
            .map_err(ioe("open runsc's log"))?;
        c.stdin(std::process::Stdio::null())
            .stdout(log.try_clone().map_err(ioe("log"))?)
            .stderr(log);
        let t0 = Instant::now();
        let st = c.status().map_err(ioe("run runsc"))?;
        let took = t0.elapsed();
        if !st.success() {
            let log = fs::read_to_string(bundle.join("runsc.log")).unwrap_or_default();
            let tail: String = log.lines().rev().take(3).collect::<Vec<_>>().join(" / ");
            return Err(err(format!(
                "runsc {:?} failed ({st}): {tail}",
                c.get_args().collect::<Vec<_>>()
            )));
        }
        Ok(took)
    };
    logged(rs(&["run", "--bundle", &b, "-detach", "paper"]))?;
    let result = (|| {
        wait_file(&ready_dir.join("pid"), 600)?;
        let mut got = Vec::new();
        let mut stored = 0;
        for _ in 0..runs {
            let images = bundle.join("images");
            let _ = fs::remove_dir_all(&images);
            fs::create_dir_all(&images).map_err(ioe("create"))?;
            let im = images.to_str().unwrap_or_default().to_string();
            let d = logged(rs(&["checkpoint", "--image-path", &im, "paper"]))?;
            stored = bytes_under(&images);
            let _ = logged(rs(&["delete", "-force", "paper"]));
            let rd = logged(rs(&[
                "restore",
                "--image-path",
                &im,
                "--bundle",
                &b,
                "-detach",
                "paper",
            ]))?;
            let st = out(&mut rs(&["state", "paper"]))?;
            if !st.contains("\"running\"") {
                return Err(err(format!("bench: runsc's restore left: {st}")));
            }
            got.push((ms(d), ms(rd), ms(d)));
        }
        Ok(Cell::measured("gVisor runsc", MEMORY, &got, false, stored))
    })();
    let _ = logged(rs(&["delete", "-force", "paper"]));
    let _ = fs::remove_dir_all(&bundle);
    result
}

/// A cell, or what stopped it.
fn cell(
    m: &'static str,
    w: &'static str,
    log: &dyn Fn(&str),
    f: impl FnOnce() -> Result<Cell, BenchError>,
) -> Cell {
    log(&format!("{m}: {w}"));
    f().unwrap_or_else(|e| Cell::new(m, w, format!("failed: {}", e.message)))
}

pub fn run(args: &PaperArgs, json: bool, tools: &crate::Tools) -> Result<(), BenchError> {
    require_isolation("bench paper runs programs in sandboxes and containers")?;
    let mib = args.mib.unwrap_or(if args.quick { 64 } else { 2048 });
    let runs = if args.quick { 1 } else { args.runs.max(1) };
    let log = logger(json);
    let (base, _cleanup) = bench_dir(args.dir.as_ref(), "tine-bench-paper-", false)?;
    let t = Tine {
        exe: tools.exe.clone(),
        repo: base.join("repo"),
    };
    timed(&mut t.cmd(&["init"]))?;
    let mut notes = vec![format!(
        "workloads: a Python program holding {mib} MiB of random bytes; {mib} MiB of new files (16 files). \
         Snapshot: the whole command; restore: after the state was lost (program killed, container removed, files deleted). \
         tine's paused: how long the program did not run. \
         Storage: what the snapshot added on disk; tine native's process state is a live copy-on-write template in memory, not on disk."
    )];
    let mut cells = Vec::new();
    cells.push(cell("tine native", MEMORY, &log, || {
        tine_native(&t, &base, mib, runs, false)
    }));
    cells.push(cell("tine native", DISK, &log, || {
        tine_native(&t, &base, mib, runs, true)
    }));
    // A repository of its own: the same bytes already stored would cost nothing.
    let tf = Tine {
        exe: tools.exe.clone(),
        repo: base.join("repo-files"),
    };
    timed(&mut tf.cmd(&["init"]))?;
    cells.push(cell("tine files", DISK, &log, || {
        tine_files(&tf, &base, mib, runs)
    }));
    let criu_ok = tools.criu.check().is_ok();
    cells.push(if criu_ok {
        cell("CRIU", MEMORY, &log, || {
            criu_plain(&tools.criu.bin, &base, mib, runs)
        })
    } else {
        Cell::new("CRIU", MEMORY, "not installed (scripts/install-criu.sh)")
    });
    cells.push(Cell::new(
        "CRIU",
        DISK,
        "not applicable: CRIU does not snapshot files",
    ));
    if which("podman").is_some() && which("runc").is_some() {
        let pm = Podman {
            dir: base.join("podman"),
            criu_dir: criu_ok
                .then(|| tools.criu.bin.parent().map(Path::to_path_buf))
                .flatten(),
        };
        match pm.setup(&base) {
            Ok(()) => {
                cells.push(Cell::new(
                    "Podman commit",
                    MEMORY,
                    "not applicable: a commit holds no process",
                ));
                cells.push(cell("Podman commit", DISK, &log, || {
                    podman_commit(&pm, mib, runs)
                }));
                if criu_ok {
                    cells.push(cell("Podman + CRIU", MEMORY, &log, || {
                        podman_checkpoint(&pm, &base, mib, runs, false)
                    }));
                    cells.push(cell("Podman + CRIU", DISK, &log, || {
                        podman_checkpoint(&pm, &base, mib, runs, true)
                    }));
                } else {
                    for w in [MEMORY, DISK] {
                        cells.push(Cell::new(
                            "Podman + CRIU",
                            w,
                            "not installed: needs CRIU 4.1 or later",
                        ));
                    }
                }
            }
            Err(e) => {
                for m in ["Podman commit", "Podman + CRIU"] {
                    for w in [MEMORY, DISK] {
                        cells.push(Cell::new(m, w, format!("failed: {}", e.message)));
                    }
                }
            }
        }
        pm.cleanup();
    } else {
        for m in ["Podman commit", "Podman + CRIU"] {
            for w in [MEMORY, DISK] {
                cells.push(Cell::new(m, w, "not installed (Debian's podman and runc)"));
            }
        }
    }
    if which("runsc").is_some() {
        cells.push(cell("gVisor runsc", MEMORY, &log, || {
            runsc(&base, mib, runs)
        }));
        notes.push(
            "gVisor compresses its checkpoint images; the memory is random, so it gains nothing"
                .into(),
        );
    } else {
        cells.push(Cell::new(
            "gVisor runsc",
            MEMORY,
            "not installed (Debian's runsc)",
        ));
    }
    cells.push(Cell::new(
        "gVisor runsc",
        DISK,
        "not measured: its files are the container's own root",
    ));
    for w in [MEMORY, DISK] {
        cells.push(Cell::new(
            "ProcessFork",
            w,
            if which("pf").is_some() {
                "not measured: ProcessFork snapshots directories (see tine bench fs)"
            } else {
                "not installed (cargo install processfork --locked)"
            },
        ));
    }
    let report = PaperReport {
        bench: "paper",
        quick: args.quick,
        mib,
        runs,
        cpus: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        kernel: fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string(),
        cells,
        notes,
    };
    if let Some(dir) = &args.chart {
        fs::create_dir_all(dir).map_err(ioe("create the chart's directory"))?;
        crate::chart::draw(&report_rows(&report), mib, dir)
            .map_err(|e| err(format!("bench: the chart: {e}")))?;
    }
    let failed = report
        .cells
        .iter()
        .filter(|c| c.status.starts_with("failed"))
        .count();
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
    } else {
        print_table(&report);
    }
    if failed > 0 {
        return Err(err(format!(
            "bench paper: {failed} mechanism(s) failed (see the table)"
        )));
    }
    Ok(())
}

/// What the chart shows of each measured cell.
fn report_rows(r: &PaperReport) -> Vec<crate::chart::Bar> {
    r.cells
        .iter()
        .filter_map(|c| {
            Some(crate::chart::Bar {
                label: format!("{} ({})", c.mechanism, c.workload),
                snapshot_s: c.snapshot_ms? / 1e3,
                restore_s: c.restore_ms? / 1e3,
                paused_s: c.paused_ms.map(|p| p / 1e3),
                stored_mib: c.storage_bytes.unwrap_or(0) as f64 / (1u64 << 20) as f64,
            })
        })
        .collect()
}

fn print_table(r: &PaperReport) {
    println!(
        "tine bench paper ({} cpus, kernel {}, {} MiB, median of {} runs{})",
        r.cpus,
        r.kernel,
        r.mib,
        r.runs,
        if r.quick { ", QUICK" } else { "" }
    );
    println!(
        "{:<16} {:<8} {:>12} {:>12} {:>12} {:>12}  status",
        "mechanism", "workload", "snapshot", "restore", "paused", "storage"
    );
    let f = |v: Option<f64>| v.map(|x| format!("{x:.1} ms")).unwrap_or_default();
    for c in &r.cells {
        println!(
            "{:<16} {:<8} {:>12} {:>12} {:>12} {:>12}  {}",
            c.mechanism,
            c.workload,
            f(c.snapshot_ms),
            f(c.restore_ms),
            f(c.paused_ms),
            c.storage_bytes
                .map(|b| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64))
                .unwrap_or_default(),
            c.status
        );
    }
    for n in &r.notes {
        println!("note: {n}");
    }
}
