//! `tine serve`: the HTTP API against a real daemon on loopback.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{Env, skipped_without_root};

/// A running `tine serve` (stopped when dropped).
pub struct Server {
    child: Child,
    pub url: String,
    pub token: String,
    pub token_file: PathBuf,
    agent: ureq::Agent,
}

impl Server {
    pub fn start(env: &Env, extra: &[&str]) -> Server {
        let mut c = env.cmd(&["--json", "serve", "--listen", "127.0.0.1:0"]);
        c.args(extra);
        Server::spawn(env, c)
    }

    /// Starts `c`, a command that runs `tine --json serve` (perhaps through
    /// a wrapper), and waits for the daemon's first line.
    pub fn spawn(env: &Env, mut c: std::process::Command) -> Server {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(env.tmp.path().join("serve.log"))
            .unwrap();
        c.stdout(Stdio::piped()).stderr(log);
        let mut child = c.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| {
            panic!(
                "tine serve did not start ({e}): {line:?}; log: {}",
                std::fs::read_to_string(env.tmp.path().join("serve.log")).unwrap_or_default()
            )
        });
        let token_file = PathBuf::from(v["token_file"].as_str().unwrap());
        let token = std::fs::read_to_string(&token_file)
            .unwrap()
            .trim()
            .to_string();
        Server {
            child,
            url: v["url"].as_str().unwrap().to_string(),
            token,
            token_file,
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(Duration::from_secs(120)))
                .build()
                .into(),
        }
    }

    /// A request with the given token (none: no Authorization header).
    pub fn raw(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        content_type: Option<&str>,
        body: Vec<u8>,
    ) -> (u16, Vec<u8>) {
        let mut b = ureq::http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url));
        if let Some(t) = token {
            b = b.header("Authorization", format!("Bearer {t}"));
        }
        if let Some(ct) = content_type {
            b = b.header("Content-Type", ct);
        }
        // The error says what failed (seen once under a full parallel run,
        // not reproduced since: a pooled connection the daemon had closed?).
        let mut resp = self
            .agent
            .run(b.body(body).unwrap())
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = resp.status().as_u16();
        let bytes = resp
            .body_mut()
            .with_config()
            .limit(512 << 20)
            .read_to_vec()
            .unwrap();
        (status, bytes)
    }

    /// A JSON request with the right token; the status and the JSON answer.
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let (status, bytes) = self.raw(
            method,
            path,
            Some(&self.token),
            body.as_ref().map(|_| "application/json"),
            body.map(|b| b.to_string().into_bytes()).unwrap_or_default(),
        );
        let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (status, v)
    }

    /// [`call`], asserting the status.
    pub fn expect(&self, status: u16, method: &str, path: &str, body: Option<Value>) -> Value {
        let (s, v) = self.call(method, path, body);
        assert_eq!(s, status, "{method} {path}: {v}");
        v
    }

    /// A request over a bare socket that keeps reading the answer when the
    /// daemon stops reading the body (it refuses an oversized one from its
    /// length alone, and an HTTP client library then fails on the write).
    pub fn oversized(
        &self,
        method: &str,
        path: &str,
        ct: Option<&str>,
        body: &[u8],
    ) -> (u16, Vec<u8>) {
        use std::io::{Read, Write};
        let addr = self.url.trim_start_matches("http://");
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n{}Content-Length: {}\r\nConnection: close\r\n\r\n",
            self.token,
            ct.map(|c| format!("Content-Type: {c}\r\n"))
                .unwrap_or_default(),
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        let _ = s.write_all(body);
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        let text = String::from_utf8_lossy(&answer);
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        // A chunked answer: the JSON is the line that starts with '{'.
        let json = body
            .lines()
            .find(|l| l.starts_with('{'))
            .unwrap_or_default();
        (status, json.as_bytes().to_vec())
    }

    /// Writes a file of sandbox `sb` (`path` as it sees it); the status.
    pub fn put_file(&self, sb: &str, path: &str, data: &[u8]) -> u16 {
        let q = format!("/v1/sandboxes/{sb}/files/content?path={path}");
        self.raw("PUT", &q, Some(&self.token), None, data.to_vec())
            .0
    }

    /// Reads a file of sandbox `sb`: the status and the bytes.
    pub fn get_file(&self, sb: &str, path: &str) -> (u16, Vec<u8>) {
        let q = format!("/v1/sandboxes/{sb}/files/content?path={path}");
        self.raw("GET", &q, Some(&self.token), None, vec![])
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(p) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(p, rustix::process::Signal::TERM);
        }
        let _ = self.child.wait();
    }
}

/// The (method, path) pairs docs/openapi.yaml describes.
fn spec_routes() -> Vec<(String, String)> {
    let spec = include_str!("../../../../docs/openapi.yaml");
    let mut out = Vec::new();
    let mut path: Option<String> = None;
    let mut in_paths = false;
    for line in spec.lines() {
        if line == "paths:" {
            in_paths = true;
            continue;
        }
        if in_paths && !line.starts_with(' ') && !line.is_empty() {
            break;
        }
        if !in_paths {
            continue;
        }
        if let Some(p) = line.strip_prefix("  /") {
            path = Some(format!("/{}", p.trim_end_matches(':')));
        } else if let Some(m) = line.strip_prefix("    ")
            && let Some(m) = m.strip_suffix(':')
            && ["get", "post", "put", "delete"].contains(&m)
        {
            out.push((m.to_uppercase(), path.clone().unwrap()));
        }
    }
    out
}

fn fill(path: &str) -> String {
    let mut out = String::new();
    let mut in_param = false;
    for c in path.chars() {
        match c {
            '{' => in_param = true,
            '}' => {
                in_param = false;
                out.push_str("nosuch");
            }
            c if !in_param => out.push(c),
            _ => {}
        }
    }
    out
}

#[test]
fn every_route_but_healthz_needs_the_token_and_the_spec_matches_the_routes() {
    let env = Env::new();
    let srv = Server::start(&env, &[]);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&srv.token_file).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o600, "the token file is private");
    let routes = spec_routes();
    assert!(routes.len() >= 28, "the spec lists the routes: {routes:?}");
    for (method, path) in &routes {
        let p = fill(path);
        for token in [None, Some("wrong-token-0123456789")] {
            let (status, body) = srv.raw(method, &p, token, None, vec![]);
            if path == "/healthz" {
                assert_eq!(status, 200, "{method} {p} is open");
                continue;
            }
            assert_eq!(status, 401, "{method} {p} with {token:?}");
            let v: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["error"]["code"], "unauthorized", "{method} {p}: {v}");
        }
        // With the token, the route exists (whatever the answer to "nosuch").
        let (status, body) = srv.raw(method, &p, Some(&srv.token), None, vec![]);
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let unrouted = status == 405
            || (status == 404
                && v["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("no route")));
        assert!(
            !unrouted,
            "{method} {p} is in the spec but not served: {status} {v}"
        );
        if status >= 400 {
            assert!(v["error"]["code"].is_string(), "{method} {p}: {status} {v}");
        }
    }
    // Something the spec does not describe is not served.
    let (status, body) = srv.raw("GET", "/v1/nope", Some(&srv.token), None, vec![]);
    assert_eq!(status, 404);
    assert!(String::from_utf8_lossy(&body).contains("no route"));
    let (status, spec) = srv.raw("GET", "/v1/openapi.yaml", Some(&srv.token), None, vec![]);
    assert_eq!(status, 200);
    assert_eq!(spec, include_bytes!("../../../../docs/openapi.yaml"));
    // A non-loopback address without a token file is refused.
    let o = env.run(&["serve", "--listen", "0.0.0.0:0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not loopback"));
}

