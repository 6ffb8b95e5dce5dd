//! `tine diff`: changes between two snapshots or against live files (through the engine).

use std::path::PathBuf;

use super::Cx;
use crate::output::CliError;
use crate::{emit, render};

#[derive(clap::Args, Debug)]
pub struct Args {
    pub a: String,
    pub b: Option<String>,
    /// Include unified diffs of text files.
    #[arg(short = 'p', long)]
    pub patch: bool,
    /// Live directory to compare with when B is not given (default: the snapshot's source).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

pub fn run(cx: &Cx<'_>, a: Args) -> Result<(), CliError> {
    let Args { a, b, patch, dir } = a;
    let req = tine_engine::DiffRequest { to: b, dir, patch };
    let out = cx.ops()?.diff(&a, &req, &cx.ctx)?;
    let doc = serde_json::to_value(&out).unwrap_or_default();
    emit(cx.json, doc.clone(), || render::diff(&doc));
    Ok(())
}
