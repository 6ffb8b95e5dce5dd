//! Property test: random create / modify / delete / rename / chmod / symlink /
//! mkdir operations, snapshots and restores leave the directory identical to a
//! simple in-memory model at the restored point.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use proptest::prelude::*;
use proptest::sample::Index;

use crate::common::{Entry, Env, read_tree};

#[derive(Debug, Clone)]
pub(crate) enum Op {
    Create {
        dir: Index,
        name: u8,
        content: Vec<u8>,
        mode: u32,
    },
    Modify {
        pick: Index,
        content: Vec<u8>,
    },
    Delete {
        pick: Index,
    },
    Rename {
        pick: Index,
        dir: Index,
        name: u8,
    },
    Chmod {
        pick: Index,
        mode: u32,
    },
    Symlink {
        dir: Index,
        name: u8,
        target: u8,
    },
    Mkdir {
        dir: Index,
        name: u8,
        mode: u32,
    },
    Snapshot,
    Restore {
        pick: Index,
    },
}

fn content() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        // Same-length contents: a stale stat cache would miss these edits.
        prop::sample::select(vec![b"aaaa".to_vec(), b"bbbb".to_vec(), b"cccc".to_vec()]),
        prop::collection::vec(any::<u8>(), 0..64),
        // Sometimes large enough to be chunked.
        (0u8..4).prop_map(|b| vec![b; 1_300_000]),
    ]
}

fn mode() -> impl Strategy<Value = u32> {
    prop::sample::select(vec![0o644, 0o755, 0o600, 0o444, 0o4755])
}

pub(crate) fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (any::<Index>(), 0u8..4, content(), mode()).prop_map(|(dir, name, content, mode)| Op::Create { dir, name, content, mode }),
        3 => (any::<Index>(), content()).prop_map(|(pick, content)| Op::Modify { pick, content }),
        2 => any::<Index>().prop_map(|pick| Op::Delete { pick }),
        1 => (any::<Index>(), any::<Index>(), 0u8..4).prop_map(|(pick, dir, name)| Op::Rename { pick, dir, name }),
        1 => (any::<Index>(), mode()).prop_map(|(pick, mode)| Op::Chmod { pick, mode }),
        1 => (any::<Index>(), 0u8..4, 0u8..4).prop_map(|(dir, name, target)| Op::Symlink { dir, name, target }),
        1 => (any::<Index>(), 0u8..4, prop::sample::select(vec![0o755, 0o700, 0o750])).prop_map(|(dir, name, mode)| Op::Mkdir { dir, name, mode }),
        2 => Just(Op::Snapshot),
        2 => any::<Index>().prop_map(|pick| Op::Restore { pick }),
    ]
}

pub(crate) type Model = BTreeMap<String, Entry>;

