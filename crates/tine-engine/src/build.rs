//! `tine build`: a Dockerfile run step by step over an image, each step
//! that changes files a snapshot whose parent is the step before. `RUN`
//! runs in a sandbox made from the snapshot so far (isolated as any
//! sandbox); `COPY`/`ADD` write the context's files into a fresh upper
//! layer over it. A step's key digests the key before it, the image's
//! configuration so far, the instruction and the files it copies: a key
//! already in the build cache (and its snapshot still there) is not run
//! again, so an unchanged prefix of a Dockerfile costs nothing.

use std::collections::VecDeque;
use std::io::{Read, Seek};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tine_image::Digest;
use tine_image::dockerfile::{self, Command, Copy, Instruction, Step};
use tine_sandbox::manager;
use tine_store::{
    BuildStep, ErrorKind, ImageLayer, ImageRecord, Node, ObjectId, Repository, now_ns,
};

use crate::images::{file_in_snapshot, resolve_user, view};
use crate::{Ctx, Engine, EngineError, ImageView};

/// What `tine build` asks for.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BuildImage {
    /// The build context: the directory `COPY` and `ADD` read from.
    pub context: PathBuf,
    /// The Dockerfile (default: `Dockerfile` in the context).
    pub dockerfile: Option<PathBuf>,
    /// Names to give the image.
    pub names: Vec<String>,
    /// The network `RUN` steps have (default: none, loopback only).
    pub net: tine_sandbox::Net,
    /// Run every step, cached or not.
    pub no_cache: bool,
    /// A memory limit for each `RUN` step's sandbox.
    pub memory_bytes: Option<u64>,
    /// Values of the Dockerfile's `ARG`s (`--build-arg NAME=VALUE`).
    pub build_args: std::collections::BTreeMap<String, String>,
}

/// One step as a build went through it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BuiltStep {
    /// 1 is the `FROM`.
    pub step: usize,
    pub line: usize,
    pub instruction: String,
    /// Found in the build cache, not run.
    pub cached: bool,
    /// The root filesystem after it, where it changes files.
    pub snapshot: Option<String>,
    pub seconds: f64,
    /// A `RUN` step run: the last 4 KiB of its output.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub output: String,
}

/// What a build made.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Built {
    pub image: ImageView,
    pub steps: Vec<BuiltStep>,
    /// Steps that changed files and were run (not cached).
    pub run: usize,
    /// Steps that changed files and were found in the cache.
    pub cached: usize,
    pub seconds: f64,
}

/// What a build reports as it goes.
#[derive(Debug)]
pub enum BuildEvent<'a> {
    Step {
        step: usize,
        of: usize,
        instruction: &'a str,
        cached: bool,
    },
    /// Output of a `RUN` step, as it comes.
    Output(&'a [u8]),
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{path}: {source}")]
    Dockerfile {
        path: String,
        source: tine_image::dockerfile::DockerfileError,
    },
    #[error("step {step} ({instruction}): {message}")]
    Step {
        step: usize,
        instruction: String,
        message: String,
    },
    #[error("step {step} ({instruction}): the command exited with {code}{}", if output.is_empty() { String::new() } else { format!("; its last output:\n{output}") })]
    Failed {
        step: usize,
        instruction: String,
        code: i32,
        output: String,
    },
}

impl BuildError {
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidInput
    }
}

/// The image as the build has it so far.
struct State {
    snapshot: ObjectId,
    /// The whole OCI configuration.
    config: Value,
    key: String,
    layers: Vec<ImageLayer>,
    /// The build arguments declared so far, with their values.
    args: Vec<(String, String)>,
}

impl State {
    fn section(&mut self) -> &mut serde_json::Map<String, Value> {
        if !self.config["config"].is_object() {
            self.config["config"] = json!({});
        }
        self.config["config"]
            .as_object_mut()
            .expect("made an object")
    }

    fn env(&self) -> Vec<(String, String)> {
        self.config["config"]["Env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str()?.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// What `$NAME` expands to and a `RUN` step gets in its environment:
    /// the build arguments, then the image's environment (which wins).
    fn scope(&self) -> Vec<(String, String)> {
        let mut v = self.args.clone();
        v.extend(self.env());
        v
    }

    fn get(&self, key: &str) -> Option<String> {
        self.config["config"][key]
            .as_str()
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    }

    fn workdir(&self) -> String {
        self.get("WorkingDir")
            .filter(|w| w.starts_with('/'))
            .unwrap_or_else(|| "/".into())
    }
}

fn digest_str(parts: &[&[u8]]) -> String {
    let mut all = Vec::new();
    for p in parts {
        all.extend_from_slice(&(p.len() as u64).to_le_bytes());
        all.extend_from_slice(p);
    }
    Digest::of(&all).to_string()
}

/// `path` (absolute, or relative to `base`) as components, `.` and `..`
/// resolved lexically, never above `/`.
fn components(base: &str, path: &str) -> Vec<Vec<u8>> {
    let full = if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{base}/{path}")
    };
    let mut out: Vec<Vec<u8>> = Vec::new();
    for c in full.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c.as_bytes().to_vec()),
        }
    }
    out
}

