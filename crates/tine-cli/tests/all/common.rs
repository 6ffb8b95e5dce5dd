use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// True (and says so) when not root: sandbox tests then skip.
pub fn skipped_without_root() -> bool {
    tine_testkit::skipped_without_root("an isolated sandbox")
}

/// A work directory with a repository in `work/.tine`, and the tine binary.
pub struct Env {
    pub tmp: tempfile::TempDir,
}

impl Env {
    pub fn new() -> Env {
        Env::in_dir(&std::env::temp_dir())
    }

    /// An environment under `parent` (sandboxes get a private /tmp, so tests
    /// of what they see of the host need one elsewhere).
    pub fn in_dir(parent: &Path) -> Env {
        let env = Env {
            tmp: tempfile::tempdir_in(parent).unwrap(),
        };
        std::fs::create_dir(env.work()).unwrap();
        env.ok(&["init"]);
        env
    }

    pub fn work(&self) -> PathBuf {
        self.tmp.path().join("work")
    }

    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_tine"));
        c.args(args)
            .current_dir(self.work())
            .env_remove("TINE_REPO");
        c
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().unwrap()
    }

    /// Runs and asserts success; returns stdout.
    /// Polls `tine ps --all --json` until sandbox `name` satisfies `done` (or
    /// 20 s pass); returns its last view.
    pub fn wait_for(
        &self,
        name: &str,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let ps = self.json(&["ps", "--all"]);
            let v = ps
                .as_array()
                .unwrap()
                .iter()
                .find(|v| v["name"] == name)
                .cloned()
                .unwrap_or_default();
            if done(&v) || std::time::Instant::now() > deadline {
                return v;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(
            o.status.success(),
            "tine {args:?} failed: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    }

    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut a = vec!["--json"];
        a.extend_from_slice(args);
        serde_json::from_str(&self.ok(&a)).unwrap()
    }

    pub fn write(&self, rel: &str, data: &[u8]) {
        let p = self.work().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
    }
}

impl Drop for Env {
    /// Sandboxes outlive their test otherwise (their supervisors are detached),
    /// also when the test failed half-way.
    fn drop(&mut self) {
        if !self.work().join(".tine/sandboxes").exists() {
            return;
        }
        let out = self.run(&["--json", "workspace", "ls"]);
        if let Ok(list) = serde_json::from_slice::<serde_json::Value>(&out.stdout) {
            for w in list.as_array().into_iter().flatten() {
                if let Some(name) = w["name"].as_str() {
                    let _ = self.run(&["workspace", "rm", name]);
                }
            }
        }
        let ids = || -> Vec<String> {
            let out = self.run(&["--json", "ps", "--all"]);
            let list = serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap_or_default();
            list.as_array()
                .into_iter()
                .flatten()
                .filter_map(|sb| Some(sb["id"].as_str()?.to_string()))
                .collect()
        };
        // All in one call first: it removes native forks before the
        // sandboxes they are nested in (which refuse to go while they run).
        let all = ids();
        if all.is_empty() {
            return;
        }
        let mut rm = vec!["rm", "-f"];
        rm.extend(all.iter().map(String::as_str));
        let _ = self.run(&rm);
        for id in ids() {
            let _ = self.run(&["rm", "-f", &id]);
        }
    }
}

pub fn listing(root: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v = Vec::new();
    fn walk(root: &Path, d: &Path, v: &mut Vec<(String, Vec<u8>)>) {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if rel == ".tine" {
                continue;
            }
            if p.is_dir() {
                walk(root, &p, v);
            } else {
                v.push((rel, std::fs::read(&p).unwrap()));
            }
        }
    }
    walk(root, root, &mut v);
    v.sort();
    v
}

/// Starts sandbox `name` running an idle Python loop (a native checkpoint's
/// single process; sessions are opened beside it).
pub fn run_idle_python(env: &Env, name: &str) {
    run_python(env, name, "import time\nwhile True: time.sleep(0.05)");
}

/// Starts sandbox `name` running `python3 -c SCRIPT`.
pub fn run_python(env: &Env, name: &str, script: &str) {
    env.ok(&["run", "--name", name, "--", "python3", "-c", script]);
}