fn dirs(m: &Model) -> Vec<String> {
    let mut v = vec![String::new()];
    v.extend(
        m.iter()
            .filter(|(_, e)| matches!(e, Entry::Dir(_)))
            .map(|(p, _)| p.clone()),
    );
    v
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

pub(crate) fn apply(root: &Path, m: &mut Model, op: &Op) {
    match op {
        Op::Create {
            dir,
            name,
            content,
            mode,
        } => {
            let ds = dirs(m);
            let p = join(dir.get::<String>(&ds), &format!("f{name}"));
            if m.contains_key(&p) {
                return;
            }
            let abs = root.join(&p);
            fs::write(&abs, content).unwrap();
            fs::set_permissions(&abs, fs::Permissions::from_mode(*mode)).unwrap();
            m.insert(p, Entry::File(content.clone(), *mode));
        }
        Op::Modify { pick, content } => {
            let files: Vec<String> = m
                .iter()
                .filter(|(_, e)| matches!(e, Entry::File(..)))
                .map(|(p, _)| p.clone())
                .collect();
            if files.is_empty() {
                return;
            }
            let p = pick.get(&files).clone();
            let abs = root.join(&p);
            let Some(Entry::File(_, mode)) = m.get(&p).cloned() else {
                unreachable!()
            };
            fs::set_permissions(&abs, fs::Permissions::from_mode(0o644)).unwrap();
            fs::write(&abs, content).unwrap();
            fs::set_permissions(&abs, fs::Permissions::from_mode(mode)).unwrap();
            m.insert(p, Entry::File(content.clone(), mode));
        }
        Op::Delete { pick } => {
            let all: Vec<String> = m.keys().cloned().collect();
            if all.is_empty() {
                return;
            }
            let p = pick.get(&all).clone();
            let abs = root.join(&p);
            if let Some(Entry::Dir(_)) = m.get(&p) {
                fs::remove_dir_all(&abs).unwrap();
            } else {
                fs::remove_file(&abs).unwrap();
            }
            let prefix = format!("{p}/");
            m.retain(|k, _| k != &p && !k.starts_with(&prefix));
        }
        Op::Rename { pick, dir, name } => {
            let all: Vec<String> = m.keys().cloned().collect();
            if all.is_empty() {
                return;
            }
            let from = pick.get(&all).clone();
            let ds: Vec<String> = dirs(m)
                .into_iter()
                .filter(|d| d != &from && !d.starts_with(&format!("{from}/")))
                .collect();
            let to = join(dir.get::<String>(&ds), &format!("r{name}"));
            if m.contains_key(&to) {
                return;
            }
            fs::rename(root.join(&from), root.join(&to)).unwrap();
            let prefix = format!("{from}/");
            let moved: Vec<(String, Entry)> = m
                .iter()
                .filter(|(k, _)| *k == &from || k.starts_with(&prefix))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            for (k, v) in moved {
                m.remove(&k);
                m.insert(format!("{to}{}", &k[from.len()..]), v);
            }
        }
        Op::Chmod { pick, mode } => {
            let files: Vec<String> = m
                .iter()
                .filter(|(_, e)| matches!(e, Entry::File(..)))
                .map(|(p, _)| p.clone())
                .collect();
            if files.is_empty() {
                return;
            }
            let p = pick.get(&files).clone();
            fs::set_permissions(root.join(&p), fs::Permissions::from_mode(*mode)).unwrap();
            if let Some(Entry::File(c, _)) = m.get(&p).cloned() {
                m.insert(p, Entry::File(c, *mode));
            }
        }
        Op::Symlink { dir, name, target } => {
            let ds = dirs(m);
            let p = join(dir.get::<String>(&ds), &format!("l{name}"));
            if m.contains_key(&p) {
                return;
            }
            let t = format!("../t{target}");
            std::os::unix::fs::symlink(&t, root.join(&p)).unwrap();
            m.insert(p, Entry::Symlink(t.into_bytes()));
        }
        Op::Mkdir { dir, name, mode } => {
            let ds = dirs(m);
            let p = join(dir.get::<String>(&ds), &format!("d{name}"));
            if m.contains_key(&p) {
                return;
            }
            fs::create_dir(root.join(&p)).unwrap();
            fs::set_permissions(root.join(&p), fs::Permissions::from_mode(*mode)).unwrap();
            m.insert(p, Entry::Dir(*mode));
        }
        Op::Snapshot | Op::Restore { .. } => unreachable!(),
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let env = Env::new();
    let root = env.dir("work");
    let mut model = Model::new();
    let mut snaps: Vec<(tine_store::ObjectId, Model)> = Vec::new();
    for op in &ops {
        match op {
            Op::Snapshot => {
                let out = env.snapshot(&root);
                snaps.push((out.id, model.clone()));
            }
            Op::Restore { pick } => {
                if snaps.is_empty() {
                    continue;
                }
                let (id, m) = pick.get(&snaps).clone();
                env.restore(&id, &root)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                model = m;
                prop_assert_eq!(&read_tree(&root), &model, "after restoring {}", id.short());
            }
            op => apply(&root, &mut model, op),
        }
    }
    // Every snapshot is still restorable, into a fresh directory too.
    for (i, (id, m)) in snaps.iter().enumerate() {
        let fresh = env.dir(&format!("fresh{i}"));
        env.restore(id, &fresh)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&read_tree(&fresh), m);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, max_shrink_iters: 200, ..ProptestConfig::default() })]

    #[test]
    fn snapshots_and_restores_match_the_model(ops in prop::collection::vec(op(), 1..40)) {
        run(ops)?;
    }
}