/// One component of a path resolved in a snapshot: its name and, where it
/// is there, its entry.
type Resolved = Vec<(Vec<u8>, Option<tine_store::TreeEntry>)>;

/// `path` resolved in the tree `root` as the image's processes would see
/// it: symbolic links followed inside the image (an absolute target from
/// its root), the last one too when `follow_last`.
fn resolve(
    repo: &Repository,
    root: &ObjectId,
    path: &[Vec<u8>],
    follow_last: bool,
) -> Result<Resolved, String> {
    let mut done: Resolved = Vec::new();
    let mut todo: VecDeque<Vec<u8>> = path.iter().cloned().collect();
    let mut hops = 0;
    while let Some(c) = todo.pop_front() {
        if c.is_empty() || c == b"." {
            continue;
        }
        if c == b".." {
            done.pop();
            continue;
        }
        let tree = match done.last() {
            None => Some(*root),
            Some((_, Some(e))) => match &e.node {
                Node::Dir { tree } => Some(*tree),
                _ => {
                    return Err(format!(
                        "/{} is not a directory",
                        show(&done.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>())
                    ));
                }
            },
            // Below something missing: missing too.
            Some((_, None)) => None,
        };
        let entry = match tree {
            Some(t) => repo
                .read_tree(&t)
                .map_err(|e| e.to_string())?
                .entries
                .into_iter()
                .find(|e| e.name == c),
            None => None,
        };
        if let Some(e) = &entry
            && let Node::Symlink { target } = &e.node
            && (!todo.is_empty() || follow_last)
        {
            hops += 1;
            if hops > 40 {
                return Err(format!(
                    "too many symbolic links on the way to /{}",
                    show(path)
                ));
            }
            if target.starts_with(b"/") {
                done.clear();
            }
            for t in target.split(|b| *b == b'/').rev() {
                todo.push_front(t.to_vec());
            }
            continue;
        }
        done.push((c, entry));
    }
    Ok(done)
}

fn show(path: &[Vec<u8>]) -> String {
    path.iter()
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// A directory of the upper layer at `rel`, made like `like` (its entry in
/// the layers below), else 0755 root's.
fn make_dir(
    upper: &Path,
    rel: &[Vec<u8>],
    like: Option<&tine_store::TreeEntry>,
    as_root: bool,
) -> std::io::Result<()> {
    let p = host_path(upper, rel);
    match std::fs::symlink_metadata(&p) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(_) => std::fs::remove_file(&p)?,
        Err(_) => {}
    }
    std::fs::create_dir(&p)?;
    let (mode, uid, gid) = like
        .map(|e| (e.mode, e.owner.uid, e.owner.gid))
        .unwrap_or((0o755, 0, 0));
    set_meta(&p, mode, uid, gid, as_root)
}

fn set_meta(p: &Path, mode: u32, uid: u32, gid: u32, as_root: bool) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if as_root {
        std::os::unix::fs::lchown(p, Some(uid), Some(gid))?;
    }
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode & 0o7777))
}

fn host_path(upper: &Path, rel: &[Vec<u8>]) -> PathBuf {
    let mut p = upper.to_path_buf();
    for c in rel {
        p.push(std::ffi::OsStr::from_bytes(c));
    }
    p
}

/// The context's `.dockerignore`: patterns of paths in the context (`*`,
/// `?` within a name, `**` for any depth; `#` comments), a leading `!`
/// taking a path back; the last pattern that matches a path, or a directory
/// above it, decides. What it leaves out, `COPY` and `ADD` never see.
#[derive(Debug, Default)]
pub(crate) struct Ignore {
    context: PathBuf,
    rules: Vec<(bool, Vec<Vec<u8>>)>,
}

impl Ignore {
    fn load(context: &Path) -> Ignore {
        let text = std::fs::read_to_string(context.join(".dockerignore")).unwrap_or_default();
        let rules = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| {
                let (keep, pat) = match l.strip_prefix('!') {
                    Some(p) => (true, p.trim()),
                    None => (false, l),
                };
                (!keep, components("/", pat))
            })
            .filter(|(_, p)| !p.is_empty())
            .collect();
        Ignore {
            context: context.to_path_buf(),
            rules,
        }
    }

    /// Whether the context's file at `path` is left out.
    fn ignored(&self, path: &Path) -> bool {
        let Ok(rel) = path.strip_prefix(&self.context) else {
            return false;
        };
        let rel: Vec<Vec<u8>> = rel
            .components()
            .map(|c| c.as_os_str().as_bytes().to_vec())
            .collect();
        let mut out = false;
        for (exclude, pat) in &self.rules {
            if (1..=rel.len()).any(|n| path_match(pat, &rel[..n])) {
                out = *exclude;
            }
        }
        out
    }
}

/// `pat` (components; `**` for any number of them) against `path`.
fn path_match(pat: &[Vec<u8>], path: &[Vec<u8>]) -> bool {
    match pat.split_first() {
        None => path.is_empty(),
        Some((p, rest)) if p == b"**" => (0..=path.len()).any(|k| path_match(rest, &path[k..])),
        Some((p, rest)) => {
            !path.is_empty() && glob_match(p, &path[0]) && path_match(rest, &path[1..])
        }
    }
}

