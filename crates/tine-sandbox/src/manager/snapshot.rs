//! Snapshots of a live sandbox: its files read frozen, its processes
//! checkpointed as templates (while the files are read), the tracker told.

use super::*;
use crate::processes::prepare::Preparation;

/// Whether a process of `cg` maps a file of the overlay at `merged` shared
/// and writable (templates are skipped: they never run).
pub(super) fn shared_writable_mapping(
    cg: &crate::cgroup::Cgroup,
    merged: &Path,
    templates: &[u32],
) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = std::fs::metadata(merged) else {
        return true;
    };
    let dev = (rustix::fs::major(md.dev()), rustix::fs::minor(md.dev()));
    let Ok(pids) = cg.processes() else {
        return true;
    };
    pids.iter()
        .filter(|p| !templates.contains(p))
        .any(|&pid| tine_proc::inspect::maps_file_shared_writable(pid, dev).unwrap_or(false))
}

/// The files read (`read`, on a thread of its own) while the stopped
/// processes make their templates: once both are done, the processes run
/// again, and `read`'s `after_scan` learns whether the files held still (no
/// process joined meanwhile). Returns the templates, what `read` returned
/// (an error if its thread could not start or panicked), how long the
/// processes were stopped, and what is left to prepare of the templates.
fn read_while_templates_are_made<R: Send>(
    mut stopped: crate::processes::Stopped,
    cg: &crate::cgroup::Cgroup,
    read: impl FnOnce(&mut (dyn FnMut() -> bool + Send)) -> R + Send,
) -> MadeWhileRead<R> {
    use std::sync::mpsc::sync_channel;
    let (scanned, scanned_rx) = sync_channel::<()>(1);
    let (held, held_rx) = sync_channel::<bool>(1);
    std::thread::scope(|sc| {
        // A walker's stack: merging the trees read recurses once per level.
        let reader = tine_fs::paths::spawn_walker(sc, move || {
            read(&mut move || {
                let _ = scanned.send(());
                // No answer (the other side is gone): the files did not hold.
                held_rx.recv().unwrap_or(false)
            })
        });
        let state = stopped.make_templates();
        // The read is over (or failed, or panicked, or never started: the
        // sender is dropped).
        let _ = scanned_rx.recv();
        let joined = stopped.joined(cg);
        let (paused, unsettled) = stopped.resume();
        let _ = held.send(!joined);
        // Settled while the reader stores what it read.
        let spared = unsettled.from_spares();
        let (settled, prep) = unsettled.settle();
        let read = reader.and_then(|h| {
            h.join()
                .map_err(|_| std::io::Error::other("the reading thread panicked"))
        });
        MadeWhileRead {
            state,
            read,
            paused,
            settled,
            prep,
            spared,
        }
    })
}

/// What [`read_while_templates_are_made`] made: the templates, what the
/// read returned, how long the processes were stopped, the work on the
/// templates in the call once they ran again and what it left for after,
/// and how many templates were spares made into them.
struct MadeWhileRead<R> {
    state: Result<ProcessState, crate::processes::ProcessError>,
    read: std::io::Result<R>,
    paused: Duration,
    settled: Duration,
    prep: Preparation,
    spared: usize,
}

/// What a sandbox snapshot does with the processes.
#[derive(Debug, Clone, Default)]
pub struct ProcessOptions {
    /// Capture the files only.
    pub files_only: bool,
    /// The template pool's limits, enforced after each capture.
    pub pool: crate::processes::PoolLimits,
    /// Also persist the templates with this CRIU (after the thaw: the
    /// program runs on meanwhile), so they outlive eviction and reboots.
    pub persist: Option<crate::criu::Criu>,
}