#[test]
fn bad_requests_get_a_clear_4xx_and_the_daemon_keeps_serving() {
    let env = Env::new();
    let srv = Server::start(&env, &["--max-body", "1M"]);
    let sb = srv.expect(201, "POST", "/v1/sandboxes", Some(json!({"name": "b"})));
    assert_eq!(sb["name"], "b");
    let bad = |method: &str, path: &str, ct: Option<&str>, body: Vec<u8>, want: u16, says: &str| {
        let (status, bytes) = if want == 413 {
            srv.oversized(method, path, ct, &body)
        } else {
            srv.raw(method, path, Some(&srv.token), ct, body)
        };
        let v: Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| panic!("{path}: not JSON: {}", String::from_utf8_lossy(&bytes)));
        assert_eq!(status, want, "{method} {path}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains(says),
            "{method} {path}: {msg:?} should say {says:?}"
        );
        assert!(v["error"]["code"].is_string());
    };
    let json_ct = Some("application/json");
    bad(
        "POST",
        "/v1/sandboxes",
        json_ct,
        b"{\"name\": ".to_vec(),
        400,
        "JSON",
    );
    bad(
        "POST",
        "/v1/sandboxes",
        json_ct,
        b"not json".to_vec(),
        400,
        "JSON",
    );
    bad(
        "POST",
        "/v1/sandboxes",
        json_ct,
        br#"{"nmae": "x"}"#.to_vec(),
        422,
        "unknown field `nmae`",
    );
    bad(
        "POST",
        "/v1/sandboxes/b/exec",
        json_ct,
        br#"{"command": ["true"], "cwd": "/"}"#.to_vec(),
        422,
        "unknown field `cwd`",
    );
    bad(
        "POST",
        "/v1/sandboxes/b/snapshot",
        None,
        br#"{"mesage": "x"}"#.to_vec(),
        // Well-formed JSON that does not fit: 422 on every route.
        422,
        "unknown field `mesage`",
    );
    let huge = format!("{{\"name\": \"{}\"}}", "x".repeat(2 << 20));
    bad(
        "POST",
        "/v1/sandboxes",
        json_ct,
        huge.into_bytes(),
        413,
        "too large",
    );
    bad(
        "PUT",
        "/v1/sandboxes/b/files/content?path=big",
        None,
        vec![0u8; 2 << 20],
        413,
        "too large",
    );
    for p in [
        "/workspace/../etc/passwd",
        "../../etc/passwd",
        "/etc/passwd",
        "/workspacefoo/x",
        "a/../../b",
    ] {
        let q = format!(
            "/v1/sandboxes/b/files/content?path={}",
            p.replace('/', "%2F")
        );
        bad("GET", &q, None, vec![], 400, "path");
        bad("PUT", &q, None, b"x".to_vec(), 400, "path");
        bad(
            "GET",
            &format!("/v1/sandboxes/b/files?path={}", p.replace('/', "%2F")),
            None,
            vec![],
            400,
            "path",
        );
    }
    bad(
        "PUT",
        "/v1/sandboxes/b/files/content?path=x&mode=999",
        None,
        b"x".to_vec(),
        400,
        "octal",
    );
    bad(
        "GET",
        "/v1/sandboxes/b/files/content",
        None,
        vec![],
        400,
        "path=",
    );
    bad("GET", "/v1/sandboxes?bogus=1", None, vec![], 400, "bogus");
    bad(
        "PATCH",
        "/v1/sandboxes/b",
        None,
        vec![],
        405,
        "does not take this method",
    );
    bad(
        "POST",
        "/v1/sandboxes/b/exec",
        json_ct,
        br#"{"command": []}"#.to_vec(),
        400,
        "empty",
    );
    bad("GET", "/v1/sandboxes/nosuch", None, vec![], 404, "nosuch");
    // A symlink the sandbox plants cannot lead a read or a write outside its workspace.
    let out = srv.expect(
        200,
        "POST",
        "/v1/sandboxes/b/exec",
        Some(json!({"command": ["sh", "-c", "ln -s /etc/passwd leak && ln -s ../../../../../.. up"]})),
    );
    assert_eq!(out["exit_code"], 0, "{out}");
    for p in ["leak", "up/etc/passwd"] {
        let (status, body) = srv.get_file("b", p);
        assert_eq!(status, 404, "{p}: {}", String::from_utf8_lossy(&body));
        assert!(!String::from_utf8_lossy(&body).contains("root:"));
    }
    // And the daemon still serves.
    let (status, _) = srv.raw("GET", "/healthz", None, None, vec![]);
    assert_eq!(status, 200);
    srv.expect(
        200,
        "PUT",
        "/v1/sandboxes/b/files/content?path=/workspace/ok.txt",
        None,
    );
    assert_eq!(srv.put_file("b", "/workspace/d/ok.txt", b"fine"), 200);
    let (status, body) = srv.get_file("b", "d/ok.txt");
    assert_eq!((status, body.as_slice()), (200, &b"fine"[..]));
    srv.expect(200, "DELETE", "/v1/sandboxes/b?force=true", None);
}

