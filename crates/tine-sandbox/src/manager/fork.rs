//! Forks of a snapshot into new sandboxes: natively from its templates,
//! or through CRIU.

use super::*;

/// What `tine fork SNAP -n N` (into sandboxes) asks for.
#[derive(Debug, Clone, Default)]
pub struct ForkOptions {
    /// Names are PREFIX-1 .. PREFIX-N (default: the ids).
    pub prefix: Option<String>,
    /// The command; default: that of the sandbox the snapshot was taken from.
    pub command: Vec<String>,
    /// Create the sandboxes without starting them.
    pub no_start: bool,
    /// Start the command afresh even when the snapshot holds processes.
    pub files_only: bool,
    /// Brings the snapshot's processes into the forks (persisting its
    /// templates first when they are not yet) when native forks cannot.
    pub criu: Option<crate::criu::Criu>,
    /// Go through CRIU even where native forks can be made.
    pub through_criu: bool,
    /// Make prepared forks (`prepared::prepare`): native only, named by
    /// their ids, their processes held until a fork claims them.
    pub prepare: bool,
}

/// How a fork's processes came to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ForkVia {
    /// Its command started afresh (or it was not started).
    #[default]
    Afresh,
    /// Cloned from the live template (`nested`).
    Native,
    /// Restored from CRIU images.
    Criu,
}

/// What a fork made.
#[derive(Debug, Clone, Default)]
pub struct Forked {
    pub records: Vec<SandboxRecord>,
    /// Processes each fork got from the snapshot (0: its command started afresh).
    pub processes: usize,
    /// Time spent persisting the snapshot's templates first, in ms.
    pub persist_ms: f64,
    /// Why the snapshot's processes were not brought (they started afresh),
    /// or not natively.
    pub note: Option<String>,
    pub via: ForkVia,
    /// Of the forks, how many were prepared ahead (claimed, not made).
    pub prepared: usize,
}

