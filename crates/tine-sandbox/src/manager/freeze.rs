//! A sandbox's frozen window, released by a guard.

use super::*;

/// A live sandbox frozen (or nothing, without a cgroup), thawed on the
/// first [`Freeze::thaw`] or when dropped: no early return or panic leaves
/// it frozen.
pub(super) struct Freeze<'a> {
    cg: Option<&'a crate::cgroup::Cgroup>,
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
        cg: Option<&'a crate::cgroup::Cgroup>,
    ) -> Result<Freeze<'a>, SandboxError> {
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
