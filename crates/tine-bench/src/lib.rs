//! `tine bench`: end-to-end measurements against the targets, printed as a table
//! and as JSON. Every figure times the real `tine` binary as a user runs it.
//!
//! The harness behind the `tine bench` command, kept out of the product's
//! crates: it is a command, not a library to embed, so it prints its tables
//! and progress and finds peers on `$PATH`. Each bench has a file: `fs`,
//! `sandbox`, `proc`, `api`, `remote`; this one holds what they share
//! (reports, workloads, timing).
#![forbid(unsafe_code)]
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod api;
mod chart;
mod fs;
mod paper;
mod proc;
mod rebuild;
mod remote;
mod sandbox;
mod trees;

pub use fs::FsArgs;

use std::fs as stdfs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use tine_store::ErrorKind;

use tine_store::human::size;

#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// Directory snapshots: (a) 10,000 x 4 KiB files, (b) one 1 GiB random file,
    /// (c) a source-tree-like workspace (~6,000 files, ~60 MB); ProcessFork side by side if installed.
    Fs(FsArgs),
    /// Live sandboxes (root only): snapshot, rollback and fork x16 of a running
    /// sandbox over workspace (c), and again with the workspace grown tenfold.
    Sandbox(crate::sandbox::SandboxArgs),
    /// Running processes (root only): checkpoint and rollback of a program
    /// holding 0, 566 MB, 1 and 2 GiB, with huge pages and with 4 KiB pages,
    /// in a sandbox over workspace (c); fork x64 of one template; CRIU side by
    /// side when installed.
    Proc(crate::proc::ProcArgs),
    /// The HTTP API (root only): what `tine serve` adds to the library call
    /// for snapshot and rollback of a small sandbox; sequential `exec` of
    /// `true` through the API, p50 and p99.
    Api(crate::api::ApiArgs),
    /// Remotes: push and pull of workspace (c) and of a 1 GiB random file
    /// through a local SeaweedFS (S3) and a directory, in MB/s; the share of
    /// the first push that a second one sends after a one-file change.
    Remote(crate::remote::RemoteArgs),
    /// The paper's Table 1 (root only): a program holding 2 GiB and a 2 GiB
    /// disk change, snapshotted and restored by every mechanism installed
    /// (tine native and files, CRIU, Podman commit, Podman + CRIU, gVisor
    /// runsc, ProcessFork): times, storage, and a chart (--chart DIR).
    Paper(crate::paper::PaperArgs),
}

/// A bench that could not run: its kind decides the CLI's exit code.
#[derive(Debug)]
pub struct BenchError {
    pub kind: ErrorKind,
    pub message: String,
}

impl BenchError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> BenchError {
        BenchError {
            kind,
            message: message.into(),
        }
    }
}

impl<E: tine_store::HasKind + std::fmt::Display> From<E> for BenchError {
    fn from(e: E) -> BenchError {
        BenchError::new(e.kind(), e.to_string())
    }
}

/// What the benches run: the `tine` binary under test and CRIU (which may
/// be missing: its rows say so).
#[derive(Debug, Clone)]
pub struct Tools {
    pub exe: PathBuf,
    pub criu: tine_sandbox::criu::Criu,
}

/// Runs one bench and prints its table (or, with `json`, its report).
pub fn run(which: &BenchCommand, json: bool, tools: &Tools) -> Result<(), BenchError> {
    match which {
        BenchCommand::Fs(a) => fs::run(a, json, tools),
        BenchCommand::Sandbox(a) => sandbox::run(a, json, tools),
        BenchCommand::Proc(a) => proc::run(a, json, tools),
        BenchCommand::Api(a) => api::run(a, json, tools),
        BenchCommand::Remote(a) => remote::run(a, json),
        BenchCommand::Paper(a) => paper::run(a, json, tools),
    }
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
            kernel: stdfs::read_to_string("/proc/sys/kernel/osrelease")
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
) -> Result<(PathBuf, Option<tempfile::TempDir>), BenchError> {
    if let Some(d) = dir {
        stdfs::create_dir_all(d).map_err(ioe("create bench directory"))?;
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

pub(crate) fn err(msg: impl Into<String>) -> BenchError {
    BenchError::new(ErrorKind::Internal, msg)
}

pub(crate) fn ioe(what: &str) -> impl FnOnce(std::io::Error) -> BenchError + '_ {
    move |e| BenchError::new(ErrorKind::Io, format!("bench: {what}: {e}"))
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

pub(crate) fn write(path: &Path, data: &[u8]) -> Result<(), BenchError> {
    if let Some(p) = path.parent() {
        stdfs::create_dir_all(p).map_err(ioe("create directory"))?;
    }
    stdfs::write(path, data).map_err(ioe("write workload"))
}

fn gen_a(root: &Path, files: usize, rng: &mut Rng) -> Result<Vec<PathBuf>, BenchError> {
    let dirs = 100.min(files);
    let mut out = Vec::new();
    for i in 0..files {
        let p = root.join(format!("d{:03}/f{:05}.txt", i % dirs, i));
        write(&p, &rng.text(4096))?;
        out.push(p);
    }
    Ok(out)
}

pub(crate) fn gen_b(path: &Path, bytes: u64, rng: &mut Rng) -> Result<(), BenchError> {
    if let Some(p) = path.parent() {
        stdfs::create_dir_all(p).map_err(ioe("create directory"))?;
    }
    let mut f = std::io::BufWriter::new(stdfs::File::create(path).map_err(ioe("create workload"))?);
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
pub(crate) fn gen_c(root: &Path, files: usize, rng: &mut Rng) -> Result<Vec<PathBuf>, BenchError> {
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
pub(crate) fn timed(cmd: &mut Command) -> Result<(Duration, String), BenchError> {
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
    fn snapshot(&self, dir: &Path) -> Result<(Duration, serde_json::Value), BenchError> {
        let (d, out) = timed(self.cmd(&["--json", "snapshot", "-m", "bench"]).arg(dir))?;
        Ok((
            d,
            serde_json::from_str(&out)
                .map_err(|e| err(format!("bench: bad JSON from tine: {e}")))?,
        ))
    }
}

pub(crate) fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(name))
            .find(|p| p.is_file())
    })
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
