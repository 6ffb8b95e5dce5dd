//! How the results of the operations every client shares (run, ps, stop, rm;
//! snapshot, restore and fork of sandboxes, diff, merge) read as text: one function per verb,
//! from the JSON document `--json` prints. Locally and through a daemon the
//! document is the engine's, so the text is the same on both routes.

use std::time::Duration;

use serde_json::Value;

use crate::output::{duration, plural, size};

fn n(v: &Value, path: &[&str]) -> u64 {
    path.iter().fold(v, |v, k| &v[*k]).as_u64().unwrap_or(0)
}

fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(0.0)
}

fn s<'v>(v: &'v Value, key: &str) -> &'v str {
    v[key].as_str().unwrap_or_default()
}

/// The first 12 characters of an id.
pub fn short(id: &Value) -> String {
    id.as_str().unwrap_or_default().chars().take(12).collect()
}

fn took(doc: &Value) -> String {
    duration(Duration::from_secs_f64(
        f(doc, "duration_ms").max(0.0) / 1e3,
    ))
}

/// "2 processes captured, paused 3.10 ms; " (nothing when none were).
fn processes(doc: &Value, verb: &str) -> String {
    let count = n(doc, &["processes"]);
    if count == 0 {
        return String::new();
    }
    let mut out = format!(
        "{} {verb}, paused {:.2} ms",
        plural(count, "process"),
        f(doc, "paused_ms")
    );
    if n(doc, &["from_images"]) > 0 {
        out += &format!(" ({} from CRIU images)", n(doc, &["from_images"]));
    }
    if f(doc, "persist_ms") > 0.0 {
        out += &format!(
            ", persisted with CRIU ({}, {:.2} s)",
            size(n(doc, &["persisted_bytes"])),
            f(doc, "persist_ms") / 1e3
        );
    }
    out + "; "
}

/// "frozen 0.84 ms, " when the sandbox was frozen (not when its processes
/// were stopped or killed instead: nothing else could change its files).
fn frozen(doc: &Value) -> String {
    if f(doc, "frozen_ms") > 0.0 {
        format!("frozen {:.2} ms, ", f(doc, "frozen_ms"))
    } else {
        String::new()
    }
}

/// `tine snapshot --sandbox`.
pub fn sandbox_snapshot(doc: &Value) -> String {
    format!(
        "snapshot {} of sandbox {}: read {} changed ({}), stored {} ({}); {}{}{} in all\n",
        short(&doc["id"]),
        s(doc, "sandbox"),
        plural(n(doc, &["stats", "hashed_files"]), "file"),
        size(n(doc, &["stats", "hashed_bytes"])),
        plural(n(doc, &["commit", "new_objects"]), "new object"),
        size(n(doc, &["commit", "new_bytes"])),
        processes(doc, "captured"),
        frozen(doc),
        took(doc),
    ) + &prepared_forks(doc)
}

/// The forks a snapshot prepared (`--prepare-forks`), as a line.
fn prepared_forks(doc: &Value) -> String {
    let p = &doc["prepared_forks"];
    if p.is_null() {
        return String::new();
    }
    match p["note"].as_str() {
        Some(note) if n(p, &["forks"]) == 0 => format!("no forks prepared: {note}\n"),
        _ => format!(
            "prepared {} of it in {:.1} ms (page tables {}): `tine fork {}` claims them\n",
            plural(n(p, &["forks"]), "fork"),
            p["ms"].as_f64().unwrap_or(0.0),
            size(n(p, &["page_table_bytes"])),
            short(&doc["id"]),
        ),
    }
}

/// What a sandbox snapshot's pool let go, one note per snapshot.
pub fn evicted_notes(doc: &Value) -> Vec<String> {
    doc["evicted"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            format!(
                "let go of the process templates of snapshot {} ({}); {}",
                short(&e["snapshot"]),
                size(n(e, &["bytes"])),
                if e["persisted"].as_bool().unwrap_or(false) {
                    "its processes stay restorable from their CRIU images"
                } else {
                    "it stays restorable from its files"
                }
            )
        })
        .collect()
}

/// `tine restore` into a sandbox.
pub fn sandbox_restore(doc: &Value) -> String {
    format!(
        "restored {} into sandbox {}: {} added, {} modified, {} deleted, {} mode changed{}; {}{}{} in all\n",
        short(&doc["snapshot"]),
        s(doc, "sandbox"),
        n(doc, &["added"]),
        n(doc, &["modified"]),
        n(doc, &["deleted"]),
        n(doc, &["mode_changed"]),
        match n(doc, &["owner_changed"]) {
            0 => String::new(),
            k => format!(", {k} owner changed"),
        },
        processes(doc, "brought back"),
        frozen(doc),
        took(doc)
    )
}

