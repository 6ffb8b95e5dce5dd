//! Rollback of a sandbox (files and processes) to a snapshot, and the
//! live diff against one.

use super::*;

/// Rolls a sandbox's workspace back (or forward) to `snap`, in place through its
/// overlay while it runs: frozen, only the differing paths rewritten (open files
/// see the new content), thawed. When `snap` holds live templates of this
/// sandbox (and not `files_only`), its processes go back too: the live ones
/// are killed and copies of the templates take their PIDs, after the files.
pub fn restore(
    lock: &WriteLock<'_>,
    rec: &SandboxRecord,
    snap: &ObjectId,
    files_only: bool,
    criu: Option<&crate::criu::Criu>,
    progress: &dyn Progress,
) -> Result<(tine_fs::RestoreOutcome, Frozen), SandboxError> {
    let repo = lock.repo();
    let spec = spec_of(rec)?;
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    let ledger_head = tine_store::ledger::head_of(repo, snap)?;
    if let Isolation::None { .. } = spec.isolation {
        let out = tine_fs::restore_with(lock, snap, &dirs.plain(), IN_REPOSITORY, progress)?;
        tine_ledger::set_head(lock, &rec.id, ledger_head)?;
        return Ok((out, Frozen::default()));
    }
    // No template is seized by two: an earlier checkpoint's preparation
    // still running stops first (a source it left is read below, off the
    // pause), and goes on after.
    let preparation = live_cgroup(rec).map(|_| crate::processes::prepare::Paused::stop(&dirs));
    let ws = layered(repo, &spec, &dirs)?;
    let ov = dirs.overlay(&spec);
    // Mounted for this restore only when the sandbox is not running.
    let _unmount = if ov.is_mounted() {
        None
    } else {
        mount(repo, &rec.name, &ov)?;
        Some(crate::overlay::Unmounting(&ov))
    };
    let cg = live_cgroup(rec);
    // A first pass while the sandbox still runs loads the trees it needs into
    // the block cache; the pass that counts happens frozen, below. On the
    // threads that pass will use (started before any process is killed or
    // frozen: the pause pays for no thread), likely as few as this one.
    let early = cg
        .as_ref()
        .and_then(|_| supervisor::dirty(&dirs))
        .map(|r| r.tracked());
    let small = early.as_ref().is_some_and(Tracked::is_small);
    tine_fs::warm_up(small);
    let first = || current_tree(repo, &ws, early.as_ref(), progress);
    let _ = if small {
        tine_fs::on_one_thread(first)
    } else {
        first()
    };
    let templates = crate::processes::template_pids(&dirs);
    // What changed, asked of the tracker by the rollback once its processes
    // are stopped, if nothing was killed after (taken by the first restore).
    let ahead = AskedAhead {
        dirs: &dirs,
        cg: cg.as_ref(),
        templates: &templates,
        asked: std::sync::Mutex::new(None),
        small,
    };
    // Frozen, unless a rollback killed every process but init (which never
    // writes to the workspace) and the templates (which never run).
    let files = |frozen: bool| -> Result<(tine_fs::RestoreOutcome, f64), SandboxError> {
        let mut freeze = Freeze::begin(rec, &dirs, if frozen { cg.as_ref() } else { None })?;
        let asked = ahead.take();
        let tracked = tracked_asked(&dirs, cg.as_ref(), &templates, asked).map(|(t, _)| t);
        let restore = || {
            repo.in_read_transaction(|| {
                let (current, made) = current_tree(repo, &ws, tracked.as_ref(), progress)?;
                Ok::<_, SandboxError>(tine_fs::restore_known(
                    lock,
                    snap,
                    &dirs.merged(),
                    current,
                    made,
                    tine_fs::RestoreOptions::sandbox(Some(sandbox_ids(repo))),
                    progress,
                )?)
            })
        };
        // On a pool thread: the scan and the writes start in place, not
        // handed over. Where few directories changed, on a pool of one:
        // the other's idle threads would spin on the CPUs a rollback's
        // pause needs.
        let result = if tracked.as_ref().is_some_and(Tracked::is_small) {
            tine_fs::on_one_thread(restore)
        } else {
            tine_fs::on_pool(restore)
        };
        let frozen_ms = freeze.thaw();
        Ok((result?, frozen_ms))
    };
    // The snapshot's processes: from their templates in this sandbox, or
    // from CRIU images; a state that was let go leaves the processes alone.
    let recorded = match (&cg, files_only) {
        (Some(_), false) => crate::processes::load(&dirs, snap),
        _ => None,
    };
    let (mut state, let_go, let_go_reason) = match recorded {
        Some(st) if st.restorable(criu.is_some()) => (Some(st), 0, None),
        Some(st) => (None, st.processes.len(), Some(st.why_let_go())),
        None => (None, 0, None),
    };
    let (files, rolled, paused_ms, restarted) = match (&mut state, &cg, rec.init_pid) {
        (Some(st), Some(cg), Some(init)) => {
            // Before any process is killed: an exec session whose command
            // this ends reads it at once (best effort: without it, the
            // command ends as killed, unexplained).
            let _ = crate::rollback_mark::mark(&dirs, snap);
            let (files, rolled) = crate::processes::rollback(
                &rec.name,
                cg,
                &dirs,
                files_at(rec),
                init,
                st,
                criu,
                files,
                &ahead,
            )
            .map_err(|e| process_error(&rec.name, e))?;
            crate::processes::touch(&dirs, snap);
            let paused = rolled.paused.as_secs_f64() * 1e3;
            let restarted = rolled.failed.is_some();
            (files, rolled, paused, restarted)
        }
        // The snapshot's processes cannot come back: the command starts
        // afresh over its files rather than run on out of step with them.
        (None, Some(cg), Some(init)) if let_go > 0 && crate::processes::can_restart(init) => {
            let _ = crate::rollback_mark::mark(&dirs, snap);
            let (files, paused) =
                crate::processes::restart_afresh(&rec.name, cg, &dirs, init, files)
                    .map_err(|e| process_error(&rec.name, e))?;
            let paused = paused.as_secs_f64() * 1e3;
            (files, crate::processes::Rolled::default(), paused, true)
        }
        _ => (files(true), crate::processes::Rolled::default(), 0.0, false),
    };
    // A rollback that failed and started the command afresh let them go.
    let (let_go, let_go_reason) = match (&rolled.failed, &state) {
        (Some(why), Some(st)) => (
            st.processes.len(),
            Some(format!("the rollback failed: {why}")),
        ),
        _ => (let_go, let_go_reason),
    };
    let (result, frozen) = match files {
        Ok((out, frozen_ms)) => (
            Ok(out),
            Frozen {
                frozen_ms,
                processes: rolled.pids.len(),
                paused_ms,
                from_images: rolled.from_images,
                processes_let_go: let_go,
                let_go_reason,
                restarted,
                earlier_preparation: preparation.as_ref().and_then(|p| p.report()),
                ..Frozen::default()
            },
        ),
        Err(e) => (Err(e), Frozen::default()),
    };
    // Recorded after the thaw: the sandbox need not wait for this fsync.
    if result.is_ok() {
        lock.set_head(&head_key(&rec.id), snap)
            .map_err(tine_fs::RestoreError::from)?;
        // The visible ledger rewinds with it (every entry stays stored).
        tine_ledger::set_head(lock, &rec.id, ledger_head)?;
    }
    Ok((result?, frozen))
}

