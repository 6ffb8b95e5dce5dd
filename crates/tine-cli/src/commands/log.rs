//! `tine log`: snapshots, newest first, optionally as a graph.

use std::collections::HashSet;

use tine_store::ObjectId;

use super::Cx;
use crate::emit;
use crate::output::{CliError, count, plural, size, time};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Draw the parent graph.
    #[arg(long)]
    pub graph: bool,
    /// Show at most N snapshots.
    #[arg(short = 'n', long)]
    pub limit: Option<usize>,
}

pub fn run(cx: &Cx<'_>, a: Args) -> Result<(), CliError> {
    let Args { graph, limit } = a;
    let snaps = cx.ops()?.snapshots(limit)?;
    if cx.json {
        emit(
            true,
            serde_json::to_value(&snaps).unwrap_or_default(),
            String::new,
        );
        return Ok(());
    }
    log(&snaps, graph)
}

fn log(snaps: &[tine_engine::SnapshotEntry], graph: bool) -> Result<(), CliError> {
    let line = |e: &tine_engine::SnapshotEntry| {
        let s = &e.info;
        let mut tags = if s.tags.is_empty() {
            String::new()
        } else {
            format!(" [{}]", s.tags.join(", "))
        };
        if e.live_processes > 0 {
            tags += &format!(" (+{})", plural(e.live_processes as u64, "live process"));
        } else if e.persisted_processes > 0 {
            tags += &format!(
                " (+{} persisted)",
                plural(e.persisted_processes as u64, "process")
            );
        }
        format!(
            "{}  {}  {:>7}  {:>9}{tags}  {}",
            s.id.short(),
            time(s.time_ns),
            count(s.files),
            size(s.bytes),
            s.message
        )
    };
    let mut out = String::new();
    if snaps.is_empty() {
        eprintln!("no snapshots yet (take one with `tine snapshot`)");
        return Ok(());
    }
    if graph {
        use renderdag::{Ancestor, GraphRowRenderer, Renderer};
        let present: HashSet<ObjectId> = snaps.iter().map(|s| s.info.id).collect();
        let mut r = GraphRowRenderer::new()
            .output()
            .with_min_row_height(0)
            .build_box_drawing();
        for s in snaps {
            let parents = s
                .info
                .parents
                .iter()
                .map(|p| {
                    if present.contains(p) {
                        Ancestor::Parent(*p)
                    } else {
                        Ancestor::Anonymous
                    }
                })
                .collect();
            out += &r.next_row(s.info.id, parents, "○".into(), line(s));
        }
    } else {
        for s in snaps {
            out += &line(s);
            out.push('\n');
        }
    }
    emit(false, serde_json::Value::Null, || out);
    Ok(())
}