/// Forks snapshot `snap` into `n` new sandboxes over one shared lower layer.
/// For a snapshot of a sandbox the lower layer is that sandbox's, and each new
/// upper layer is seeded with just the snapshot's difference from it, written
/// through the new overlay. Returns the new records (started unless `no_start`).
///
/// When the snapshot holds processes of its sandbox (and with CRIU), each
/// fork starts holding, without its command, and gets them from the
/// templates' CRIU images (persisted first if they are not yet): restored
/// into the fork as templates, then cloned under their PIDs as a rollback
/// does. Native clones of the live templates cannot be moved into another
/// sandbox's namespaces without privileges the sandboxes do not have.
pub fn fork(
    lock: &WriteLock<'_>,
    snap: &ObjectId,
    n: usize,
    opts: &ForkOptions,
    exe: &Path,
    progress: &dyn Progress,
) -> Result<Forked, SandboxError> {
    if n == 0 {
        return Ok(Forked::default());
    }
    let repo = lock.repo();
    let source = sandbox_of_source(repo, &repo.read_snapshot(snap)?.source);
    let source_spec = source.as_ref().map(spec_of).transpose()?;
    let command = if opts.command.is_empty() {
        source_spec
            .as_ref()
            .map(|s| s.command.clone())
            .ok_or(SandboxError::NoCommand)?
    } else {
        opts.command.clone()
    };
    let isolation = isolation_available();
    let mut forked = Forked::default();
    let names: Vec<Option<String>> = (1..=n)
        .map(|k| opts.prefix.as_ref().map(|p| format!("{p}-{k}")))
        .collect();
    if let Some(bad) = names.iter().flatten().find(|n| !valid_name(n)) {
        return Err(SandboxError::BadName { name: bad.clone() });
    }
    let native_asked = !opts.files_only
        && !opts.no_start
        && opts.command.is_empty()
        && isolation == Isolation::Full;
    // Forks prepared ahead of this call first: nothing left to make of them.
    let mut claimed = Vec::new();
    if let Some(src) = &source
        && native_asked
        && !opts.through_criu
        && !opts.prepare
    {
        claimed = super::prepared::claim(lock, &src.id, snap, &names)?;
        if claimed.len() == n {
            let st = crate::processes::load(&SandboxDirs::new(repo.path(), &claimed[0].id), snap);
            forked.processes = st.map_or(0, |s| s.processes.len());
            forked.via = ForkVia::Native;
            forked.prepared = n;
            forked.records = claimed;
            return Ok(forked);
        }
    }
    // The source's templates are seized below: an earlier checkpoint's
    // preparation still running stops first, and goes on after.
    let _preparation = source
        .as_ref()
        .filter(|s| live_cgroup(s).is_some())
        .map(|s| crate::processes::prepare::Paused::stop(&SandboxDirs::new(repo.path(), &s.id)));
    // What the claimed ones did not take, in order.
    let names: Vec<Option<String>> = names
        .into_iter()
        .filter(|n| {
            n.as_ref()
                .is_none_or(|n| !claimed.iter().any(|c| &c.name == n))
        })
        .take(n - claimed.len())
        .collect();
    let n = names.len();
    let mut native = None;
    let procs = match &source {
        Some(src) if native_asked => {
            let private = PrivateMounts::of(src.init_pid);
            match crate::nested::plan(src, snap, repo.path(), &private) {
                Ok(plan) if !opts.through_criu => {
                    forked.note = plan.note();
                    native = Some(plan);
                    None
                }
                Err(no) if opts.prepare => {
                    forked.note = Some(format!("{}: no forks were prepared", no.why));
                    return Ok(forked);
                }
                Err(no) if !no.criu_can => {
                    forked.note = Some(format!("{}: the forks start their command afresh", no.why));
                    None
                }
                planned => {
                    let criu = opts.criu.as_ref();
                    let procs =
                        fork_processes(src, snap, &private, criu, repo.path(), &mut forked)?;
                    if let Err(no) = planned {
                        forked.note = match (&procs, forked.note.take()) {
                            (Some(_), None) => {
                                Some(format!("{}: through CRIU instead of natively", no.why))
                            }
                            // Both ways failed: both reasons.
                            (None, Some(n)) => Some(format!("not natively ({}); {n}", no.why)),
                            (_, n) => n,
                        };
                    }
                    procs
                }
            }
        }
        _ => None,
    };
    if opts.prepare && native.is_none() {
        forked.note.get_or_insert_with(|| {
            "the snapshot's processes cannot be forked natively: no forks were prepared".into()
        });
        return Ok(forked);
    }
    // The shared lower layer, and the tree it holds.
    let (base, lower) = match &source_spec {
        Some(s) if s.isolation == Isolation::Full && isolation == Isolation::Full => {
            (base_of(s), s.lower.clone())
        }
        _ => (
            Some(*snap),
            materialize_base(lock, Some(snap), &isolation, progress)?,
        ),
    };
    let (base_tree, made) = match &base {
        Some(b) => (repo.read_snapshot(b)?.tree, HashMap::new()),
        None => {
            let empty = tine_store::Tree::default();
            let id = ObjectId::compute(tine_store::Kind::Tree, &empty.encode());
            (id, HashMap::from([(id, empty)]))
        }
    };
    let template = source_spec.unwrap_or(RunSpec {
        command: command.clone(),
        env: vec![("PATH".into(), crate::DEFAULT_PATH.into())],
        limits: Limits::default().or_defaults(crate::cgroup::host_memory()),
        net: Net::None,
        restart: Restart::No,
        rootfs: None,
        base: None,
        lower: lower.clone(),
        isolation: isolation.clone(),
        stop_timeout_ms: 10_000,
        seccomp: true,
        image: None,
    });
    let mut out = Vec::with_capacity(n);
    for name in &names {
        let id = new_id();
        let name = name.clone().unwrap_or_else(|| id.clone());
        let spec = RunSpec {
            command: command.clone(),
            base: base.map(|b| b.to_hex()),
            lower: lower.clone(),
            isolation: isolation.clone(),
            ..template.clone()
        };
        let root = SandboxDirs::new(repo.path(), &id).root;
        std::fs::create_dir_all(&root).map_err(io_error(&name, "create", &root))?;
        out.push(new_record(
            id,
            name,
            if opts.no_start {
                SandboxState::Created
            } else {
                SandboxState::Starting
            },
            &spec,
        ));
    }
    let first = &out[0];
    let first_dirs = SandboxDirs::new(repo.path(), &first.id);
    match &isolation {
        Isolation::Full => {
            // Only the snapshot's difference from the lower layer is written, once,
            // through the first fork's mount; the others copy its upper layer.
            let ov = first_dirs.overlay(&spec_of(first)?);
            mount(repo, &first.name, &ov)?;
            // Unmounted if the seeding fails, or when the forks do not start.
            let mounted = crate::overlay::Unmounting(&ov);
            tine_fs::restore_known(
                lock,
                snap,
                &first_dirs.merged(),
                base_tree,
                made,
                tine_fs::RestoreOptions::sandbox(Some(sandbox_ids(repo))),
                &NoProgress,
            )?;
            if !opts.no_start {
                // The first fork's supervisor takes the mount over.
                mounted.keep();
            }
        }
        Isolation::None { .. } => {
            for rec in &out {
                let plain = SandboxDirs::new(repo.path(), &rec.id).plain();
                tine_fs::restore_with(lock, snap, &plain, IN_REPOSITORY, &NoProgress)?;
            }
        }
    }
    // Records and heads in one transaction: one fsync for all forks.
    lock.record_sandboxes(
        &out,
        &out.iter()
            .map(|r| (head_key(&r.id), *snap))
            .collect::<Vec<_>>(),
    )?;
    // Each fork inherits the ledger up to the snapshot.
    let ledger_head = tine_store::ledger::head_of(repo, snap)?;
    let ids: Vec<&str> = out.iter().map(|r| r.id.as_str()).collect();
    tine_ledger::set_heads(lock, &ids, ledger_head)?;
    // The other forks are seeded, mounted and started in parallel: a start is
    // mostly waiting on new processes, and a seed on the filesystem.
    let seed = |k: usize, rec: &SandboxRecord| -> Result<(), SandboxError> {
        if k > 0 && isolation == Isolation::Full {
            let ov = SandboxDirs::new(repo.path(), &rec.id).overlay(&spec_of(rec)?);
            ov.make_upper()
                .map_err(overlay_error(&rec.name, "make upper layer", &ov.upper))?;
            crate::overlay::copy_upper(&first_dirs.upper(), &ov.upper).map_err(io_error(
                &rec.name,
                "seed upper layer",
                &ov.upper,
            ))?;
            if !opts.no_start {
                mount(repo, &rec.name, &ov)?;
            }
        }
        if opts.no_start {
            return Ok(());
        }
        if let Some(plan) = &native {
            let (spec, held) = (spec_of(rec)?, opts.prepare);
            if held {
                let mark = SandboxDirs::new(repo.path(), &rec.id).prepared_mark();
                std::fs::write(&mark, b"").map_err(io_error(&rec.name, "mark", &mark))?;
            }
            let nested = crate::nested::fork_into(plan, rec, &spec, repo.path(), exe, held)?;
            let first = match held {
                true => FirstRun::Prepared(nested.init_pid),
                false => FirstRun::Adopt(nested.init_pid),
            };
            return launch_with(repo, rec, exe, first);
        }
        let Some((st, src_dirs, criu)) = &procs else {
            return launch(repo, rec, exe);
        };
        let dirs = SandboxDirs::new(repo.path(), &rec.id);
        let mut own = crate::processes::adopt(&rec.name, st, src_dirs, &dirs)
            .map_err(|e| process_error(&rec.name, e))?;
        launch_from_images(repo, rec, exe, &mut own, criu)
    };
    let results: Vec<Result<(), SandboxError>> = std::thread::scope(|sc| {
        // Seeding walks the snapshot's tree: threads with stacks for it.
        let handles: Vec<_> = out
            .iter()
            .enumerate()
            .map(|(k, rec)| tine_fs::paths::spawn_walker(sc, move || seed(k, rec)))
            .collect();
        handles
            .into_iter()
            .zip(&out)
            .map(|(h, rec)| {
                let failed = |e: std::io::Error| io_error(&rec.name, "seed", Path::new(&rec.id))(e);
                h.map_err(failed)?.join().unwrap_or_else(|_| {
                    Err(failed(std::io::Error::other("the seeding thread panicked")))
                })
            })
            .collect()
    });
    if let Some(e) = results.into_iter().find_map(Result::err) {
        // A fork that failed leaves nothing behind: every sandbox this call
        // recorded goes, with its files and mounts (as a failed create).
        for rec in &out {
            if let Ok(r) = repo.sandbox(&rec.id) {
                let _ = remove(repo, &r, true);
            }
        }
        return Err(e);
    }
    (forked.processes, forked.via) = match (&native, &procs) {
        (Some(plan), _) => (plan.processes(), ForkVia::Native),
        (None, Some((st, _, _))) => (st.processes.len(), ForkVia::Criu),
        (None, None) => (0, ForkVia::Afresh),
    };
    forked.prepared = claimed.len();
    if forked.prepared > 0 && forked.via != ForkVia::Native {
        // The claimed ones have the processes; the others' way is `via`.
        let made = format!(
            "the first {} came prepared ahead with the snapshot's processes; the other {} did not",
            forked.prepared,
            out.len()
        );
        forked.note = Some(match forked.note.take() {
            Some(n) => format!("{made}: {n}"),
            None => made,
        });
    }
    claimed.extend(out);
    forked.records = claimed;
    Ok(forked)
}

