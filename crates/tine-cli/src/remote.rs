//! The CLI against a daemon (`--url` or `TINE_URL`, token from `TINE_TOKEN`
//! or `--token-file`): each command becomes one API request; `--json` prints
//! the daemon's answer as it is, and errors keep their kinds (so their exit
//! codes). Commands that need the repository's host (gc, fsck, logs,
//! snapshots of host directories) say so.

use std::io::{BufRead, BufReader, Write};

use serde_json::{Value, json};
use tine_store::ErrorKind;

use crate::output::CliError;
use crate::render::{self, short};
use crate::{Cli, Command};

/// A daemon to talk to.
pub struct Remote {
    url: String,
    token: String,
    agent: ureq::Agent,
}

fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl Remote {
    pub fn new(url: &str, token: Option<String>) -> Result<Remote, CliError> {
        if !url.starts_with("http://") {
            return Err(CliError::new(
                ErrorKind::InvalidInput,
                format!(
                    "--url {url:?}: give http://HOST:PORT (for TLS, put a proxy in front of tine serve and reach it through an http:// tunnel)"
                ),
            ));
        }
        let token = token.ok_or_else(|| {
            CliError::new(
                ErrorKind::Unauthorized,
                "talking to a daemon needs its token: set TINE_TOKEN, or --token-file FILE (tine serve printed where it keeps it)",
            )
        })?;
        Ok(Remote {
            url: url.trim_end_matches('/').to_string(),
            token,
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .build()
                .into(),
        })
    }

    fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<ureq::http::Response<ureq::Body>, CliError> {
        let mut b = ureq::http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url))
            .header("Authorization", format!("Bearer {}", self.token));
        if body.is_some() {
            b = b.header("Content-Type", "application/json");
        }
        let req = b
            .body(body.map(|v| v.to_string()).unwrap_or_default())
            .map_err(|e| CliError::new(ErrorKind::InvalidInput, e.to_string()))?;
        let mut resp = self
            .agent
            .run(req)
            .map_err(|e| CliError::new(ErrorKind::Io, format!("daemon at {}: {e}", self.url)))?;
        if resp.status().as_u16() >= 400 {
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            let v: Value = serde_json::from_str(&text).unwrap_or_default();
            let code = v["error"]["code"].as_str().unwrap_or("internal");
            let message = v["error"]["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| format!("HTTP {}: {text}", resp.status()));
            return Err(CliError::new(ErrorKind::from_code(code), message));
        }
        Ok(resp)
    }

    /// One request; its JSON answer.
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, CliError> {
        let mut resp = self.send(method, path, body.as_ref())?;
        resp.body_mut()
            .with_config()
            .limit(256 << 20)
            .read_json()
            .map_err(|e| CliError::new(ErrorKind::Io, format!("daemon at {}: {e}", self.url)))
    }
}

fn unavailable(what: &str) -> CliError {
    CliError::new(
        ErrorKind::Unsupported,
        format!(
            "{what} is not available through the daemon; run it on the daemon's host without --url/TINE_URL"
        ),
    )
}

fn out(json: bool, doc: &Value, text: impl FnOnce() -> String) {
    crate::emit(json, doc.clone(), text);
}

fn env_map(env: &[String]) -> Result<Value, CliError> {
    Ok(Value::Object(
        crate::commands::sandbox::parse_env(env)?
            .into_iter()
            .map(|(k, v)| (k, Value::String(v)))
            .collect(),
    ))
}

