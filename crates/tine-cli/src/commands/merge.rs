//! `tine merge`: three-way merge into a directory or a running sandbox (through the engine).

use std::path::PathBuf;

use tine_store::ErrorKind;

use super::Cx;
use crate::output::CliError;
use crate::{emit, render};

#[derive(clap::Args, Debug)]
pub struct Args {
    pub a: String,
    pub b: String,
    /// The base to merge against (default: the nearest common ancestor).
    #[arg(long, value_name = "SNAPSHOT")]
    pub base: Option<String>,
    /// The directory to write the result into (new or empty).
    #[arg(long, value_name = "DIR", required_unless_present = "sandbox")]
    pub into: Option<PathBuf>,
    /// Put the result into this running sandbox instead (its files are
    /// restored to the merge's snapshot, in place; its processes run on).
    #[arg(long, value_name = "SB", conflicts_with = "into")]
    pub sandbox: Option<String>,
    #[arg(short, long)]
    pub message: Option<String>,
}

pub fn run(cx: &Cx<'_>, a: Args) -> Result<(), CliError> {
    let Args {
        a,
        b,
        base,
        into,
        sandbox,
        message,
    } = a;
    let req = tine_engine::MergeRequest {
        ours: a,
        theirs: b,
        base,
        message,
    };
    let into = match (sandbox, into) {
        (Some(sb), _) => tine_engine::MergeInto::Sandbox(sb),
        (None, Some(dir)) => tine_engine::MergeInto::Dir(dir),
        (None, None) => unreachable!("clap requires --into or --sandbox"),
    };
    let out = cx.ops()?.merge(&req, &into, &cx.ctx)?;
    let doc = serde_json::to_value(&out).unwrap_or_default();
    emit(cx.json, doc.clone(), || render::merge(&doc));
    if !out.outcome.conflicts.is_empty() {
        return Err(CliError::exit(ErrorKind::Conflict.exit_code() as i32));
    }
    Ok(())
}
