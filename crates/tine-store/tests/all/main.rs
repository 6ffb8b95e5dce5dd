//! Integration tests of tine-store.
#![allow(clippy::print_stderr, clippy::print_stdout)]

mod model;
mod repo;
