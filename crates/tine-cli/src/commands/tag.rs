//! `tine tag`: list, set or delete tags.

use serde_json::json;
use tine_store::ErrorKind;

use super::Cx;
use crate::emit;
use crate::output::CliError;

#[derive(clap::Args, Debug)]
pub struct Args {
    pub name: Option<String>,
    pub snapshot: Option<String>,
    #[arg(short, long)]
    pub delete: bool,
    /// Move an existing tag.
    #[arg(short, long)]
    pub force: bool,
}

pub fn run(cx: &Cx<'_>, a: Args) -> Result<(), CliError> {
    let Args {
        name,
        snapshot,
        delete,
        force,
    } = a;
    let json = cx.json;
    match (name, snapshot, delete) {
        (Some(name), None, true) => {
            let was = cx.ops()?.untag(&name, &cx.ctx)?;
            emit(json, json!({"deleted": name, "was": was}), || {
                format!("deleted tag {name} (was {})\n", was.short())
            });
        }
        (Some(name), Some(snap), false) => {
            let id = cx.ops()?.tag(&snap, &name, force, &cx.ctx)?;
            emit(json, json!({"tag": name, "snapshot": id}), || {
                format!("tagged {} as {name}\n", id.short())
            });
        }
        (None, None, false) => {
            cx.local("listing tags")?;
            let tags = cx.repo()?.tags()?;
            let doc = json!(
                tags.iter()
                    .map(|(n, id)| json!({"tag": n, "snapshot": id}))
                    .collect::<Vec<_>>()
            );
            emit(json, doc, || {
                tags.iter()
                    .map(|(n, id)| format!("{n}\t{}\n", id.short()))
                    .collect()
            });
        }
        (Some(_), None, false) => {
            return Err(CliError::new(
                ErrorKind::InvalidInput,
                "tag: give both TAG and SNAPSHOT, or --delete TAG",
            ));
        }
        _ => {
            return Err(CliError::new(
                ErrorKind::InvalidInput,
                "tag: use `tine tag`, `tine tag NAME SNAPSHOT` or `tine tag --delete NAME`",
            ));
        }
    };
    Ok(())
}