#[test]
fn sandboxes_files_exec_snapshots_and_forks_through_the_api() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let src = env.tmp.path().join("src");
    std::fs::create_dir_all(src.join("lib")).unwrap();
    std::fs::write(src.join("lib/a.txt"), "one\n").unwrap();
    let srv = Server::start(&env, &["--import-root", src.to_str().unwrap()]);
    // Only directories under --import-root may be imported.
    let (s, v) = srv.call("POST", "/v1/sandboxes", Some(json!({"directory": "/etc"})));
    assert_eq!(s, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--import-root")
    );
    let sb = srv.expect(
        201,
        "POST",
        "/v1/sandboxes",
        Some(json!({"name": "s", "directory": src, "env": {"GREETING": "hi"}})),
    );
    assert_eq!(sb["state"], "running");
    // Files, as the sandbox sees them.
    let list = srv.expect(
        200,
        "GET",
        "/v1/sandboxes/s/files?path=/workspace/lib",
        None,
    );
    assert_eq!(list[0]["name"], "a.txt");
    assert_eq!(list[0]["path"], "/workspace/lib/a.txt");
    let script = b"#!/bin/sh\necho \"$GREETING from $(pwd)\"; echo oops >&2; exit 7\n";
    assert_eq!(srv.put_file("s", "/workspace/run.sh&mode=755", script), 200);
    // Exec, collected.
    let out = srv.expect(
        200,
        "POST",
        "/v1/sandboxes/s/exec",
        Some(json!({"command": ["./run.sh"]})),
    );
    assert_eq!(out["stdout"], "hi from /workspace\n");
    assert_eq!(out["stderr"], "oops\n");
    assert_eq!(out["exit_code"], 7);
    let out = srv.expect(
        200,
        "POST",
        "/v1/sandboxes/s/exec",
        Some(json!({"command": ["sh", "-c", "echo $GREETING"], "env": {"GREETING": "env wins"}})),
    );
    assert_eq!(out["stdout"], "env wins\n");
    // Exec, streamed: pieces as they come, then the outcome.
    let (st, body) = srv.raw(
        "POST",
        "/v1/sandboxes/s/exec?stream=true",
        Some(&srv.token),
        Some("application/json"),
        json!({"command": ["sh", "-c", "echo a; sleep 0.2; echo b >&2; printf '\\377'; exit 3"]})
            .to_string()
            .into_bytes(),
    );
    assert_eq!(st, 200);
    let lines: Vec<Value> = String::from_utf8(body)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0], json!({"stream": "stdout", "data": "a\n"}));
    assert!(
        lines.contains(&json!({"stream": "stderr", "data": "b\n"})),
        "{lines:?}"
    );
    assert!(
        lines.contains(&json!({"stream": "stdout", "data_b64": "/w=="})),
        "{lines:?}"
    );
    assert_eq!(lines.last().unwrap()["exit_code"], 3);
    // A timeout kills the command.
    let t0 = Instant::now();
    let out = srv.expect(
        200,
        "POST",
        "/v1/sandboxes/s/exec",
        Some(json!({"command": ["sleep", "30"], "timeout_s": 0.5})),
    );
    assert_eq!(
        (out["timed_out"].as_bool(), out["exit_code"].as_i64()),
        (Some(true), Some(137))
    );
    assert!(t0.elapsed() < Duration::from_secs(10));
    // Snapshot, change, restore.
    let snap = srv.expect(
        201,
        "POST",
        "/v1/sandboxes/s/snapshot",
        Some(json!({"message": "one", "tags": ["t1"]})),
    );
    let id = snap["id"].as_str().unwrap().to_string();
    assert!(snap["duration_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(srv.put_file("s", "lib/a.txt", b"two\n"), 200);
    let diff = srv.expect(200, "GET", &format!("/v1/snapshots/{id}/diff"), None);
    assert_eq!(diff["changes"][0]["path"], "lib/a.txt", "{diff}");
    let r = srv.expect(
        200,
        "POST",
        "/v1/sandboxes/s/restore",
        Some(json!({"snapshot": "t1"})),
    );
    assert_eq!(r["modified"], 1, "{r}");
    let (_, body) = srv.get_file("s", "lib/a.txt");
    assert_eq!(body, b"one\n");
    // Snapshots: list, show, tag, delete refused while something depends on it.
    let all = srv.expect(200, "GET", "/v1/snapshots", None);
    assert!(
        all.as_array()
            .unwrap()
            .iter()
            .any(|s| s["id"] == id.as_str())
    );
    let shown = srv.expect(200, "GET", "/v1/snapshots/t1", None);
    assert_eq!(shown["message"], "one");
    srv.expect(
        200,
        "POST",
        &format!("/v1/snapshots/{id}/tags"),
        Some(json!({"name": "t2"})),
    );
    let (s, v) = srv.call("DELETE", &format!("/v1/snapshots/{id}"), None);
    assert_eq!(s, 409, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("tag t1"),
        "{v}"
    );
    // Fork: one result per fork, each its own running sandbox.
    let forked = srv.expect(
        201,
        "POST",
        "/v1/snapshots/t1/fork",
        Some(json!({"n": 3, "name": "f"})),
    );
    let forks = forked["sandboxes"].as_array().unwrap();
    assert_eq!(forks.len(), 3, "{forked}");
    for (k, f) in forks.iter().enumerate() {
        assert_eq!(f["name"], format!("f-{}", k + 1));
        assert_eq!(f["state"], "running", "{f}");
        let out = srv.expect(
            200,
            "POST",
            &format!("/v1/sandboxes/f-{}/exec", k + 1),
            Some(json!({"command": ["cat", "lib/a.txt"]})),
        );
        assert_eq!(out["stdout"], "one\n");
    }
    let live = srv.expect(201, "POST", "/v1/sandboxes/s/fork", Some(json!({"n": 2})));
    assert_eq!(live["sandboxes"].as_array().unwrap().len(), 2, "{live}");
    // Metrics count what happened.
    let (st, m) = srv.raw("GET", "/metrics", Some(&srv.token), None, vec![]);
    assert_eq!(st, 200);
    let m = String::from_utf8(m).unwrap();
    for want in [
        "tine_operations_total{op=\"snapshot\",outcome=\"ok\"} 2",
        "tine_operations_total{op=\"restore\",outcome=\"ok\"} 1",
        "tine_operations_total{op=\"fork\",outcome=\"ok\"} 2",
        "tine_operation_seconds_count{op=\"exec\"}",
        "tine_live_sandboxes 6",
        "tine_template_bytes",
    ] {
        assert!(m.contains(want), "metrics lack {want:?}:\n{m}");
    }
    for f in live["sandboxes"].as_array().unwrap() {
        srv.expect(
            200,
            "DELETE",
            &format!("/v1/sandboxes/{}?force=true", f["id"].as_str().unwrap()),
            None,
        );
    }
    for k in 1..=3 {
        srv.expect(
            200,
            "DELETE",
            &format!("/v1/sandboxes/f-{k}?force=true"),
            None,
        );
    }
    let (s, v) = srv.call("DELETE", "/v1/sandboxes/s", None);
    assert_eq!(s, 409, "a live sandbox needs force: {v}");
    srv.expect(200, "DELETE", "/v1/sandboxes/s?force=true", None);
    srv.expect(200, "DELETE", "/v1/tags/t2", None);
    assert_eq!(
        srv.expect(200, "GET", "/v1/sandboxes?all=true", None),
        json!([])
    );
}

/// The lines of the workspace's log file, read through the API.
fn log_lines(srv: &Server, ws: &str) -> Vec<u64> {
    let (st, body) = srv.get_file(ws, "log");
    if st != 200 {
        return vec![];
    }
    String::from_utf8_lossy(&body)
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect()
}

const COUNTER: &str = "import time\ni = 0\nwhile True:\n    i += 1\n    open('/workspace/log', 'a').write(f'{i}\\n')\n    time.sleep(0.05)\n";

#[test]
fn a_suspended_workspace_survives_kill_9_of_the_daemon_and_resumes() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let srv = Server::start(&env, &[]);
    let ws = srv.expect(
        201,
        "POST",
        "/v1/workspaces",
        Some(json!({"name": "w", "sandbox": {"command": ["python3", "-c", COUNTER]}})),
    );
    assert_eq!(ws["state"], "running", "{ws}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while log_lines(&srv, "w").len() < 5 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    for (p, data) in [
        ("notes/a.md", &b"# a\n"[..]),
        ("bin.dat", &[0u8, 255, 7][..]),
    ] {
        let st = srv.put_file("w", p, data);
        assert_eq!(st, 200);
    }
    let s = srv.expect(200, "POST", "/v1/workspaces/w/suspend", None);
    assert_eq!(s["state"]["seq"], 1, "{s}");
    let criu = s["state"]["processes"] == "criu";
    let snap = s["state"]["snapshot"].as_str().unwrap().to_string();
    // The daemon dies without a chance to do anything.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(srv.pid() as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    drop(srv);
    let srv = Server::start(&env, &[]);
    let ws = srv.expect(200, "GET", "/v1/workspaces/w", None);
    assert_eq!(ws["state"], "suspended", "{ws}");
    let r = srv.expect(200, "POST", "/v1/workspaces/w/resume", None);
    assert_eq!(r["from"], 1, "{r}");
    // The files are exactly those of the suspended state.
    let shown = srv.expect(200, "GET", &format!("/v1/snapshots/{snap}"), None);
    assert!(shown["files"].as_u64().unwrap() >= 3);
    for (p, data) in [
        ("notes/a.md", &b"# a\n"[..]),
        ("bin.dat", &[0u8, 255, 7][..]),
    ] {
        let (st, body) = srv.get_file("w", p);
        assert_eq!((st, body.as_slice()), (200, data));
    }
    // Nothing but the log the resumed program appends to differs from the state.
    let diff = srv.expect(200, "GET", &format!("/v1/snapshots/{snap}/diff"), None);
    for c in diff["changes"].as_array().unwrap() {
        assert_eq!(c["path"], "log", "{diff}");
    }
    let k = log_lines(&srv, "w").len();
    assert!(k >= 5, "the log as suspended is back");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut lines = log_lines(&srv, "w");
    while lines.len() < k + 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        lines = log_lines(&srv, "w");
    }
    assert!(lines.len() >= k + 3, "the workspace runs again: {lines:?}");
    if criu {
        assert_eq!(r["processes"], "criu", "{r}");
        // It continued where it was: no restart from 1.
        let expected: Vec<u64> = (1..=lines.len() as u64).collect();
        assert_eq!(lines, expected, "the counter continues");
    } else {
        eprintln!("no CRIU: the command restarts on resume");
        assert_eq!(r["processes"], "restart", "{r}");
        assert!(lines[k..].contains(&1), "{lines:?}");
    }
    srv.expect(200, "DELETE", "/v1/workspaces/w", None);
    assert_eq!(
        srv.expect(200, "GET", "/v1/sandboxes?all=true", None),
        json!([])
    );
}

