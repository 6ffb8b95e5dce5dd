//! A sandbox's frozen window, released by a guard; and the lock that lets
//! a freeze whose holder was killed (no guard runs on `SIGKILL`) be found
//! and thawed.

use super::*;

/// Takes `dirs`'s freeze lock (`SANDBOX/freeze.lock`), held by whoever has
/// the sandbox frozen: the kernel lets it go when its holder dies, so a
/// frozen sandbox whose lock is free was left frozen. Without it there is
/// no freeze: the supervisor would take the sandbox for one left frozen.
pub(super) fn take_freeze_lock(dirs: &SandboxDirs) -> std::io::Result<std::fs::File> {
    let path = dirs.freeze_lock();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        // (A lock needs no write access: one made by another user of the
        // repository is taken read-only.)
        .or_else(|_| std::fs::File::open(&path))?;
    loop {
        match f.lock() {
            Ok(()) => return Ok(f),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Thaws `cg` when it is frozen and nobody holds its freeze lock: its
/// freezer was killed inside its frozen window. Whether it thawed.
pub fn thaw_abandoned(dirs: &SandboxDirs, cg: &crate::cgroup::Cgroup) -> bool {
    let Ok(f) = std::fs::File::open(dirs.freeze_lock()) else {
        return false;
    };
    if f.try_lock().is_err() {
        // Frozen by someone alive, or being checked by someone else.
        return false;
    }
    cg.is_frozen().unwrap_or(false) && cg.thaw().is_ok()
}

/// A live sandbox frozen (or nothing, without a cgroup), thawed on the
/// first [`Freeze::thaw`] or when dropped: no early return or panic leaves
/// it frozen.
pub(super) struct Freeze<'a> {
    cg: Option<&'a crate::cgroup::Cgroup>,
    /// Held until thawed (see [`take_freeze_lock`]).
    lock: Option<std::fs::File>,
    /// When the freeze was asked for.
    t0: std::time::Instant,
    /// How long it was frozen, once thawed.
    thawed: Option<Duration>,
}

impl<'a> Freeze<'a> {
    /// Freezes `cg`. Callers start the worker threads first
    /// ([`tine_fs::warm_up`]), so that the frozen window does not pay for them.
    pub(super) fn begin(
        rec: &SandboxRecord,
        dirs: &SandboxDirs,
        cg: Option<&'a crate::cgroup::Cgroup>,
    ) -> Result<Freeze<'a>, SandboxError> {
        let lock = match cg {
            Some(_) => Some(take_freeze_lock(dirs).map_err(|e| {
                io_error(&rec.name, "take the freeze lock", &dirs.freeze_lock())(e)
            })?),
            None => None,
        };
        let t0 = std::time::Instant::now();
        if let Some(cg) = cg
            && let Err(e) = cg.freeze(Duration::from_secs(5))
        {
            // A freeze that did not complete (a task stuck in the kernel) must
            // not leave the group FREEZING: the sandbox would hang.
            let _ = cg.thaw();
            return Err(io_error(&rec.name, "freeze", &cg.dirs()[0])(
                std::io::Error::other(e.to_string()),
            ));
        }
        Ok(Freeze {
            cg,
            lock,
            t0,
            thawed: None,
        })
    }

    /// Thaws (the first time); how long the sandbox was frozen, in ms (0
    /// without a cgroup).
    pub(super) fn thaw(&mut self) -> f64 {
        let took = *self.thawed.get_or_insert_with(|| {
            if let Some(cg) = self.cg {
                let _ = cg.thaw();
            }
            // Thawed: nobody holds it frozen any more.
            self.lock = None;
            self.t0.elapsed()
        });
        if self.cg.is_some() {
            took.as_secs_f64() * 1e3
        } else {
            0.0
        }
    }
}

impl Drop for Freeze<'_> {
    fn drop(&mut self) {
        self.thaw();
    }
}