/// How long a live sandbox's processes were stopped.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct Frozen {
    /// Freeze requested to thaw done, in ms; 0 when nothing was running.
    pub frozen_ms: f64,
    /// Processes whose state was captured (snapshot) or brought back (restore).
    pub processes: usize,
    /// How long the program did not run, in ms (0 when no process state was
    /// involved): snapshot, from the first process stopped to the last one
    /// running again; restore, from the first process killed to the last
    /// copy running.
    pub paused_ms: f64,
    /// Snapshots whose templates the pool let go to stay within its limits.
    pub evicted: Vec<crate::processes::Evicted>,
    /// Snapshot: CRIU images written (`--persist`), and how long that took.
    pub persisted_bytes: u64,
    pub persist_ms: f64,
    /// Snapshot: how long the kernel's fork of each process took, summed
    /// (the floor of `paused_ms`), in ms.
    pub fork_ms: f64,
    /// Snapshot: the work on the templates in the call after the processes
    /// ran again (their sessions; and, where the sandbox's supervisor did
    /// not take it, what `preparing` says), in ms.
    pub prepared_ms: f64,
    /// Snapshot: what rollbacks read from the templates, and the spares the
    /// next checkpoint takes, are made by the sandbox's supervisor after
    /// this call returned (`processes::prepare`; false: in the call).
    #[serde(default)]
    pub preparing: bool,
    /// The earlier checkpoint's preparation as this call found it (it told
    /// it to stop where it was still running: `finished` false).
    #[serde(default)]
    pub earlier_preparation: Option<crate::processes::prepare::Report>,
    /// Snapshot: templates that were spares made into them, the kernel's
    /// fork done off the pause (`tine_proc::spare`).
    #[serde(default)]
    pub from_spares: usize,
    /// Restore: templates first brought back from CRIU images.
    pub from_images: usize,
    /// Restore: the snapshot had process state, but it was let go (evicted
    /// without images, templates killed, or the sandbox restarted).
    pub processes_let_go: usize,
    /// Restore: why they were let go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub let_go_reason: Option<String>,
    /// Restore: the processes could not come back, so the command started
    /// afresh over the restored files (false: they were left alone, only
    /// the files went back: a native fork's sandbox, whose init cannot).
    #[serde(default)]
    pub restarted: bool,
}