/// A file or directory of the context to copy, found from a source (its
/// last component may hold `*` and `?`).
struct Source {
    path: PathBuf,
    name: Vec<u8>,
    is_dir: bool,
}

fn glob_match(pat: &[u8], name: &[u8]) -> bool {
    match (pat.first(), name.first()) {
        (None, None) => true,
        (Some(b'*'), _) => {
            glob_match(&pat[1..], name) || (!name.is_empty() && glob_match(pat, &name[1..]))
        }
        (Some(b'?'), Some(_)) => glob_match(&pat[1..], &name[1..]),
        (Some(p), Some(n)) if p == n => glob_match(&pat[1..], &name[1..]),
        _ => false,
    }
}

/// The context's files a source names, each checked to be inside it.
fn sources(context: &Path, src: &str, ign: &Ignore) -> Result<Vec<Source>, String> {
    let rel = components("/", src);
    let inside = |p: &Path| -> Result<PathBuf, String> {
        let real = std::fs::canonicalize(p).map_err(|e| format!("{src}: {e}"))?;
        if real.starts_with(context) {
            Ok(real)
        } else {
            Err(format!(
                "{src} leads outside the build context {} (through a symbolic link)",
                context.display()
            ))
        }
    };
    let (dir_part, last) = match rel.split_last() {
        Some((l, d)) => (d.to_vec(), Some(l.clone())),
        None => (vec![], None),
    };
    let mut found = Vec::new();
    match last {
        Some(l) if l.contains(&b'*') || l.contains(&b'?') => {
            let dir = inside(&host_path(context, &dir_part))?;
            let mut names: Vec<Vec<u8>> = std::fs::read_dir(&dir)
                .map_err(|e| format!("{src}: {e}"))?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().as_bytes().to_vec())
                .filter(|n| glob_match(&l, n))
                .collect();
            names.sort();
            for n in names {
                let real = inside(&dir.join(std::ffi::OsStr::from_bytes(&n)))?;
                if ign.ignored(&real) {
                    continue;
                }
                found.push(Source {
                    is_dir: real.is_dir(),
                    path: real,
                    name: n,
                });
            }
            if found.is_empty() {
                return Err(format!("{src}: nothing in the build context matches it"));
            }
        }
        l => {
            let real = inside(&host_path(context, &rel))?;
            if ign.ignored(&real) {
                return Err(format!("{src}: the context's .dockerignore leaves it out"));
            }
            found.push(Source {
                is_dir: real.is_dir(),
                path: real,
                name: l.unwrap_or_default(),
            });
        }
    }
    Ok(found)
}

/// What a source holds, digested (names, kinds, modes, link targets and
/// contents, in order): what a copy's cache key is made of.
fn digest_tree(path: &Path, ign: &Ignore, out: &mut Vec<u8>) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path)?;
    out.extend_from_slice(format!("{:o} {}\0", m.mode(), m.len()).as_bytes());
    if m.file_type().is_symlink() {
        out.extend_from_slice(std::fs::read_link(path)?.as_os_str().as_bytes());
    } else if m.is_file() {
        let mut h = tine_image::digest::Hashing::new(std::io::sink());
        std::io::copy(&mut std::fs::File::open(path)?, &mut h)?;
        out.extend_from_slice(h.finish().0.to_string().as_bytes());
    } else if m.is_dir() {
        let mut names: Vec<_> = std::fs::read_dir(path)?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        names.sort();
        for n in names {
            if ign.ignored(&path.join(&n)) {
                continue;
            }
            out.extend_from_slice(n.as_bytes());
            out.push(0);
            digest_tree(&path.join(&n), ign, out)?;
        }
    }
    out.push(b'\n');
    Ok(())
}

/// How files are copied: their owner (`--chown`) and mode (`--chmod`).
#[derive(Clone, Copy)]
struct CopyAs<'a> {
    owner: Option<(u32, u32)>,
    chmod: Option<u32>,
    as_root: bool,
    ignore: &'a Ignore,
}

