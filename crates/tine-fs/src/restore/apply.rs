//! Applying a restore: plan, verify every object the plan will write, then
//! remove, create, write in parallel and set modes; files with more than one
//! link are replaced, never written through.

use super::*;

/// Plans, verifies and applies a restore over what `current` says is in
/// `target`; with `cache`, writes the target's stat cache and records its head.
pub(super) fn apply(
    lock: &WriteLock<'_>,
    snap: &ObjectId,
    target: PathBuf,
    mut current: Scan,
    cache: Option<(PathBuf, u64, CacheBuilder)>,
    opts: RestoreOptions,
    progress: &dyn Progress,
) -> Result<RestoreOutcome, RestoreError> {
    let repo = lock.repo();
    let tree = &repo.read_snapshot(snap)?.tree;
    let trees = Trees::new(repo, Some(&current.trees));

    // 1. Plan.
    let mut plan = Plan {
        opts,
        ..Plan::default()
    };
    plan.sync(&trees, Some(&current.root), tree, &[])?;
    if !current.excluded_root_names.is_empty() {
        let top = trees.load(tree)?;
        for n in &current.excluded_root_names {
            if top.entries.iter().any(|e| &e.name == n) {
                return Err(RestoreError::WouldOverwriteRepository {
                    name: String::from_utf8_lossy(n).into_owned(),
                });
            }
        }
    }

    // Nothing to change (a rollback whose files did not): no directory
    // opened, no pool woken, inside the pause.
    if plan.ops.is_empty() && plan.setid_dropped.is_empty() && cache.is_none() {
        return outcome(repo, snap, target, &plan, 0, current.warnings);
    }

    // 2. Verify everything that will be written: of a file rewritten in
    // place, the chunks it does not hold already.
    let mut dirs = Dirs::new(&target)?;
    let mut held: HashMap<&[u8], Held> = HashMap::new();
    for op in &plan.ops {
        if let Op::Write {
            path,
            content,
            existing: true,
            ..
        } = op
            && content.kind == Kind::Chunked
        {
            let (parent, name) = split(path);
            // (A directory that cannot be opened fails the write below.)
            if let Ok(pfd) = dirs.get(parent)
                && let Some(h) = chunks_held(repo, pfd, name, content)
            {
                held.insert(path.as_slice(), h);
            }
        }
    }
    let writes: Vec<(Content, Option<&[bool]>)> = plan
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::Write { path, content, .. } => Some((
                *content,
                held.get(path.as_slice()).map(|h| h.same.as_slice()),
            )),
            _ => None,
        })
        .collect();
    let fetched = prefetch(repo, &writes, progress)?;

    // 3. Apply.
    let mut warnings = std::mem::take(&mut current.warnings);
    for p in &plan.setid_dropped {
        warnings.push(Warning {
            path: dirs.abs(p).display().to_string(),
            message: "set-user-ID/set-group-ID bit not restored (--keep-setuid restores it)".into(),
        });
    }
    let mut touched: Vec<Vec<u8>> = Vec::new();
    for op in &plan.ops {
        match op {
            Op::Remove { path, current } => {
                let (parent, _) = split(path);
                remove_entry(&mut dirs, &trees, parent, current, &mut warnings)?;
                touched.push(path.clone());
            }
            Op::Mkdir { path, owner } => {
                let (parent, name) = split(path);
                let abs = dirs.abs(path);
                let pfd = dirs.get(parent)?;
                match rustix::fs::mkdirat(pfd, os(name), Mode::from_raw_mode(0o700))
                    .and_then(|()| opts.own(pfd, name, *owner))
                {
                    Ok(()) => {}
                    Err(rustix::io::Errno::EXIST) => {
                        // Something untracked (ignored) is in the way; a directory is fine.
                        let is_dir = rustix::fs::statat(pfd, os(name), AtFlags::SYMLINK_NOFOLLOW)
                            .map(|st| {
                                rustix::fs::FileType::from_raw_mode(st.st_mode)
                                    == rustix::fs::FileType::Directory
                            })
                            .unwrap_or(false);
                        if !is_dir {
                            clear_path(pfd, name).map_err(io_err("replace", abs.clone()))?;
                            rustix::fs::mkdirat(pfd, os(name), Mode::from_raw_mode(0o700))
                                .and_then(|()| opts.own(pfd, name, *owner))
                                .map_err(|e| io_err("create directory", abs)(errno(e)))?;
                        } else {
                            // Kept: it still gets the owner recorded.
                            opts.own(pfd, name, *owner)
                                .map_err(|e| io_err("chown", abs)(errno(e)))?;
                        }
                    }
                    Err(e) => return Err(io_err("create directory", abs)(errno(e))),
                }
            }
            Op::Symlink {
                path,
                target: link,
                owner,
            } => {
                let (parent, name) = split(path);
                let abs = dirs.abs(path);
                let pfd = dirs.get(parent)?;
                create_replacing(pfd, name, || rustix::fs::symlinkat(os(link), pfd, os(name)))
                    .and_then(|()| opts.own(pfd, name, *owner).map_err(errno))
                    .map_err(io_err("create symlink", abs))?;
                touched.push(path.clone());
            }
            Op::Write { path, .. } => {
                dirs.get(split(path).0)?;
            }
            Op::Chown {
                path,
                owner,
                mode,
                dir,
            } => {
                chown(&mut dirs, &opts, path, *owner, *mode, *dir)?;
                touched.push(path.clone());
            }
            Op::Chmod { .. } => {}
        }
    }
    let writes: Vec<&Op> = plan
        .ops
        .iter()
        .filter(|op| matches!(op, Op::Write { .. }))
        .collect();
    progress.start("writing", writes.len() as u64);
    let written: Vec<Result<Written, RestoreError>> = crate::scan::in_pool(|| {
        writes
            .par_iter()
            .map(|op| {
                let Op::Write {
                    path,
                    content,
                    size,
                    mode,
                    existing,
                    owner,
                } = op
                else {
                    unreachable!()
                };
                let (parent, name) = split(path);
                let abs = dirs.abs(path);
                let pfd = &dirs.fds[parent];
                let file = open_for_write(pfd, name, *existing, opts.host(*owner))
                    .map_err(io_err("open for writing", abs.clone()))?;
                let mut file = File::from(file);
                // (Only where it is still the file whose chunks were read.)
                let same = held
                    .get(path.as_slice())
                    .filter(|h| h.is(&file))
                    .map(|h| h.same.as_slice());
                let (n, wrote) = write_content(repo, &fetched, content, &mut file, &abs, same)?;
                if n != *size {
                    return Err(RestoreError::Object(ObjectError::Damaged {
                        id: content.id,
                        pack: "?".into(),
                        offset: 0,
                        reason: format!("content is {n} bytes, the tree says {size}"),
                    }));
                }
                file.set_len(*size)
                    .map_err(io_err("truncate", abs.clone()))?;
                rustix::fs::fchmod(file.as_fd(), Mode::from_raw_mode(*mode))
                    .map_err(|e| io_err("chmod", abs.clone())(errno(e)))?;
                let md = file.metadata().map_err(io_err("stat", abs.clone()))?;
                progress.advance(1);
                Ok((
                    path.clone(),
                    CacheEntry {
                        stat: StatKey::of(&md),
                        content: *content,
                    },
                    wrote,
                ))
            })
            .collect()
    });
    progress.finish();
    let mut bytes_written = 0;
    let mut first_err = None;
    let mut fresh = crate::statcache::CacheBuilder::default();
    for r in written {
        match r {
            Ok((path, entry, n)) => {
                bytes_written += n;
                if !entry.stat.is_racy(current.started_ns) {
                    let (dir, name) = split(&path);
                    fresh.push(dir, name, &entry);
                }
                touched.push(path);
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    for op in &plan.ops {
        if let Op::Chmod { path, mode, dir } = op {
            let abs = dirs.abs(path);
            if *dir {
                let fd = dirs.get(path)?;
                rustix::fs::fchmod(fd, Mode::from_raw_mode(*mode))
                    .map_err(|e| io_err("chmod", abs)(errno(e)))?;
            } else {
                let (parent, name) = split(path);
                let pfd = dirs.get(parent)?;
                let fd = open_alone(pfd, name, &abs, "open for chmod")?;
                rustix::fs::fchmod(&fd, Mode::from_raw_mode(*mode))
                    .map_err(|e| io_err("chmod", abs)(errno(e)))?;
                touched.push(path.clone());
            }
        }
    }
    let Some((cpath, generation, mut new_cache)) = cache else {
        return outcome(repo, snap, target, &plan, bytes_written, warnings);
    };
    if !touched.is_empty() {
        let touched: HashSet<&[u8]> = touched.iter().map(|t| t.as_slice()).collect();
        // Drop entries for touched paths and anything below them.
        new_cache
            .retain(|k| !(touched.contains(k) || inner_ancestors(k).any(|a| touched.contains(a))));
    }
    new_cache.append(fresh);
    // The cache only saves time; failing to write it must not fail the restore.
    // It is written while the head is recorded (an fsync).
    let head_result = std::thread::scope(|sc| {
        let writer = sc.spawn(|| new_cache.save(&cpath, repo.repo_id(), generation, &target));
        let head_result = lock.set_head(&target.to_string_lossy(), snap);
        let _ = writer.join();
        head_result
    });
    head_result?;
    outcome(repo, snap, target, &plan, bytes_written, warnings)
}

pub(super) fn outcome(
    repo: &tine_store::Repository,
    snap: &ObjectId,
    target: PathBuf,
    plan: &Plan,
    bytes_written: u64,
    warnings: Vec<Warning>,
) -> Result<RestoreOutcome, RestoreError> {
    Ok(RestoreOutcome {
        snapshot: Some(*snap),
        target,
        added: plan.added,
        modified: plan.modified,
        deleted: plan.deleted,
        mode_changed: plan.mode_changed,
        owner_changed: plan.owner_changed,
        bytes_written,
        files: repo.snapshot_info(snap)?.map_or(0, |i| i.files),
        warnings,
    })
}

/// Replaces `name` in `pfd` (open at `fd`, which has other links) with a
/// copy of its content (temporary name, then rename); returns the copy.
pub(super) fn unlink_copy(pfd: &OwnedFd, name: &[u8], fd: OwnedFd) -> io::Result<OwnedFd> {
    let mut tmp = b".tine-restore-".to_vec();
    tmp.extend_from_slice(name.get(..200).unwrap_or(name));
    let copy = create_replacing(pfd, &tmp, || {
        rustix::fs::openat(
            pfd,
            os(&tmp),
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
    })?;
    // The copy keeps the original's owner.
    let owner = rustix::fs::fstat(&fd).map_err(errno)?;
    let (from, to) = (File::from(fd), File::from(copy));
    let copied = rustix::fs::fchown(
        &to,
        Some(rustix::fs::Uid::from_raw(owner.st_uid)),
        Some(rustix::fs::Gid::from_raw(owner.st_gid)),
    )
    .map_err(errno)
    .and_then(|()| crate::sparse::copy(&from, &to))
    .and_then(|_| rustix::fs::renameat(pfd, os(&tmp), pfd, os(name)).map_err(errno));
    if let Err(e) = copied {
        let _ = rustix::fs::unlinkat(pfd, os(&tmp), AtFlags::empty());
        return Err(e);
    }
    Ok(OwnedFd::from(to))
}

/// A file written by restore: its path, what to cache for it, and bytes written.
type Written = (Vec<u8>, CacheEntry, u64);

/// Whether the file open at `fd` has other names: writing it in place would
/// write them too (a link made in the target may name a file outside it).
pub(super) fn is_linked(fd: &OwnedFd) -> bool {
    rustix::fs::fstat(fd).is_ok_and(|st| st.st_nlink > 1)
}

/// Opens file `name` in `pfd` (at `abs`) for a change of its mode or owner;
/// one with other links is replaced by a copy of its own first, so that
/// the change reaches no other name. `step` names the open in errors.
fn open_alone(
    pfd: &OwnedFd,
    name: &[u8],
    abs: &Path,
    step: &'static str,
) -> Result<OwnedFd, RestoreError> {
    let fd = rustix::fs::openat(
        pfd,
        os(name),
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_err(step, abs)(errno(e)))?;
    if !is_linked(&fd) {
        return Ok(fd);
    }
    unlink_copy(pfd, name, fd).map_err(io_err("copy a hard-linked file", abs))
}

/// Gives the entry at `path` (which stays) `owner`, then `mode`; a file
/// with other links gets a copy of its own first, as for a mode.
fn chown(
    dirs: &mut Dirs,
    opts: &RestoreOptions,
    path: &[u8],
    owner: Owner,
    mode: u32,
    dir: bool,
) -> Result<(), RestoreError> {
    let Some((uid, gid)) = opts.host(owner) else {
        return Ok(());
    };
    let abs = dirs.abs(path);
    let (uid, gid) = (
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(gid)),
    );
    if dir {
        let fd = dirs.get(path)?;
        return rustix::fs::fchown(fd, uid, gid)
            .and_then(|()| rustix::fs::fchmod(fd, Mode::from_raw_mode(mode)))
            .map_err(|e| io_err("chown", abs)(errno(e)));
    }
    let (parent, name) = split(path);
    let pfd = dirs.get(parent)?;
    let st = rustix::fs::statat(pfd, os(name), AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| io_err("stat", abs.clone())(errno(e)))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Symlink {
        return rustix::fs::chownat(pfd, os(name), uid, gid, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io_err("chown", abs)(errno(e)));
    }
    let fd = open_alone(pfd, name, &abs, "open for chown")?;
    rustix::fs::fchown(&fd, uid, gid)
        .and_then(|()| rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode)))
        .map_err(|e| io_err("chown", abs)(errno(e)))
}

