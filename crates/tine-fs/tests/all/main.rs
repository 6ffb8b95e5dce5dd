//! Integration tests of tine-fs (one binary; modules by topic).
#![allow(clippy::print_stderr, clippy::print_stdout)]

mod common;
mod corrupt;
mod layered;
mod merge;
mod model;
mod owners;
mod safety;
mod scan;
mod targets;
