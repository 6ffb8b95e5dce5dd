//! End-to-end tests of the `tine` binary.

mod cli;
mod common;
mod crash;
