//! Images built here byte by byte (OCI layouts and archives, docker-save
//! archives), read and applied: whiteouts, digests, hostile entries.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::json;
use tine_image::{Budget, Digest, Format, ImageError, ImageSource, Limits};

/// An entry of a layer: a file, a directory, a symlink, or a raw name.
enum E<'a> {
    F(&'a str, &'a str),
    D(&'a str),
    L(&'a str, &'a str),
    Dev(&'a str),
    /// A file whose name the tar builder would refuse (written raw).
    Raw(&'a str),
}

fn layer_tar(entries: &[E<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mtime(1_700_000_000);
        match e {
            E::F(p, data) => {
                h.set_size(data.len() as u64);
                h.set_mode(0o644);
                h.set_entry_type(tar::EntryType::Regular);
                b.append_data(&mut h, p, data.as_bytes()).unwrap();
            }
            E::D(p) => {
                h.set_size(0);
                h.set_mode(0o755);
                h.set_entry_type(tar::EntryType::Directory);
                b.append_data(&mut h, p, &[][..]).unwrap();
            }
            E::L(p, target) => {
                h.set_size(0);
                h.set_entry_type(tar::EntryType::Symlink);
                b.append_link(&mut h, p, target).unwrap();
            }
            E::Dev(p) => {
                h.set_size(0);
                h.set_mode(0o600);
                h.set_entry_type(tar::EntryType::Char);
                h.set_device_major(1).unwrap();
                h.set_device_minor(3).unwrap();
                b.append_data(&mut h, p, &[][..]).unwrap();
            }
            E::Raw(name) => {
                h.set_size(1);
                h.set_mode(0o644);
                h.set_entry_type(tar::EntryType::Regular);
                let n = &mut h.as_old_mut().name;
                n[..name.len()].copy_from_slice(name.as_bytes());
                h.set_cksum();
                b.append(&h, &b"x"[..]).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut g = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    g.write_all(data).unwrap();
    g.finish().unwrap()
}

/// A layer's tar, and whether it is stored gzipped.
type Layer = (Vec<u8>, bool);

/// An image's files by name (blobs and documents), as a layout holds them.
struct Built {
    files: BTreeMap<String, Vec<u8>>,
    layer_digests: Vec<Digest>,
}

/// An OCI layout with these layers (gzipped where `gz`), named `name`.
fn oci(name: &str, layers: &[Layer]) -> Built {
    let mut files = BTreeMap::new();
    let mut descs = Vec::new();
    let mut diff_ids = Vec::new();
    let mut layer_digests = Vec::new();
    for (tar, gz) in layers {
        diff_ids.push(Digest::of(tar).to_string());
        let blob = if *gz { gzip(tar) } else { tar.clone() };
        let d = Digest::of(&blob);
        descs.push(json!({
            "mediaType": if *gz { "application/vnd.oci.image.layer.v1.tar+gzip" } else { "application/vnd.oci.image.layer.v1.tar" },
            "digest": d.to_string(), "size": blob.len()}));
        files.insert(format!("blobs/sha256/{}", d.hex()), blob);
        layer_digests.push(d);
    }
    let config = serde_json::to_vec(&json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": ["/bin/sh"], "Cmd": ["-c", "echo hi"], "Env": ["PATH=/bin", "A=1"], "WorkingDir": "/srv", "User": "1000"},
        "rootfs": {"type": "layers", "diff_ids": diff_ids}})).unwrap();
    let cd = Digest::of(&config);
    files.insert(format!("blobs/sha256/{}", cd.hex()), config.clone());
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd.to_string(), "size": config.len()},
        "layers": descs})).unwrap();
    let md = Digest::of(&manifest);
    files.insert(format!("blobs/sha256/{}", md.hex()), manifest.clone());
    files.insert(
        "index.json".into(),
        serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md.to_string(), "size": manifest.len(),
            "annotations": {"org.opencontainers.image.ref.name": name}}]}))
        .unwrap(),
    );
    files.insert(
        "oci-layout".into(),
        br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
    );
    Built {
        files,
        layer_digests,
    }
}

/// A `docker save` archive's files for these (uncompressed) layers.
fn docker(tag: &str, layers: &[Vec<u8>]) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    let diff_ids: Vec<String> = layers.iter().map(|t| Digest::of(t).to_string()).collect();
    let config = serde_json::to_vec(
        &json!({"architecture": "amd64", "os": "linux", "config": {"Cmd": ["sh"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids}}),
    )
    .unwrap();
    let cd = Digest::of(&config);
    let mut names = Vec::new();
    for (i, t) in layers.iter().enumerate() {
        let n = format!("l{i}/layer.tar");
        files.insert(n.clone(), t.clone());
        names.push(n);
    }
    files.insert(format!("{}.json", cd.hex()), config);
    files.insert(
        "manifest.json".into(),
        serde_json::to_vec(
            &json!([{"Config": format!("{}.json", cd.hex()), "RepoTags": [tag], "Layers": names}]),
        )
        .unwrap(),
    );
    files
}

