//! Integration tests of tine-proc (one binary; modules by topic), run against
//! real processes.

mod fdtable;
mod inspect;
mod native;