/// Snapshots a sandbox's workspace, and (unless `files_only`) its processes:
/// they are stopped with ptrace, and each forks a template while the upper
/// layer is read (only what changed since its base); without processes, or
/// when one joined during the read, the sandbox is frozen for the read
/// instead. The processes run on before the pack is made durable.
///
/// What the templates need for what comes next is returned, to be handed
/// to the sandbox's supervisor once the caller is done with them
/// ([`Preparation::hand_off`]); an earlier checkpoint's still being made
/// is stopped first (`earlier_preparation`).
pub fn snapshot(
    lock: &WriteLock<'_>,
    rec: &SandboxRecord,
    opts: &tine_fs::SnapshotOptions,
    procs: &ProcessOptions,
    progress: &dyn Progress,
) -> Result<(tine_fs::SnapshotOutcome, Frozen, Preparation), SandboxError> {
    let repo = lock.repo();
    let spec = spec_of(rec)?;
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    // The sandbox's ledger head goes with the snapshot (a restore or a fork
    // of it starts its ledger there).
    let mut with_head;
    let opts = match repo.ledger_head(&rec.id)? {
        Some(entry) => {
            let mac = repo.ledger_row(entry)?.map(|r| r.mac).unwrap_or_default();
            with_head = opts.clone();
            with_head.notes.push((
                tine_store::ledger::HEAD_NOTE.to_string(),
                tine_store::ledger::head_note(entry, &mac),
            ));
            &with_head
        }
        None => opts,
    };
    if let Isolation::None { .. } = spec.isolation {
        let out = tine_fs::snapshot(lock, &dirs.plain(), opts, progress)?;
        return Ok((out, Frozen::default(), Preparation::default()));
    }
    let cg = live_cgroup(rec);
    // An earlier checkpoint's preparation still running is let finish
    // first: its spares are what this one's templates are made of (else
    // forked inside the pause); this one's templates get their own.
    let earlier_preparation = cg
        .as_ref()
        .and_then(|_| crate::processes::prepare::Paused::finish(&dirs).superseded());
    // Before the processes stop: their pause does not pay for threads. Those
    // the read will likely use: where the tracker saw few directories
    // change, one (see below).
    let small = |t: &Option<(Tracked, bool)>| t.as_ref().is_some_and(|(t, _)| t.is_small());
    let early = cg
        .as_ref()
        .and_then(|_| supervisor::dirty(&dirs))
        .is_some_and(|r| r.tracked().is_small());
    tine_fs::warm_up(early);
    let mut frozen_ms = 0.0;
    let mut paused_ms = 0.0;
    let mut prepared_ms = 0.0;
    let mut from_spares = 0;
    let mut prep = Preparation::default();
    let mut retried = false;
    let mut must_freeze = false;
    let (out, state) = loop {
        // Loaded before the freeze: the frozen window pays only for the reading.
        let ws = layered(repo, &spec, &dirs)?;
        let pack = lock.pack().map_err(tine_fs::SnapshotError::from)?;
        // Processes are stopped and forked before the freeze (a frozen process
        // cannot be made to fork); stopped, they change nothing meanwhile.
        let stopped = match (&cg, rec.init_pid) {
            (Some(cg), Some(init)) if !procs.files_only => Some(
                crate::processes::stop_all(&rec.name, cg, init, &dirs)
                    .map_err(|e| process_error(&rec.name, e))?,
            ),
            _ => None,
        };
        // With every process of the sandbox stopped (init never writes to the
        // workspace, templates never run), nothing changes its files: no
        // freeze, and the files are read while the templates are made. One
        // that joins meanwhile is caught after the read, and the snapshot is
        // taken again, frozen.
        let skip = match &stopped {
            Some(s) => s.templates().to_vec(),
            None => crate::processes::template_pids(&dirs),
        };
        let key = head_key(&rec.id);
        let read =
            |pack, tracked: &Option<(Tracked, bool)>, after_scan: &mut dyn FnMut() -> bool| {
                tine_fs::snapshot_layered(
                    lock,
                    pack,
                    &ws,
                    &key,
                    tracked.as_ref().map(|(t, _)| t),
                    opts,
                    after_scan,
                    progress,
                )
            };
        let tracked_now = || {
            let mut t = tracked(&dirs, cg.as_ref(), &skip);
            if retried && let Some((t, _)) = &mut t {
                t.dirty = None;
            }
            t
        };
        // Frozen: the read, then `thawed` (the processes' resumption) as
        // soon as the files are read; returns the frozen time in ms.
        let read_frozen = |pack, thawed: &mut dyn FnMut()| {
            let mut freeze = Freeze::begin(rec, &dirs, cg.as_ref())?;
            let tracked = tracked_now();
            let mut frozen_ms = 0.0;
            let out = read(pack, &tracked, &mut || {
                frozen_ms = freeze.thaw();
                thawed();
                true
            });
            // Also when the snapshot failed before reading anything.
            drop(freeze);
            Ok::<_, SandboxError>((out, tracked, frozen_ms))
        };
        let (mut state, out, tracked) = match (stopped, &cg) {
            (Some(stopped), Some(cg)) if !must_freeze => {
                let MadeWhileRead {
                    state,
                    read,
                    paused,
                    settled,
                    prep: left,
                    spared,
                } = read_while_templates_are_made(stopped, cg, |after| {
                    let t = tracked_now();
                    // Few directories to read: on one thread, whose
                    // pool's idle threads would spin on the CPUs the
                    // templates are made on.
                    let out = if small(&t) {
                        tine_fs::on_one_thread(|| read(pack, &t, after))
                    } else {
                        read(pack, &t, after)
                    };
                    (out, t)
                });
                paused_ms += paused.as_secs_f64() * 1e3;
                prepared_ms += settled.as_secs_f64() * 1e3;
                prep = left;
                from_spares += spared;
                let state = state.map_err(|e| process_error(&rec.name, e))?;
                let (out, tracked) = match read {
                    Ok(read) => read,
                    Err(e) => {
                        state.discard();
                        return Err(io_error(&rec.name, "read the workspace", &dirs.upper())(e));
                    }
                };
                (Some(state), out, tracked)
            }
            (None, _) => {
                // On a pool thread: the read starts in place, not handed over.
                let (out, tracked, thawed) = tine_fs::on_pool(|| read_frozen(pack, &mut || {}))?;
                frozen_ms += thawed;
                (None, out, tracked)
            }
            (Some(mut stopped), _) => {
                // A process joined during an unfrozen read: frozen this time,
                // on this thread (the processes' tracer), which resumes them.
                let state = stopped
                    .make_templates()
                    .map_err(|e| process_error(&rec.name, e))?;
                let mut stopped = Some(stopped);
                let mut resume = || {
                    if let Some(s) = stopped.take() {
                        let (paused, unsettled) = s.resume();
                        paused_ms += paused.as_secs_f64() * 1e3;
                        from_spares += unsettled.from_spares();
                        let (settled, left) = unsettled.settle();
                        prepared_ms += settled.as_secs_f64() * 1e3;
                        prep = left;
                    }
                };
                let read = read_frozen(pack, &mut resume);
                // Also when the read failed before thawing.
                resume();
                let (out, tracked, thawed) = match read {
                    Ok(read) => read,
                    Err(e) => {
                        state.discard();
                        return Err(e);
                    }
                };
                frozen_ms += thawed;
                (Some(state), out, tracked)
            }
        };
        match out {
            // The tracker's claim did not hold up: read everything, frozen
            // again, with templates made again (the processes ran meanwhile).
            Err(tine_fs::SnapshotError::TrackerStale { .. }) if !retried => {
                if let Some(st) = state.take() {
                    st.discard();
                }
                retried = true
            }
            // A process joined while the files were read unfrozen: again, frozen.
            Err(tine_fs::SnapshotError::Interfered { .. }) if !must_freeze => {
                if let Some(st) = state.take() {
                    st.discard();
                }
                must_freeze = true
            }
            Ok(o) => {
                if let Some((t, mapped)) = tracked {
                    supervisor::clean(&dirs, t.now.seq, mapped);
                }
                break (o, state);
            }
            Err(e) => {
                if let Some(st) = state.take() {
                    st.discard();
                }
                return Err(e.into());
            }
        }
    };
    let (mut persisted_bytes, mut persist_ms) = (0, 0.0);
    let fork_ms = state.as_ref().map_or(0.0, |st| {
        st.processes
            .iter()
            .map(|c| c.template.fork_us as f64 / 1e3)
            .sum()
    });
    let prep = prep.of_snapshot(out.id.to_hex());
    let processes = match state {
        Some(mut st) => {
            st.snapshot = out.id.to_hex();
            let n = st.processes.len();
            crate::processes::save(&dirs, &st).map_err(|e| {
                st.discard();
                io_error(&rec.name, "record templates", &dirs.root)(e)
            })?;
            if let (Some(criu), Some(cg)) = (&procs.persist, &cg) {
                let t0 = std::time::Instant::now();
                persisted_bytes = crate::processes::persist(&rec.name, criu, cg, &dirs, &mut st)
                    .map_err(|source| SandboxError::Persist {
                        name: rec.name.clone(),
                        snapshot: out.id.to_hex(),
                        source: Box::new(source),
                    })?;
                persist_ms = t0.elapsed().as_secs_f64() * 1e3;
            }
            n
        }
        None => 0,
    };
    let evicted = if processes > 0 {
        crate::processes::enforce(repo.path(), procs.pool)
    } else {
        Vec::new()
    };
    Ok((
        out,
        Frozen {
            frozen_ms,
            processes,
            paused_ms,
            evicted,
            persisted_bytes,
            persist_ms,
            fork_ms,
            prepared_ms,
            from_spares,
            earlier_preparation,
            ..Frozen::default()
        },
        prep,
    ))
}