fn write_dir(files: &BTreeMap<String, Vec<u8>>, dir: &Path) {
    for (name, data) in files {
        let p = dir.join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
    }
}

fn write_tar(files: &BTreeMap<String, Vec<u8>>, path: &Path) {
    let mut b = tar::Builder::new(std::fs::File::create(path).unwrap());
    for (name, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, name, &data[..]).unwrap();
    }
    b.finish().unwrap();
}

/// The tree under `root`: path to file contents, `<dir>` or `-> target`.
fn tree(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    fn walk(root: &Path, d: &Path, out: &mut BTreeMap<String, String>) {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.file_type().is_symlink() {
                out.insert(
                    rel,
                    format!("-> {}", std::fs::read_link(&p).unwrap().display()),
                );
            } else if m.is_dir() {
                out.insert(rel, "<dir>".into());
                walk(root, &p, out);
            } else {
                out.insert(rel, std::fs::read_to_string(&p).unwrap());
            }
        }
    }
    walk(root, root, &mut out);
    out
}

fn two_layers() -> (Vec<u8>, Vec<u8>) {
    let base = layer_tar(&[
        E::D("etc"),
        E::F("etc/hostname", "one"),
        E::D("d"),
        E::F("d/old1", "1"),
        E::F("d/old2", "2"),
        E::F("gone.txt", "g"),
        E::D("e"),
        E::F("e/kept", "k"),
        E::L("bin", "usr/bin"),
    ]);
    let top = layer_tar(&[
        // The opaque marker after an entry of its own layer: it hides only
        // what is below.
        E::F("d/new", "n"),
        E::F("d/.wh..wh..opq", ""),
        E::F(".wh.gone.txt", ""),
        E::F("e/added", "a"),
        E::F("etc/hostname", "two"),
        E::Dev("dev-null"),
    ]);
    (base, top)
}

