//! `tine bench proc`: checkpoint and rollback of a running program, in the
//! shape of the paper's Table 1. A Python program holds 0, 566 MB, 1 or 2 GiB
//! of touched memory, backed by transparent huge pages (`MADV_HUGEPAGE`) or
//! by 4 KiB pages (`MADV_NOHUGEPAGE`), in a sandbox over workspace (c). Each
//! figure is what the real `tine` command reports: how long the program was
//! paused (stopped until it ran again), and the whole CLI call. CRIU (when
//! installed) dumps and restores the same program in the same run, through
//! `tine snapshot --persist` and a restore whose template was let go. Fork
//! x64 clones one template 64 times through the library, in its sandbox;
//! fork x4 into sandboxes is the whole `tine fork` call, native and (with
//! CRIU) through the images. At 566 MB of 4 KiB pages, fork x16 too: made
//! in the call, and claiming 16 forks prepared ahead (`tine snapshot
//! --prepare-forks 16`, whose time, CPU and page tables are reported).

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::BenchError;
use crate::sandbox::{json_of, judged, remove_all, require_isolation, settle};
use crate::{
    Report, Rng, Tine, bench_dir, err, gen_c, ioe, logger, median_f64 as med, ms, row, timed,
};

#[derive(clap::Args, Debug)]
pub struct ProcArgs {
    /// Small programs (0 and 64 MiB), a small workspace, for a quick check.
    #[arg(long)]
    quick: bool,
    /// Checkpoint/rollback pairs per configuration.
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Only these sizes, in MiB (comma-separated, e.g. 540,2048).
    #[arg(long, value_delimiter = ',', value_name = "MIB")]
    sizes: Option<Vec<u64>>,
    /// Leave CRIU out even when it is installed.
    #[arg(long)]
    no_criu: bool,
    /// Where to generate the workspace (default: a temporary directory, removed afterwards).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

/// The program: holds `argv[1]` MiB touched, huge pages or not (`argv[2]`:
/// thp, 4k, or plain: not asking either way, as most programs),
/// creates `argv[3]` when ready; SIGUSR2 counts a step and changes one page.
const HOLDER: &str = r#"
import mmap, signal, sys
size = int(sys.argv[1]) << 20
counter = 0
if size:
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if sys.argv[2] != "plain":
        buf.madvise(mmap.MADV_HUGEPAGE if sys.argv[2] == "thp" else mmap.MADV_NOHUGEPAGE)
    for i in range(0, size, 4096):
        buf[i] = 1
def step(*_):
    global counter
    counter += 1
    if size:
        buf[(counter * 4096) % size] = counter % 256
signal.signal(signal.SIGUSR2, step)
open(sys.argv[3], "w").close()
while True:
    signal.pause()
"#;

/// numpy holding 566 MB with OpenBLAS's threads started (numpy asks for
/// huge pages for large arrays itself); SIGUSR2 changes one element and
/// runs a small product on those threads.
const NUMPY: &str = r#"
import numpy as np, signal, sys
a = np.ones(540 * 1024 * 1024 // 8)
b = np.random.default_rng(1).random((200, 200))
counter = 0
def step(*_):
    global counter
    counter += 1
    a[(counter * 512) % a.size] += 1
    (b @ b).trace()
signal.signal(signal.SIGUSR2, step)
step()
open(sys.argv[1], "w").close()
while True:
    signal.pause()
"#;

/// node serving HTTP and holding 100 MiB (a Buffer, and V8's heap);
/// SIGUSR2 changes one byte.
const NODE: &str = "const b = Buffer.alloc(100 << 20, 1); let n = 0; process.on('SIGUSR2', () => { b[(++n * 4096) % b.length]++; }); require('http').createServer((q, r) => r.end(String(n))).listen(8000, '127.0.0.1', () => require('fs').writeFileSync(process.argv[1], ''));";

/// 566 MB, the workload size of the best published system (DeltaBox).
const MB566: u64 = 540;

#[derive(Debug, Clone, Copy)]
struct Config {
    mib: u64,
    thp: bool,
}

impl Config {
    fn name(&self) -> String {
        let size = match self.mib {
            0 => "0".to_string(),
            MB566 => "566 MB".to_string(),
            m if m % 1024 == 0 => format!("{} GiB", m / 1024),
            m => format!("{m} MiB"),
        };
        format!("{size} {}", if self.thp { "THP" } else { "4K" })
    }
}

/// Medians of one configuration, in ms (and MiB for memory).
#[derive(Debug, Default)]
struct Figures {
    rss_mib: f64,
    huge_mib: f64,
    ckpt_paused: f64,
    ckpt_cli: f64,
    roll_paused: f64,
    roll_cli: f64,
    template_mib: f64,
    criu: Option<(f64, f64)>,
    /// `tine fork -n FORKS` with the processes, per child (ms): cloned
    /// natively, and through CRIU images.
    fork_native: Option<f64>,
    fork_criu: Option<f64>,
    /// `tine fork -n 16`, per child (ms), made in the call.
    fork16: Option<f64>,
    /// `tine fork -n 16` claiming 16 forks prepared ahead: issue 21's
    /// target at 566 MB.
    fork16_prepared: Option<PreparedForks>,
    /// The checkpoints' and rollbacks' inputs.
    pairs: Option<Pairs>,
}

/// Forks into sandboxes measured per configuration that has them.
const FORKS: usize = 4;

/// `field:` of `/proc/PID/smaps_rollup`, in MiB.
pub(crate) fn rollup_mib(pid: u32, field: &str) -> f64 {
    fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        })
        .map(|kib| kib / 1024.0)
        .unwrap_or(0.0)
}