/// The process state forks of `snap` get from `src`, persisted with CRIU
/// first if it is not yet; `None` (with a note in `forked`) when they start
/// their command afresh instead.
fn fork_processes(
    src: &SandboxRecord,
    snap: &ObjectId,
    private_mounts: &PrivateMounts,
    criu: Option<&crate::criu::Criu>,
    repo_path: &Path,
    forked: &mut Forked,
) -> Result<Option<(ProcessState, SandboxDirs, crate::criu::Criu)>, SandboxError> {
    let src_dirs = SandboxDirs::new(repo_path, &src.id);
    let Some(mut st) = crate::processes::load(&src_dirs, snap) else {
        return Ok(None);
    };
    // What lives in the sandbox's private mounts (not its workspace) is not
    // in the snapshot: a fork cannot give it back. (Descriptors of host
    // files, such as the sandbox's logs, are on other mounts.)
    let private = st.processes.iter().find_map(|c| {
        let external = |fd: i32| {
            c.image
                .as_ref()
                .is_some_and(|i| i.externals.iter().any(|x| x.fd == fd))
        };
        c.template.fds.iter().find_map(|e| match &e.target {
            // Shared memory the template captured: each copy gets its own.
            _ if tine_proc::shm::captures_fd(&c.template.shm, e.fd) => None,
            tine_proc::FdTarget::Path { path } | tine_proc::FdTarget::Deleted { path }
                if private_mounts.hold(e, path, external(e.fd)) =>
            {
                Some((c, path.clone()))
            }
            _ => None,
        })
    });
    if let Some((c, path)) = private {
        forked.note = Some(format!(
            "process {} ({}) holds {}, in sandbox {}'s private {}, which is not part of snapshots: the forks start their command afresh",
            c.ns_pid,
            c.cmdline,
            path.display(),
            src.name,
            if path.starts_with("/tmp") {
                "/tmp"
            } else {
                "/dev/shm"
            }
        ));
        return Ok(None);
    }
    if st.is_tree() {
        forked.note = Some(
            "CRIU does not bring process trees (each child is made again from its parent's copy natively only): the forks start their command afresh"
                .to_string(),
        );
        return Ok(None);
    }
    let Some(criu) = criu else {
        forked.note = Some(format!(
            "the snapshot holds {} of sandbox {}, but bringing processes into new sandboxes needs CRIU (scripts/install-criu.sh): the forks start their command afresh",
            plural_processes(st.processes.len()),
            src.name
        ));
        return Ok(None);
    };
    if !st.persisted() {
        let cg = live_cgroup(src).filter(|_| st.alive());
        let Some(cg) = cg else {
            forked.note = Some(format!(
                "the snapshot's processes were let go (evicted, or sandbox {} restarted) and were not persisted: the forks start their command afresh",
                src.name
            ));
            return Ok(None);
        };
        let t0 = std::time::Instant::now();
        match crate::processes::persist(&src.name, criu, &cg, &src_dirs, &mut st) {
            Ok(_) => {}
            // What CRIU cannot persist, or failed to, forks cannot get:
            // they start afresh, and the note says why.
            Err(e)
                if process_kind(&e) == ErrorKind::Unsupported
                    || matches!(&e, crate::processes::ProcessError::Criu(c)
                        if matches!(**c, crate::criu::CriuError::Failed { .. })) =>
            {
                forked.note = Some(format!("{e}: the forks start their command afresh"));
                return Ok(None);
            }
            Err(e) => return Err(process_error(&src.name, e)),
        }
        forked.persist_ms = t0.elapsed().as_secs_f64() * 1e3;
    }
    Ok(Some((st, src_dirs, criu.clone())))
}

