//! `tine log`: snapshots, newest first, optionally as a graph.

use std::collections::HashSet;

use serde_json::json;
use tine_store::{ObjectId, Repository};

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
    let _json = cx.json;
    log(cx.repo, cx.json, graph, limit)
}

fn log(repo: &Repository, json: bool, graph: bool, limit: Option<usize>) -> Result<(), CliError> {
    let mut snaps = repo.snapshots()?;
    snaps.reverse();
    if let Some(n) = limit {
        snaps.truncate(n);
    }
    // Counts only: `log` shows no bytes.
    let held = tine_sandbox::processes::held(repo.path(), false);
    if json {
        let mut doc = serde_json::to_value(&snaps).unwrap_or_default();
        for entry in doc.as_array_mut().into_iter().flatten() {
            let h = entry["id"]
                .as_str()
                .and_then(|h| held.get(h))
                .copied()
                .unwrap_or_default();
            entry["live_processes"] = json!(h.live);
            entry["persisted_processes"] = json!(h.persisted);
        }
        emit(true, doc, String::new);
        return Ok(());
    }
    let line = |s: &tine_store::SnapshotInfo| {
        let mut tags = if s.tags.is_empty() {
            String::new()
        } else {
            format!(" [{}]", s.tags.join(", "))
        };
        if let Some(h) = held.get(&s.id.to_hex()) {
            if h.live > 0 {
                tags += &format!(" (+{})", plural(h.live as u64, "live process"));
            } else if h.persisted > 0 {
                tags += &format!(" (+{} persisted)", plural(h.persisted as u64, "process"));
            }
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
        let present: HashSet<ObjectId> = snaps.iter().map(|s| s.id).collect();
        let mut r = GraphRowRenderer::new()
            .output()
            .with_min_row_height(0)
            .build_box_drawing();
        for s in &snaps {
            let parents = s
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
            out += &r.next_row(s.id, parents, "○".into(), line(s));
        }
    } else {
        for s in &snaps {
            out += &line(s);
            out.push('\n');
        }
    }
    emit(false, serde_json::Value::Null, || out);
    Ok(())
}