/// Runs `cli`'s command through the daemon.
pub fn run(cli: Cli, remote: &Remote) -> Result<(), CliError> {
    let json = cli.json;
    match cli.command {
        Command::Run(a) => {
            let body = serde_json::to_value(crate::commands::sandbox::create_request(&a)?)
                .unwrap_or_default();
            let v = remote.call("POST", "/v1/sandboxes", Some(body))?;
            out(json, &v, || render::started(&v));
        }
        Command::Ps { all } => {
            let v = remote.call("GET", &format!("/v1/sandboxes?all={all}"), None)?;
            out(json, &v, || render::sandboxes(&v, all));
        }
        Command::Stop { sandbox, timeout } => {
            let q = timeout
                .map(|t| format!("?timeout_s={t}"))
                .unwrap_or_default();
            let v = remote.call(
                "POST",
                &format!("/v1/sandboxes/{}/stop{q}", enc(&sandbox)),
                None,
            )?;
            out(json, &v, || render::stopped(&v));
        }
        Command::Rm { sandboxes, force } => {
            for sb in sandboxes {
                let v = remote.call(
                    "DELETE",
                    &format!("/v1/sandboxes/{}?force={force}", enc(&sb)),
                    None,
                )?;
                out(json, &v, || render::removed(&v));
            }
        }
        Command::Exec {
            sandbox,
            interactive,
            tty,
            env,
            command,
        } => {
            if interactive || tty {
                return Err(unavailable("exec -i/-t"));
            }
            let body = json!({"command": command, "env": env_map(&env)?});
            let resp = remote.send(
                "POST",
                &format!("/v1/sandboxes/{}/exec?stream=true", enc(&sandbox)),
                Some(&body),
            )?;
            let mut code = 1;
            let reader = BufReader::new(resp.into_body().into_reader());
            for line in reader.lines() {
                let line =
                    line.map_err(|e| CliError::new(ErrorKind::Io, format!("exec stream: {e}")))?;
                let Ok(ev) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                let data = ev["data"]
                    .as_str()
                    .map(|s| s.as_bytes().to_vec())
                    .or_else(|| {
                        ev["data_b64"].as_str().map(|b| {
                            use base64::Engine as _;
                            base64::engine::general_purpose::STANDARD
                                .decode(b)
                                .unwrap_or_default()
                        })
                    });
                match (ev["stream"].as_str(), data) {
                    (Some("stdout"), Some(d)) => {
                        let _ = std::io::stdout().write_all(&d);
                        let _ = std::io::stdout().flush();
                    }
                    (Some("stderr"), Some(d)) => {
                        let _ = std::io::stderr().write_all(&d);
                    }
                    _ if ev.get("error").is_some() => {
                        return Err(CliError::new(
                            ErrorKind::from_code(
                                ev["error"]["code"].as_str().unwrap_or("internal"),
                            ),
                            ev["error"]["message"].as_str().unwrap_or_default(),
                        ));
                    }
                    _ => code = ev["exit_code"].as_i64().unwrap_or(1) as i32,
                }
            }
            if code != 0 {
                return Err(CliError::exit(code));
            }
        }
        Command::Snapshot(crate::commands::snapshot::Args {
            message,
            tags,
            force,
            sandbox,
            files_only,
            persist,
            ..
        }) => {
            let Some(sb) = sandbox else {
                return Err(unavailable("a snapshot of a directory (give --sandbox SB)"));
            };
            let v = remote.call(
                "POST",
                &format!("/v1/sandboxes/{}/snapshot", enc(&sb)),
                Some(json!({"message": message, "tags": tags, "force": force, "files_only": files_only, "persist": persist})),
            )?;
            if !json {
                for note in render::evicted_notes(&v) {
                    eprintln!("note: {note}");
                }
            }
            out(json, &v, || render::sandbox_snapshot(&v));
        }
        Command::Restore(crate::commands::restore::Args {
            snapshot,
            to,
            sandbox,
            files_only,
            keep_setuid: _,
            ..
        }) => {
            if to.is_some() {
                return Err(unavailable("restore --to DIR"));
            }
            // As locally: a snapshot of a sandbox goes back into that sandbox.
            let sb = match sandbox {
                Some(sb) => sb,
                None => {
                    let snap =
                        remote.call("GET", &format!("/v1/snapshots/{}", enc(&snapshot)), None)?;
                    let source = snap["source"].as_str().unwrap_or_default();
                    let Some(id) = tine_engine::sandbox_id_of_source(source) else {
                        return Err(unavailable(
                            "restore of a directory's snapshot (give --sandbox SB)",
                        ));
                    };
                    id.to_string()
                }
            };
            let v = remote.call(
                "POST",
                &format!("/v1/sandboxes/{}/restore", enc(&sb)),
                Some(json!({"snapshot": snapshot, "files_only": files_only})),
            )?;
            if !json && let Some(note) = render::let_go_note(&v) {
                eprintln!("note: {note}");
            }
            out(json, &v, || render::sandbox_restore(&v));
        }
        Command::Fork(crate::commands::fork::Args {
            snapshot,
            count,
            into,
            keep_setuid: _,
            name,
            no_start,
            files_only,
            through_criu,
            command,
            ..
        }) => {
            if into.is_some() {
                return Err(unavailable("fork --into DIR"));
            }
            let mut body = json!({"n": count, "no_start": no_start, "files_only": files_only, "through_criu": through_criu, "command": command});
            if let Some(n) = name {
                body["name"] = Value::from(n);
            }
            let v = remote.call(
                "POST",
                &format!("/v1/snapshots/{}/fork", enc(&snapshot)),
                Some(body),
            )?;
            if !json && let Some(note) = v["note"].as_str() {
                eprintln!("note: {note}");
            }
            out(json, &v, || render::fork(&v));
        }
        Command::Log(crate::commands::log::Args { limit, graph, .. }) => {
            if graph {
                return Err(unavailable("log --graph"));
            }
            let q = limit.map(|n| format!("?limit={n}")).unwrap_or_default();
            let v = remote.call("GET", &format!("/v1/snapshots{q}"), None)?;
            out(json, &v, || {
                v.as_array()
                    .into_iter()
                    .flatten()
                    .map(|s| {
                        format!(
                            "{}  {}  {}{}\n",
                            short(&s["id"]),
                            crate::output::time(s["time_ns"].as_u64().unwrap_or(0)),
                            s["message"].as_str().unwrap_or_default(),
                            s["tags"]
                                .as_array()
                                .filter(|t| !t.is_empty())
                                .map(|t| format!(
                                    "  [{}]",
                                    t.iter()
                                        .filter_map(|x| x.as_str())
                                        .collect::<Vec<_>>()
                                        .join(", ")
                                ))
                                .unwrap_or_default()
                        )
                    })
                    .collect()
            });
        }
        Command::Show(crate::commands::show::Args {
            snapshot,
            attachment,
            ..
        }) => {
            if attachment.is_some() {
                return Err(unavailable("show --attachment"));
            }
            let v = remote.call("GET", &format!("/v1/snapshots/{}", enc(&snapshot)), None)?;
            out(json, &v, || {
                format!("{}\n", serde_json::to_string_pretty(&v).unwrap_or_default())
            });
        }
        Command::Diff(crate::commands::diff::Args {
            a, b, patch, dir, ..
        }) => {
            if dir.is_some() {
                return Err(unavailable("diff --dir"));
            }
            let mut q = vec![];
            if let Some(b) = b {
                q.push(format!("to={}", enc(&b)));
            }
            if patch {
                q.push("patch=true".to_string());
            }
            let q = if q.is_empty() {
                String::new()
            } else {
                format!("?{}", q.join("&"))
            };
            let v = remote.call("GET", &format!("/v1/snapshots/{}/diff{q}", enc(&a)), None)?;
            out(json, &v, || render::diff(&v));
        }
        Command::Tag(crate::commands::tag::Args {
            name,
            snapshot,
            delete,
            force,
            ..
        }) => match (name, snapshot, delete) {
            (Some(name), None, true) => {
                let v = remote.call("DELETE", &format!("/v1/tags/{}", enc(&name)), None)?;
                out(json, &v, || {
                    format!("deleted tag {name} (was {})\n", short(&v["was"]))
                });
            }
            (Some(name), Some(snap), false) => {
                let v = remote.call(
                    "POST",
                    &format!("/v1/snapshots/{}/tags", enc(&snap)),
                    Some(json!({"name": name, "force": force})),
                )?;
                out(json, &v, || {
                    format!("tag {name} -> {}\n", short(&v["snapshot"]))
                });
            }
            _ => return Err(unavailable("listing tags")),
        },
        Command::Workspace { cmd } => {
            use crate::commands::workspace::WorkspaceCmd as W;
            let v = match cmd {
                W::Create(a) => {
                    let req = crate::commands::workspace::create_request(a);
                    let body = serde_json::to_value(req).unwrap_or_default();
                    remote.call("POST", "/v1/workspaces", Some(body))?
                }
                W::Ls => remote.call("GET", "/v1/workspaces", None)?,
                W::Show { name } => {
                    remote.call("GET", &format!("/v1/workspaces/{}", enc(&name)), None)?
                }
                W::Rm { name } => {
                    remote.call("DELETE", &format!("/v1/workspaces/{}", enc(&name)), None)?
                }
            };
            out(json, &v, || {
                format!("{}\n", serde_json::to_string_pretty(&v).unwrap_or_default())
            });
        }
        Command::Suspend { to: Some(_), .. } => return Err(unavailable("suspend --to")),
        Command::Resume { from: Some(_), .. } => return Err(unavailable("resume --from")),
        Command::Suspend {
            name, crash_after, ..
        } => {
            if crash_after.is_some() {
                return Err(unavailable("--crash-after"));
            }
            let v = remote.call(
                "POST",
                &format!("/v1/workspaces/{}/suspend", enc(&name)),
                None,
            )?;
            out(json, &v, || {
                format!(
                    "suspended workspace {name}: state {} (processes: {})\n",
                    v["state"]["seq"],
                    v["state"]["processes"].as_str().unwrap_or_default()
                )
            });
        }
        Command::Resume { name, .. } => {
            let v = remote.call(
                "POST",
                &format!("/v1/workspaces/{}/resume", enc(&name)),
                None,
            )?;
            out(json, &v, || {
                format!(
                    "resumed workspace {name} (processes: {})\n",
                    v["processes"].as_str().unwrap_or_default()
                )
            });
        }
        Command::Merge(crate::commands::merge::Args {
            a,
            b,
            base,
            sandbox,
            message,
            ..
        }) => {
            let Some(sb) = sandbox else {
                return Err(unavailable("merge --into DIR (give --sandbox SB)"));
            };
            let body = tine_engine::MergeRequest {
                ours: a,
                theirs: b,
                base,
                message,
            };
            let v = remote.call(
                "POST",
                &format!("/v1/sandboxes/{}/merge", enc(&sb)),
                Some(serde_json::to_value(&body).unwrap_or_default()),
            )?;
            out(json, &v, || render::merge(&v));
            if v["conflicts"].as_array().is_some_and(|c| !c.is_empty()) {
                return Err(CliError::exit(ErrorKind::Conflict.exit_code() as i32));
            }
        }
        Command::Ledger { cmd } => {
            use crate::commands::ledger::LedgerCmd as L;
            let v = match cmd {
                L::Append {
                    sandbox,
                    kind,
                    key,
                    request,
                    result,
                } => remote.call(
                    "POST",
                    &format!("/v1/sandboxes/{}/ledger", enc(&sandbox)),
                    Some(json!({"kind": kind, "key": key, "request": request, "result": result})),
                )?,
                L::List {
                    sandbox: Some(sb),
                    all,
                } => remote.call(
                    "GET",
                    &format!("/v1/sandboxes/{}/ledger?all={all}", enc(&sb)),
                    None,
                )?,
                L::List { sandbox: None, .. } => remote.call("GET", "/v1/ledger", None)?,
                L::Lookup { sandbox, key } => remote.call(
                    "GET",
                    &format!(
                        "/v1/sandboxes/{}/ledger/lookup?key={}",
                        enc(&sandbox),
                        enc(&key)
                    ),
                    None,
                )?,
                L::Verify => remote.call("GET", "/v1/ledger/verify", None)?,
            };
            out(json, &v, || {
                format!("{}\n", serde_json::to_string_pretty(&v).unwrap_or_default())
            });
        }
        Command::Init => return Err(unavailable("init")),
        Command::Gc(_) => return Err(unavailable("gc")),
        Command::Remote { .. } => return Err(unavailable("remote")),
        Command::Push { .. } => return Err(unavailable("push")),
        Command::Pull { .. } => return Err(unavailable("pull")),
        Command::Clone { .. } => return Err(unavailable("clone")),
        Command::Fsck(_) => return Err(unavailable("fsck")),
        Command::Logs { .. } => return Err(unavailable("logs")),
        Command::Bench { .. } => return Err(unavailable("bench")),
        Command::Serve(_) => return Err(unavailable("serve")),
    }
    Ok(())
}