/// A sandbox's private, unsnapshotted mounts (`/tmp`, `/dev/shm` and below,
/// in the mount namespace of its init): what lives there a fork cannot get.
pub(crate) struct PrivateMounts(std::collections::HashSet<u64>);

impl PrivateMounts {
    pub(crate) fn of(init_pid: Option<u32>) -> PrivateMounts {
        let Some(pid) = init_pid else {
            return PrivateMounts(Default::default());
        };
        PrivateMounts(
            std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| {
                    let mut f = l.split_whitespace();
                    let id = f.next()?.parse().ok()?;
                    let point = f.nth(3)?;
                    let private = ["/tmp", "/dev/shm"]
                        .iter()
                        .any(|p| point == *p || point.starts_with(&format!("{p}/")));
                    private.then_some(id)
                })
                .collect(),
        )
    }

    /// Whether descriptor `e` (open on `path`) is on one of them. Without
    /// the mount ids (the sandbox is not running) the path decides, unless
    /// the caller knows the file lives elsewhere (`outside`).
    pub(crate) fn hold(&self, e: &tine_proc::FdEntry, path: &Path, outside: bool) -> bool {
        e.mnt_id.is_some_and(|m| self.0.contains(&m))
            || (self.0.is_empty()
                && !outside
                && (path.starts_with("/tmp") || path.starts_with("/dev/shm")))
    }
}
