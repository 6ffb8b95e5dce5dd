//! Sandboxes for real (root only): isolation of files, processes, network and
//! privileges, as seen from inside.

use std::ffi::OsStr;
use std::fs::File;
use std::path::Path;

use tine_sandbox::ns::{self, InitSpec, Net};

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

/// Runs `script` with `sh` inside a sandbox over `ws`; returns (exit code, stdout, stderr).
fn run(ws: &Path, logs: &Path, net: Net, script: &str) -> (i32, String, String) {
    let spec = InitSpec {
        workspace: ws.to_path_buf(),
        rootfs: None,
        hostname: "tine-test".into(),
        net,
        command: vec!["sh".into(), "-c".into(), script.into()],
        env: vec![("PATH".into(), "/usr/bin:/bin:/usr/sbin:/sbin".into())],
        cgroup_procs: vec![],
    };
    let (o, e) = (logs.join("out"), logs.join("err"));
    let pid = ns::spawn_init(
        Path::new(env!("CARGO_BIN_EXE_tine")),
        &[
            OsStr::new("__sandbox-init"),
            OsStr::new(&serde_json::to_string(&spec).unwrap()),
        ],
        net,
        &File::create(&o).unwrap(),
        &File::create(&e).unwrap(),
    )
    .unwrap();
    let code = ns::wait(pid).unwrap();
    (
        code,
        std::fs::read_to_string(o).unwrap(),
        std::fs::read_to_string(e).unwrap(),
    )
}

#[test]
fn a_sandbox_writes_only_its_workspace_and_tmp_and_sees_nothing_of_the_host() {
    if !is_root() {
        eprintln!("skipped: sandboxes need root");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let ws = tmp.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    std::fs::write(ws.join("given.txt"), "from the host\n").unwrap();
    let host_tmp_probe = format!("tine-probe-{}", std::process::id());
    let script = format!(
        r#"
        cat /workspace/given.txt
        echo made-inside > /workspace/made.txt && echo ws-write-ok
        echo x > /tmp/{host_tmp_probe} && echo tmp-write-ok
        for p in /etc/tine-escape /usr/tine-escape /tine-escape {ws}/direct /sys/tine-escape /proc/sys/kernel/hostname; do
            (echo x > $p) 2>/dev/null && echo "ESCAPED $p"
        done
        mount -o remount,rw / 2>/dev/null && echo "ESCAPED remount"
        echo "pid $$"
        echo "procs $(ls /proc | grep -c '^[0-9]')"
        echo "host $(cat /proc/sys/kernel/hostname)"
        echo "nnp $(grep NoNewPrivs /proc/self/status | tr -s '\t ' ' ')"
        echo "capeff $(grep CapEff /proc/self/status | tr -s '\t ' ' ')"
        echo "ifaces $(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\n' ' ')"
        echo "routes $(tail -n +2 /proc/net/route | wc -l)"
        exit 7
        "#,
        ws = ws.display()
    );
    let (code, out, err) = run(&ws, tmp.path(), Net::None, &script);
    assert_eq!(code, 7, "stdout:\n{out}\nstderr:\n{err}");
    assert!(!out.contains("ESCAPED"), "{out}");
    for want in [
        "from the host",
        "ws-write-ok",
        "tmp-write-ok",
        "pid 2",
        "host tine-test",
        "nnp NoNewPrivs: 1",
        "ifaces lo ",
        "routes 0",
    ] {
        assert!(
            out.contains(want),
            "missing {want:?} in:\n{out}\nstderr:\n{err}"
        );
    }
    // Only init, sh and the ls pipeline exist in its PID namespace.
    let procs: usize = out
        .lines()
        .find_map(|l| l.strip_prefix("procs "))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(procs <= 5, "saw {procs} processes:\n{out}");
    // CAP_SYS_ADMIN (bit 21) is gone.
    let capeff = out
        .lines()
        .find_map(|l| l.strip_prefix("capeff CapEff: "))
        .unwrap();
    let caps = u64::from_str_radix(capeff.trim(), 16).unwrap();
    assert_eq!(caps & (1 << 21), 0, "CapEff {capeff}");
    assert_eq!(
        std::fs::read_to_string(ws.join("made.txt")).unwrap(),
        "made-inside\n"
    );
    assert!(!Path::new("/tmp").join(&host_tmp_probe).exists());
    assert!(!Path::new("/etc/tine-escape").exists());

    // With the host's network, the host's interfaces are visible.
    let (code, out, _) = run(
        &ws,
        tmp.path(),
        Net::Host,
        "tail -n +3 /proc/net/dev | wc -l",
    );
    assert_eq!(code, 0);
    assert!(out.trim().parse::<u32>().unwrap() >= 2, "{out}");
}