#[test]
fn a_crash_at_any_step_of_a_suspend_leaves_a_restorable_workspace() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    env.ok(&["workspace", "create", "c", "--keep", "1"]);
    let exec = |cmd: &str| env.run(&["exec", "c", "--", "sh", "-c", cmd]);
    // One clean cycle first, so that there is a previous state to keep or prune.
    env.ok(&["suspend", "c"]);
    env.ok(&["resume", "c"]);
    for (k, step) in ["snapshotted", "recorded", "stopped", "pruned"]
        .iter()
        .enumerate()
    {
        assert!(exec(&format!("echo {k} > mark")).status.success());
        let o = env.run(&["suspend", "c", "--crash-after", step]);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(o.status.signal(), Some(9), "killed after {step}");
        let w = env.json(&["workspace", "show", "c"]);
        let state = w["state"].as_str().unwrap().to_string();
        assert!(
            state == "running" || state == "suspended",
            "after a crash at {step}: {w}"
        );
        // Every state listed is a snapshot the repository has.
        assert!(!w["states"].as_array().unwrap().is_empty(), "{w}");
        for st in w["states"].as_array().unwrap() {
            env.ok(&["show", st["snapshot"].as_str().unwrap()]);
        }
        if state == "running" {
            env.ok(&["suspend", "c"]);
        }
        let r = env.json(&["resume", "c"]);
        assert_eq!(r["workspace"]["state"], "running", "{r}");
        let o = exec("cat mark");
        assert_eq!(
            String::from_utf8_lossy(&o.stdout).trim(),
            k.to_string(),
            "after {step}"
        );
    }
    // Retention kept one state (plus none lost).
    let w = env.json(&["workspace", "show", "c"]);
    assert_eq!(w["states"].as_array().unwrap().len(), 1, "{w}");
    env.ok(&["workspace", "rm", "c"]);
}

#[test]
fn fifty_concurrent_clients_leave_no_5xx_and_nothing_behind() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let srv = Server::start(&env, &["--max-sandboxes", "24"]);
    let repo = std::fs::canonicalize(env.work().join(".tine")).unwrap();
    let stop_at = Instant::now() + Duration::from_secs(15);
    let most = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<Vec<(String, u16, Value)>> = std::thread::scope(|sc| {
        // How many are live at once, sampled all along: never over the cap.
        sc.spawn(|| {
            while Instant::now() < stop_at {
                let (s, v) = srv.call("GET", "/v1/sandboxes", None);
                if s == 200 {
                    let live = v
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter(|x| x["state"] == "running" || x["state"] == "starting")
                        .count();
                    most.fetch_max(live, std::sync::atomic::Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let hs: Vec<_> = (0..50)
            .map(|c| {
                let srv = &srv;
                sc.spawn(move || {
                    let mut seen = Vec::new();
                    let mut note = |what: &str, s: u16, v: &Value| {
                        seen.push((what.to_string(), s, v.clone()));
                    };
                    let mut i = 0;
                    while Instant::now() < stop_at {
                        i += 1;
                        let name = format!("c{c}-{i}");
                        let (s, v) = srv.call("POST", "/v1/sandboxes", Some(json!({"name": name})));
                        note("create", s, &v);
                        if s != 201 {
                            std::thread::sleep(Duration::from_millis(200));
                            continue;
                        }
                        let (s, v) = srv.call(
                            "POST",
                            &format!("/v1/sandboxes/{name}/exec"),
                            Some(json!({"command": ["true"]})),
                        );
                        note("exec", s, &v);
                        let (s, v) = srv.call(
                            "POST",
                            &format!("/v1/sandboxes/{name}/fork"),
                            Some(json!({"n": 1})),
                        );
                        note("fork", s, &v);
                        if s == 201 {
                            for f in v["sandboxes"].as_array().unwrap() {
                                let (s, v) = srv.call(
                                    "DELETE",
                                    &format!(
                                        "/v1/sandboxes/{}?force=true",
                                        f["id"].as_str().unwrap()
                                    ),
                                    None,
                                );
                                note("delete fork", s, &v);
                            }
                        }
                        let (s, v) =
                            srv.call("DELETE", &format!("/v1/sandboxes/{name}?force=true"), None);
                        note("delete", s, &v);
                    }
                    seen
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let all: Vec<_> = results.into_iter().flatten().collect();
    let count = |what: &str, s: u16| {
        all.iter()
            .filter(|(w, st, _)| w == what && *st == s)
            .count()
    };
    eprintln!(
        "50 clients: {} creates ok, {} at capacity; {} execs, {} forks ok, {} at capacity; {} deletes",
        count("create", 201),
        count("create", 503),
        count("exec", 200),
        count("fork", 201),
        count("fork", 503),
        count("delete", 200)
    );
    for (what, s, v) in &all {
        if *s >= 500 {
            assert!(
                *s == 503 && v["error"]["code"] == "capacity",
                "{what}: {s} {v}"
            );
        }
        if what.starts_with("delete") || what == "exec" {
            assert!(*s < 300, "{what}: {s} {v}");
        }
    }
    assert!(count("create", 201) >= 50, "work was done");
    let most = most.into_inner();
    assert!(
        most <= 24,
        "{most} sandboxes were live at once under --max-sandboxes 24"
    );
    eprintln!("at most {most} live at once");
    assert!(count("fork", 201) >= 10, "forks were made");
    // Nothing is left: no sandbox, no mount, no process, no cgroup.
    assert_eq!(
        srv.expect(200, "GET", "/v1/sandboxes?all=true", None),
        json!([])
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(repo.to_str().unwrap()),
        "mounts left under {}",
        repo.display()
    );
    let leftovers: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(repo.to_str().unwrap()))
        .collect();
    assert!(leftovers.is_empty(), "processes left: {leftovers:?}");
}

#[test]
fn the_cli_talks_to_a_daemon_given_tine_url() {
    let env = Env::new();
    let srv = Server::start(&env, &[]);
    // Run from a directory with no repository: everything goes through the daemon.
    let elsewhere = tempfile::tempdir().unwrap();
    let tine = |args: &[&str], token: Option<&str>| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_tine"));
        c.args(args)
            .current_dir(elsewhere.path())
            .env_remove("TINE_REPO")
            .env("TINE_URL", &srv.url);
        match token {
            Some(t) => c.env("TINE_TOKEN", t),
            None => c.env_remove("TINE_TOKEN"),
        };
        c.output().unwrap()
    };
    let ok = |args: &[&str]| {
        let o = tine(args, Some(&srv.token));
        assert!(
            o.status.success(),
            "tine {args:?}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    };
    let v: Value = serde_json::from_str(&ok(&[
        "--json", "run", "--name", "r", "--", "sleep", "infinity",
    ]))
    .unwrap();
    assert_eq!(v["state"], "running", "{v}");
    assert!(ok(&["ps"]).contains(" r "));
    // exec: output and exit code pass through.
    let o = tine(
        &[
            "exec",
            "r",
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 5",
        ],
        Some(&srv.token),
    );
    assert_eq!(o.status.code(), Some(5));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "out\n");
    assert_eq!(String::from_utf8_lossy(&o.stderr), "err\n");
    ok(&["exec", "r", "--", "sh", "-c", "echo 1 > f"]);
    let snap: Value = serde_json::from_str(&ok(&[
        "--json",
        "snapshot",
        "--sandbox",
        "r",
        "-m",
        "one",
        "--tag",
        "one",
    ]))
    .unwrap();
    assert!(snap["id"].is_string(), "{snap}");
    ok(&["exec", "r", "--", "sh", "-c", "echo 2 > f"]);
    ok(&["restore", "one", "--sandbox", "r"]);
    let o = tine(&["exec", "r", "--", "cat", "f"], Some(&srv.token));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "1\n");
    let f: Value =
        serde_json::from_str(&ok(&["--json", "fork", "one", "-n", "2", "--name", "rf"])).unwrap();
    assert_eq!(f["sandboxes"].as_array().unwrap().len(), 2, "{f}");
    assert!(ok(&["log"]).contains("one"));
    // Errors keep their kind, so their exit code.
    let o = tine(&["exec", "nosuch", "--", "true"], Some(&srv.token));
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = tine(&["ps"], None);
    assert_eq!(
        o.status.code(),
        Some(10),
        "no token: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = tine(&["ps"], Some("wrong-token-0123456789"));
    assert_eq!(o.status.code(), Some(10));
    let o = tine(&["gc"], Some(&srv.token));
    assert_eq!(o.status.code(), Some(8));
    assert!(String::from_utf8_lossy(&o.stderr).contains("daemon's host"));
    ok(&["rm", "-f", "rf-1", "rf-2", "r"]);
    ok(&["tag", "-d", "one"]);
}

#[test]
fn an_idle_workspace_is_suspended_and_a_busy_one_is_not() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let srv = Server::start(&env, &["--idle-check", "1"]);
    srv.expect(
        201,
        "POST",
        "/v1/workspaces",
        Some(json!({"name": "idle", "idle_suspend_s": 2})),
    );
    srv.expect(
        201,
        "POST",
        "/v1/workspaces",
        Some(json!({"name": "busy", "idle_suspend_s": 2, "sandbox": {"command": ["sh", "-c", "while :; do :; done"]}})),
    );
    let t0 = Instant::now();
    let mut idle_state = String::new();
    while t0.elapsed() < Duration::from_secs(15) {
        idle_state = srv.expect(200, "GET", "/v1/workspaces/idle", None)["state"]
            .as_str()
            .unwrap()
            .to_string();
        if idle_state == "suspended" {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(
        idle_state, "suspended",
        "no API activity and no CPU use for 2 s"
    );
    assert!(t0.elapsed() >= Duration::from_secs(2));
    // The busy one used CPU all along: still running.
    let busy = srv.expect(200, "GET", "/v1/workspaces/busy", None);
    assert_eq!(busy["state"], "running", "{busy}");
    // Activity through the API keeps a workspace awake as well.
    srv.expect(200, "POST", "/v1/workspaces/idle/resume", None);
    let t1 = Instant::now();
    while t1.elapsed() < Duration::from_secs(4) {
        srv.expect(200, "GET", "/v1/sandboxes/idle/files", None);
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(
        srv.expect(200, "GET", "/v1/workspaces/idle", None)["state"],
        "running"
    );
    let log = std::fs::read_to_string(env.tmp.path().join("serve.log")).unwrap();
    assert!(
        log.contains("\"auto-suspend\""),
        "the daemon logged it: {log}"
    );
    srv.expect(200, "DELETE", "/v1/workspaces/busy", None);
    srv.expect(200, "DELETE", "/v1/workspaces/idle", None);
}

/// PIDs of the processes whose command line holds all of `words`.
fn pids_with(words: &[&str]) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| {
                    let c = String::from_utf8_lossy(&c).replace('\0', " ");
                    words.iter().all(|w| c.contains(w))
                })
                .unwrap_or(false)
        })
        .collect()
}

#[test]
fn a_restarted_daemon_adopts_live_sandboxes_and_marks_dead_ones_stale() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let srv = Server::start(&env, &[]);
    let live = srv.expect(201, "POST", "/v1/sandboxes", Some(json!({"name": "alive"})));
    let dead = srv.expect(201, "POST", "/v1/sandboxes", Some(json!({"name": "dead"})));
    let kill9 = |pid: i32| {
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid).unwrap(),
            rustix::process::Signal::KILL,
        );
    };
    kill9(srv.pid() as i32);
    drop(srv);
    // The dead one's supervisor goes too (as after a crash of its own).
    let sup = pids_with(&["__supervise", dead["id"].as_str().unwrap()]);
    assert_eq!(sup.len(), 1, "one supervisor per sandbox");
    kill9(sup[0]);
    let srv = Server::start(&env, &[]);
    let log = std::fs::read_to_string(env.tmp.path().join("serve.log")).unwrap();
    let reconciled = log
        .lines()
        .rev()
        .find(|l| l.contains("\"reconciled\""))
        .expect("the daemon logs what it reconciled");
    let v: Value = serde_json::from_str(reconciled).unwrap();
    assert_eq!(v["event"]["detail"]["adopted"], json!(["alive"]), "{v}");
    assert_eq!(v["event"]["detail"]["stale"], json!(["dead"]), "{v}");
    // The live one is served as before; the dead one is recorded stale.
    let out = srv.expect(
        200,
        "POST",
        "/v1/sandboxes/alive/exec",
        Some(json!({"command": ["true"]})),
    );
    assert_eq!(out["exit_code"], 0);
    assert_eq!(
        srv.expect(200, "GET", "/v1/sandboxes/dead", None)["state"],
        "stale"
    );
    assert_eq!(
        live["id"],
        srv.expect(200, "GET", "/v1/sandboxes/alive", None)["id"]
    );
    // A stale one is cleaned up by a forced delete: its processes too.
    srv.expect(200, "DELETE", "/v1/sandboxes/dead?force=true", None);
    srv.expect(200, "DELETE", "/v1/sandboxes/alive?force=true", None);
    let repo = std::fs::canonicalize(env.work().join(".tine")).unwrap();
    assert!(pids_with(&[repo.to_str().unwrap()]).is_empty());
}

/// Whether two answers to the same request have the same shape, where
/// ids and timings differ: the same keys at every level, leaves of the same
/// JSON type (null stands for an optional value of any type), arrays whose
/// elements are alike.
fn alike(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Null, _) | (_, Value::Null) => true,
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| alike(v, w)))
        }
        (Value::Array(x), Value::Array(y)) => {
            let mut all = x.iter().chain(y);
            all.next()
                .is_none_or(|first| x.iter().chain(y).all(|v| alike(first, v)))
        }
        (Value::String(_), Value::String(_))
        | (Value::Number(_), Value::Number(_))
        | (Value::Bool(_), Value::Bool(_)) => true,
        _ => false,
    }
}

