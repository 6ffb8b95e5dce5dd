//! `tine bench`: end-to-end measurements against the targets, printed as a table
//! and as JSON. Every figure times the real `tine` binary as a user runs it.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use tine_store::ErrorKind;

use crate::output::{CliError, size};

#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// Directory snapshots: (a) 10,000 x 4 KiB files, (b) one 1 GiB random file,
    /// (c) a source-tree-like workspace (~6,000 files, ~60 MB); ProcessFork side by side if installed.
    Fs(FsArgs),
    /// Live sandboxes (root only): snapshot, rollback and fork x16 of a running
    /// sandbox over workspace (c), and again with the workspace grown tenfold.
    Sandbox(crate::bench_sandbox::SandboxArgs),
    /// Running processes (root only): checkpoint and rollback of a program
    /// holding 0, 566 MB, 1 and 2 GiB, with huge pages and with 4 KiB pages,
    /// in a sandbox over workspace (c); fork x64 of one template; CRIU side by
    /// side when installed.
    Proc(crate::bench_proc::ProcArgs),
    /// The HTTP API (root only): what `tine serve` adds to the library call
    /// for snapshot and rollback of a small sandbox; sequential `exec` of
    /// `true` through the API, p50 and p99.
    Api(crate::bench_api::ApiArgs),
    /// Remotes: push and pull of workspace (c) and of a 1 GiB random file
    /// through a local SeaweedFS (S3) and a directory, in MB/s; the share of
    /// the first push that a second one sends after a one-file change.
    Remote(crate::bench_remote::RemoteArgs),
}

#[derive(clap::Args, Debug)]
pub struct FsArgs {
    /// Smaller workloads (a: 1,000 files, b: 64 MiB, c: 600 files) for a quick check.
    #[arg(long)]
    quick: bool,
    /// Where to generate workloads (default: a temporary directory, removed afterwards).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Repetitions for each median.
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Do not run peers (ProcessFork `pf`) even when installed.
    #[arg(long)]
    no_peers: bool,
    /// Keep the generated workloads and repositories (for inspection).
    #[arg(long)]
    keep: bool,
    /// Only these workloads (comma-separated: a,b,c).
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<String>>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Row {
    pub(crate) workload: String,
    pub(crate) metric: &'static str,
    pub(crate) tine: f64,
    pub(crate) unit: &'static str,
    /// What tine is compared with (the floor or a peer).
    pub(crate) against: Option<String>,
    pub(crate) against_value: Option<f64>,
    /// tine / against for times (lower is better), or against / tine for peer speedups.
    pub(crate) ratio: Option<f64>,
    pub(crate) target: String,
    pub(crate) pass: Option<bool>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub(crate) bench: &'static str,
    pub(crate) quick: bool,
    pub(crate) runs: usize,
    pub(crate) cpus: usize,
    pub(crate) kernel: String,
    pub(crate) peers: Vec<String>,
    pub(crate) rows: Vec<Row>,
    pub(crate) notes: Vec<String>,
}

impl Report {
    pub(crate) fn new(bench: &'static str, quick: bool, runs: usize) -> Report {
        Report {
            bench,
            quick,
            runs,
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            kernel: fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_string(),
            peers: Vec::new(),
            rows: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Prints the report (a table, or JSON). Quick runs judge nothing: the targets
    /// are defined on the full workloads; small ones only check that it all runs.
    pub(crate) fn finish(mut self, json: bool) {
        if self.quick {
            for r in &mut self.rows {
                r.pass = None;
            }
            self.notes
                .push("quick workloads: targets are not judged (run without --quick)".into());
        }
        if json {
            println!(
                "{}",
                serde_json::to_string_pretty(&self).unwrap_or_default()
            );
        } else {
            print_table(&self);
        }
    }
}

/// Where a bench generates its workloads: `dir`, or a temporary directory that
/// is removed when the returned guard drops (unless `keep`).
pub(crate) fn bench_dir(
    dir: Option<&PathBuf>,
    prefix: &str,
    keep: bool,
) -> Result<(PathBuf, Option<tempfile::TempDir>), CliError> {
    if let Some(d) = dir {
        fs::create_dir_all(d).map_err(ioe("create bench directory"))?;
        return Ok((d.clone(), None));
    }
    let t = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(std::env::temp_dir())
        .map_err(ioe("create bench directory"))?;
    Ok(if keep {
        (t.keep(), None)
    } else {
        (t.path().to_path_buf(), Some(t))
    })
}

pub(crate) fn err(msg: impl Into<String>) -> CliError {
    CliError::new(ErrorKind::Internal, msg)
}

pub(crate) fn ioe(what: &str) -> impl FnOnce(std::io::Error) -> CliError + '_ {
    move |e| CliError::new(ErrorKind::Io, format!("bench: {what}: {e}"))
}

/// Deterministic fast pseudo-random bytes (xorshift64*), so runs are comparable.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Source-code-like text (compressible, like real workspaces).
    pub(crate) fn text(&mut self, len: usize) -> Vec<u8> {
        const WORDS: [&str; 16] = [
            "fn", "let", "self", "return", "match", "value", "struct", "impl", "pub", "use", "for",
            "in", "if", "else", "Some", "None",
        ];
        let mut v = Vec::with_capacity(len + 16);
        while v.len() < len {
            let w = WORDS[self.below(16) as usize];
            v.extend_from_slice(w.as_bytes());
            v.push(if self.below(8) == 0 { b'\n' } else { b' ' });
            if self.below(5) == 0 {
                v.extend_from_slice(format!("{}", self.below(100000)).as_bytes());
                v.push(b' ');
            }
        }
        v.truncate(len);
        v
    }
}

pub(crate) fn write(path: &Path, data: &[u8]) -> Result<(), CliError> {
    if let Some(p) = path.parent() {
        fs::create_dir_all(p).map_err(ioe("create directory"))?;
    }
    fs::write(path, data).map_err(ioe("write workload"))
}

fn gen_a(root: &Path, files: usize, rng: &mut Rng) -> Result<Vec<PathBuf>, CliError> {
    let dirs = 100.min(files);
    let mut out = Vec::new();
    for i in 0..files {
        let p = root.join(format!("d{:03}/f{:05}.txt", i % dirs, i));
        write(&p, &rng.text(4096))?;
        out.push(p);
    }
    Ok(out)
}

pub(crate) fn gen_b(path: &Path, bytes: u64, rng: &mut Rng) -> Result<(), CliError> {
    if let Some(p) = path.parent() {
        fs::create_dir_all(p).map_err(ioe("create directory"))?;
    }
    let mut f = std::io::BufWriter::new(fs::File::create(path).map_err(ioe("create workload"))?);
    let mut buf = vec![0u8; 8 << 20];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        rng.fill(&mut buf[..n]);
        f.write_all(&buf[..n]).map_err(ioe("write workload"))?;
        left -= n as u64;
    }
    f.flush().map_err(ioe("write workload"))
}