/// The sandbox a snapshot was taken from (its `source` is `sandbox:ID`).
pub fn sandbox_of_source(repo: &Repository, source: &str) -> Option<SandboxRecord> {
    let id = super::sandbox_id_of_source(source)?;
    repo.sandbox(id).ok().filter(|r| r.id == id)
}

/// Changes from snapshot `a` to a sandbox's workspace as it is now (reading
/// only its upper layer); also where its live files can be read.
pub fn diff_live(
    repo: &Repository,
    rec: &SandboxRecord,
    a: &ObjectId,
    progress: &dyn Progress,
) -> Result<(Vec<tine_fs::Change>, PathBuf), SandboxError> {
    let spec = spec_of(rec)?;
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    if let Isolation::None { .. } = spec.isolation {
        let d = dirs.plain();
        return Ok((tine_fs::diff_with_dir(repo, a, &d, progress)?, d));
    }
    let templates = crate::processes::template_pids(&dirs);
    let tracked = tracked(&dirs, live_cgroup(rec).as_ref(), &templates).map(|(t, _)| t);
    let ws = layered(repo, &spec, &dirs)?;
    let (root, made) = current_tree(repo, &ws, tracked.as_ref(), progress)?;
    let tree = repo
        .read_snapshot(a)
        .map_err(tine_fs::SnapshotError::from)?
        .tree;
    let changes = tine_fs::diff_trees(&tine_fs::Trees::new(repo, Some(&made)), &tree, &root)
        .map_err(tine_fs::SnapshotError::from)?;
    Ok((changes, dirs.merged()))
}

/// The files' change tracker asked ahead of a rollback's restore
/// ([`crate::processes::FilesAhead`]), and whether a process maps a
/// workspace file shared and writable (looked for then too: every process
/// that could is stopped, and a process's map read costs 0.1 ms inside
/// the pause).
struct AskedAhead<'a> {
    dirs: &'a SandboxDirs,
    cg: Option<&'a crate::cgroup::Cgroup>,
    templates: &'a [u32],
    asked: std::sync::Mutex<Option<(supervisor::Asked, bool)>>,
    /// The change tracker said few directories changed before the pause:
    /// the restore is expected to run on a pool of one (`tine_fs::on_one_thread`).
    /// (Hosted there, a restore found larger in the pause runs on that
    /// one thread: the answers differ only by what changed in between.)
    small: bool,
}

impl AskedAhead<'_> {
    /// The answers asked ahead, once.
    fn take(&self) -> Option<(supervisor::Asked, bool)> {
        self.asked.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl crate::processes::FilesAhead for AskedAhead<'_> {
    fn ask(&self) {
        let both = self
            .cg
            .and_then(|cg| ask_tracker(self.dirs, cg, self.templates));
        *self.asked.lock().unwrap_or_else(|p| p.into_inner()) = both;
    }

    fn forget(&self) {
        self.take();
    }

    fn host(&self, f: &mut (dyn FnMut() + Send)) {
        tine_fs::on_pool_sized(self.small, f);
    }
}