fn expected() -> BTreeMap<String, String> {
    [
        ("bin", "-> usr/bin"),
        ("d", "<dir>"),
        ("d/new", "n"),
        ("e", "<dir>"),
        ("e/added", "a"),
        ("e/kept", "k"),
        ("etc", "<dir>"),
        ("etc/hostname", "two"),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect()
}

fn apply_all(src: &ImageSource, name: Option<&str>, root: &Path) -> Vec<tine_image::Applied> {
    let img = src.pick(name).unwrap();
    img.layers
        .iter()
        .map(|l| {
            src.apply(l, root, false, &mut Budget::new(Limits::default()))
                .unwrap()
        })
        .collect()
}

#[test]
fn an_oci_layout_its_archive_and_a_docker_archive_give_the_same_tree() {
    let t = tempfile::tempdir().unwrap();
    let (base, top) = two_layers();
    let built = oci("demo:1", &[(base.clone(), false), (top.clone(), true)]);
    write_dir(&built.files, &t.path().join("layout"));
    write_tar(&built.files, &t.path().join("oci.tar"));
    write_tar(
        &docker("demo:1", &[base, top]),
        &t.path().join("docker.tar"),
    );
    for (what, path, format) in [
        ("layout", "layout", Format::Oci),
        ("oci archive", "oci.tar", Format::Oci),
        ("docker archive", "docker.tar", Format::Docker),
    ] {
        let src = ImageSource::open(&t.path().join(path)).unwrap();
        assert_eq!(src.format, format, "{what}");
        let img = src.pick(Some("demo:1")).unwrap();
        assert_eq!(img.layers.len(), 2, "{what}");
        let root = t.path().join(format!("root-{path}"));
        std::fs::create_dir(&root).unwrap();
        let applied = apply_all(&src, None, &root);
        assert_eq!(tree(&root), expected(), "{what}");
        assert_eq!(applied[1].whiteouts, 2, "{what}");
        assert_eq!(applied[1].skipped, vec!["dev-null".to_string()], "{what}");
    }
    let src = ImageSource::open(&t.path().join("layout")).unwrap();
    let c = src.images[0].config.config().as_ref().unwrap();
    assert_eq!(
        c.entrypoint().as_deref(),
        Some(&["/bin/sh".to_string()][..])
    );
    assert_eq!(c.working_dir().as_deref(), Some("/srv"));
    assert_eq!(c.user().as_deref(), Some("1000"));
    assert_eq!(src.images[0].layers[0].digest, built.layer_digests[0]);
}

#[test]
fn a_corrupted_layer_is_refused_naming_its_digest() {
    let t = tempfile::tempdir().unwrap();
    let (base, top) = two_layers();
    let built = oci("demo:1", &[(base, false), (top, true)]);
    let dir = t.path().join("layout");
    write_dir(&built.files, &dir);
    let blob = dir.join(format!("blobs/sha256/{}", built.layer_digests[0].hex()));
    let mut bytes = std::fs::read(&blob).unwrap();
    // A byte of file data changed: the tar still reads, the digest does not match.
    let at = bytes.windows(3).position(|w| w == b"one").unwrap();
    bytes[at] = b'X';
    std::fs::write(&blob, bytes).unwrap();
    let src = ImageSource::open(&dir).unwrap();
    let root = t.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let err = src
        .apply(
            &src.images[0].layers[0],
            &root,
            false,
            &mut Budget::new(Limits::default()),
        )
        .unwrap_err();
    assert!(matches!(err, ImageError::DigestMismatch { .. }), "{err}");
    assert!(
        err.to_string().contains(built.layer_digests[0].as_str()),
        "{err}"
    );
    // A damaged manifest or configuration is refused at open.
    let cfg = built
        .files
        .keys()
        .find(|k| k.starts_with("blobs/") && built.files[*k].starts_with(b"{\"architecture\""));
    let cfg = dir.join(cfg.unwrap());
    std::fs::write(&cfg, b"{\"architecture\":\"arm64\"}").unwrap();
    let err = ImageSource::open(&dir).unwrap_err();
    assert!(err.to_string().contains("configuration sha256:"), "{err}");
}

#[test]
fn entries_that_would_leave_the_root_are_refused_and_nothing_is_written_outside() {
    let t = tempfile::tempdir().unwrap();
    let outside = t.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let cases: Vec<(&str, Vec<Layer>)> = vec![
        ("dotdot", vec![(layer_tar(&[E::Raw("../escape")]), false)]),
        (
            "through a link",
            vec![
                (layer_tar(&[E::L("l", outside.to_str().unwrap())]), false),
                (layer_tar(&[E::F("l/planted", "x")]), false),
            ],
        ),
        (
            "whiteout through a link",
            vec![
                (layer_tar(&[E::L("l", outside.to_str().unwrap())]), false),
                (layer_tar(&[E::F("l/.wh..wh..opq", "")]), false),
            ],
        ),
    ];
    std::fs::write(outside.join("precious"), "keep").unwrap();
    for (what, layers) in cases {
        let built = oci("x", &layers);
        let dir = t.path().join(format!("layout-{what}"));
        write_dir(&built.files, &dir);
        let src = ImageSource::open(&dir).unwrap();
        let root = t.path().join(format!("root-{what}"));
        std::fs::create_dir(&root).unwrap();
        let mut result = Ok(());
        for l in &src.images[0].layers {
            if let Err(e) = src.apply(l, &root, false, &mut Budget::new(Limits::default())) {
                result = Err(e);
                break;
            }
        }
        let err = result.expect_err(what);
        assert!(matches!(err, ImageError::BadEntry { .. }), "{what}: {err}");
        assert!(!t.path().join("escape").exists(), "{what}");
        assert_eq!(
            tree(&outside),
            BTreeMap::from([("precious".to_string(), "keep".to_string())]),
            "{what}"
        );
    }
}

#[test]
fn what_is_not_an_image_is_named_and_a_choice_among_images_is_asked_for() {
    let t = tempfile::tempdir().unwrap();
    let err = ImageSource::open(t.path()).unwrap_err();
    assert!(err.to_string().contains("neither index.json"), "{err}");
    let gz = t.path().join("image.tar.gz");
    std::fs::write(&gz, gzip(b"not really")).unwrap();
    let err = ImageSource::open(&gz).unwrap_err();
    assert!(err.to_string().contains("decompress it first"), "{err}");
    let err = ImageSource::open(&PathBuf::from("/nonexistent/image")).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/image"), "{err}");
    // Two images in one docker archive: name one.
    let (base, top) = two_layers();
    let mut files = docker("a:1", std::slice::from_ref(&base));
    let b = docker("b:1", &[base, top]);
    let mut entries: Vec<serde_json::Value> =
        serde_json::from_slice(&files["manifest.json"]).unwrap();
    entries.extend(serde_json::from_slice::<Vec<serde_json::Value>>(&b["manifest.json"]).unwrap());
    for (k, v) in b {
        files.entry(k).or_insert(v);
    }
    files.insert(
        "manifest.json".into(),
        serde_json::to_vec(&entries).unwrap(),
    );
    let path = t.path().join("two.tar");
    write_tar(&files, &path);
    let src = ImageSource::open(&path).unwrap();
    let err = src.pick(None).unwrap_err();
    assert!(err.to_string().contains("a:1, b:1"), "{err}");
    assert_eq!(src.pick(Some("b:1")).unwrap().layers.len(), 2);
    assert!(src.pick(Some("c:1")).is_err());
}

#[test]
fn as_root_owners_and_modes_are_kept() {
    use std::os::unix::fs::MetadataExt;
    if tine_testkit::skipped_without_root("keeping a layer's file owners") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(2);
    h.set_mode(0o4750);
    h.set_uid(1234);
    h.set_gid(4321);
    h.set_entry_type(tar::EntryType::Regular);
    b.append_data(&mut h, "usr/bin/tool", &b"#!"[..]).unwrap();
    let built = oci("x", &[(b.into_inner().unwrap(), true)]);
    let dir = t.path().join("layout");
    write_dir(&built.files, &dir);
    let src = ImageSource::open(&dir).unwrap();
    let root = t.path().join("root");
    std::fs::create_dir(&root).unwrap();
    src.apply(
        &src.images[0].layers[0],
        &root,
        true,
        &mut Budget::new(Limits::default()),
    )
    .unwrap();
    let m = std::fs::metadata(root.join("usr/bin/tool")).unwrap();
    assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (1234, 4321, 0o4750));
}