/// Copies `src` (a directory's contents, or a file, or a link) to `dest`
/// of the upper layer, its directories resolved in the snapshot below.
fn copy_into(
    repo: &Repository,
    root: &ObjectId,
    upper: &Path,
    src: &Path,
    dest: &[Vec<u8>],
    how: CopyAs<'_>,
) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(src).map_err(|e| format!("{}: {e}", src.display()))?;
    let err = |e: std::io::Error| format!("/{}: {e}", show(dest));
    let (uid, gid) = how.owner.unwrap_or((0, 0));
    let mode = |m: u32| how.chmod.unwrap_or(m & 0o7777);
    if m.is_dir() {
        let real = ensure_dir(
            repo,
            root,
            upper,
            dest,
            how.as_root,
            Some((mode(m.mode()), uid, gid)),
        )?;
        let mut names: Vec<_> = std::fs::read_dir(src)
            .map_err(|e| format!("{}: {e}", src.display()))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        names.sort();
        for n in names {
            if how.ignore.ignored(&src.join(&n)) {
                continue;
            }
            let mut d = real.clone();
            d.push(n.as_bytes().to_vec());
            copy_into(repo, root, upper, &src.join(&n), &d, how)?;
        }
        return Ok(());
    }
    let Some((name, parent)) = dest.split_last() else {
        return Err("cannot copy a file onto /".into());
    };
    let mut real = ensure_dir(repo, root, upper, parent, how.as_root, None)?;
    real.push(name.clone());
    // What is there below: a directory is not replaced by a file.
    let below = resolve(repo, root, &real, false)?;
    if let Some((_, Some(e))) = below.last()
        && matches!(e.node, Node::Dir { .. })
    {
        return Err(format!(
            "/{} is a directory in the image; copy into it with a destination ending in /",
            show(&real)
        ));
    }
    let p = host_path(upper, &real);
    if let Ok(old) = std::fs::symlink_metadata(&p) {
        if old.is_dir() {
            std::fs::remove_dir_all(&p).map_err(err)?;
        } else {
            std::fs::remove_file(&p).map_err(err)?;
        }
    }
    if m.file_type().is_symlink() {
        let t = std::fs::read_link(src).map_err(err)?;
        std::os::unix::fs::symlink(&t, &p).map_err(err)?;
        if how.as_root {
            std::os::unix::fs::lchown(&p, Some(uid), Some(gid)).map_err(err)?;
        }
    } else if m.is_file() {
        std::fs::copy(src, &p).map_err(err)?;
        set_meta(&p, mode(m.mode()), uid, gid, how.as_root).map_err(err)?;
    }
    // Devices, FIFOs and sockets of the context are left out.
    Ok(())
}

/// Makes directory `rel` (resolved in the snapshot) in the upper layer,
/// with the directories on the way as the snapshot has them; the resolved
/// path. `fresh`: the mode and owner for the last one, if it is not there.
fn ensure_dir(
    repo: &Repository,
    root: &ObjectId,
    upper: &Path,
    rel: &[Vec<u8>],
    as_root: bool,
    fresh: Option<(u32, u32, u32)>,
) -> Result<Vec<Vec<u8>>, String> {
    let got = resolve(repo, root, rel, true)?;
    let mut path = Vec::new();
    let n = got.len();
    for (i, (name, e)) in got.into_iter().enumerate() {
        path.push(name);
        let made = match (&e, fresh) {
            (Some(e), _) if !matches!(e.node, Node::Dir { .. }) => {
                return Err(format!("/{} is not a directory in the image", show(&path)));
            }
            (None, Some((mode, uid, gid))) if i + 1 == n => {
                let fake = tine_store::TreeEntry {
                    name: vec![],
                    mode,
                    owner: tine_store::Owner { uid, gid },
                    node: Node::Symlink { target: vec![] },
                };
                make_dir(upper, &path, Some(&fake), as_root)
            }
            (e, _) => make_dir(upper, &path, e.as_ref(), as_root),
        };
        made.map_err(|e| format!("/{}: {e}", show(&path)))?;
    }
    Ok(path)
}

/// Unpacks the archive at `src` into `dest` of the upper layer: its files,
/// directories and links (links only inside it); devices and FIFOs left out.
fn unpack_into(
    repo: &Repository,
    root: &ObjectId,
    upper: &Path,
    src: &Path,
    dest: &[Vec<u8>],
    as_root: bool,
) -> Result<(), String> {
    let real = ensure_dir(repo, root, upper, dest, as_root, Some((0o755, 0, 0)))?;
    tine_image::unpack::unpack(src, &host_path(upper, &real), as_root).map_err(|e| e.to_string())
}

/// How a `RUN` step ended: its exit code and the tail of its output.
struct Ran {
    code: i32,
    tail: Vec<u8>,
}

/// Removes a step's sandbox however the step ends.
struct StepSandbox<'r> {
    repo: &'r Repository,
    id: String,
}

impl Drop for StepSandbox<'_> {
    fn drop(&mut self) {
        if let Ok(r) = self.repo.sandbox(&self.id) {
            let _ = manager::remove(self.repo, &r, true);
        }
    }
}

const TAIL: usize = 4096;

