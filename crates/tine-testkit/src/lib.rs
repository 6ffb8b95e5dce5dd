//! Test and bench harness shared by tine's crates (never a dependency of a
//! library crate): skips, and a local S3 server ([`seaweed`]).
//!
//! A test that cannot run here (no root, no CRIU, no `weed`, no
//! filesystem it needs) calls [`skip`] and returns. The skip is reported on
//! stderr and, when `TINE_SKIP_LOG` names a file, appended to it by name, so
//! that `scripts/test.sh` lists every skip at the end. Under
//! `TINE_REQUIRE_PRIVILEGED=1` (`scripts/test.sh` sets it when run as root)
//! a skip fails the test instead: on CI nothing passes by skipping.
#![forbid(unsafe_code)]
#![allow(clippy::print_stderr)]

pub mod seaweed;

use std::io::Write;
use std::path::{Path, PathBuf};

/// Set to `1`: every skip is a failure.
pub const REQUIRE_VAR: &str = "TINE_REQUIRE_PRIVILEGED";
/// A file each skip is appended to, one `test: why` line each.
pub const SKIP_LOG_VAR: &str = "TINE_SKIP_LOG";

/// Whether this process runs as root.
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// The running test's name (libtest names each test's thread after it).
fn test_name() -> String {
    std::thread::current()
        .name()
        .unwrap_or("an unnamed test")
        .to_string()
}

/// Reports that the running test cannot run here because of `why`, and
/// returns true (callers return early); under `TINE_REQUIRE_PRIVILEGED=1`
/// it panics instead.
#[track_caller]
pub fn skip(why: &str) -> bool {
    let required = std::env::var_os(REQUIRE_VAR).is_some_and(|v| v == "1");
    let log = std::env::var_os(SKIP_LOG_VAR).map(PathBuf::from);
    if let Err(refused) = report(&test_name(), why, required, log.as_deref()) {
        panic!("{refused}");
    }
    true
}

/// Says that test `name` is skipped (stderr, and a line in `log`), or, when
/// skips are not allowed, why that fails.
fn report(name: &str, why: &str, required: bool, log: Option<&Path>) -> Result<(), String> {
    if required {
        return Err(format!(
            "{name} cannot run here: {why}. {REQUIRE_VAR}=1 makes every skip a failure \
             (scripts/test.sh installs what the tests need and sets it when run as root)"
        ));
    }
    eprintln!("SKIPPED {name}: {why}");
    if let Some(log) = log {
        // One short write with O_APPEND: lines of concurrent tests do not mix.
        let line = format!("{name}: {why}\n");
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .and_then(|mut f| f.write_all(line.as_bytes()));
    }
    Ok(())
}

/// [`skip`]s unless running as root: `what` needs it.
#[track_caller]
pub fn skipped_without_root(what: &str) -> bool {
    !is_root() && skip(&format!("{what} needs root"))
}

/// Starts `cmd` with its output piped and waits for its first line (a
/// program saying it is ready), which is returned with it.
pub fn started_and_ready(cmd: &mut std::process::Command) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut c = cmd
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the program");
    let mut line = String::new();
    std::io::BufReader::new(c.stdout.as_mut().expect("its output"))
        .read_line(&mut line)
        .expect("read its first line");
    (c, line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_logged_by_name_or_refused_when_skips_are_not_allowed() {
        let dir = std::env::temp_dir().join(format!("tine-testkit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("skips");
        report("mod::a", "no weed", false, Some(&log)).unwrap();
        report("mod::b", "needs root", false, Some(&log)).unwrap();
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            "mod::a: no weed\nmod::b: needs root\n"
        );
        let refused = report("mod::c", "CRIU is not installed", true, Some(&log)).unwrap_err();
        assert!(refused.contains("mod::c") && refused.contains("CRIU is not installed"));
        assert!(refused.contains(REQUIRE_VAR), "{refused}");
        // A refused skip is not listed as a skip.
        assert_eq!(std::fs::read_to_string(&log).unwrap().lines().count(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_running_tests_name_is_its_threads() {
        assert!(test_name().ends_with("the_running_tests_name_is_its_threads"));
    }
}
