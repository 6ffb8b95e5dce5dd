//! End-to-end tests of the `tine` binary.
#![allow(clippy::print_stderr, clippy::print_stdout)]

mod attach;
mod build;
mod cli;
mod common;
mod crash;
mod escape;
mod hostile;
mod images;
mod native;
mod objects;
mod sandbox;
mod serve;
mod sync;
mod trees;