/// The host PID of the sandbox's command (PID 2 inside), among init's children.
fn program_pid(init: u32) -> Result<u32, BenchError> {
    let kids = fs::read_to_string(format!("/proc/{init}/task/{init}/children")).unwrap_or_default();
    kids.split_whitespace()
        .filter_map(|p| p.parse().ok())
        .find(|p| tine_proc::template::ns_pid(*p) == Some(2))
        .ok_or_else(|| err("bench: the sandbox's program is gone"))
}

fn step(pid: u32) -> Result<(), BenchError> {
    let r = std::process::Command::new("kill")
        .args(["-USR2", &pid.to_string()])
        .status()
        .map_err(ioe("signal the program"))?;
    if !r.success() {
        return Err(err(format!("bench: could not signal process {pid}")));
    }
    // Let the handler run before the next checkpoint.
    std::thread::sleep(Duration::from_millis(5));
    Ok(())
}

pub(crate) fn wait_for(path: &Path, what: &str) -> Result<(), BenchError> {
    let deadline = Instant::now() + Duration::from_secs(300);
    while !path.exists() {
        if Instant::now() > deadline {
            return Err(err(format!("bench: {what} did not start")));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// A holder program started in a sandbox of its own, ready.
struct Program {
    /// The sandbox's id, and its init's host PID.
    id: String,
    init: u32,
}

/// Starts the holder (`mib` MiB, `mode` thp, 4k or plain) in sandbox `name`
/// over `work`, and waits until its memory is touched. `seccomp`: under the
/// sandbox's filter (the default), or without it, as CRIU needs to dump it.
fn start_program(
    t: &Tine,
    work: &Path,
    name: &str,
    mib: u64,
    mode: &str,
    seccomp: bool,
) -> Result<Program, BenchError> {
    let (_, out) = timed(
        t.cmd(&["--json", "run", "--name", name, "--workspace"])
            .arg(work)
            .args((!seccomp).then_some("--no-seccomp"))
            .args(["--", "python3", "-c", HOLDER])
            .args([&mib.to_string(), mode, "/workspace/.ready"]),
    )?;
    let v = json_of(&out)?;
    let merged = PathBuf::from(v["workspace"].as_str().unwrap_or_default());
    let init = v["init_pid"]
        .as_u64()
        .ok_or_else(|| err("bench: no init PID"))? as u32;
    wait_for(&merged.join(".ready"), "the program")?;
    settle();
    Ok(Program {
        id: v["id"].as_str().unwrap_or_default().to_string(),
        init,
    })
}

/// Checkpoint and rollback pairs of a program: medians' inputs, in ms.
#[derive(Debug)]
struct Pairs {
    /// Program paused, and the whole CLI call: checkpoints, rollbacks.
    cp: Vec<f64>,
    cc: Vec<f64>,
    rp: Vec<f64>,
    rc: Vec<f64>,
    /// Of each counted checkpoint: the kernel's fork alone, and the work on
    /// its templates after the program ran again (in the call, and by the
    /// sandbox's supervisor after it returned: wall, and that thread's CPU).
    fork: Vec<f64>,
    prepared: Vec<f64>,
    prepared_cpu: Vec<f64>,
    /// Counted rollbacks ([`THINK`] after their checkpoint) that found its
    /// preparation through.
    found_prepared: usize,
    /// Rollbacks asked for at once after their checkpoint: paused, the
    /// whole CLI call, and how many cut their checkpoint's preparation short.
    at_once_paused: Vec<f64>,
    at_once_cli: Vec<f64>,
    at_once_cut: usize,
    /// The first checkpoint's pause (it arms the memory tracking).
    first: f64,
    /// Counted checkpoints whose template was a spare made ready after the
    /// one before (no fork in the pause), and the memory the last spare
    /// held of its own (its page tables), in MiB.
    spared: usize,
    spare_mib: f64,
    /// The snapshots taken.
    snaps: Vec<String>,
}

impl Pairs {
    /// Rows of the checkpoint's floor (the kernel's fork), the first
    /// checkpoint and the work done off the pause, for workload `w`.
    fn floor_rows(&self, w: &str, report: &mut Report) {
        let (cp, fork) = (med(self.cp.clone()), med(self.fork.clone()));
        let mut push = |metric: &'static str, v: f64, unit: &'static str| {
            report.rows.push(row(w.to_string(), metric, v, unit, ""))
        };
        push("checkpoint: the kernel's fork alone (floor)", fork, "ms");
        if fork > 0.0 {
            push("checkpoint paused / the fork", cp / fork, "x");
        }
        push(
            "first checkpoint: program paused (arms memory tracking)",
            self.first,
            "ms",
        );
        for (metric, v, unit) in [
            (
                "after each checkpoint, off the call: templates prepared (wall)",
                med(self.prepared.clone()),
                "ms",
            ),
            (
                "after each checkpoint, off the call: its CPU time",
                med(self.prepared_cpu.clone()),
                "ms",
            ),
            (
                "rollbacks 100 ms after their checkpoint that found it prepared",
                self.found_prepared as f64,
                "",
            ),
            (
                "rollback asked for at once after its checkpoint: paused",
                med(self.at_once_paused.clone()),
                "ms",
            ),
            (
                "rollback asked for at once: whole CLI call",
                med(self.at_once_cli.clone()),
                "ms",
            ),
            (
                "rollbacks asked for at once that cut the preparation short",
                self.at_once_cut as f64,
                "",
            ),
        ] {
            push(metric, v, unit);
        }
        push(
            "checkpoints made from a spare ready in time",
            self.spared as f64,
            "",
        );
        push(
            "the spare's own memory (page tables)",
            self.spare_mib,
            "MiB",
        );
    }
}

/// How long after a checkpoint its rollback is asked for: an agent's next
/// step (a model's answer) comes later still. Meanwhile the sandbox's
/// supervisor prepares the checkpoint's templates (`processes::prepare`).
pub(crate) const THINK: Duration = Duration::from_millis(100);

/// `runs` pairs of a snapshot and a rollback to it of sandbox `name`
/// (whose init is `init`), a step of its program before each and
/// [`THINK`] after the snapshot; the first pair warms the caches up and is
/// not counted. Then up to 3 pairs whose rollback is asked for at once.
fn pairs(t: &Tine, name: &str, init: u32, runs: usize) -> Result<Pairs, BenchError> {
    let mut p = Pairs {
        cp: vec![],
        cc: vec![],
        rp: vec![],
        rc: vec![],
        fork: vec![],
        prepared: vec![],
        prepared_cpu: vec![],
        found_prepared: 0,
        at_once_paused: vec![],
        at_once_cli: vec![],
        at_once_cut: 0,
        first: f64::NAN,
        spared: 0,
        spare_mib: 0.0,
        snaps: vec![],
    };
    let pair = |think: bool| -> Result<_, BenchError> {
        step(program_pid(init)?)?;
        let (d, out) = timed(&mut t.cmd(&["--json", "snapshot", "--sandbox", name]))?;
        let s = json_of(&out)?;
        if think {
            std::thread::sleep(THINK);
        }
        let id = s["id"].as_str().unwrap_or_default().to_string();
        step(program_pid(init)?)?;
        let (rd, rout) = timed(&mut t.cmd(&["--json", "restore", &id, "--sandbox", name]))?;
        let r = json_of(&rout)?;
        if r["processes"] != 1 {
            return Err(err(format!(
                "bench: {name}: the rollback brought back no process: {r}"
            )));
        }
        Ok((d, s, rd, r, id))
    };
    for i in 0..=runs {
        let (d, s, rd, r, id) = pair(true)?;
        if i == 0 {
            p.first = s["paused_ms"].as_f64().unwrap_or(f64::NAN);
        } else {
            let after = &r["earlier_preparation"];
            p.fork.push(s["fork_ms"].as_f64().unwrap_or(f64::NAN));
            p.prepared.push(
                s["prepared_ms"].as_f64().unwrap_or(f64::NAN) + after["ms"].as_f64().unwrap_or(0.0),
            );
            p.prepared_cpu.push(after["cpu_ms"].as_f64().unwrap_or(0.0));
            if after["finished"] == true || s["preparing"] != true {
                p.found_prepared += 1;
            }
            p.cp.push(s["paused_ms"].as_f64().unwrap_or(f64::NAN));
            if s["from_spares"].as_u64().unwrap_or(0) > 0 {
                p.spared += 1;
            }
            p.cc.push(ms(d));
            p.rp.push(r["paused_ms"].as_f64().unwrap_or(f64::NAN));
            p.rc.push(ms(rd));
        }
        p.snaps.push(id);
    }
    p.spare_mib = spare_mib(t, name);
    for _ in 0..runs.min(3) {
        let (_, _, rd, r, _) = pair(false)?;
        p.at_once_paused
            .push(r["paused_ms"].as_f64().unwrap_or(f64::NAN));
        p.at_once_cli.push(ms(rd));
        if r["earlier_preparation"]["finished"] == false {
            p.at_once_cut += 1;
        }
    }
    Ok(p)
}

/// The page tables (`VmPTE`) of sandbox `name`'s spares, in MiB: the
/// memory a spare holds of its own (it shares its pages with its template).
fn spare_mib(t: &Tine, name: &str) -> f64 {
    let Ok(out) = t.cmd(&["--json", "ps"]).output() else {
        return 0.0;
    };
    let ps: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let Some(id) = ps
        .as_array()
        .and_then(|a| a.iter().find(|s| s["name"] == name))
        .and_then(|s| s["id"].as_str())
    else {
        return 0.0;
    };
    let rec: serde_json::Value = fs::read(t.repo.join("sandboxes").join(id).join("spares"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    rec["spares"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["spare"]["pid"].as_u64())
        .filter_map(|pid| tine_proc::inspect::page_table_bytes(pid as u32))
        .map(|b| b as f64 / (1 << 20) as f64)
        .fold(0.0, |a, b| a + b)
}

fn measure(
    t: &Tine,
    work: &Path,
    cfg: Config,
    runs: usize,
    criu: bool,
    fork_into: bool,
    log: &dyn Fn(&str),
) -> Result<Figures, BenchError> {
    let name = format!("p{}{}", cfg.mib, if cfg.thp { "h" } else { "k" });
    log(&format!("{}: starting the program", cfg.name()));
    let mode = if cfg.thp { "thp" } else { "4k" };
    let init = start_program(t, work, &name, cfg.mib, mode, !criu)?.init;
    let mut f = Figures::default();
    let pid = program_pid(init)?;
    f.rss_mib = rollup_mib(pid, "Rss:");
    f.huge_mib = rollup_mib(pid, "AnonHugePages:");
    log(&format!(
        "{}: checkpoints and rollbacks (RSS {:.0} MiB)",
        cfg.name(),
        f.rss_mib
    ));
    let p = pairs(t, &name, init, runs)?;
    (f.ckpt_paused, f.ckpt_cli, f.roll_paused, f.roll_cli) = (
        med(p.cp.clone()),
        med(p.cc.clone()),
        med(p.rp.clone()),
        med(p.rc.clone()),
    );
    let snaps = p.snaps.clone();
    f.pairs = Some(p);
    // What the templates cost once the program ran on from them.
    let mut held = vec![];
    for id in &snaps {
        let (_, out) = timed(&mut t.cmd(&["--json", "show", id]))?;
        if let Some(b) = json_of(&out)?["processes"]["private_bytes"].as_f64() {
            held.push(b / (1 << 20) as f64);
        }
    }
    f.template_mib = med(held);
    if fork_into {
        log(&format!(
            "{}: fork x{FORKS} into sandboxes, natively",
            cfg.name()
        ));
        let last = snaps.last().cloned().unwrap_or_default();
        f.fork_native = Some(fork_into_sandboxes(t, &last, "native", runs.min(5))?);
        if cfg.mib == MB566 && !cfg.thp {
            log(&format!(
                "{}: fork x16 into sandboxes, natively",
                cfg.name()
            ));
            f.fork16 = Some(fork_n_into_sandboxes(t, &last, "native", runs.min(3), 16)?);
            log(&format!(
                "{}: fork x16 into sandboxes, prepared ahead",
                cfg.name()
            ));
            f.fork16_prepared = Some(fork_prepared(t, &name, runs.min(3), 16)?);
        }
    }
    if criu {
        log(&format!("{}: CRIU dump and restore", cfg.name()));
        step(program_pid(init)?)?;
        let (_, out) = timed(&mut t.cmd(&["--json", "snapshot", "--sandbox", &name, "--persist"]))?;
        let s = json_of(&out)?;
        let dump = s["persist_ms"].as_f64().unwrap_or(f64::NAN);
        let id = s["id"].as_str().unwrap_or_default().to_string();
        step(program_pid(init)?)?;
        // A pool of one lets the persisted template go.
        timed(&mut t.cmd(&["snapshot", "--sandbox", &name, "--max-templates", "1"]))?;
        let (_, rout) = timed(&mut t.cmd(&["--json", "restore", &id, "--sandbox", &name]))?;
        let r = json_of(&rout)?;
        if r["from_images"] != 1 {
            return Err(err(format!(
                "bench: the restore did not use the CRIU images: {r}"
            )));
        }
        f.criu = Some((dump, r["paused_ms"].as_f64().unwrap_or(f64::NAN)));
        if fork_into {
            log(&format!(
                "{}: fork x{FORKS} into sandboxes through CRIU",
                cfg.name()
            ));
            f.fork_criu = Some(fork_into_sandboxes(t, &id, "criu", 1)?);
        }
    }
    timed(&mut t.cmd(&["rm", "-f", &name]))?;
    Ok(f)
}

/// `tine fork SNAP -n FORKS` with the snapshot's process, `via` "native"
/// or "criu" (`--through-criu`), `runs` times: the whole CLI call per
/// child (median), forks removed after each run.
fn fork_into_sandboxes(t: &Tine, snap: &str, via: &str, runs: usize) -> Result<f64, BenchError> {
    fork_n_into_sandboxes(t, snap, via, runs, FORKS)
}

/// [`fork_into_sandboxes`] with `n` forks.
fn fork_n_into_sandboxes(
    t: &Tine,
    snap: &str,
    via: &str,
    runs: usize,
    n: usize,
) -> Result<f64, BenchError> {
    let mut per = vec![];
    for _ in 0..runs.max(1) {
        let mut cmd = t.cmd(&["--json", "fork", snap, "-n", &n.to_string(), "--name", "fk"]);
        if via == "criu" {
            cmd.arg("--through-criu");
        }
        let (d, out) = timed(&mut cmd)?;
        let fk = json_of(&out)?;
        if fk["processes"] != 1 || fk["via"] != via {
            return Err(err(format!(
                "bench: the forks did not get their process {via}: {fk}"
            )));
        }
        per.push(ms(d) / n as f64);
        for k in 1..=n {
            timed(&mut t.cmd(&["rm", "-f", &format!("fk-{k}")]))?;
        }
    }
    Ok(med(per))
}

/// `tine fork -n N` claiming N forks prepared ahead: medians of its runs.
#[derive(Debug, Default)]
struct PreparedForks {
    /// The whole `tine fork` call, per child (ms).
    per_child: f64,
    /// The preparation after the snapshot (wall ms), and the host's busy
    /// CPU time meanwhile (ms, all cores: supervisors and kernel work too).
    prepare_ms: f64,
    prepare_cpu_ms: f64,
    /// The prepared forks' page tables (MiB, all of them).
    page_tables_mib: f64,
}

/// Busy CPU time of the whole host so far (`/proc/stat`), in ms.
fn busy_cpu_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal: all but idle and iowait.
    let busy: f64 = ticks
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .take(6)
        .map(|(_, v)| v)
        .sum();
    busy * 1000.0 / rustix::param::clock_ticks_per_second() as f64
}

/// `runs` times: a snapshot of sandbox `name` preparing `n` forks, then the
/// whole `tine fork SNAP -n N` call that claims them (each checked to be
/// claimed, not made), forks removed after each run.
fn fork_prepared(t: &Tine, name: &str, runs: usize, n: usize) -> Result<PreparedForks, BenchError> {
    let (mut per, mut prep, mut cpu, mut pt) = (vec![], vec![], vec![], vec![]);
    for _ in 0..runs.max(1) {
        let busy = busy_cpu_ms();
        let (_, out) = timed(&mut t.cmd(&[
            "--json",
            "snapshot",
            "--sandbox",
            name,
            "--prepare-forks",
            &n.to_string(),
        ]))?;
        cpu.push(busy_cpu_ms() - busy);
        let snap = json_of(&out)?;
        let p = &snap["prepared_forks"];
        if p["forks"] != n {
            return Err(err(format!("bench: {n} forks were not prepared: {snap}")));
        }
        prep.push(p["ms"].as_f64().unwrap_or(f64::NAN));
        pt.push(p["page_table_bytes"].as_f64().unwrap_or(f64::NAN) / (1 << 20) as f64);
        let id = snap["id"].as_str().unwrap_or_default().to_string();
        let (d, out) =
            timed(&mut t.cmd(&["--json", "fork", &id, "-n", &n.to_string(), "--name", "fp"]))?;
        let fk = json_of(&out)?;
        if fk["processes"] != 1 || fk["via"] != "native" || fk["prepared"] != n {
            return Err(err(format!(
                "bench: the forks were not the {n} prepared ones: {fk}"
            )));
        }
        per.push(ms(d) / n as f64);
        let forks: Vec<String> = (1..=n).map(|k| format!("fp-{k}")).collect();
        timed(t.cmd(&["rm", "-f"]).args(&forks))?;
    }
    Ok(PreparedForks {
        per_child: med(per),
        prepare_ms: med(prep),
        prepare_cpu_ms: med(cpu),
        page_tables_mib: med(pt),
    })
}

/// What collapsing a template's memory into huge pages buys: a program that
/// never asked for huge pages (4 KiB pages here), rolled back from its
/// template before and after `MADV_COLLAPSE` of the template.
struct Collapsed {
    before: f64,
    after: f64,
    collapse_ms: f64,
    collapsed_mib: f64,
    template_mib: f64,
}

fn collapse_experiment(
    t: &Tine,
    work: &Path,
    mib: u64,
    runs: usize,
    log: &dyn Fn(&str),
) -> Result<Collapsed, BenchError> {
    let name = format!("c{mib}");
    log(&format!(
        "{mib} MiB, huge pages not asked for: MADV_COLLAPSE of the template"
    ));
    let Program { id: sb_id, init } = start_program(t, work, &name, mib, "plain", true)?;
    step(program_pid(init)?)?;
    let (_, out) = timed(&mut t.cmd(&["--json", "snapshot", "--sandbox", &name]))?;
    let id = json_of(&out)?["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let rollbacks = |n: usize| -> Result<f64, BenchError> {
        let mut v = vec![];
        for _ in 0..n {
            step(program_pid(init)?)?;
            let (_, out) = timed(&mut t.cmd(&["--json", "restore", &id, "--sandbox", &name]))?;
            v.push(json_of(&out)?["paused_ms"].as_f64().unwrap_or(f64::NAN));
        }
        Ok(med(v))
    };
    let before = rollbacks(runs)?;
    let snap = tine_store::ObjectId::from_hex(&id).ok_or_else(|| err("bench: bad snapshot id"))?;
    let st = tine_sandbox::processes::load(&tine_sandbox::SandboxDirs::new(&t.repo, &sb_id), &snap)
        .ok_or_else(|| err("bench: the snapshot holds no template"))?;
    let t0 = Instant::now();
    let collapsed = tine_proc::template::collapse(&st.processes[0].template)
        .map_err(|e| err(format!("bench: collapse: {e}")))?;
    let collapse_ms = ms(t0.elapsed());
    // While the program still runs on its own 4 KiB pages, the template's
    // huge pages are a second copy (the processes made from it share them).
    let (_, out) = timed(&mut t.cmd(&["--json", "show", &id]))?;
    let template_mib = json_of(&out)?["processes"]["private_bytes"]
        .as_f64()
        .unwrap_or(f64::NAN)
        / (1 << 20) as f64;
    let after = rollbacks(runs)?;
    timed(&mut t.cmd(&["rm", "-f", &name]))?;
    Ok(Collapsed {
        before,
        after,
        collapse_ms,
        collapsed_mib: collapsed as f64 / (1 << 20) as f64,
        template_mib,
    })
}

/// Fork x`n` of one template of a program holding `mib` MiB of huge pages,
/// through the library; ms per child.
fn fork_n(dir: &Path, mib: u64, n: usize) -> Result<f64, BenchError> {
    let ready = dir.join("fork.ready");
    let _ = fs::remove_file(&ready);
    // In a session of its own, as in a sandbox (setsid(1) execs in place:
    // its child is not a group leader).
    let mut child = std::process::Command::new("setsid")
        .args(["python3", "-c", HOLDER, &mib.to_string(), "thp"])
        .arg(&ready)
        .stdin(std::process::Stdio::null())
        .spawn()
        .map_err(ioe("start python3"))?;
    let pid = child.id();
    let result = (|| {
        wait_for(&ready, "the program")?;
        let perr = |e: tine_proc::ProcError| err(format!("bench: fork x{n}: {e}"));
        let mut tr = tine_proc::ptrace::Tracee::seize(pid).map_err(perr)?;
        let tpl = tine_proc::make_template(&mut tr).map_err(perr);
        let _ = tr.resume();
        let tpl = tpl?;
        let how = tine_proc::Respawn {
            parent: true,
            ..Default::default()
        };
        let t0 = Instant::now();
        let made = tine_proc::template::respawn_many(&tpl, &vec![how; n]);
        let took = t0.elapsed();
        for p in made.iter().flatten().copied().chain([tpl.pid]) {
            tine_proc::template::kill_and_reap(p);
        }
        made.map_err(perr)?;
        Ok(ms(took) / n as f64)
    })();
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// ns per MiB of the program's RSS.
fn per_mib(ms: f64, rss_mib: f64) -> f64 {
    ms * 1e6 / rss_mib.max(1.0)
}

fn criu_usable(criu: &tine_sandbox::criu::Criu, log: &dyn Fn(&str)) -> Result<bool, String> {
    if !criu.bin.is_file() {
        return Err(format!(
            "CRIU is not installed at {} (scripts/install-criu.sh, or TINE_CRIU): CRIU rows skipped",
            criu.bin.display()
        ));
    }
    log("checking CRIU");
    criu.check()
        .map(|_| true)
        .map_err(|e| format!("CRIU rows skipped: {e}"))
}

pub fn run(args: &ProcArgs, json: bool, tools: &crate::Tools) -> Result<(), BenchError> {
    let exe = tools.exe.clone();
    let runs = args.runs.max(2);
    let mut report = Report::new("proc", args.quick, runs);
    let log = logger(json);
    require_isolation("bench proc runs programs in sandboxes")?;
    let criu = if args.no_criu {
        report.notes.push("--no-criu: CRIU rows skipped".into());
        false
    } else {
        match criu_usable(&tools.criu, &log) {
            Ok(ok) => ok,
            Err(note) => {
                report.notes.push(note);
                false
            }
        }
    };
    if criu {
        report.peers.push("CRIU".into());
    }
    let (base, _cleanup) = bench_dir(args.dir.as_ref(), "tine-bench-proc-", false)?;
    let sizes = args.sizes.clone().unwrap_or_else(|| {
        if args.quick {
            vec![0, 64]
        } else {
            vec![0, MB566, 1024, 2048]
        }
    });
    let files = if args.quick { 600 } else { 6_000 };
    let work = base.join("work");
    log(&format!("generating workspace (c): {files} files"));
    gen_c(&work, files, &mut Rng(0x5a4d_b0c5_1234_0c0c))?;
    let t = Tine {
        exe,
        repo: base.join("repo"),
    };
    timed(&mut t.cmd(&["init"]))?;
    let result = (|| {
        let fork_mib = if args.quick { 64 } else { MB566 };
        let c = collapse_experiment(&t, &work, fork_mib, runs, &log)?;
        let w = format!(
            "{} plain",
            Config {
                mib: fork_mib,
                thp: true
            }
            .name()
            .trim_end_matches(" THP")
        );
        for (metric, v, unit) in [
            ("rollback paused, 4K template", c.before, "ms"),
            ("rollback paused, template collapsed", c.after, "ms"),
            ("MADV_COLLAPSE of the template", c.collapse_ms, "ms"),
            ("memory collapsed", c.collapsed_mib, "MiB"),
            (
                "template memory right after collapse",
                c.template_mib,
                "MiB",
            ),
        ] {
            report.rows.push(row(w.clone(), metric, v, unit, ""));
        }
        report.notes.push(
            "plain = a program that does not ask for huge pages (THP is in madvise mode here, so it gets 4 KiB pages); its template collapsed with MADV_COLLAPSE (injected into the parked template) holds that memory as its own copy: not done by default".into(),
        );
        for &mib in &sizes {
            for thp in [true, false] {
                let cfg = Config { mib, thp };
                let f = measure(&t, &work, cfg, runs, criu, mib == fork_mib, &log)?;
                add_rows(&mut report, cfg, &f);
            }
        }
        if !args.quick {
            real_programs(&t, &work, runs, &mut report, &log)?;
            // One process of a tree's memory, rolled back the same way.
            let single = |mib: u64| -> Result<f64, BenchError> {
                let p = start_program(&t, &work, "single", mib, "plain", true)?;
                let rp = pairs(&t, "single", p.init, runs)?.rp;
                timed(&mut t.cmd(&["rm", "-f", "single"]))?;
                Ok(med(rp))
            };
            let criu = criu.then_some(&tools.criu);
            crate::trees::rows(&t, &work, runs, &mut report, &single, criu, &log)?;
        }
        log("rebuild per item: threads and kernel objects");
        for (kind, us) in crate::rebuild::per_item(&base, runs)? {
            report
                .rows
                .push(row("rebuild per item", kind, us, "us", ""));
        }
        log(&format!("fork x64 of one {fork_mib} MiB template"));
        let per_child = fork_n(&base, fork_mib, 64)?;
        let w = Config {
            mib: fork_mib,
            thp: true,
        }
        .name();
        report.rows.push(judged(
            w,
            "fork x64: per child (in the template's sandbox)",
            per_child,
            1.0,
        ));
        Ok::<_, BenchError>(())
    })();
    remove_all(&t);
    result?;
    report.notes.push(
        "paused = how long the program did not run, as tine reports it: checkpoint, from its stop to running again; rollback, from its stop (or, cloned from its template, its kill) to running again; CLI = the whole tine command".into(),
    );
    report.notes.push(
        "rollbacks in place: each process's memory is tracked from its first checkpoint (a userfaultfd in asynchronous write-protect mode, held by the sandbox's supervisor; PAGEMAP_SCAN finds what was written since): a rollback copies back only the pages it changed, the pages it dropped and the template holds, and sets its threads, descriptors and signal dispositions back; a process not tracked is cloned from its template. The first checkpoint arms the tracking inside its pause (its row). After each checkpoint the sandbox's supervisor prepares its templates, after the call returned: what a rollback reads from each, and the spares below (its rows: wall and CPU time). Each rollback is asked for 100 ms after its checkpoint (an agent's next step comes later still); its row says how many found the preparation through. Then 3 rollbacks are asked for at once: one that finds the preparation running stops it after the step in hand, reads what it left of the template itself, before its pause, and hands the rest back (their rows). A checkpoint that finds it running waits for it. Tracking holds no memory: write-protect bits in the page tables, a record of page ranges and a small file per template. Spare templates: where a process's fork costs more than 2.5 ms, a spare (a copy of its template) is forked off the call after each checkpoint, and the next checkpoint makes it the new template by copying in only the pages written since (its row says how many of the counted checkpoints found one ready; its memory is its page tables: it shares its pages with the template). the kernel's fork alone = the fork that made the template's memory: the injected fork inside the pause, or the spare's, off it; with a spare, the pause is below the fork".into(),
    );
    report.notes.push(
        "566 MB = 540 MiB; THP rows ask for huge pages with MADV_HUGEPAGE (the program's memory that got them is in 'RSS in huge pages'); 4K rows refuse them with MADV_NOHUGEPAGE".into(),
    );
    if criu {
        report.notes.push(
            "CRIU: dump = `tine snapshot --persist` dumping the template (the program runs on meanwhile); restore = a rollback whose template was let go, brought back from the images (CRIU restore plus the native clone); the ratio is CRIU dump + restore over tine checkpoint + rollback (paused)".into(),
        );
        report.notes.push(
            "with CRIU rows the programs run with --no-seccomp (CRIU cannot dump processes under the sandbox's seccomp filter from inside their user namespace); --no-criu runs them under the filter, as sandboxes run by default".into(),
        );
    }
    report.notes.push(format!(
        "rebuild per item: a copy of a program holding {} threads, pipes, socketpairs, eventfds, timerfds or epoll registrations (on eventfds), made with its objects anew, against the same made sharing them (threads: against the program without them); the difference over the count, through the library",
        64
    ));
    report.notes.push(
        "fork x64 clones one template 64 times through the library, in its sandbox; 'fork x4 into sandboxes' is the whole `tine fork -n 4` call over 4 (new overlays, cgroups, supervisors and the process in each): native = cloned from the live template into namespaces nested in the origin's, CRIU = `--through-criu`, from the persisted images".into(),
    );
    report.finish(json);
    Ok(())
}

/// Checkpoints, rollbacks and native forks of programs agents run (numpy
/// with its BLAS threads, a node server), where they are installed.
fn real_programs(
    t: &Tine,
    work: &Path,
    runs: usize,
    report: &mut Report,
    log: &dyn Fn(&str),
) -> Result<(), BenchError> {
    let programs: [(&str, &str, Vec<&str>, bool); 3] = [
        (
            "numpy 566 MB",
            "/usr/lib/python3/dist-packages/numpy",
            vec!["python3", "-c", NUMPY, "/workspace/.ready"],
            true,
        ),
        (
            "numpy 566 MB 4K",
            "/usr/lib/python3/dist-packages/numpy",
            vec![
                "env",
                "NUMPY_MADVISE_HUGEPAGE=0",
                "python3",
                "-c",
                NUMPY,
                "/workspace/.ready",
            ],
            true,
        ),
        (
            "node 100 MiB",
            "/usr/bin/node",
            vec!["node", "-e", NODE, "/workspace/.ready"],
            true,
        ),
    ];
    for (label, needs, argv, fork) in programs {
        if !Path::new(needs).exists() {
            report
                .notes
                .push(format!("{label}: skipped, {needs} is not installed"));
            continue;
        }
        log(&format!("{label}: checkpoints and rollbacks"));
        let name = "real";
        let (_, out) = timed(
            t.cmd(&["--json", "run", "--name", name, "--workspace"])
                .arg(work)
                .arg("--")
                .args(&argv),
        )?;
        let v = json_of(&out)?;
        let merged = PathBuf::from(v["workspace"].as_str().unwrap_or_default());
        let init = v["init_pid"]
            .as_u64()
            .ok_or_else(|| err("bench: no init PID"))? as u32;
        let ready = merged.join(".ready");
        wait_for(&ready, label)?;
        settle();
        let pid = program_pid(init)?;
        let threads = fs::read_dir(format!("/proc/{pid}/task"))
            .map(|d| d.count())
            .unwrap_or(0) as f64;
        let rss = rollup_mib(pid, "Rss:");
        let huge = rollup_mib(pid, "AnonHugePages:");
        let p = pairs(t, name, init, runs)?;
        let (cp, rp, snaps) = (p.cp.clone(), p.rp.clone(), p.snaps.clone());
        let w = label.to_string();
        report
            .rows
            .push(row(w.clone(), "program RSS", rss, "MiB", ""));
        report
            .rows
            .push(row(w.clone(), "RSS in huge pages", huge, "MiB", ""));
        report.rows.push(row(w.clone(), "threads", threads, "", ""));
        // The issue's goal for these programs: DeltaBox's figures, beaten.
        report.rows.push(judged(
            w.clone(),
            "checkpoint: program paused",
            med(cp),
            5.0,
        ));
        report
            .rows
            .push(judged(w.clone(), "rollback: program paused", med(rp), 2.0));
        p.floor_rows(&w, report);
        if fork {
            log(&format!("{label}: fork x{FORKS} into sandboxes, natively"));
            let last = snaps.last().cloned().unwrap_or_default();
            let per = fork_into_sandboxes(t, &last, "native", runs.min(5))?;
            report.rows.push(row(
                w,
                "fork x4 into sandboxes (native): per child",
                per,
                "ms",
                "",
            ));
        }
        timed(&mut t.cmd(&["rm", "-f", name]))?;
    }
    report.notes.push(
        "numpy and node rows: Debian's python3-numpy (OpenBLAS threads; numpy asks for huge pages for large arrays by itself, hence its RSS in huge pages; the 4K row turns that off with NUMPY_MADVISE_HUGEPAGE=0) and nodejs, run as they are; a rollback ends the threads and makes the checkpoint's again; a node fork makes its epoll instances, eventfds, pipes and listening socket anew".into(),
    );
    Ok(())
}

fn add_rows(report: &mut Report, cfg: Config, f: &Figures) {
    let w = cfg.name();
    // The issues' targets, where they set them (566 MB and 2 GiB, huge
    // pages and 4 KiB ones).
    let (ckpt_limit, roll_limit) = match (cfg.thp, cfg.mib) {
        (true, MB566) => (None, Some(2.0)),
        (true, 2048) => (Some(10.0), Some(5.0)),
        (false, MB566) => (Some(5.0), Some(2.0)),
        (false, 2048) => (None, Some(5.0)),
        _ => (None, None),
    };
    let mut push = |metric: &'static str, v: f64, unit: &'static str, limit: Option<f64>| {
        report.rows.push(match limit {
            Some(l) => judged(w.clone(), metric, v, l),
            None => row(w.clone(), metric, v, unit, ""),
        })
    };
    push("program RSS", f.rss_mib, "MiB", None);
    if cfg.thp && cfg.mib > 0 {
        push("RSS in huge pages", f.huge_mib, "MiB", None);
    }
    push(
        "checkpoint: program paused",
        f.ckpt_paused,
        "ms",
        ckpt_limit,
    );
    push("rollback: program paused", f.roll_paused, "ms", roll_limit);
    if cfg.mib > 0 {
        let ckpt = per_mib(f.ckpt_paused, f.rss_mib);
        push("checkpoint paused per MiB", ckpt, "ns/MiB", None);
        push(
            "rollback paused per MiB",
            per_mib(f.roll_paused, f.rss_mib),
            "ns/MiB",
            None,
        );
    }
    if let Some(p) = &f.pairs {
        p.floor_rows(&w, report);
    }
    let mut push = |metric: &'static str, v: f64, unit: &'static str, limit: Option<f64>| {
        report.rows.push(match limit {
            Some(l) => judged(w.clone(), metric, v, l),
            None => row(w.clone(), metric, v, unit, ""),
        })
    };
    push("checkpoint: whole CLI call", f.ckpt_cli, "ms", None);
    push("rollback: whole CLI call", f.roll_cli, "ms", None);
    push("template memory per snapshot", f.template_mib, "MiB", None);
    if let Some((dump, restore)) = f.criu {
        let tine = f.ckpt_paused + f.roll_paused;
        // Judged where the issue sets it: the largest program, huge pages.
        let judged = cfg.thp && cfg.mib == 2048;
        report
            .rows
            .push(vs_criu(&w, tine, dump + restore, 100.0, judged));
        let mut push =
            |metric: &'static str, v: f64| report.rows.push(row(w.clone(), metric, v, "ms", ""));
        push("CRIU dump (of the template)", dump);
        push("CRIU restore + clone", restore);
    }
    if let Some(per) = f.fork_native {
        report.rows.push(row(
            w.clone(),
            "fork x4 into sandboxes (native): per child",
            per,
            "ms",
            "",
        ));
    }
    if let Some(per) = f.fork16 {
        report.rows.push(row(
            w.clone(),
            "fork x16 into sandboxes (native, made in the call): per child",
            per,
            "ms",
            "",
        ));
    }
    if let Some(p) = &f.fork16_prepared {
        report.rows.push(judged(
            w.clone(),
            "fork x16 into sandboxes (native, prepared ahead): per child",
            p.per_child,
            2.0,
        ));
        let mut push = |metric: &'static str, v: f64, unit: &'static str| {
            report.rows.push(row(w.clone(), metric, v, unit, ""))
        };
        push(
            "prepare x16 forks after the snapshot: wall",
            p.prepare_ms,
            "ms",
        );
        push(
            "prepare x16 forks: host CPU busy meanwhile",
            p.prepare_cpu_ms,
            "ms",
        );
        push(
            "prepare x16 forks: page tables held",
            p.page_tables_mib,
            "MiB",
        );
    }
    if let Some(per) = f.fork_criu {
        report.rows.push(row(
            w,
            "fork x4 into sandboxes (CRIU): per child",
            per,
            "ms",
            "",
        ));
    }
}

/// The row of tine's checkpoint and rollback (`tine`, ms) against CRIU's
/// dump and restore (`criu`, ms) for workload `w`, with the goal of `goal`
/// times; judged (pass or fail) where `judged`.
pub(crate) fn vs_criu(w: &str, tine: f64, criu: f64, goal: f64, judged: bool) -> crate::Row {
    let mut r = row(
        w.to_string(),
        "checkpoint + rollback vs CRIU",
        tine,
        "ms",
        format!(">= {goal}x"),
    )
    .compared("CRIU dump+restore", criu, criu / tine);
    if judged {
        r.pass = Some(criu / tine >= goal);
    }
    r
}
