//! Integration tests of tine-store.

mod model;
mod repo;
