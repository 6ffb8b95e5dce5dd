//! Progress reporting without printing: libraries call these hooks, the CLI draws.

/// Receives progress of long operations. All methods default to doing nothing.
pub trait Progress: Sync {
    /// A phase begins; `total` is in the phase's unit (bytes or items), 0 if unknown.
    fn start(&self, _phase: &'static str, _total: u64) {}
    fn advance(&self, _n: u64) {}
    fn finish(&self) {}
    /// The operation waits for something another process holds (`what`
    /// names it and its holder); it goes on by itself once that is free.
    fn waiting(&self, _what: &str) {}
}

/// Progress that goes nowhere.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {}
