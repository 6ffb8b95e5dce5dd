//! What a client hands an operation: where its progress goes, and whether it
//! waits for the repository's write lock when another process holds it.

use tine_store::{NoProgress, OpenError, Progress, Repository, WriteLock};

use crate::EngineError;

/// The caller's side of one operation. The daemon uses [`Ctx::QUIET`]; the
/// CLI passes its progress bars and `--no-wait`.
#[derive(Clone, Copy)]
pub struct Ctx<'a> {
    /// Phases and counts of long work; [`Progress::waiting`] is told when the
    /// operation waits for the write lock.
    pub progress: &'a dyn Progress,
    /// Wait for the write lock (else a held lock is an error at once,
    /// `locked`, exit 7).
    pub wait: bool,
}

impl Ctx<'static> {
    /// Waits for the lock, reports nothing.
    pub const QUIET: Ctx<'static> = Ctx {
        progress: &NoProgress,
        wait: true,
    };
}

impl std::fmt::Debug for Ctx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx").field("wait", &self.wait).finish()
    }
}

impl Ctx<'_> {
    /// The repository's write lock, as this context says to take it.
    pub fn lock<'r>(&self, repo: &'r Repository) -> Result<WriteLock<'r>, EngineError> {
        match repo.lock(false) {
            Ok(l) => Ok(l),
            Err(OpenError::Locked { holder, .. }) if self.wait => {
                self.progress
                    .waiting(&format!("the repository lock (held by {holder})"));
                Ok(repo.lock(true)?)
            }
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Told(Mutex<Vec<String>>);
    impl Progress for Told {
        fn waiting(&self, what: &str) {
            self.0.lock().unwrap().push(what.to_string());
        }
    }

    #[test]
    fn a_held_lock_is_an_error_without_wait_and_is_told_before_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repository::init(&dir.path().join(".tine")).unwrap();
        let other = Repository::open(repo.path()).unwrap();
        let held = other.lock(false).unwrap();
        let told = Told::default();
        let no_wait = Ctx {
            progress: &told,
            wait: false,
        };
        let err = no_wait.lock(&repo).unwrap_err();
        assert_eq!(
            tine_store::HasKind::kind(&err),
            tine_store::ErrorKind::Locked,
            "{err}"
        );
        assert!(told.0.lock().unwrap().is_empty());
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                Ctx {
                    progress: &told,
                    wait: true,
                }
                .lock(&repo)
                .map(|_| ())
            });
            while told.0.lock().unwrap().is_empty() {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            drop(held);
            waiter.join().unwrap().unwrap();
        });
        let said = told.0.lock().unwrap();
        assert_eq!(said.len(), 1);
        assert!(
            said[0].starts_with("the repository lock (held by pid "),
            "{said:?}"
        );
    }
}