/// Applies every layer of a one-image layout built from `layers` onto a
/// fresh `root` inside `t`, within `limits`.
fn apply_layers(
    t: &Path,
    what: &str,
    layers: &[Layer],
    limits: Limits,
) -> (PathBuf, Result<(), ImageError>) {
    let built = oci("x", layers);
    let dir = t.join(format!("layout-{what}"));
    write_dir(&built.files, &dir);
    let src = ImageSource::open(&dir).unwrap();
    let root = t.join(format!("box-{what}")).join("root");
    std::fs::create_dir_all(&root).unwrap();
    let mut budget = Budget::new(limits);
    for l in &src.images[0].layers {
        if let Err(e) = src.apply(l, &root, false, &mut budget) {
            return (root, Err(e));
        }
    }
    (root, Ok(()))
}

#[test]
fn whiteouts_of_dot_and_dotdot_and_reserved_names_are_refused_and_remove_nothing() {
    let t = tempfile::tempdir().unwrap();
    for (what, name) in [
        ("dotdotdot", ".wh..."),
        ("dotdot", ".wh.."),
        ("empty", ".wh."),
        ("nested", "d/.wh..."),
        ("reserved", ".wh..wh.x"),
    ] {
        let base = layer_tar(&[E::D("d"), E::F("d/f", "kept")]);
        let top = layer_tar(&[E::F(name, "")]);
        let (root, result) = apply_layers(
            t.path(),
            what,
            &[(base, false), (top, true)],
            Limits::default(),
        );
        // Beside the root: what a whiteout of `..` would take with it.
        let above = root.parent().unwrap();
        std::fs::write(above.join("sibling"), "s").ok();
        let err = result.expect_err(what);
        assert!(matches!(err, ImageError::BadEntry { .. }), "{what}: {err}");
        assert!(err.to_string().contains(name), "{what}: {err}");
        assert_eq!(std::fs::read(root.join("d/f")).unwrap(), b"kept", "{what}");
        assert!(above.join("sibling").exists(), "{what}");
    }
    // A real whiteout and an opaque one at the root still work.
    let base = layer_tar(&[E::F("a", "1"), E::F("b", "2")]);
    let top = layer_tar(&[E::F(".wh.a", ""), E::F("c", "3")]);
    let (root, r) = apply_layers(
        t.path(),
        "fine",
        &[(base, false), (top, false)],
        Limits::default(),
    );
    r.unwrap();
    assert_eq!(tree(&root).keys().cloned().collect::<Vec<_>>(), ["b", "c"]);
    // A whiteout of a symbolic link removes the link (never what it
    // points to), and is no "way through a link".
    let base = layer_tar(&[E::F("keep", "k"), E::L("l", "keep"), E::L("out", "/etc")]);
    let top = layer_tar(&[E::F(".wh.l", ""), E::F(".wh.out", "")]);
    let (root, r) = apply_layers(
        t.path(),
        "links",
        &[(base, false), (top, false)],
        Limits::default(),
    );
    r.unwrap();
    assert_eq!(tree(&root).keys().cloned().collect::<Vec<_>>(), ["keep"]);
    let opq = layer_tar(&[E::F(".wh..wh..opq", ""), E::F("z", "9")]);
    let base = layer_tar(&[E::F("a", "1")]);
    let (root, r) = apply_layers(
        t.path(),
        "opq",
        &[(base, false), (opq, false)],
        Limits::default(),
    );
    r.unwrap();
    assert_eq!(tree(&root).keys().cloned().collect::<Vec<_>>(), ["z"]);
}

