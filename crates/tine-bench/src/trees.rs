//! `tine bench proc` rows for process trees: a shell waiting on its
//! command, a multiprocessing pool of 4 processes holding ~300 MB, and
//! PostgreSQL 15 — each checkpointed and rolled back natively (the pause,
//! median), forked into sandboxes natively, and compared with one process
//! holding the same memory, rolled back in the same run, and with CRIU
//! dumping the same live tree and restoring it in its place.

use std::fs;
use std::path::{Path, PathBuf};

use crate::sandbox::{json_of, settle};
use crate::{BenchError, Report, Tine, err, median_f64 as med, ms, row, timed};

/// The pool: its parent and 3 workers each hold 75 MiB of their own
/// (touched, 4 KiB pages), the workers inside a task; ready once all are.
const POOL: &str = r#"
import multiprocessing as mp, os, sys, time
MIB = 75
def hold():
    global mine
    mine = bytearray(MIB << 20)
    for i in range(0, len(mine), 4096):
        mine[i] = 1
def task(i):
    open(f'/workspace/.w{i}', 'w').close()
    while True:
        time.sleep(1)
if __name__ == '__main__':
    hold()
    p = mp.Pool(3, initializer=hold)
    r = p.map_async(task, range(3), chunksize=1)
    while not all(os.path.exists(f'/workspace/.w{i}') for i in range(3)):
        time.sleep(0.05)
    open(sys.argv[1], 'w').close()
    r.wait()
"#;

/// PostgreSQL 15 (Debian's) as `postgres` over a data directory in the
/// workspace, with a table written; ready once a client could read it.
const POSTGRES: &str = "B=/usr/lib/postgresql/15/bin; as() { setpriv --reuid=postgres --regid=postgres --init-groups \"$@\"; }; mkdir -p /workspace/pgdata && chown postgres:postgres /workspace/pgdata && as $B/initdb -D /workspace/pgdata -A trust -U postgres > /workspace/initdb.log 2>&1 && as $B/pg_ctl -D /workspace/pgdata -o '-c listen_addresses=127.0.0.1 -c unix_socket_directories=' -l /workspace/pgdata/pg.log start -w >/dev/null && as psql -h 127.0.0.1 -U postgres -c 'create table t (v int); insert into t select generate_series(1, 100000)' >/dev/null && touch \"$1\" && exec sleep 1000000";