/// A source-tree-like workspace: nested packages, mostly small text files, a few larger binaries.
pub(crate) fn gen_c(root: &Path, files: usize, rng: &mut Rng) -> Result<Vec<PathBuf>, CliError> {
    let mut out = Vec::new();
    for i in 0..files {
        let dir = format!("pkg{:02}/mod{}/sub{}", i % 20, (i / 20) % 8, (i / 160) % 4);
        let roll = rng.below(100);
        let (name, data) = if roll < 70 {
            {
                let n = 1024 + rng.below(7 * 1024) as usize;
                (format!("src_{i}.rs"), rng.text(n))
            }
        } else if roll < 97 {
            {
                let n = 8 * 1024 + rng.below(16 * 1024) as usize;
                (format!("doc_{i}.md"), rng.text(n))
            }
        } else {
            let mut b = vec![0u8; 40 * 1024 + rng.below(80 * 1024) as usize];
            rng.fill(&mut b);
            (format!("asset_{i}.bin"), b)
        };
        let p = root.join(dir).join(name);
        write(&p, &data)?;
        out.push(p);
    }
    Ok(out)
}

/// The median of figures (NaN for none).
pub(crate) fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Progress lines on stderr, unless the output is JSON.
pub(crate) fn logger(json: bool) -> impl Fn(&str) {
    move |s: &str| {
        if !json {
            eprintln!("tine bench: {s}");
        }
    }
}

