//! `tine fsck`: re-hash everything and name what is damaged; optionally rebuild the index first.

use std::time::Instant;

use tine_store::ErrorKind;

use super::Cx;
use crate::output::{CliError, duration, plural, size};
use crate::{emit, write_lock};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// First rebuild the database's index from the packs where it can:
    /// list every pack file, index every object a pack's own index names,
    /// and give every snapshot object a row that says what it says
    /// (nothing stored is removed)
    #[arg(long)]
    pub rebuild_index: bool,
}

pub fn run(cx: &Cx<'_>, a: Args) -> Result<(), CliError> {
    let Args { rebuild_index } = a;
    let json = cx.json;
    let repo = cx.repo()?;
    if rebuild_index {
        let lock = write_lock(repo, cx.no_wait)?;
        let rb = tine_store::rebuild_index(&lock, cx.bars)?;
        drop(lock);
        if json {
            eprintln!("{}", serde_json::json!({ "rebuilt": rb }));
        } else {
            eprintln!(
                "rebuilt the index from {}: {} listed again, {} indexed, {} recorded, {} repaired{}",
                plural(rb.packs_read, "pack"),
                plural(rb.packs_registered, "pack"),
                plural(rb.objects_indexed, "object"),
                plural(rb.snapshots_recorded.len() as u64, "snapshot"),
                plural(rb.snapshots_repaired.len() as u64, "snapshot row"),
                if rb.packs_unreadable.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; {} unreadable",
                        plural(rb.packs_unreadable.len() as u64, "pack")
                    )
                }
            );
        }
    }
    let t0 = Instant::now();
    let r = tine_store::fsck(repo, cx.bars)?;
    let took = t0.elapsed();
    emit(json, serde_json::to_value(&r).unwrap_or_default(), || {
        let mut s = format!(
            "checked {} in {} ({}) in {}\n",
            plural(r.objects_checked, "object"),
            plural(r.packs_checked, "pack"),
            size(r.bytes_checked),
            duration(took)
        );
        for p in &r.damaged_packs {
            s += &format!("damaged pack {}: {}\n", p.pack, p.reason);
        }
        for d in &r.damaged_objects {
            s += &format!(
                "damaged object {} ({}) in pack {} at offset {}: {}\n",
                d.id, d.kind, d.pack, d.offset, d.reason
            );
        }
        for m in &r.missing_objects {
            s += &format!(
                "missing object {} (referenced by {})\n",
                m.id,
                m.referenced_by.short()
            );
        }
        if !r.affected_snapshots.is_empty() {
            s += "snapshots that cannot be fully restored:\n";
            for a in &r.affected_snapshots {
                let tags = if a.tags.is_empty() {
                    String::new()
                } else {
                    format!(" [{}]", a.tags.join(", "))
                };
                s += &format!(
                    "  {}{tags} {} (needs {})\n",
                    a.id.short(),
                    a.message,
                    plural(a.bad_objects.len() as u64, "bad object")
                );
            }
        }
        for m in &r.mismatched_snapshots {
            s += &format!(
                "snapshot {}: its database row does not match its stored object ({}); `tine fsck --rebuild-index` rewrites the rows from the objects\n",
                m.id.short(),
                m.fields.join(", ")
            );
        }
        if !r.leftover_files.is_empty() || r.unreachable_objects > 0 {
            s += &format!(
                "{} and {} left over from interrupted writes; `tine gc` removes them\n",
                plural(r.leftover_files.len() as u64, "file"),
                plural(r.unreachable_objects, "unreachable object")
            );
        }
        s += if r.is_clean() {
            "repository is clean\n"
        } else {
            "repository is DAMAGED\n"
        };
        s
    });
    if !r.is_clean() {
        return Err(CliError::new(
            ErrorKind::Corrupt,
            format!(
                "fsck found damage: {} damaged objects, {} missing, {} damaged packs, {} affected snapshots, {} snapshot rows that do not match their objects",
                r.damaged_objects.len(),
                r.missing_objects.len(),
                r.damaged_packs.len(),
                r.affected_snapshots.len(),
                r.mismatched_snapshots.len()
            ),
        ));
    }
    Ok(())
}