/// Every process of the tree under `init` (its descendants but stopped
/// templates), host PIDs.
fn tree_pids(init: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut todo = vec![init];
    while let Some(p) = todo.pop() {
        let tasks = fs::read_dir(format!("/proc/{p}/task"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().to_string())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        for t in tasks {
            let kids =
                fs::read_to_string(format!("/proc/{p}/task/{t}/children")).unwrap_or_default();
            for k in kids
                .split_whitespace()
                .filter_map(|k| k.parse::<u32>().ok())
            {
                let stopped = tine_proc::stat(k).is_ok_and(|s| s.state == 'T');
                if !stopped {
                    out.push(k);
                    todo.push(k);
                }
            }
        }
    }
    out
}

/// Resident memory of the tree (each process's `Rss`), MiB.
fn tree_rss(init: u32) -> f64 {
    tree_pids(init)
        .iter()
        .map(|p| crate::proc::rollup_mib(*p, "Rss:"))
        .sum()
}

/// One tree workload's medians (ms).
struct Measured {
    processes: usize,
    rss_mib: f64,
    ckpt: f64,
    roll: f64,
    fork_per_child: Option<f64>,
    fork_note: Option<String>,
    /// CRIU's dump and restore of the same tree (ms), or why not.
    criu: Option<Result<(f64, f64), String>>,
}

/// Runs `argv` in sandbox `name` over `work` until `.ready`, then `runs`
/// checkpoint + rollback pairs, one native fork x4 and, with `criu`, a
/// CRIU dump and restore of the live tree.
fn measure(
    t: &Tine,
    work: &Path,
    name: &str,
    argv: &[&str],
    runs: usize,
    criu: Option<&tine_sandbox::criu::Criu>,
) -> Result<Measured, BenchError> {
    let (_, out) = timed(
        t.cmd(&["--json", "run", "--name", name, "--workspace"])
            .arg(work)
            // CRIU cannot dump a process under the sandbox's filter.
            .args(criu.is_some().then_some("--no-seccomp"))
            .arg("--")
            .args(argv),
    )?;
    let v = json_of(&out)?;
    let merged = PathBuf::from(v["workspace"].as_str().unwrap_or_default());
    let init = v["init_pid"]
        .as_u64()
        .ok_or_else(|| err("bench: no init PID"))? as u32;
    crate::proc::wait_for(&merged.join(".ready"), name)?;
    settle();
    let processes = tree_pids(init).len();
    let rss_mib = tree_rss(init);
    let (mut cp, mut rp) = (vec![], vec![]);
    let mut last = String::new();
    for i in 0..=runs {
        let (_, out) = timed(&mut t.cmd(&["--json", "snapshot", "--sandbox", name]))?;
        let s = json_of(&out)?;
        std::thread::sleep(crate::proc::THINK);
        last = s["id"].as_str().unwrap_or_default().to_string();
        let (_, rout) = timed(&mut t.cmd(&["--json", "restore", &last, "--sandbox", name]))?;
        let r = json_of(&rout)?;
        if r["processes"].as_u64() != Some(processes as u64) {
            return Err(err(format!(
                "bench: {name}: the rollback brought back {} of {processes} processes: {r}",
                r["processes"]
            )));
        }
        // The first pair warms the caches up.
        if i > 0 {
            cp.push(s["paused_ms"].as_f64().unwrap_or(f64::NAN));
            rp.push(r["paused_ms"].as_f64().unwrap_or(f64::NAN));
        }
    }
    let (d, out) = timed(&mut t.cmd(&["--json", "fork", &last, "-n", "4", "--name", "tf"]))?;
    let fk = json_of(&out)?;
    let (fork_per_child, fork_note) = if fk["via"] == "native" {
        (Some(ms(d) / 4.0), None)
    } else {
        (None, fk["note"].as_str().map(str::to_string))
    };
    for k in 1..=4 {
        timed(&mut t.cmd(&["rm", "-f", &format!("tf-{k}")]))?;
    }
    let criu = criu.map(|c| {
        let id = v["id"].as_str().unwrap_or_default();
        criu_dump_restore(c, init, id, work, processes)
    });
    timed(&mut t.cmd(&["rm", "-f", name]))?;
    Ok(Measured {
        processes,
        rss_mib,
        ckpt: med(cp),
        roll: med(rp),
        fork_per_child,
        fork_note,
        criu,
    })
}

/// CRIU on the same tree, as it would checkpoint and roll it back: each
/// process tree under the sandbox's init (`init`; sandbox `id`) dumped
/// live (`--leave-running`), then killed, then restored in its place from
/// the images (under `work`). Returns the dumps' and the restores' time
/// (ms), or why CRIU could not.
fn criu_dump_restore(
    criu: &tine_sandbox::criu::Criu,
    init: u32,
    id: &str,
    work: &Path,
    processes: usize,
) -> Result<(f64, f64), String> {
    let procs = tine_sandbox::CgroupRoot::detect(Path::new(tine_sandbox::cgroup::DEFAULT_ROOT))
        .and_then(|r| r.open(id))
        .map_err(|e| format!("its cgroup: {e}"))?
        .procs_files();
    let roots: Vec<u32> = tree_pids(init)
        .into_iter()
        .filter(|p| tine_proc::stat(*p).is_ok_and(|s| s.ppid == init))
        .collect();
    let t0 = std::time::Instant::now();
    let mut images = Vec::new();
    for (i, &root) in roots.iter().enumerate() {
        let ns = tine_proc::template::ns_pid(root).unwrap_or(0);
        let cmd = fs::read_to_string(format!("/proc/{root}/cmdline"))
            .unwrap_or_default()
            .replace('\0', " ");
        let dest = work.join(format!(".criu-tree-{i}"));
        let img = tine_sandbox::criu::dump(criu, init, &procs, root, (ns, cmd.trim()), &dest)
            .map_err(|e| format!("dump of process {ns}: {e}"))?;
        images.push((img, dest));
    }
    let dump = ms(t0.elapsed());
    // Its PIDs must be free for the restore; the sandbox must not end with
    // its command meanwhile (as for a rollback).
    let _held = tine_sandbox::processes::HeldInit::hold(init)
        .map_err(|e| format!("hold the sandbox's init: {e}"))?;
    // tine's templates go too: they share the tree's sockets (a listener
    // keeps its port), which CRIU makes anew.
    let mut live = tree_pids(init);
    live.extend(
        fs::read_to_string(format!("/proc/{init}/task/{init}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|k| k.parse::<u32>().ok()),
    );
    for &p in &live {
        if let Some(p) = rustix::process::Pid::from_raw(p as i32) {
            let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
        }
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while live.iter().any(|p| tine_proc::stat(*p).is_ok()) {
        if std::time::Instant::now() > deadline {
            return Err("the tree did not end for the restore".into());
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let t0 = std::time::Instant::now();
    for (img, dest) in &images {
        tine_sandbox::criu::restore(criu, init, &procs, img, dest, |_| Some(0))
            .map_err(|e| format!("restore of process {}: {e}", img.ns_pid))?;
    }
    let restore = ms(t0.elapsed());
    for (_, dest) in &images {
        let _ = fs::remove_dir_all(dest);
    }
    let back = tree_pids(init).len();
    if back != processes {
        return Err(format!(
            "the restore brought back {back} of {processes} processes"
        ));
    }
    Ok((dump, restore))
}

/// The tree rows, where their programs are installed; `single` gives the
/// rollback pause (ms) of one process holding that many MiB, in this run.
pub(crate) fn rows(
    t: &Tine,
    work: &Path,
    runs: usize,
    report: &mut Report,
    single: &dyn Fn(u64) -> Result<f64, BenchError>,
    criu: Option<&tine_sandbox::criu::Criu>,
    log: &dyn Fn(&str),
) -> Result<(), BenchError> {
    let workloads: [(&str, &str, Vec<&str>); 3] = [
        (
            "tree: bash + sleep",
            "/bin/bash",
            vec![
                "bash",
                "-c",
                "sleep 1000000 & touch /workspace/.ready; wait",
            ],
        ),
        (
            "tree: pool, 4 processes x 75 MiB",
            "/usr/bin/python3",
            vec!["python3", "-c", POOL, "/workspace/.ready"],
        ),
        (
            "tree: PostgreSQL 15",
            "/usr/lib/postgresql/15/bin/postgres",
            vec!["sh", "-c", POSTGRES, "sh", "/workspace/.ready"],
        ),
    ];
    for (label, needs, argv) in workloads {
        if !Path::new(needs).exists() {
            report
                .notes
                .push(format!("{label}: skipped, {needs} is not installed"));
            continue;
        }
        log(&format!(
            "{label}: checkpoints, rollbacks, fork x4{}",
            if criu.is_some() { ", CRIU" } else { "" }
        ));
        let m = measure(t, work, "tree", &argv, runs, criu)?;
        let w = label.to_string();
        report
            .rows
            .push(row(w.clone(), "processes", m.processes as f64, "", ""));
        report
            .rows
            .push(row(w.clone(), "tree RSS", m.rss_mib, "MiB", ""));
        report
            .rows
            .push(row(w.clone(), "checkpoint: tree paused", m.ckpt, "ms", ""));
        report
            .rows
            .push(row(w.clone(), "rollback: tree paused", m.roll, "ms", ""));
        // The issue's goal: within 2x of one process of the same memory.
        let mib = m.rss_mib.round().max(1.0) as u64;
        let one = single(mib)?;
        let mut r = row(
            w.clone(),
            "rollback paused vs one process of the same RSS",
            m.roll,
            "ms",
            "<= 2x",
        )
        .compared(&format!("one process, {mib} MiB"), one, m.roll / one);
        r.pass = Some(m.roll <= 2.0 * one);
        report.rows.push(r);
        match &m.criu {
            Some(Ok((dump, restore))) => {
                let tine = m.ckpt + m.roll;
                let r = crate::proc::vs_criu(&w, tine, dump + restore, 50.0, true);
                report.rows.push(r);
                report
                    .rows
                    .push(row(w.clone(), "CRIU dump (live tree)", *dump, "ms", ""));
                report
                    .rows
                    .push(row(w.clone(), "CRIU restore (tree)", *restore, "ms", ""));
            }
            Some(Err(why)) => report.notes.push(format!("{label}: CRIU could not: {why}")),
            None => {}
        }
        match (m.fork_per_child, m.fork_note) {
            (Some(per), _) => report.rows.push(row(
                w,
                "fork x4 into sandboxes (native): per child",
                per,
                "ms",
                "",
            )),
            (None, note) => report.notes.push(format!(
                "{label}: not forked natively: {}",
                note.unwrap_or_default()
            )),
        }
    }
    report.notes.push(
        "tree rows: paused = from the first process stopped (checkpoint) or killed (rollback) to the last running again; the pool's parent and workers each hold 75 MiB of their own (4 KiB pages), the workers inside a task; PostgreSQL (Debian's, as postgres, a 100,000-row table) with its background processes and its shared memory copied per checkpoint; 'one process' is the 4K holder of the tree's RSS, rolled back in the same run; CRIU = `criu dump --leave-running` of each tree under the sandbox's init (run inside the sandbox's namespaces, as tine's --persist does) plus `criu restore` of them after the tree was killed, against tine's checkpoint + rollback pauses".into(),
    );
    Ok(())
}