#[test]
fn the_cli_and_the_api_answer_snapshot_restore_fork_merge_and_diff_alike() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let srv = Server::start(&env, &[]);
    env.ok(&["run", "--name", "c", "--", "sleep", "infinity"]);
    let sh = |script: &str| env.ok(&["exec", "c", "--", "sh", "-c", script]);
    sh("echo base > f; printf 'a\\nb\\nc\\n' > t");
    // Snapshot: the local CLI and the API (the base, and one of them later).
    let local = env.json(&["snapshot", "--sandbox", "c", "-m", "base"]);
    let base = local["id"].as_str().unwrap().to_string();
    sh("printf 'A\\nb\\nc\\n' > t; echo ours > o");
    let api = srv.expect(
        201,
        "POST",
        "/v1/sandboxes/c/snapshot",
        Some(json!({"message": "ours"})),
    );
    let ours = api["id"].as_str().unwrap().to_string();
    assert!(alike(&local, &api), "snapshot: {local} / {api}");
    assert_eq!(local["processes"], 1, "{local}");
    assert_eq!(api["sandbox"], "c", "{api}");
    // Restore: back to the base both ways, then theirs on top of it.
    let local = env.json(&["restore", &base, "--sandbox", "c"]);
    let api = srv.expect(
        200,
        "POST",
        "/v1/sandboxes/c/restore",
        Some(json!({"snapshot": base})),
    );
    assert!(alike(&local, &api), "restore: {local} / {api}");
    assert_eq!(local["snapshot"], json!(base), "{local}");
    sh("printf 'a\\nb\\nC\\n' > t; echo theirs > th");
    let theirs = env.json(&["snapshot", "--sandbox", "c", "-m", "theirs"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    // Fork: full views of the new sandboxes on both routes.
    let local = env.json(&["fork", &base, "-n", "1", "--name", "lf"]);
    let api = srv.expect(
        201,
        "POST",
        &format!("/v1/snapshots/{base}/fork"),
        Some(json!({"n": 1, "name": "af"})),
    );
    assert!(alike(&local, &api), "fork: {local} / {api}");
    assert_eq!(local["sandboxes"][0]["state"], "running", "{local}");
    // Diff with patches: the same document, and the same text locally and
    // through the daemon.
    let local = env.json(&["diff", &base, &ours, "-p"]);
    let api = srv.expect(
        200,
        "GET",
        &format!("/v1/snapshots/{base}/diff?to={ours}&patch=true"),
        None,
    );
    assert_eq!(local, api);
    assert!(
        local["patches"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p.as_str().unwrap().contains("-a\n+A\n")),
        "{local}"
    );
    let through = |args: &[&str]| {
        let o = env
            .cmd(args)
            .env("TINE_URL", &srv.url)
            .env("TINE_TOKEN", &srv.token)
            .output()
            .unwrap();
        (o.status.code(), String::from_utf8(o.stdout).unwrap())
    };
    let text = env.ok(&["diff", &base, &ours, "-p"]);
    assert_eq!(through(&["diff", &base, &ours, "-p"]), (Some(0), text));
    let text = env.ok(&["ps"]);
    assert!(text.contains(" c ") && text.contains("lf-1"), "{text}");
    assert_eq!(through(&["ps"]), (Some(0), text));
    let text = env.ok(&["log"]);
    assert_eq!(through(&["log"]).1.lines().count(), text.lines().count());
    // As locally, a snapshot of a sandbox goes back into it without naming it.
    sh("echo later > f");
    let (code, out) = through(&["restore", &ours]);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.starts_with("restored ") && out.contains("into sandbox c"),
        "{out}"
    );
    assert_eq!(sh("cat f"), "base\n");
    // Merge into the sandbox: locally, then the same merge through the API
    // (the second finds the first's result in place and makes it again).
    let local = env.json(&["merge", &ours, &theirs, "--sandbox", "c"]);
    assert_eq!(local["conflicts"], json!([]), "{local}");
    assert_eq!(local["target"], "/workspace", "{local}");
    assert_eq!(sh("cat t o th"), "A\nb\nC\nours\ntheirs\n");
    let api = srv.expect(
        200,
        "POST",
        "/v1/sandboxes/c/merge",
        Some(json!({"ours": ours, "theirs": theirs})),
    );
    assert!(alike(&local, &api), "merge: {local} / {api}");
    assert_eq!(local["base"], json!(base), "{local}");
    assert_eq!(api["base"], json!(base), "{api}");
    // A conflicting merge through the daemon exits 11 like a local one.
    sh("echo mine > f");
    let mine = env.json(&["snapshot", "--sandbox", "c"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (code, out) = through(&["merge", &mine, &ours, "--base", &base, "--sandbox", "c"]);
    assert_eq!(code, Some(0), "{out}");
    sh("echo yours > f");
    let yours = env.json(&["snapshot", "--sandbox", "c"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (code, out) = through(&["merge", &mine, &yours, "--base", &base, "--sandbox", "c"]);
    assert_eq!(code, Some(11), "{out}");
    assert!(out.contains("conflict (content): f"), "{out}");
    env.ok(&["rm", "-f", "lf-1", "af-1", "c"]);
}

/// One handler serves both routes: every command that a daemon can answer
/// prints the same text (and the same JSON) through it as locally, exits
/// with the same codes, and what needs the repository's host is refused by
/// name.
#[test]
fn every_command_reads_the_same_locally_and_through_a_daemon() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let srv = Server::start(&env, &[]);
    let run = |daemon: bool, args: &[&str]| {
        let mut c = env.cmd(args);
        if daemon {
            c.env("TINE_URL", &srv.url).env("TINE_TOKEN", &srv.token);
        }
        let o = c.output().unwrap();
        (
            o.status.code(),
            String::from_utf8(o.stdout).unwrap(),
            String::from_utf8(o.stderr).unwrap(),
        )
    };
    let through = |args: &[&str]| run(true, args);
    // A sandbox made through the daemon; exec streams its output and exits
    // with the command's code.
    let (code, out, err) = through(&["run", "--name", "d", "--", "sleep", "infinity"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("started sandbox d"), "{out}");
    let (code, out, err) = through(&[
        "exec",
        "d",
        "-e",
        "WHO=daemon",
        "--",
        "sh",
        "-c",
        "echo out $WHO > f; cat f; echo err >&2; exit 3",
    ]);
    assert_eq!(
        (code, out.as_str(), err.as_str()),
        (Some(3), "out daemon\n", "err\n")
    );
    let (code, _, err) = through(&["exec", "d", "--", "no-such-program"]);
    let local = run(false, &["exec", "d", "--", "no-such-program"]);
    assert_eq!(code, local.0, "{err} / {}", local.2);
    let snap = env.json(&["snapshot", "--sandbox", "d", "-m", "one"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    // Tags, set and deleted through the daemon, read the same as locally.
    let (code, out, _) = through(&["tag", "t1", &snap]);
    assert_eq!(code, Some(0));
    assert_eq!(out, format!("tagged {} as t1\n", &snap[..12]));
    // The ledger through the daemon.
    let (code, out, err) = through(&[
        "ledger",
        "append",
        "--sandbox",
        "d",
        "--kind",
        "email",
        "--key",
        "k1",
        "--request",
        "{\"to\":\"a\"}",
        "--result",
        "{\"ok\":true}",
    ]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.starts_with("recorded entry "), "{out}");
    // Each of these: the same text, the same JSON and the same exit code on
    // both routes.
    let same: &[&[&str]] = &[
        &["ps"],
        &["ps", "--all"],
        &["log"],
        &["log", "--graph"],
        &["show", &snap],
        &["diff", &snap],
        &["ledger", "list", "--sandbox", "d"],
        &["ledger", "list", "--all"],
        &["ledger", "lookup", "--sandbox", "d", "k1"],
        &["ledger", "lookup", "--sandbox", "d", "no-such-key"],
        &["ledger", "verify"],
        &["workspace", "ls"],
        &["show", "no-such-snapshot"],
        &["stop", "no-such-sandbox"],
    ];
    for args in same {
        let (local, daemon) = (run(false, args), through(args));
        assert_eq!((local.0, &local.1), (daemon.0, &daemon.1), "{args:?}");
        let mut json = vec!["--json"];
        json.extend_from_slice(args);
        let (local, daemon) = (run(false, &json), through(&json));
        assert_eq!(local.0, daemon.0, "{json:?}");
        if local.0 == Some(0) {
            let (l, d): (Value, Value) = (
                serde_json::from_str(&local.1).unwrap(),
                serde_json::from_str(&daemon.1).unwrap(),
            );
            assert_eq!(l, d, "{json:?}");
        }
    }
    assert_eq!(
        through(&["ledger", "lookup", "--sandbox", "d", "no"]).0,
        Some(3)
    );
    let (code, out, _) = through(&["tag", "--delete", "t1"]);
    assert_eq!(code, Some(0));
    assert_eq!(out, format!("deleted tag t1 (was {})\n", &snap[..12]));
    // Workspaces through the daemon.
    let (code, out, err) = through(&["workspace", "create", "w", "--", "sleep", "infinity"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.starts_with("workspace w (running)"), "{out}");
    let (local, daemon) = (
        run(false, &["workspace", "show", "w"]),
        through(&["workspace", "show", "w"]),
    );
    assert_eq!(local.1, daemon.1);
    let (code, out, _) = through(&["suspend", "w"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.starts_with("suspended workspace w: state 1"), "{out}");
    let (code, out, _) = through(&["resume", "w"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.starts_with("resumed workspace w from state 1"), "{out}");
    assert_eq!(
        through(&["workspace", "rm", "w"]).1,
        "deleted workspace w\n"
    );
    // What needs the repository's host is refused by name (unsupported, 8).
    let dir = env.tmp.path().join("d");
    std::fs::create_dir_all(&dir).unwrap();
    let dir = dir.to_str().unwrap();
    for (args, named) in [
        (&["gc"][..], "gc"),
        (&["fsck"], "fsck"),
        (&["logs", "d"], "logs"),
        (&["tag"], "listing tags"),
        (&["snapshot", dir], "a snapshot of a directory"),
        (&["restore", &snap, "--to", dir], "restore --to DIR"),
        (&["fork", &snap, "--into", dir], "fork --into DIR"),
        (&["diff", &snap, "--dir", dir], "diff --dir"),
        (&["show", &snap, "--attachment", "x"], "show --attachment"),
        (&["exec", "-i", "d", "--", "true"], "exec -i/-t"),
    ] {
        let (code, _, err) = through(args);
        assert_eq!(code, Some(8), "{args:?}: {err}");
        assert!(
            err.contains(named) && err.contains("not available through the daemon"),
            "{args:?}: {err}"
        );
    }
    let (code, out, err) = through(&["rm", "-f", "d"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.starts_with("removed sandbox d ("), "{out}");
}

/// The engine and the HTTP client are one interface: the same calls, through
/// `&dyn Operations`, give the same typed results and errors of the same
/// kinds (files, exec, snapshots, tags, the ledger).
#[test]
fn the_engine_and_the_client_are_one_interface() {
    use tine_engine::{Ctx, ExecRequest, Operations, SnapshotRequest, Stream};
    use tine_store::{EntryKind, ErrorKind, HasKind};
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let remotes = env.tmp.path().join("remotes");
    std::fs::create_dir(&remotes).unwrap();
    let srv = Server::start(&env, &["--remote-root", remotes.to_str().unwrap()]);
    env.ok(&["run", "--name", "f", "--", "sleep", "infinity"]);
    let repo = std::fs::canonicalize(env.work().join(".tine")).unwrap();
    let engine = tine_engine::Engine::new(tine_engine::EngineConfig::new(
        repo,
        PathBuf::from(env!("CARGO_BIN_EXE_tine")),
    ));
    let client = tine_client::Client::new(&srv.url, srv.token.clone()).unwrap();
    let both: [&dyn Operations; 2] = [&engine, &client];
    // A file written through either reads back the same through both.
    for (i, ops) in both.iter().enumerate() {
        let path = format!("/workspace/sub/f{i}");
        let data: Vec<u8> = (0..300_000u32).map(|n| (n % 251) as u8 + i as u8).collect();
        let e = ops
            .write_file("f", &path, &mut &data[..], Some(0o640))
            .unwrap();
        assert_eq!((e.kind, e.size, e.mode), (EntryKind::File, 300_000, 0o640));
        for o in both {
            assert_eq!(o.read_file("f", &path).unwrap(), data);
        }
    }
    let listed: Vec<_> = both
        .iter()
        .map(|o| o.list_files("f", "/workspace/sub").unwrap())
        .collect();
    assert_eq!(listed[0].len(), 2);
    assert_eq!(listed[0], listed[1]);
    // Errors keep their kinds across the wire.
    for ops in both {
        let kind = |e: tine_engine::EngineError| e.kind();
        assert_eq!(
            kind(ops.sandbox("no-such").unwrap_err()),
            ErrorKind::NotFound
        );
        assert_eq!(
            kind(ops.read_file("f", "/workspace/../etc").unwrap_err()),
            ErrorKind::InvalidInput
        );
        assert_eq!(kind(ops.snapshot("zzzz").unwrap_err()), ErrorKind::NotFound);
    }
    // Exec: the output as it comes (bytes that are not text too), the code.
    for ops in both {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let req = ExecRequest {
            command: ["sh", "-c", "printf 'x\\377'; echo e >&2; exit 4"]
                .map(String::from)
                .to_vec(),
            ..Default::default()
        };
        let r = ops
            .exec("f", &req, &mut |s, d| {
                match s {
                    Stream::Stdout => out.extend_from_slice(d),
                    Stream::Stderr => err.extend_from_slice(d),
                }
                true
            })
            .unwrap();
        assert_eq!(
            (r.exit_code, &out[..], &err[..]),
            (4, &b"x\xff"[..], &b"e\n"[..])
        );
    }
    // Snapshots, tags and the ledger.
    let snap = client
        .snapshot_sandbox("f", &SnapshotRequest::default(), &Ctx::QUIET)
        .unwrap();
    let id = snap.outcome.id.to_hex();
    // The template's private memory is measured when asked (it grows as
    // the template's pages are copied on write), so it is compared apart.
    let details: Vec<_> = both
        .iter()
        .map(|o| {
            let mut d = serde_json::to_value(o.snapshot(&id).unwrap()).unwrap();
            let private = d["processes"]
                .as_object_mut()
                .unwrap()
                .remove("private_bytes");
            assert!(private.and_then(|p| p.as_u64()).unwrap() > 0, "{d}");
            d
        })
        .collect();
    assert_eq!(details[0], details[1]);
    assert_eq!(
        client.tag(&id, "via-client", false, &Ctx::QUIET).unwrap(),
        snap.outcome.id
    );
    assert_eq!(
        engine.untag("via-client", &Ctx::QUIET).unwrap(),
        snap.outcome.id
    );
    for ops in both {
        assert_eq!(ops.ledger_lookup("f", "none").unwrap(), None);
        assert_eq!(
            ops.ledger_lookup("no-such", "none").unwrap_err().kind(),
            ErrorKind::NotFound
        );
    }
    // Graph checkpoints: a thread bound to the sandbox, written through
    // either, read alike through both; loading the first to run from it
    // rolls the sandbox back to its snapshot.
    use tine_engine::graph::{GraphPut, GraphWrites, TaskWrite};
    use tine_store::graph::{GraphQuery, Typed};
    let typed = |s: &str| Typed {
        kind: "json".into(),
        data: s.as_bytes().to_vec(),
    };
    let sh = |c: &str| env.ok(&["exec", "f", "--", "sh", "-c", c]);
    for (i, ops) in both.iter().enumerate() {
        let thread = format!("g{i}");
        sh(&format!("echo first > /workspace/g{i}"));
        let put = |id: &str, parent: Option<&str>| GraphPut {
            ns: String::new(),
            id: id.into(),
            parent: parent.map(str::to_string),
            checkpoint: typed(id),
            metadata: typed("{}"),
            filter: [("step".to_string(), id.len().to_string())].into(),
            run_id: Some("run".into()),
            sandbox: Some("f".into()),
        };
        let a = ops
            .graph_put(&thread, &put("a", None), &Ctx::QUIET)
            .unwrap();
        assert!(
            a.snapshot.is_some(),
            "a root checkpoint snapshots its sandbox"
        );
        sh(&format!("echo second > /workspace/g{i}"));
        ops.graph_put(&thread, &put("bb", Some("a")), &Ctx::QUIET)
            .unwrap();
        let w = GraphWrites {
            ns: String::new(),
            checkpoint: "bb".into(),
            task: "t".into(),
            task_path: String::new(),
            writes: vec![TaskWrite {
                idx: 0,
                channel: "ch".into(),
                value: typed("v"),
            }],
        };
        ops.graph_put_writes(&thread, &w, &Ctx::QUIET).unwrap();
        let q = GraphQuery {
            thread: Some(thread.clone()),
            ..Default::default()
        };
        let pages: Vec<_> = both
            .iter()
            .map(|o| serde_json::to_value(o.graph_list(&q).unwrap()).unwrap())
            .collect();
        assert_eq!(pages[0], pages[1]);
        assert_eq!(pages[0]["checkpoints"][0]["writes"][0]["channel"], "ch");
        let latest = ops
            .graph_get(&thread, "", None, true, &Ctx::QUIET)
            .unwrap()
            .unwrap();
        assert_eq!(
            (latest.checkpoint.id.as_str(), latest.rewound),
            ("bb", None)
        );
        let first = ops
            .graph_get(&thread, "", Some("a"), true, &Ctx::QUIET)
            .unwrap()
            .unwrap();
        assert!(first.rewound.is_some(), "the sandbox went back to a");
        assert_eq!(sh(&format!("cat /workspace/g{i}")), "first\n");
        assert!(
            ops.graph_get(&thread, "", Some("zz"), true, &Ctx::QUIET)
                .unwrap()
                .is_none()
        );
        assert_eq!(
            ops.graph_delete_thread(&thread, &Ctx::QUIET)
                .unwrap()
                .checkpoints,
            2
        );
    }
    // Remotes: named through either, listed alike; a push through the
    // daemon is seen by both, and what it sent is already here for a pull.
    use tine_engine::{AddRemote, PullRequest, PushRequest};
    for (i, ops) in both.iter().enumerate() {
        let req = AddRemote {
            name: format!("r{i}"),
            url: format!("file://{}/r{i}", remotes.display()),
            ..AddRemote::default()
        };
        assert_eq!(ops.add_remote(&req, &Ctx::QUIET).unwrap().name, req.name);
    }
    let listed: Vec<_> = both.iter().map(|o| o.remotes().unwrap()).collect();
    assert_eq!(listed[0], listed[1]);
    assert_eq!(listed[0].len(), 2);
    let push = PushRequest {
        remote: Some("r0".into()),
        ..PushRequest::default()
    };
    let pushed = client.push(&push, &Ctx::QUIET).unwrap();
    assert!(!pushed.report.snapshots_sent.is_empty(), "{pushed:?}");
    let shown: Vec<_> = both
        .iter()
        .map(|o| serde_json::to_value(o.remote_show("r0").unwrap()).unwrap())
        .collect();
    assert_eq!(shown[0], shown[1]);
    let pull = PullRequest {
        remote: Some("r0".into()),
        snapshots: Vec::new(),
    };
    for ops in both {
        let pulled = ops.pull(&pull, &Ctx::QUIET).unwrap();
        assert!(pulled.report.snapshots_received.is_empty(), "{pulled:?}");
    }
    let err = client.remote_show("nope").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    assert!(err.to_string().contains("known: r0, r1"), "{err}");
    assert_eq!(client.remove_remote("r1", &Ctx::QUIET).unwrap().name, "r1");
    assert_eq!(engine.remotes().unwrap().len(), 1);
    env.ok(&["rm", "-f", "f"]);
}

/// A command run through the API that a rollback of the sandbox's
/// processes kills says so: exit code 137 and `rolled_back`, naming the
/// snapshot.
#[test]
fn an_api_exec_ended_by_a_rollback_says_why() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let srv = Server::start(&env, &[]);
    let sb = srv.expect(
        201,
        "POST",
        "/v1/sandboxes",
        Some(json!({"name": "r", "command": ["python3", "-c", "import signal; signal.pause()"]})),
    );
    let started = std::path::PathBuf::from(sb["workspace"].as_str().unwrap()).join("started");
    let snap = srv.expect(201, "POST", "/v1/sandboxes/r/snapshot", Some(json!({})));
    assert_eq!(snap["processes"], 1, "{snap}");
    let id = snap["id"].as_str().unwrap().to_string();
    std::thread::scope(|s| {
        let exec = s.spawn(|| {
            srv.call(
                "POST",
                "/v1/sandboxes/r/exec",
                Some(json!({"command": ["sh", "-c", "touch /workspace/started; sleep 30"]})),
            )
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        while !started.exists() {
            assert!(Instant::now() < deadline, "the command did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        srv.expect(
            200,
            "POST",
            "/v1/sandboxes/r/restore",
            Some(json!({"snapshot": id})),
        );
        let (st, out) = exec.join().unwrap();
        assert_eq!(st, 200, "{out}");
        assert_eq!(out["exit_code"], 137, "{out}");
        let why = out["rolled_back"].as_str().unwrap_or_default();
        assert!(
            why.contains("was rolled back to snapshot") && why.contains(&id[..12]),
            "{out}"
        );
    });
}

#[test]
fn an_api_exec_whose_client_went_away_is_stopped_though_it_writes_nothing() {
    use std::io::Write;
    if skipped_without_root() {
        return;
    }
    // The command writes nothing, so no failed write tells the daemon the
    // client is gone: its heartbeat does, streamed or collected.
    let env = Env::new();
    let srv = Server::start(&env, &[]);
    let sb = srv.expect(201, "POST", "/v1/sandboxes", Some(json!({"name": "q"})));
    let ws = std::path::PathBuf::from(sb["workspace"].as_str().unwrap());
    let addr = srv.url.trim_start_matches("http://").to_string();
    for (i, query) in ["?stream=true", ""].into_iter().enumerate() {
        let mark = ws.join(format!("started{i}"));
        let body =
            json!({"command": ["sh", "-c", format!("touch /workspace/started{i}; sleep 3{i}")]})
                .to_string();
        let mut conn = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            conn,
            "POST /v1/sandboxes/q/exec{query} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            srv.token,
            body.len()
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !mark.exists() {
            assert!(Instant::now() < deadline, "the command did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(conn);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (_, out) = srv.call(
                "POST",
                "/v1/sandboxes/q/exec",
                Some(json!({"command": ["sh", "-c", format!("ps -eo args | grep -c '[s]leep 3{i}' || true")]})),
            );
            if out["stdout"].as_str() == Some("0\n") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "sleep 3{i} ({query:?}) still runs after its client left: {out}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    srv.expect(200, "DELETE", "/v1/sandboxes/q?force=true", None);
}

#[test]
fn an_api_exec_snapshotted_while_it_runs_ends_with_its_command() {
    if skipped_without_root() {
        return;
    }
    // A snapshot taken while an exec's command runs makes templates of it,
    // which hold its output pipes open: the exec still ends when the
    // command does, with all it wrote (LangGraph saves a checkpoint, and so
    // snapshots, while the next step's commands run).
    let env = Env::new();
    let srv = Server::start(&env, &[]);
    let sb = srv.expect(201, "POST", "/v1/sandboxes", Some(json!({"name": "x"})));
    let started = std::path::PathBuf::from(sb["workspace"].as_str().unwrap()).join("started");
    std::thread::scope(|s| {
        let exec = s.spawn(|| {
            let t0 = Instant::now();
            let r = srv.call(
                "POST",
                "/v1/sandboxes/x/exec",
                Some(json!({"command": ["sh", "-c", "echo one; touch /workspace/started; sleep 1; echo two"]})),
            );
            (r, t0.elapsed())
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        while !started.exists() {
            assert!(Instant::now() < deadline, "the command did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        let snap = srv.expect(201, "POST", "/v1/sandboxes/x/snapshot", Some(json!({})));
        assert!(
            snap["processes"].as_u64().unwrap() >= 2,
            "the command was captured: {snap}"
        );
        let ((st, out), took) = exec.join().unwrap();
        assert_eq!(st, 200, "{out}");
        assert_eq!(
            (out["exit_code"].as_i64(), out["stdout"].as_str()),
            (Some(0), Some("one\ntwo\n")),
            "{out}"
        );
        assert!(
            took < Duration::from_secs(10),
            "the exec ended {took:?} after it began"
        );
    });
    srv.expect(200, "DELETE", "/v1/sandboxes/x?force=true", None);
}

/// `/mcp` takes the names given with --mcp-host besides loopback ones, and
/// still refuses any other `Host` (MCP's guard against DNS rebinding).
#[test]
fn mcp_over_http_takes_the_hosts_it_is_told_of_and_no_other() {
    use std::io::{Read, Write};
    let env = Env::new();
    let srv = Server::start(&env, &["--mcp-host", "tine.example"]);
    let addr = srv.url.trim_start_matches("http://").to_string();
    let port = addr.rsplit(':').next().unwrap().to_string();
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "test", "version": "1"}}})
    .to_string();
    let status = |host: &str| -> u16 {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            c,
            "POST /mcp HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{init}",
            srv.token,
            init.len()
        )
        .unwrap();
        let mut head = [0u8; 12];
        c.read_exact(&mut head).unwrap();
        String::from_utf8_lossy(&head[9..12]).parse().unwrap()
    };
    assert_eq!(status(&format!("127.0.0.1:{port}")), 200);
    assert_eq!(status(&format!("tine.example:{port}")), 200);
    assert_eq!(status("tine.example"), 200);
    let refused = status(&format!("evil.example:{port}"));
    assert!(
        (400..500).contains(&refused),
        "another Host is refused: {refused}"
    );
}