/// The note of a restore whose processes could not come back.
pub fn let_go_note(doc: &Value) -> Option<String> {
    let count = n(doc, &["processes_let_go"]);
    let why = doc["let_go_reason"]
        .as_str()
        .unwrap_or("their templates were let go");
    (count > 0).then(|| {
        format!(
            "snapshot {} held {}, but they cannot come back ({}){}: {}",
            short(&doc["snapshot"]),
            plural(count, "process"),
            why,
            if why.starts_with("the rollback failed") {
                ""
            } else {
                " and no CRIU images could bring them"
            },
            if doc["restarted"].as_bool().unwrap_or(false) {
                "the files were restored and the command started afresh over them"
            } else {
                "only the files were restored; the running processes were left alone (a native fork's sandbox cannot start its command afresh)"
            }
        )
    })
}

/// `tine fork` into sandboxes.
pub fn fork(doc: &Value) -> String {
    let forks = doc["sandboxes"].as_array().cloned().unwrap_or_default();
    let each = n(doc, &["processes"]);
    let mut out = format!(
        "forked {} into {} ({}{}) in {}\n",
        short(&doc["snapshot"]),
        plural(forks.len() as u64, "sandbox"),
        if doc["started"].as_bool().unwrap_or(false) {
            "running"
        } else {
            "not started"
        },
        match s(doc, "via") {
            "native" if n(doc, &["prepared"]) > 0 => format!(
                ", each with {} cloned natively; {} prepared ahead",
                plural(each, "process"),
                n(doc, &["prepared"])
            ),
            "native" => format!(", each with {} cloned natively", plural(each, "process")),
            "criu" => format!(", each with {} from CRIU images", plural(each, "process")),
            _ => String::new(),
        },
        took(doc)
    );
    for sb in &forks {
        out += &format!("  {} ({})\n", s(sb, "name"), s(sb, "id"));
    }
    out
}

/// `tine diff`.
pub fn diff(doc: &Value) -> String {
    let changes = doc["changes"].as_array().cloned().unwrap_or_default();
    let patches = doc["patches"].as_array();
    let mut out = String::new();
    let mut kinds = std::collections::BTreeMap::<&str, usize>::new();
    for (i, c) in changes.iter().enumerate() {
        let kind = s(c, "kind");
        *kinds.entry(kind).or_default() += 1;
        let extra = if kind == "mode_changed" {
            let owner = |side: &str| {
                format!(
                    "{}:{}",
                    n(c, &[side, "owner", "uid"]),
                    n(c, &[side, "owner", "gid"])
                )
            };
            let mut e = format!(
                "  ({:o} -> {:o}",
                n(c, &["old", "mode"]),
                n(c, &["new", "mode"])
            );
            if owner("old") != owner("new") {
                e += &format!(", owner {} -> {}", owner("old"), owner("new"));
            }
            e + ")"
        } else {
            String::new()
        };
        out += &format!("{}  {}{extra}\n", letter(kind), s(c, "path"));
        if let Some(p) = patches.and_then(|p| p.get(i)).and_then(Value::as_str) {
            out += p;
        }
    }
    let k = |name: &str| kinds.get(name).copied().unwrap_or(0);
    out += &format!(
        "{}: {} added, {} modified, {} deleted, {} type changed, {} mode changed\n",
        plural(changes.len() as u64, "change"),
        k("added"),
        k("modified"),
        k("deleted"),
        k("type_changed"),
        k("mode_changed")
    );
    out
}

/// The one-letter code of a change kind, as `tine diff` prints it.
fn letter(kind: &str) -> char {
    let kind = serde_json::from_value::<tine_fs::ChangeKind>(Value::from(kind));
    kind.map_or('?', |k| k.letter())
}

/// `tine merge`.
pub fn merge(doc: &Value) -> String {
    let place = match doc["sandbox"].as_str() {
        Some(sb) => format!("sandbox {sb}"),
        None => s(doc, "target").to_string(),
    };
    let conflicts = doc["conflicts"].as_array().cloned().unwrap_or_default();
    let mut out = format!(
        "merged {} into {} (base {}) in {}: snapshot {}; {} taken from theirs, {} merged line by line, {}\n",
        short(&doc["theirs"]),
        short(&doc["ours"]),
        if doc["base"].is_null() {
            "none: no shared history".to_string()
        } else {
            short(&doc["base"])
        },
        place,
        short(&doc["snapshot"]),
        plural(n(doc, &["taken"]), "path"),
        plural(n(doc, &["merged"]), "file"),
        plural(conflicts.len() as u64, "conflict"),
    );
    for c in &conflicts {
        out += &format!("  conflict ({}): {}\n", s(c, "kind"), s(c, "path"));
    }
    out
}

/// `tine run`: the sandbox started.
pub fn started(view: &Value) -> String {
    format!(
        "started sandbox {} ({}): {}\n",
        s(view, "name"),
        s(view, "id"),
        words(&view["command"])
    )
}

