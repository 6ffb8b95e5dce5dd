//! Progress reporting without printing: libraries call these hooks, the CLI draws.

/// Receives progress of long operations. All methods default to doing nothing.
pub trait Progress: Sync {
    /// A phase begins; `total` is in the phase's unit (bytes or items), 0 if unknown.
    fn start(&self, _phase: &'static str, _total: u64) {}
    fn advance(&self, _n: u64) {}
    fn finish(&self) {}
}

/// Progress that goes nowhere.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {}