pub(crate) fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Runs a command, fails the bench if it fails, and returns (wall time, stdout).
pub(crate) fn timed(cmd: &mut Command) -> Result<(Duration, String), CliError> {
    cmd.stdin(Stdio::null())
        .stderr(Stdio::piped())
        .stdout(Stdio::piped());
    let t0 = Instant::now();
    let out = cmd.output().map_err(ioe("run command"))?;
    let took = t0.elapsed();
    if !out.status.success() {
        // With --json, tine reports its error on stdout.
        return Err(err(format!(
            "bench: {cmd:?} failed ({}): {} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        )));
    }
    Ok((took, String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// The repository's size without its disposable stat caches (`cache/`), which
/// can be deleted at any time at the cost of one full re-read.
fn store_bytes(repo: &Path) -> u64 {
    dir_bytes(repo) - dir_bytes(&repo.join("cache"))
}

fn dir_bytes(p: &Path) -> u64 {
    let mut n = 0;
    if let Ok(rd) = fs::read_dir(p) {
        for e in rd.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => n += dir_bytes(&e.path()),
                Ok(m) => n += m.len(),
                Err(_) => {}
            }
        }
    }
    n
}

pub(crate) struct Tine {
    pub(crate) exe: PathBuf,
    pub(crate) repo: PathBuf,
}

impl Tine {
    pub(crate) fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.exe);
        c.arg("--repo")
            .arg(&self.repo)
            .args(args)
            .env_remove("TINE_REPO");
        c
    }
    fn snapshot(&self, dir: &Path) -> Result<(Duration, serde_json::Value), CliError> {
        let (d, out) = timed(self.cmd(&["--json", "snapshot", "-m", "bench"]).arg(dir))?;
        Ok((
            d,
            serde_json::from_str(&out)
                .map_err(|e| err(format!("bench: bad JSON from tine: {e}")))?,
        ))
    }
}

/// The lstat floor: `find DIR -printf '%s %T@\n'`, warm, median of `runs`.
fn floor(dir: &Path, runs: usize) -> Result<Duration, CliError> {
    let mut v = Vec::new();
    for i in 0..=runs {
        let (d, _) = timed(Command::new("find").arg(dir).args(["-printf", "%s %T@\n"]))?;
        if i > 0 {
            v.push(d);
        }
    }
    Ok(median(v))
}

/// ProcessFork's `pf`, when installed.
struct Pf {
    exe: PathBuf,
}

pub(crate) fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(name))
            .find(|p| p.is_file())
    })
}

impl Pf {
    /// `pf --store STORE ARGS...`; its store lives outside the captured directory, like tine's.
    fn cmd(&self, store: &Path, args: &[&str]) -> Command {
        let mut c = Command::new(&self.exe);
        c.arg("--store").arg(store).args(args);
        c
    }

    /// Snapshots `dir`; returns the time and the image id pf prints.
    fn snapshot(&self, store: &Path, dir: &Path) -> Result<(Duration, String), CliError> {
        let (d, out) = timed(self.cmd(store, &["snapshot", "--fs-root"]).arg(dir))?;
        let cid = out
            .split_whitespace()
            .find(|w| w.starts_with("sha256:"))
            .unwrap_or_default()
            .to_string();
        Ok((d, cid))
    }
}

pub(crate) fn row(
    workload: impl Into<String>,
    metric: &'static str,
    tine: f64,
    unit: &'static str,
    target: impl Into<String>,
) -> Row {
    Row {
        workload: workload.into(),
        metric,
        tine,
        unit,
        against: None,
        against_value: None,
        ratio: None,
        target: target.into(),
        pass: None,
    }
}