#[test]
fn a_layouts_names_are_read_through_no_link_on_any_component() {
    let t = tempfile::tempdir().unwrap();
    let secret = t.path().join("host");
    std::fs::create_dir(&secret).unwrap();
    std::fs::write(secret.join("shadow"), "root:$y$SECRETHASH:19000::::::\n").unwrap();
    // A docker-save directory whose manifest names the layer `x/shadow`,
    // `x -> host`.
    let (base, _) = two_layers();
    let mut files = docker("a:1", &[base]);
    let mut m: Vec<serde_json::Value> = serde_json::from_slice(&files["manifest.json"]).unwrap();
    m[0]["Layers"] = json!(["x/shadow"]);
    files.insert("manifest.json".into(), serde_json::to_vec(&m).unwrap());
    let dir = t.path().join("layout");
    write_dir(&files, &dir);
    std::os::unix::fs::symlink(&secret, dir.join("x")).unwrap();
    let err = ImageSource::open(&dir).unwrap_err().to_string();
    assert!(!err.contains("SECRET") && !err.contains("root:"), "{err}");
    assert!(err.contains("x/shadow") && err.contains("missing"), "{err}");
    // The same with `blobs` itself a link out of an OCI layout.
    let (base, top) = two_layers();
    let built = oci("demo:1", &[(base, false), (top, false)]);
    let real = t.path().join("elsewhere");
    write_dir(&built.files, &real);
    let dir = t.path().join("oci");
    std::fs::create_dir(&dir).unwrap();
    for f in ["index.json", "oci-layout"] {
        std::fs::copy(real.join(f), dir.join(f)).unwrap();
    }
    std::os::unix::fs::symlink(real.join("blobs"), dir.join("blobs")).unwrap();
    let err = ImageSource::open(&dir).unwrap_err().to_string();
    assert!(err.contains("missing"), "{err}");
}

#[test]
fn a_gzip_bomb_many_entries_and_deep_nesting_stop_at_the_limits() {
    let t = tempfile::tempdir().unwrap();
    // 256 MiB of zeros, about 250 KiB gzipped.
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    let zeros = vec![0u8; 256 << 20];
    h.set_size(zeros.len() as u64);
    h.set_mode(0o644);
    b.append_data(&mut h, "bomb", &zeros[..]).unwrap();
    let bomb = b.into_inner().unwrap();
    drop(zeros);
    let small = Limits {
        bytes: 16 << 20,
        ..Limits::default()
    };
    let started = std::time::Instant::now();
    let (root, r) = apply_layers(t.path(), "bomb", &[(bomb, true)], small);
    let err = r.unwrap_err();
    assert!(
        matches!(err, ImageError::OverLimit { what: "bytes", limit, .. } if limit == 16 << 20),
        "{err}"
    );
    assert!(err.to_string().contains("16777216 bytes"), "{err}");
    // It stopped at the limit, not after writing it all.
    let written = std::fs::metadata(root.join("bomb"))
        .map(|m| m.len())
        .unwrap_or(0);
    assert!(written <= 16 << 20, "{written}");
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    // Entries.
    let many: Vec<String> = (0..50).map(|i| format!("f{i}")).collect();
    let es: Vec<E<'_>> = many.iter().map(|n| E::F(n, "x")).collect();
    let few = Limits {
        entries: 20,
        ..Limits::default()
    };
    let (_, r) = apply_layers(t.path(), "many", &[(layer_tar(&es), false)], few);
    assert!(
        matches!(
            r,
            Err(ImageError::OverLimit {
                what: "entries",
                ..
            })
        ),
        "{r:?}"
    );
    // Depth: a chain of 300 directories.
    let deep: String = (0..300).map(|_| "d/").collect::<String>() + "f";
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(1);
    h.set_mode(0o644);
    b.append_data(&mut h, &deep, &b"x"[..]).unwrap();
    let (_, r) = apply_layers(
        t.path(),
        "deep",
        &[(b.into_inner().unwrap(), false)],
        Limits::default(),
    );
    let err = r.unwrap_err().to_string();
    assert!(
        err.contains("301 levels deep") && err.contains("256"),
        "{err}"
    );
}
