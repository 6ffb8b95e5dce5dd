//! Requests the daemon makes for a client (an S3 remote's endpoint is any
//! URL a token holder names): only http(s) endpoints of a host are taken,
//! checked when the remote is added (400); what the endpoint answers is
//! never reflected (a status and a one-line reason); with
//! `--remote-endpoint` the daemon reaches only the endpoints it was given,
//! and sends nothing (not even its access-key id) anywhere else.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use serde_json::json;

use crate::common::Env;
use crate::serve::Server;

/// A loopback service that answers every request with a body holding
/// `INTERNAL-SECRET`, and logs what it was sent to `log`.
struct Echo {
    child: Child,
    port: u16,
}

impl Echo {
    fn start(log: &Path, status: u16) -> Echo {
        let script = format!(
            r#"
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def answer(self):
        with open({log:?}, 'a') as f:
            f.write(self.command + ' ' + self.path + ' ' + str(self.headers.get('Authorization')) + '\n')
        body = b'<Error><Code>Internal</Code><Message>INTERNAL-SECRET root:x:0:0</Message></Error>'
        self.send_response({status})
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        if self.command != 'HEAD':
            self.wfile.write(body)
    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = answer
    def log_message(self, *a): pass
s = http.server.HTTPServer(('127.0.0.1', 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"#,
            log = log.display().to_string(),
        );
        let mut child = Command::new("python3")
            .args(["-c", &script])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        Echo {
            child,
            port: line.trim().parse().unwrap(),
        }
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn an_endpoint_the_client_names_is_checked_and_its_answers_never_reflected() {
    let env = Env::new();
    let log = env.tmp.path().join("echo.log");
    let echo = Echo::start(&log, 500);
    let srv = Server::start(&env, &[]);
    for (endpoint, why) in [
        ("file:///etc/passwd", "http"),
        ("gopher://127.0.0.1:70", "http"),
        ("http://user:pw@127.0.0.1:1", "user name"),
        ("http://", "no host"),
        ("http://127.0.0.1:99999", "port"),
        ("http://127.0.0.1:1\r\nX: y", "control"),
    ] {
        let (code, body) = srv.call(
            "POST",
            "/v1/remotes",
            Some(json!({"name": "r", "url": "s3://bucket/p", "endpoint": endpoint})),
        );
        assert_eq!(code, 400, "{endpoint}: {body}");
        assert!(body.to_string().contains(why), "{endpoint}: {body}");
    }
    let endpoint = format!("http://127.0.0.1:{}", echo.port);
    srv.expect(
        201,
        "POST",
        "/v1/remotes",
        Some(json!({"name": "inner", "url": "s3://bucket/p", "endpoint": endpoint})),
    );
    let (code, body) = srv.call("GET", "/v1/remotes/inner", None);
    assert!(code >= 400, "{code} {body}");
    let text = body.to_string();
    assert!(
        !text.contains("INTERNAL-SECRET") && !text.contains("root:x"),
        "{text}"
    );
    assert!(text.contains("HTTP 500"), "{text}");
    // The CLI, on its own host, says the same and no more.
    let o = env.run(&[
        "remote",
        "add",
        "cli",
        "s3://bucket/p",
        "--endpoint",
        &endpoint,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = env.run(&["remote", "show", "cli"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && !err.contains("INTERNAL-SECRET"),
        "{err}"
    );
    drop(srv);
    // A daemon given the endpoints it may reach reaches no other, and sends
    // nothing there (the remote named above, before, is refused too).
    std::fs::write(&log, "").unwrap();
    let srv = Server::start(&env, &["--remote-endpoint", "s3.example.internal:443"]);
    let (code, body) = srv.call(
        "POST",
        "/v1/remotes",
        Some(json!({"name": "other", "url": "s3://bucket/p", "endpoint": endpoint})),
    );
    assert_eq!(code, 400, "{body}");
    assert!(body.to_string().contains("--remote-endpoint"), "{body}");
    let (code, body) = srv.call("GET", "/v1/remotes/inner", None);
    assert_eq!(code, 400, "{body}");
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "",
        "the daemon reached it"
    );
}

#[test]
fn what_tine_writes_outside_the_repository_is_its_owners_only() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    env.write("secret.txt", b"the sandbox's data");
    env.ok(&["snapshot", "-m", "one", "--tag", "one"]);
    // A file remote tine makes: 0700, so its packs are no other user's.
    let remote = env.tmp.path().join("shared/remote");
    let url = format!("file://{}", remote.display());
    env.ok(&["remote", "add", "origin", &url]);
    env.ok(&["push", "origin", "one"]);
    let mode = std::fs::metadata(&remote).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "{mode:o}");
}