pub fn run(which_bench: &BenchCommand, json: bool) -> Result<(), CliError> {
    let args = match which_bench {
        BenchCommand::Fs(a) => a,
        BenchCommand::Sandbox(a) => return crate::bench_sandbox::run(a, json),
        BenchCommand::Proc(a) => return crate::bench_proc::run(a, json),
        BenchCommand::Api(a) => return crate::bench_api::run(a, json),
        BenchCommand::Remote(a) => return crate::bench_remote::run(a, json),
    };
    let exe = crate::output::tine_exe()?;
    let (base, _cleanup) = bench_dir(args.dir.as_ref(), "tine-bench-", args.keep)?;
    if args.keep && !json {
        eprintln!(
            "tine bench: keeping workloads and repositories in {}",
            base.display()
        );
    }
    let runs = args.runs.max(1);
    let want = |w: &str| args.only.as_ref().is_none_or(|o| o.iter().any(|x| x == w));
    let pf = if args.no_peers {
        None
    } else {
        which("pf").map(|exe| Pf { exe })
    };
    let mut report = Report::new("fs", args.quick, runs);
    report.peers = pf
        .iter()
        .map(|p| format!("ProcessFork pf ({})", p.exe.display()))
        .collect();
    if pf.is_none() {
        let msg = if args.no_peers {
            "peers skipped (--no-peers)"
        } else {
            "ProcessFork (pf) is not installed: skipped (cargo install processfork --locked)"
        };
        report.notes.push(msg.into());
        if !json {
            eprintln!("tine bench: {msg}");
        }
    }
    let log = |s: &str| {
        if !json {
            eprintln!("tine bench: {s}");
        }
    };
    let (na, nb, nc) = if args.quick {
        (1_000, 64u64 << 20, 600)
    } else {
        (10_000, 1u64 << 30, 6_000)
    };
    let mut rng = Rng(0x7ee5_1234_5678_9abc);

    for (w, name) in [("a", "a: 10k x 4 KiB"), ("c", "c: source tree")] {
        if !want(w) {
            continue;
        }
        let root = base.join(w);
        let work = root.join("work");
        let _ = fs::remove_dir_all(&root);
        log(&format!("generating workload {name}"));
        let files = if w == "a" {
            gen_a(&work, na, &mut rng)?
        } else {
            gen_c(&work, nc, &mut rng)?
        };
        let t = Tine {
            exe: exe.clone(),
            repo: root.join("repo"),
        };
        timed(&mut t.cmd(&["init"]))?;
        log(&format!("{name}: first snapshot"));
        let (first, s0) = t.snapshot(&work)?;
        let mut r = row(
            w,
            "first snapshot",
            ms(first),
            "ms",
            if w == "a" { "<= 1000 ms" } else { "" },
        );
        if w == "a" {
            r.pass = Some(ms(first) <= 1000.0);
        }
        let work_bytes = s0["stats"]["bytes"].as_u64().unwrap_or(0);
        report.rows.push(r);
        let store_first = store_bytes(&t.repo);
        report.rows.push(row(
            w,
            "store after first snapshot",
            store_first as f64 / 1e6,
            "MB",
            format!("workload {}", size(work_bytes)),
        ));
        // Snapshots write fast packs; gc recompresses them dense, off the critical path.
        log(&format!("{name}: gc (compaction)"));
        let (gc_time, _) = timed(&mut t.cmd(&["gc"]))?;
        report
            .rows
            .push(row(w, "gc: compaction time", ms(gc_time), "ms", ""));
        let store_gc = store_bytes(&t.repo);
        report.rows.push(row(
            w,
            "store after gc (at rest)",
            store_gc as f64 / 1e6,
            "MB",
            format!(
                "{:.1} % smaller",
                (1.0 - store_gc as f64 / store_first.max(1) as f64) * 100.0
            ),
        ));
        // One untimed round settles files that were too fresh for the stat cache.
        let mut edit = |i: usize| write(&files[(i * 7919) % files.len()], &rng.text(4096));
        edit(0)?;
        let (_, settled) = t.snapshot(&work)?;
        let fl = floor(&work, runs)?;
        let mut incs = Vec::new();
        let mut ids = vec![settled["id"].as_str().unwrap_or_default().to_string()];
        log(&format!("{name}: incremental snapshots"));
        for i in 1..=runs {
            edit(i)?;
            let (d, s) = t.snapshot(&work)?;
            incs.push(d);
            ids.push(s["id"].as_str().unwrap_or_default().to_string());
        }
        let inc = median(incs);
        report.rows.push(floor_row(
            w,
            "incremental snapshot (1 file changed)",
            inc,
            fl,
        ));
        log(&format!("{name}: differential restores"));
        let mut rests = Vec::new();
        for i in 0..runs {
            // Alternate between the last two snapshots: one file differs each time.
            let id = &ids[ids.len() - 2 + (i % 2)];
            let (d, _) = timed(t.cmd(&["restore", id, "--to"]).arg(&work))?;
            rests.push(d);
        }
        let rest = median(rests);
        report
            .rows
            .push(floor_row(w, "differential restore (1 file)", rest, fl));
        let store = store_bytes(&t.repo);
        report.rows.push(row(
            w,
            "store after all snapshots",
            store as f64 / 1e6,
            "MB",
            format!("{} snapshots", runs + 2),
        ));
        report.rows.push(row(
            w,
            "stat cache (disposable, not counted)",
            dir_bytes(&t.repo.join("cache")) as f64 / 1e6,
            "MB",
            "",
        ));
        if w == "c" {
            log(&format!("{name}: 12 forks"));
            let before = store_bytes(&t.repo);
            let forks = root.join("forks");
            let last = ids.last().cloned().unwrap_or_default();
            let (d, _) = timed(t.cmd(&["fork", &last, "-n", "12", "--into"]).arg(&forks))?;
            let after = store_bytes(&t.repo);
            let growth = (after.saturating_sub(before)) as f64 / before.max(1) as f64 * 100.0;
            let mut r = row(w, "12 forks: store growth", growth, "%", "<= 1 %");
            r.pass = Some(growth <= 1.0);
            report.rows.push(r);
            report.rows.push(row(w, "12 forks: time", ms(d), "ms", ""));
            let _ = fs::remove_dir_all(&forks);
        }
        if let Some(pf) = &pf {
            log(&format!("{name}: ProcessFork side by side"));
            pf_compare(
                pf,
                &mut report,
                w,
                &work,
                &files,
                first,
                gc_time,
                inc,
                rest,
                (store_first, store_gc),
                runs,
                &mut rng,
            )?;
        }
        if !args.keep {
            let _ = fs::remove_dir_all(&root);
        }
    }

    if want("b") {
        let root = base.join("b");
        let _ = fs::remove_dir_all(&root);
        let work = root.join("work");
        log(&format!(
            "generating workload b: one {} random file",
            size(nb)
        ));
        let file = work.join("big.bin");
        gen_b(&file, nb, &mut rng)?;
        let t = Tine {
            exe: exe.clone(),
            repo: root.join("repo"),
        };
        timed(&mut t.cmd(&["init"]))?;
        log("b: first snapshot");
        let (first, _) = t.snapshot(&work)?;
        let mbps = nb as f64 / 1e6 / first.as_secs_f64();
        let mut r = row(
            "b",
            "first snapshot throughput",
            mbps,
            "MB/s",
            ">= 400 MB/s",
        );
        r.pass = Some(mbps >= 400.0);
        report.rows.push(r);
        report
            .rows
            .push(row("b", "first snapshot", ms(first), "ms", ""));
        let before = store_bytes(&t.repo);
        {
            use std::os::unix::fs::FileExt;
            let f = fs::OpenOptions::new()
                .write(true)
                .open(&file)
                .map_err(ioe("open workload"))?;
            let mut buf = vec![0u8; 1 << 20];
            rng.fill(&mut buf);
            f.write_all_at(&buf, nb / 2)
                .map_err(ioe("write workload"))?;
        }
        let (d, _) = t.snapshot(&work)?;
        let added = store_bytes(&t.repo).saturating_sub(before);
        let mut r = row(
            "b",
            "1 MiB overwrite: store growth",
            added as f64 / (1 << 20) as f64,
            "MiB",
            "<= 4 MiB",
        );
        r.pass = Some(added <= 4 << 20);
        report.rows.push(r);
        report
            .rows
            .push(row("b", "1 MiB overwrite: snapshot", ms(d), "ms", ""));
        if let Some(pf) = &pf {
            log("b: ProcessFork side by side");
            let pfstore = root.join("pfstore");
            let (pfirst, _) = pf.snapshot(&pfstore, &work)?;
            let mut r = row("b", "first snapshot vs pf", ms(first), "ms", ">= 5x faster").compared(
                "pf",
                ms(pfirst),
                ms(pfirst) / ms(first),
            );
            r.pass = r.ratio.map(|x| x >= 5.0);
            report.rows.push(r);
            let _ = fs::remove_dir_all(&pfstore);
        }
        if !args.keep {
            let _ = fs::remove_dir_all(&root);
        }
    }

    report.finish(json);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn pf_compare(
    pf: &Pf,
    report: &mut Report,
    w: &'static str,
    work: &Path,
    files: &[PathBuf],
    t_first: Duration,
    t_gc: Duration,
    t_inc: Duration,
    t_rest: Duration,
    (t_store, t_store_gc): (u64, u64),
    runs: usize,
    rng: &mut Rng,
) -> Result<(), CliError> {
    let store = work.with_file_name("pfstore");
    let _ = fs::remove_dir_all(&store);
    let (first, _) = pf.snapshot(&store, work)?;
    let pstore = dir_bytes(&store);
    let mut incs = Vec::new();
    let mut cid = String::new();
    for i in 0..runs.min(3) {
        write(&files[(i * 104729 + 13) % files.len()], &rng.text(4096))?;
        let (d, c) = pf.snapshot(&store, work)?;
        incs.push(d);
        cid = c;
    }
    // pf restores only into a new directory (`checkout --into` must not exist).
    let mut rests = Vec::new();
    for i in 0..runs.min(3) {
        let into = work.with_file_name(format!("pfcheckout{i}"));
        let _ = fs::remove_dir_all(&into);
        let (d, _) = timed(pf.cmd(&store, &["checkout", &cid, "--into"]).arg(&into))?;
        rests.push(d);
        let _ = fs::remove_dir_all(&into);
    }
    for (metric, tine, peer) in [
        ("first snapshot vs pf", t_first, first),
        ("first snapshot + gc vs pf", t_first + t_gc, first),
        ("incremental snapshot vs pf", t_inc, median(incs)),
        ("restore vs pf checkout", t_rest, median(rests)),
    ] {
        let mut r = row(w, metric, ms(tine), "ms", ">= 5x faster").compared(
            "pf",
            ms(peer),
            ms(peer) / ms(tine),
        );
        r.pass = r.ratio.map(|x| x >= 5.0);
        report.rows.push(r);
    }
    // pf compresses at zstd level 19 as it writes; tine's store is as dense only
    // after gc, so the target is judged at rest and the fast store is shown beside it.
    for (metric, bytes, target) in [
        ("store after first snapshot vs pf", t_store, "(before gc)"),
        ("store at rest (after gc) vs pf", t_store_gc, "never larger"),
    ] {
        let mut r = row(w, metric, bytes as f64 / 1e6, "MB", target).compared(
            "pf",
            pstore as f64 / 1e6,
            pstore as f64 / bytes.max(1) as f64,
        );
        if target == "never larger" {
            r.pass = Some(bytes <= pstore);
        }
        report.rows.push(r);
    }
    let _ = fs::remove_dir_all(&store);
    Ok(())
}

/// A time judged against the lstat floor (target: at most 1.3x).
fn floor_row(w: &'static str, metric: &'static str, t: Duration, floor: Duration) -> Row {
    let mut r = row(w, metric, ms(t), "ms", "<= 1.3x floor").compared(
        "lstat floor (find)",
        ms(floor),
        ms(t) / ms(floor),
    );
    r.pass = r.ratio.map(|x| x <= 1.3);
    r
}

impl Row {
    /// The row compared with `against` (which measured `value`), at `ratio`.
    pub(crate) fn compared(mut self, against: &str, value: f64, ratio: f64) -> Row {
        self.against = Some(against.into());
        self.against_value = Some(value);
        self.ratio = Some(ratio);
        self
    }
}

pub(crate) fn print_table(r: &Report) {
    println!(
        "tine bench {} ({} cpus, kernel {}, median of {} runs{})",
        r.bench,
        r.cpus,
        r.kernel,
        r.runs,
        if r.quick { ", QUICK workloads" } else { "" }
    );
    let w = r.rows.iter().map(|x| x.workload.len()).max().unwrap_or(3);
    println!(
        "{:<w$} {:<40} {:>12} {:>26} {:>8}  {:<16} result",
        "", "metric", "tine", "against", "ratio", "target"
    );
    for row in &r.rows {
        let val = format!("{:.1} {}", row.tine, row.unit);
        let against = match (&row.against, row.against_value) {
            (Some(a), Some(v)) => format!("{a} {v:.1}"),
            _ => String::new(),
        };
        let ratio = row.ratio.map(|x| format!("{x:.2}x")).unwrap_or_default();
        let pass = match row.pass {
            Some(true) => "PASS",
            Some(false) => "MISS",
            None => "",
        };
        println!(
            "{:<w$} {:<40} {:>12} {:>26} {:>8}  {:<16} {pass}",
            row.workload, row.metric, val, against, ratio, row.target
        );
    }
    for n in &r.notes {
        println!("note: {n}");
    }
}
