//! Integration tests of tine-fs (one binary; modules by topic).

mod common;
mod corrupt;
mod model;
mod safety;
mod scan;
mod targets;