/// Opens `name` in `pfd` for writing its content; a file made here is
/// given `owner` (host IDs) when there is one.
pub(super) fn open_for_write(
    pfd: &OwnedFd,
    name: &[u8],
    existing: bool,
    owner: Option<(u32, u32)>,
) -> io::Result<OwnedFd> {
    // NONBLOCK: a FIFO swapped in since the scan fails (ENXIO) instead of hanging.
    let base = OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
    if existing {
        // In place: same inode, so descriptors other processes hold see the
        // new content — unless the file has other links: then a new file.
        match rustix::fs::openat(pfd, os(name), base, Mode::empty()) {
            Ok(fd) if is_linked(&fd) => {
                drop(fd);
                clear_path(pfd, name)?;
            }
            Ok(fd) => return Ok(fd),
            // Read-only file (and not root): replace it instead.
            Err(rustix::io::Errno::ACCESS | rustix::io::Errno::PERM) => clear_path(pfd, name)?,
            Err(e) => return Err(errno(e)),
        }
    }
    let fd = create_replacing(pfd, name, || {
        rustix::fs::openat(
            pfd,
            os(name),
            base | OFlags::CREATE | OFlags::EXCL,
            Mode::from_raw_mode(0o600),
        )
    })?;
    if let Some((uid, gid)) = owner {
        rustix::fs::fchown(
            &fd,
            Some(rustix::fs::Uid::from_raw(uid)),
            Some(rustix::fs::Gid::from_raw(gid)),
        )
        .map_err(errno)?;
    }
    Ok(fd)
}
