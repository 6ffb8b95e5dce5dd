//! `tine build`: an image from a Dockerfile, each step a snapshot, an
//! unchanged prefix taken from the build cache. Steps and their output go
//! to stderr as they come; the result to stdout.

use std::io::Write;
use std::path::PathBuf;

use clap::Args as ClapArgs;
use tine_engine::{BuildEvent, BuildImage, Built};

use super::Cx;
use super::sandbox::{NetArg, absolute, parse_size};
use crate::output::CliError;

#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The build context: the directory COPY and ADD read from.
    #[arg(value_name = "DIR")]
    pub context: PathBuf,
    /// The Dockerfile (default: DIR/Dockerfile).
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// A name to give the image (repeatable).
    #[arg(short = 't', long = "tag", value_name = "NAME")]
    pub names: Vec<String>,
    /// The network RUN steps have: none (loopback only), private (outbound
    /// through slirp4netns) or host.
    #[arg(long, value_enum, default_value = "none")]
    pub net: NetArg,
    /// Run every step, even those the build cache holds.
    #[arg(long)]
    pub no_cache: bool,
    /// Memory limit of each RUN step, e.g. 2G.
    #[arg(long, value_parser = parse_size)]
    pub memory: Option<u64>,
    /// A value for one of the Dockerfile's ARGs (repeatable).
    #[arg(long = "build-arg", value_name = "NAME=VALUE")]
    pub build_args: Vec<String>,
    /// Do not show the steps' output as they run.
    #[arg(short, long)]
    pub quiet: bool,
}

fn text(b: &Built) -> String {
    let name = b
        .image
        .names
        .first()
        .cloned()
        .unwrap_or_else(|| "(no name)".to_string());
    let id = b.image.id.strip_prefix("sha256:").unwrap_or(&b.image.id);
    format!(
        "built {name} ({}): {} steps, {} run, {} from the cache, in {:.2} s\n",
        id.get(..12).unwrap_or(id),
        b.steps.len(),
        b.run,
        b.cached,
        b.seconds
    )
}

pub fn run(cx: &Cx<'_>, a: Args) -> Result<(), CliError> {
    let mut build_args = std::collections::BTreeMap::new();
    for a in &a.build_args {
        let (k, v) = a.split_once('=').ok_or_else(|| {
            CliError::new(
                tine_store::ErrorKind::InvalidInput,
                format!("--build-arg {a:?}: give NAME=VALUE"),
            )
        })?;
        build_args.insert(k.to_string(), v.to_string());
    }
    let req = BuildImage {
        build_args,
        context: absolute(a.context),
        dockerfile: a.file.map(absolute),
        names: a.names,
        net: a.net.into(),
        no_cache: a.no_cache,
        memory_bytes: a.memory,
    };
    let quiet = a.quiet;
    let mut err = std::io::stderr();
    let mut events = |e: BuildEvent<'_>| match e {
        BuildEvent::Step {
            step,
            of,
            instruction,
            cached,
        } => {
            let _ = writeln!(
                err,
                "step {step}/{of}: {instruction}{}",
                if cached { "  (cached)" } else { "" }
            );
        }
        BuildEvent::Output(b) if !quiet => {
            let _ = err.write_all(b);
        }
        BuildEvent::Output(_) => {}
    };
    let out = cx.ops()?.build_image(&req, &cx.ctx, &mut events)?;
    crate::emit(
        cx.json,
        serde_json::to_value(&out).unwrap_or_default(),
        || text(&out),
    );
    Ok(())
}
