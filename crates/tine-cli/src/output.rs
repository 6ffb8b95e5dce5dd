//! Human-readable formatting, progress bars and the error-to-exit-code mapping.

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use tine_store::{ErrorKind, Progress};

/// A failure the CLI reports: its kind decides the exit code.
#[derive(Debug)]
pub struct CliError {
    pub kind: ErrorKind,
    pub message: String,
    /// Leave with this exit code and say nothing (`tine exec` passing on its command's).
    pub exit: Option<u8>,
}

impl CliError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> CliError {
        CliError {
            kind,
            message: message.into(),
            exit: None,
        }
    }

    /// A silent exit with a command's own code.
    pub fn exit(code: i32) -> CliError {
        CliError {
            kind: ErrorKind::Internal,
            message: String::new(),
            exit: Some(code.clamp(0, 255) as u8),
        }
    }
}

impl<E: tine_store::HasKind + std::fmt::Display> From<E> for CliError {
    fn from(e: E) -> CliError {
        CliError {
            kind: e.kind(),
            message: e.to_string(),
            exit: None,
        }
    }
}

pub use tine_store::human::size;

pub fn duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 0.001 {
        format!("{:.0} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else if s < 120.0 {
        format!("{s:.2} s")
    } else {
        format!("{}m{:02}s", (s / 60.0) as u64, (s % 60.0) as u64)
    }
}

pub fn count(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The CRIU binary: `TINE_CRIU`, else where scripts/install-criu.sh puts it.
pub fn criu() -> tine_engine::Criu {
    let bin = std::env::var_os("TINE_CRIU")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/opt/tine-criu/criu"));
    tine_engine::Criu { bin }
}

/// The CRIU binary if one is installed (restores and forks use it only when
/// a snapshot's templates are gone, or for new sandboxes).
pub fn criu_at_hand() -> Option<tine_engine::Criu> {
    let c = criu();
    c.bin.is_file().then_some(c)
}

/// This binary's path, for the processes it starts (supervisors, bench runs).
pub fn tine_exe() -> Result<std::path::PathBuf, CliError> {
    std::env::current_exe()
        .map_err(|e| CliError::new(ErrorKind::Io, format!("locating the tine binary: {e}")))
}

pub fn plural(n: u64, word: &str) -> String {
    let w = match (n, word.strip_suffix('y')) {
        (1, _) => word.to_string(),
        (_, Some(stem)) => format!("{stem}ies"),
        _ if word.ends_with('x') || word.ends_with('s') => format!("{word}es"),
        _ => format!("{word}s"),
    };
    format!("{} {w}", count(n))
}

/// Local time of a nanosecond timestamp.
pub fn time(ns: u64) -> String {
    match jiff::Timestamp::from_nanosecond(i128::from(ns)) {
        Ok(ts) => ts
            .to_zoned(jiff::tz::TimeZone::system())
            .strftime("%Y-%m-%d %H:%M:%S")
            .to_string(),
        Err(_) => ns.to_string(),
    }
}

/// A secret read from the file a flag names, without its surrounding whitespace.
pub fn read_secret(flag: &str, path: &std::path::Path) -> Result<String, CliError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|e| {
            CliError::new(
                ErrorKind::InvalidInput,
                format!("{flag} {}: {e}", path.display()),
            )
        })
}

/// Progress bars on stderr, drawn only when stderr is a terminal.
#[derive(Debug)]
pub struct Bars {
    enabled: bool,
    bar: Mutex<Option<ProgressBar>>,
}

impl Bars {
    pub fn new(enabled: bool) -> Bars {
        Bars {
            enabled: enabled && std::io::stderr().is_terminal(),
            bar: Mutex::new(None),
        }
    }
}

impl Progress for Bars {
    fn start(&self, phase: &'static str, total: u64) {
        if !self.enabled {
            return;
        }
        let pb = if total > 0 {
            ProgressBar::new(total).with_style(
                ProgressStyle::with_template("{msg:>10} [{bar:30}] {pos}/{len} {eta}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            )
        } else {
            ProgressBar::new_spinner().with_style(
                ProgressStyle::with_template("{spinner} {msg} {bytes} read")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            )
        };
        pb.set_message(phase);
        pb.enable_steady_tick(Duration::from_millis(120));
        *self.bar.lock().unwrap_or_else(|e| e.into_inner()) = Some(pb);
    }

    fn advance(&self, n: u64) {
        if let Some(pb) = self.bar.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            pb.inc(n);
        }
    }

    fn waiting(&self, what: &str) {
        // Said even with --json (on stderr): a silent wait looks like a hang.
        eprintln!("tine: waiting for {what}...");
    }

    fn finish(&self) {
        if let Some(pb) = self.bar.lock().unwrap_or_else(|e| e.into_inner()).take() {
            pb.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_units() {
        assert_eq!(size(512), "512 B");
        assert_eq!(size(1536), "1.5 KiB");
        assert_eq!(size(60 << 20), "60.0 MiB");
        assert_eq!(duration(Duration::from_micros(1500)), "1.5 ms");
        assert_eq!(count(1234567), "1,234,567");
        assert_eq!(plural(1, "file"), "1 file");
        assert_eq!(plural(2, "directory"), "2 directories");
        assert_eq!(plural(16, "sandbox"), "16 sandboxes");
    }
}