impl Engine {
    /// Builds an image from a Dockerfile (see the module's comment).
    pub fn build_image(
        &self,
        req: &BuildImage,
        ctx: &Ctx<'_>,
        events: &mut dyn FnMut(BuildEvent<'_>),
    ) -> Result<Built, EngineError> {
        let t0 = Instant::now();
        let context = self.importable(&req.context)?;
        if !context.is_dir() {
            return Err(EngineError::Invalid {
                message: format!(
                    "{}: the build context must be a directory",
                    req.context.display()
                ),
            });
        }
        let file = match &req.dockerfile {
            Some(f) => self.importable(f)?,
            None => context.join("Dockerfile"),
        };
        let text = read_dockerfile(&file)?;
        let ignore = Ignore::load(&context);
        let steps = dockerfile::parse(&text).map_err(|source| BuildError::Dockerfile {
            path: file.display().to_string(),
            source,
        })?;
        for n in &req.names {
            tine_store::images::check_name(n)?;
        }
        let repo = self.open()?;
        let from_at = steps
            .iter()
            .position(|s| matches!(s.instruction, Instruction::From { .. }))
            .expect("parse requires a FROM");
        // ARGs before FROM: for FROM itself, and for the ARGs after it that
        // name them without a value.
        let mut globals: Vec<(String, String)> = Vec::new();
        for s in &steps[..from_at] {
            if let Instruction::Arg(pairs) = &s.instruction {
                for (k, d) in pairs {
                    let v = req
                        .build_args
                        .get(k)
                        .cloned()
                        .or_else(|| d.as_ref().map(|d| dockerfile::expand(d, &globals)));
                    if let Some(v) = v {
                        globals.retain(|(n, _)| n != k);
                        globals.push((k.clone(), v));
                    }
                }
            }
        }
        let Instruction::From { image } = &steps[from_at].instruction else {
            unreachable!("found above")
        };
        let image = dockerfile::expand(image, &globals);
        let base = repo.image(&image)?;
        let mut st = State {
            snapshot: base.snapshot,
            config: serde_json::from_slice(&base.config).map_err(|e| EngineError::Internal {
                message: format!("image {}: its configuration does not parse: {e}", base.id),
            })?,
            key: digest_str(&[
                b"tine build 1",
                base.id.as_bytes(),
                base.snapshot.as_bytes(),
            ]),
            layers: base.layers.clone(),
            args: Vec::new(),
        };
        // What the base's configuration says of times and layers is its own.
        if let Some(o) = st.config.as_object_mut() {
            o.remove("created");
        }
        let mut history: Vec<Value> = st.config["history"].as_array().cloned().unwrap_or_default();
        let of = steps.len();
        let mut report = Vec::new();
        for (i, s) in steps.iter().enumerate().take(from_at + 1) {
            report.push(BuiltStep {
                step: i + 1,
                line: s.line,
                instruction: s.text.clone(),
                cached: false,
                snapshot: (i == from_at).then(|| st.snapshot.to_hex()),
                seconds: 0.0,
                output: String::new(),
            });
            events(BuildEvent::Step {
                step: i + 1,
                of,
                instruction: &s.text,
                cached: false,
            });
        }
        let (mut run, mut cached) = (0, 0);
        for (i, step) in steps.iter().enumerate().skip(from_at + 1) {
            let t = Instant::now();
            let n = i + 1;
            let fail = |message: String| BuildError::Step {
                step: n,
                instruction: step.text.clone(),
                message,
            };
            if let Instruction::Arg(pairs) = &step.instruction {
                for (k, d) in pairs {
                    let v = req.build_args.get(k).cloned().or_else(|| match d {
                        Some(d) => Some(dockerfile::expand(d, &st.scope())),
                        None => globals.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()),
                    });
                    if let Some(v) = v {
                        st.args.retain(|(n, _)| n != k);
                        st.args.push((k.clone(), v));
                    }
                }
            }
            let changed = self.config_step(&mut st, step).map_err(fail)?;
            let fs = match (&step.instruction, changed) {
                (Instruction::Run(_) | Instruction::Copy(_) | Instruction::Add(_), _) => true,
                (Instruction::Workdir(_), mkdir) => mkdir,
                _ => false,
            };
            // The files a copy reads are part of its key.
            let mut content = Vec::new();
            let copy = match &step.instruction {
                Instruction::Copy(c) | Instruction::Add(c) => Some(c),
                _ => None,
            };
            let mut found = Vec::new();
            if let Some(c) = copy {
                let env = st.scope();
                for s in &c.sources {
                    let s = dockerfile::expand(s, &env);
                    for src in sources(&context, &s, &ignore).map_err(fail)? {
                        content.extend_from_slice(&src.name);
                        content.push(0);
                        digest_tree(&src.path, &ignore, &mut content)
                            .map_err(|e| fail(format!("{}: {e}", src.path.display())))?;
                        found.push(src);
                    }
                }
            }
            let section = serde_json::to_vec(&st.config["config"]).unwrap_or_default();
            let args = serde_json::to_vec(&st.args).unwrap_or_default();
            st.key = digest_str(&[
                st.key.as_bytes(),
                step.text.as_bytes(),
                &section,
                &args,
                &content,
            ]);
            let mut hit = false;
            let mut output = String::new();
            if fs {
                let prior = if req.no_cache {
                    None
                } else {
                    repo.build_step(&st.key)?
                        .filter(|s| repo.snapshot_info(&s.snapshot).ok().flatten().is_some())
                };
                events(BuildEvent::Step {
                    step: n,
                    of,
                    instruction: &step.text,
                    cached: prior.is_some(),
                });
                let done = match prior {
                    Some(p) => {
                        hit = true;
                        cached += 1;
                        p
                    }
                    None => {
                        run += 1;
                        let snap = match &step.instruction {
                            Instruction::Run(cmd) => {
                                let (snap, tail) =
                                    self.run_step(&repo, &st, n, step, cmd, req, ctx, events)?;
                                output = tail;
                                snap
                            }
                            _ => self
                                .copy_step(&repo, &st, step, (copy, &found, &ignore), ctx)
                                .map_err(fail)?,
                        };
                        let (diff_id, _) = crate::export::write_layer(
                            &repo,
                            Some(&st.snapshot),
                            &snap,
                            std::io::sink(),
                        )?;
                        let s = BuildStep {
                            snapshot: snap,
                            diff_id: diff_id.to_string(),
                        };
                        ctx.lock(&repo)?.put_build_step(&st.key, &s)?;
                        s
                    }
                };
                st.snapshot = done.snapshot;
                st.layers.push(ImageLayer {
                    diff_id: done.diff_id,
                    chain: String::new(),
                    snapshot: done.snapshot,
                });
                history.push(json!({"created_by": step.text}));
            } else {
                events(BuildEvent::Step {
                    step: n,
                    of,
                    instruction: &step.text,
                    cached: false,
                });
                history.push(json!({"created_by": step.text, "empty_layer": true}));
            }
            report.push(BuiltStep {
                step: n,
                line: step.line,
                instruction: step.text.clone(),
                cached: hit,
                snapshot: fs.then(|| st.snapshot.to_hex()),
                seconds: t.elapsed().as_secs_f64(),
                output,
            });
        }
        // The configuration: the layers' digests and how each was made.
        let diff_ids: Vec<Digest> = st
            .layers
            .iter()
            .map(|l| Digest::parse(&l.diff_id))
            .collect::<Result<_, _>>()?;
        for (l, c) in st.layers.iter_mut().zip(tine_image::chain_of(&diff_ids)) {
            l.chain = c.to_string();
        }
        st.config["rootfs"] = json!({"type": "layers", "diff_ids": diff_ids});
        st.config["history"] = Value::Array(history);
        let config = serde_json::to_vec(&st.config).expect("JSON serializes");
        serde_json::from_slice::<tine_image::oci::ImageConfiguration>(&config).map_err(|e| {
            EngineError::Internal {
                message: format!("the built image's configuration is not valid: {e}"),
            }
        })?;
        let rec = ImageRecord {
            id: Digest::of(&config).to_string(),
            names: req.names.clone(),
            config,
            snapshot: st.snapshot,
            layers: st.layers,
            source: file.display().to_string(),
            created_ns: now_ns(),
        };
        ctx.lock(&repo)?.put_image(&rec)?;
        Ok(Built {
            image: view(&repo.image(&rec.id)?)?,
            steps: report,
            run,
            cached,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// Applies what a step says of the configuration; for `WORKDIR`, whether
    /// its directory must be made.
    fn config_step(&self, st: &mut State, step: &Step) -> Result<bool, String> {
        let env = st.env();
        let scope = st.scope();
        let x = |s: &str| dockerfile::expand(s, &scope);
        let argv = |c: &Command| -> Value {
            match c {
                Command::Shell(s) => json!(["/bin/sh", "-c", s]),
                Command::Exec(v) => json!(v),
            }
        };
        match &step.instruction {
            Instruction::Env(pairs) => {
                let mut all = env.clone();
                for (k, v) in pairs {
                    let mut seen = st.args.clone();
                    seen.extend(all.iter().cloned());
                    let v = dockerfile::expand(v, &seen);
                    all.retain(|(n, _)| n != k);
                    all.push((k.clone(), v));
                }
                let list: Vec<String> = all.iter().map(|(k, v)| format!("{k}={v}")).collect();
                st.section().insert("Env".into(), json!(list));
            }
            Instruction::Label(pairs) => {
                let s = st.section();
                if !s.get("Labels").is_some_and(Value::is_object) {
                    s.insert("Labels".into(), json!({}));
                }
                let labels = s["Labels"].as_object_mut().expect("made an object");
                for (k, v) in pairs {
                    labels.insert(k.clone(), json!(x(v)));
                }
            }
            Instruction::Expose(ports) => {
                let s = st.section();
                if !s.get("ExposedPorts").is_some_and(Value::is_object) {
                    s.insert("ExposedPorts".into(), json!({}));
                }
                let e = s["ExposedPorts"].as_object_mut().expect("made an object");
                for p in ports {
                    let p = x(p);
                    let p = if p.contains('/') {
                        p
                    } else {
                        format!("{p}/tcp")
                    };
                    e.insert(p, json!({}));
                }
            }
            Instruction::User(u) => {
                let u = x(u);
                st.section().insert("User".into(), json!(u));
            }
            Instruction::Cmd(c) => {
                st.section().insert("Cmd".into(), argv(c));
            }
            Instruction::Entrypoint(c) => {
                let s = st.section();
                s.insert("Entrypoint".into(), argv(c));
                // Docker's rule: a new entrypoint drops the cmd inherited.
                s.remove("Cmd");
            }
            Instruction::Workdir(w) => {
                let w = format!("/{}", show(&components(&st.workdir(), &x(w))));
                st.section().insert("WorkingDir".into(), json!(w));
                return Ok(true);
            }
            Instruction::From { .. }
            | Instruction::Arg(_)
            | Instruction::Run(_)
            | Instruction::Copy(_)
            | Instruction::Add(_) => {}
        }
        Ok(false)
    }

    /// Runs a `RUN` step in a sandbox made from the snapshot so far, as the
    /// image's user, in its working directory, with its environment; the
    /// snapshot of its files once it exited 0.
    #[allow(clippy::too_many_arguments)]
    fn run_step(
        &self,
        repo: &Repository,
        st: &State,
        n: usize,
        step: &Step,
        cmd: &Command,
        req: &BuildImage,
        ctx: &Ctx<'_>,
        events: &mut dyn FnMut(BuildEvent<'_>),
    ) -> Result<(ObjectId, String), EngineError> {
        let fail = |message: String| BuildError::Step {
            step: n,
            instruction: step.text.clone(),
            message,
        };
        let passwd = file_in_snapshot(repo, &st.snapshot, "etc/passwd").unwrap_or_default();
        let group = file_in_snapshot(repo, &st.snapshot, "etc/group").unwrap_or_default();
        let (uid, gid) = match st.get("User") {
            Some(u) => resolve_user(&u, &passwd, &group, "being built")?,
            None => (0, 0),
        };
        let mut env = st.scope();
        if !env.iter().any(|(k, _)| k == "PATH") {
            env.insert(0, ("PATH".into(), tine_sandbox::DEFAULT_PATH.into()));
        }
        if !env.iter().any(|(k, _)| k == "HOME") {
            env.push(("HOME".into(), if uid == 0 { "/root" } else { "/" }.into()));
        }
        let opts = tine_sandbox::RunOptions {
            name: None,
            from: Some(st.snapshot),
            workspace: None,
            limits: tine_sandbox::Limits {
                memory_bytes: req.memory_bytes,
                pids: None,
                disk_bytes: None,
            },
            net: req.net,
            restart: tine_sandbox::Restart::No,
            rootfs: None,
            command: cmd.argv(),
            env,
            stop_timeout: Duration::from_secs(1),
            seccomp: true,
            image: Some(tine_sandbox::ns::ImageRoot {
                image: format!("build step {n}"),
                workdir: st.workdir(),
                uid,
                gid,
            }),
        };
        let rec = {
            let lock = ctx.lock(repo)?;
            self.check_capacity(repo, 1)?;
            manager::prepare(&lock, &opts, manager::isolation_available(), ctx.progress)?
        };
        let guard = StepSandbox {
            repo,
            id: rec.id.clone(),
        };
        manager::launch(repo, &rec, &self.cfg.exe)?;
        let ran = self.follow(repo, &rec.id, events)?;
        if ran.code != 0 {
            return Err(BuildError::Failed {
                step: n,
                instruction: step.text.clone(),
                code: ran.code,
                output: String::from_utf8_lossy(&ran.tail).trim_end().to_string(),
            }
            .into());
        }
        let now = repo.sandbox(&rec.id)?;
        let lock = ctx.lock(repo)?;
        let (out, _, _) = manager::snapshot(
            &lock,
            &now,
            &tine_fs::SnapshotOptions {
                message: format!("build: {}", step.text),
                parents: Some(vec![st.snapshot]),
                detached: true,
                ..Default::default()
            },
            &manager::ProcessOptions {
                files_only: true,
                ..Default::default()
            },
            ctx.progress,
        )
        .map_err(|e| fail(format!("snapshot its files: {e}")))?;
        drop(lock);
        drop(guard);
        Ok((out.id, String::from_utf8_lossy(&ran.tail).into_owned()))
    }

    /// Waits for a step's sandbox to end, handing on its output as it comes.
    fn follow(
        &self,
        repo: &Repository,
        id: &str,
        events: &mut dyn FnMut(BuildEvent<'_>),
    ) -> Result<Ran, EngineError> {
        let (_, out, err) = self.log_files(id)?;
        let mut at = [0u64; 2];
        let mut tail: Vec<u8> = Vec::new();
        let mut pass = |at: &mut [u64; 2], tail: &mut Vec<u8>| {
            for (k, p) in [&out, &err].into_iter().enumerate() {
                let Ok(mut f) = std::fs::File::open(p) else {
                    continue;
                };
                if f.seek(std::io::SeekFrom::Start(at[k])).is_err() {
                    continue;
                }
                let mut buf = Vec::new();
                if f.read_to_end(&mut buf).is_ok() && !buf.is_empty() {
                    at[k] += buf.len() as u64;
                    events(BuildEvent::Output(&buf));
                    tail.extend_from_slice(&buf);
                    if tail.len() > TAIL {
                        tail.drain(..tail.len() - TAIL);
                    }
                }
            }
        };
        loop {
            let v = manager::view(repo, &repo.sandbox(id)?);
            pass(&mut at, &mut tail);
            if v.ended() {
                pass(&mut at, &mut tail);
                let code = v.exit.map(|e| e.code).unwrap_or(-1);
                return Ok(Ran { code, tail });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A `COPY`/`ADD` (or a `WORKDIR` whose directory is not there): what it
    /// writes, in a fresh upper layer over the snapshot so far, snapshotted.
    fn copy_step(
        &self,
        repo: &Repository,
        st: &State,
        step: &Step,
        (copy, found, ignore): (Option<&Copy>, &[Source], &Ignore),
        ctx: &Ctx<'_>,
    ) -> Result<ObjectId, String> {
        let as_root = rustix::process::geteuid().is_root();
        let root = repo
            .read_snapshot(&st.snapshot)
            .map_err(|e| e.to_string())?
            .tree;
        let scratch = tine_store::staging::Staging::new(repo, "build")
            .map_err(|e| format!("make a staging directory in {}: {e}", repo.path().display()))?;
        let upper = scratch.path().join("upper");
        std::fs::create_dir(&upper).map_err(|e| e.to_string())?;
        match copy {
            None => {
                // WORKDIR: its directory, made if it is not there.
                let w = components("/", &st.workdir());
                ensure_dir(repo, &root, &upper, &w, as_root, Some((0o755, 0, 0)))?;
            }
            Some(c) => {
                let env = st.scope();
                let owner = match &c.chown {
                    Some(u) => {
                        if !as_root {
                            return Err("--chown needs tine to run as root".into());
                        }
                        let passwd =
                            file_in_snapshot(repo, &st.snapshot, "etc/passwd").unwrap_or_default();
                        let group =
                            file_in_snapshot(repo, &st.snapshot, "etc/group").unwrap_or_default();
                        Some(
                            resolve_user(
                                &dockerfile::expand(u, &env),
                                &passwd,
                                &group,
                                "being built",
                            )
                            .map_err(|e| e.to_string())?,
                        )
                    }
                    None => None,
                };
                let how = CopyAs {
                    owner,
                    chmod: c.chmod,
                    as_root,
                    ignore,
                };
                let dest_s = dockerfile::expand(&c.dest, &env);
                let dest = components(&st.workdir(), &dest_s);
                let add = matches!(step.instruction, Instruction::Add(_));
                let dest_is_dir = dest_s.ends_with('/')
                    || found.len() > 1
                    || resolve(repo, &root, &dest, true)?
                        .last()
                        .is_some_and(|(_, e)| {
                            e.as_ref()
                                .is_some_and(|e| matches!(e.node, Node::Dir { .. }))
                        });
                for src in found {
                    if add && !src.is_dir && tine_image::unpack::is_archive(&src.path) {
                        unpack_into(repo, &root, &upper, &src.path, &dest, as_root)?;
                        continue;
                    }
                    let mut to = dest.clone();
                    if dest_is_dir && !src.is_dir {
                        to.push(src.name.clone());
                    }
                    copy_into(repo, &root, &upper, &src.path, &to, how)?;
                }
            }
        }
        let owners = as_root.then_some(tine_fs::IdMap::IDENTITY);
        let memo = scratch.path().join("memo");
        let ws = tine_fs::Layered::load(repo, Some(&st.snapshot), &upper, &memo, owners)
            .map_err(|e| e.to_string())?;
        let lock = ctx.lock(repo).map_err(|e| e.to_string())?;
        let pack = lock.pack().map_err(|e| e.to_string())?;
        let out = tine_fs::snapshot_layered(
            &lock,
            pack,
            &ws,
            "build",
            None,
            &tine_fs::SnapshotOptions {
                message: format!("build: {}", step.text),
                parents: Some(vec![st.snapshot]),
                detached: true,
                owners,
                ..Default::default()
            },
            || true,
            ctx.progress,
        )
        .map_err(|e| format!("snapshot what it copied: {e}"))?;
        let _ = std::fs::remove_file(tine_fs::statcache::cache_path(repo, &upper));
        Ok(out.id)
    }
}

fn read_dockerfile(file: &Path) -> Result<String, EngineError> {
    let e = |source| EngineError::File {
        path: file.display().to_string(),
        step: "read the Dockerfile",
        source,
    };
    let f = std::fs::File::open(file).map_err(e)?;
    let mut s = String::new();
    f.take(dockerfile::MAX_DOCKERFILE as u64 + 1)
        .read_to_string(&mut s)
        .map_err(e)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_lexically_never_above_the_root() {
        assert_eq!(show(&components("/srv", "a/../b/./c")), "srv/b/c");
        assert_eq!(show(&components("/srv", "/x")), "x");
        assert_eq!(show(&components("/", "../../etc")), "etc");
    }

    #[test]
    fn globs_match_as_a_shell_does_within_a_name() {
        assert!(glob_match(b"*.py", b"a.py"));
        assert!(glob_match(b"a?c", b"abc"));
        assert!(!glob_match(b"*.py", b"a.pyc"));
        assert!(glob_match(b"*", b""));
    }

    #[test]
    fn dockerignore_patterns_leave_out_paths_and_what_is_below_them() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join(".dockerignore"),
            "# comment\n.git\n**/*.pyc\nbuild/\n!build/keep\n",
        )
        .unwrap();
        let ign = Ignore::load(d.path());
        let at = |p: &str| ign.ignored(&d.path().join(p));
        assert!(at(".git") && at(".git/objects/x"));
        assert!(at("a.pyc") && at("src/deep/b.pyc") && !at("src/b.py"));
        assert!(at("build/out.o") && !at("build/keep"));
        assert!(!at("Dockerfile"));
        // No file: nothing left out.
        let none = Ignore::load(&d.path().join("missing"));
        assert!(!none.ignored(&d.path().join("missing/x")));
    }

    #[test]
    fn step_keys_change_with_any_part() {
        let a = digest_str(&[b"k", b"RUN x"]);
        assert_ne!(a, digest_str(&[b"k", b"RUN y"]));
        // Parts are delimited: moving a byte between them changes the key.
        assert_ne!(digest_str(&[b"ab", b"c"]), digest_str(&[b"a", b"bc"]));
    }
}