/// `tine stop`: the state it is in, and how its command ended.
pub fn stopped(view: &Value) -> String {
    let exit = &view["exit"];
    let how = if exit.is_null() {
        String::new()
    } else if exit["signal"].as_i64() == Some(9) {
        " (killed after the timeout)".to_string()
    } else {
        format!(" (exit code {})", exit["code"])
    };
    format!("sandbox {} is {}{how}\n", s(view, "name"), s(view, "state"))
}

/// `tine rm`: one line per sandbox removed.
pub fn removed(doc: &Value) -> String {
    format!(
        "removed sandbox {} ({})\n",
        s(doc, "name"),
        s(doc, "removed")
    )
}

/// `tine ps`: a table of sandbox views (`all`: ended ones were asked for).
pub fn sandboxes(views: &Value, all: bool) -> String {
    let mut out = format!(
        "{:<14} {:<20} {:<11} {:<20} {:>8}  COMMAND\n",
        "ID", "NAME", "STATE", "CREATED", "RESTARTS"
    );
    let views = views.as_array().cloned().unwrap_or_default();
    for v in &views {
        let mut state = s(v, "state").to_string();
        let exit = &v["exit"];
        if !exit.is_null() && matches!(state.as_str(), "exited" | "stopped") {
            state = if exit["oom"].as_bool().unwrap_or(false) {
                format!("{state} (OOM)")
            } else {
                format!("{state} ({})", exit["code"])
            };
        }
        out += &format!(
            "{:<14} {:<20} {:<11} {:<20} {:>8}  {}\n",
            s(v, "id"),
            s(v, "name"),
            state,
            crate::output::time(n(v, &["created_ns"])),
            n(v, &["restarts"]),
            one_line(&words(&v["command"]), 60)
        );
    }
    if views.is_empty() && !all {
        out += "(no live sandboxes; `tine ps --all` shows ended ones)\n";
    }
    out
}

/// A JSON array of strings as one space-separated line.
fn words(v: &Value) -> String {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect::<Vec<_>>()
        .join(" ")
}

/// `text` on one line, cut at `max` characters.
fn one_line(text: &str, max: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &flat[..at]),
        None => flat,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_sandbox_snapshot_reads_as_one_line_with_its_pause() {
        let doc = json!({
            "id": "0123456789abcdef", "sandbox": "agent",
            "stats": {"hashed_files": 2, "hashed_bytes": 2048},
            "commit": {"new_objects": 3, "new_bytes": 100},
            "processes": 1, "paused_ms": 1.5, "frozen_ms": 0.0, "duration_ms": 12.0,
        });
        assert_eq!(
            sandbox_snapshot(&doc),
            "snapshot 0123456789ab of sandbox agent: read 2 files changed (2.0 KiB), stored 3 new objects (100 B); 1 process captured, paused 1.50 ms; 12.0 ms in all\n"
        );
    }

    #[test]
    fn a_diff_counts_each_kind_and_shows_patches_and_modes() {
        let doc = json!({
            "changes": [
                {"path": "a", "kind": "added"},
                {"path": "b", "kind": "mode_changed", "old": {"mode": 0o644}, "new": {"mode": 0o755}},
            ],
            "patches": ["+x\n", ""],
        });
        assert_eq!(
            diff(&doc),
            "A  a\n+x\nP  b  (644 -> 755)\n2 changes: 1 added, 0 modified, 0 deleted, 0 type changed, 1 mode changed\n"
        );
    }

    #[test]
    fn a_merge_names_its_place_and_lists_conflicts() {
        let doc = json!({
            "ours": "aaaaaaaaaaaaaaaa", "theirs": "bbbbbbbbbbbbbbbb", "base": null,
            "snapshot": "cccccccccccccccc", "target": "/workspace", "sandbox": "sb",
            "taken": 1, "merged": 0, "conflicts": [{"path": "f", "kind": "text"}],
            "duration_ms": 3.0,
        });
        assert_eq!(
            merge(&doc),
            "merged bbbbbbbbbbbb into aaaaaaaaaaaa (base none: no shared history) in sandbox sb: snapshot cccccccccccc; 1 path taken from theirs, 0 files merged line by line, 1 conflict\n  conflict (text): f\n"
        );
    }

    #[test]
    fn ps_shows_how_ended_sandboxes_ended_and_cuts_long_commands() {
        let doc = json!([
            {"id": "a1", "name": "x", "state": "exited", "exit": {"code": 3, "oom": false},
             "created_ns": 0, "restarts": 0, "command": ["sh", "-c", "true"]},
            {"id": "b2", "name": "y", "state": "stopped", "exit": {"code": 137, "oom": true},
             "created_ns": 0, "restarts": 1, "command": ["x".repeat(70)]},
        ]);
        let out = sandboxes(&doc, true);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(lines[1].contains("exited (3)") && lines[1].ends_with("sh -c true"));
        assert!(lines[2].contains("stopped (OOM)") && lines[2].ends_with('…'));
        assert!(sandboxes(&json!([]), false).contains("no live sandboxes"));
    }
}
