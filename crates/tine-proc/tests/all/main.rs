//! Integration tests of tine-proc (one binary; modules by topic), run against
//! real processes.
#![allow(clippy::print_stderr)]

mod dirty;
mod fdtable;
mod inspect;
mod native;
