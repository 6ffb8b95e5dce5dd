//! `tine show`: one snapshot in full, or one of its attachments.

use std::path::Path;

use tine_store::ErrorKind;

use super::Cx;
use crate::emit;
use crate::output::{CliError, count, plural, size, time};

#[derive(clap::Args, Debug)]
pub struct Args {
    pub snapshot: String,
    /// Write the named attachment's content to stdout.
    #[arg(long, value_name = "NAME")]
    pub attachment: Option<String>,
}

pub fn run(cx: &Cx<'_>, a: Args) -> Result<(), CliError> {
    let Args {
        snapshot,
        attachment,
    } = a;
    let json = cx.json;
    if let Some(name) = attachment {
        cx.local("show --attachment")?;
        let repo = cx.repo()?;
        let id = cx.resolve(&snapshot)?;
        let obj = repo.read_snapshot(&id)?;
        let a = obj
            .attachments
            .iter()
            .find(|a| a.name == name)
            .ok_or_else(|| {
                let names: Vec<&str> = obj.attachments.iter().map(|a| a.name.as_str()).collect();
                CliError::new(
                    ErrorKind::NotFound,
                    format!(
                        "snapshot {} has no attachment {name:?} (it has: {})",
                        id.short(),
                        if names.is_empty() {
                            "none".into()
                        } else {
                            names.join(", ")
                        }
                    ),
                )
            })?;
        let mut out = std::io::stdout().lock();
        repo.write_content(&a.content, &mut out, Path::new("<stdout>"))?;
        return Ok(());
    }
    let ops = cx.ops()?;
    let d = ops.snapshot(&snapshot)?;
    let id = d.info.id;
    emit(json, serde_json::to_value(&d).unwrap_or_default(), || {
        let mut s = format!("snapshot    {id}\ntree        {}\n", d.info.tree);
        for p in &d.info.parents {
            s += &format!(
                "parent      {}{}\n",
                p.short(),
                if ops.snapshot(&p.to_hex()).is_err() {
                    " (pruned)"
                } else {
                    ""
                }
            );
        }
        s += &format!(
            "time        {}\nsource      {}\n",
            time(d.info.time_ns),
            d.info.source
        );
        if !d.info.tags.is_empty() {
            s += &format!("tags        {}\n", d.info.tags.join(", "));
        }
        s += &format!(
            "files       {} ({})\n",
            count(d.info.files),
            size(d.info.bytes)
        );
        if let Some(h) = &d.processes {
            if h.live > 0 {
                s += &format!(
                    "processes   {} live (templates hold {} of their own)\n",
                    plural(h.live as u64, "process"),
                    size(h.private_bytes)
                );
            }
            if h.persisted > 0 {
                s += &format!(
                    "persisted   {} with CRIU ({} of images)\n",
                    plural(h.persisted as u64, "process"),
                    size(h.persisted_bytes)
                );
            }
        }
        if let Some(p) = &d.prepared_forks {
            s += &format!(
                "prepared    {} ready to be claimed (page tables {})\n",
                plural(p.forks as u64, "fork"),
                size(p.page_table_bytes)
            );
        }
        if !d.info.message.is_empty() {
            s += &format!("message     {}\n", d.info.message);
        }
        for a in &d.attachments {
            s += &format!("attachment  {}  {}\n", a.name, size(a.size));
        }
        s
    });
    Ok(())
}
