//! Reading a Dockerfile: its lines joined where they continue, comments
//! dropped, each instruction parsed into a [`Step`] (shell or JSON form),
//! and `$VAR` / `${VAR}` / `${VAR:-default}` expanded where Docker expands
//! them. Only what `tine build` runs is accepted; anything else is refused
//! naming its line.

use thiserror::Error;

/// Largest Dockerfile read, in bytes.
pub const MAX_DOCKERFILE: usize = 1 << 20;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DockerfileError {
    #[error("Dockerfile line {line}: {message}")]
    Bad { line: usize, message: String },
    #[error("the Dockerfile is {size} bytes, over the limit of {MAX_DOCKERFILE}")]
    TooLarge { size: usize },
    #[error(
        "the Dockerfile has no FROM: begin it with `FROM IMAGE` (an image `tine image ls` lists)"
    )]
    NoFrom,
}

/// A command as the Dockerfile gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Shell form: run by `/bin/sh -c`.
    Shell(String),
    /// JSON (exec) form: the program and its arguments.
    Exec(Vec<String>),
}

impl Command {
    /// The argument vector it runs as.
    pub fn argv(&self) -> Vec<String> {
        match self {
            Command::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
            Command::Exec(v) => v.clone(),
        }
    }
}

/// What `COPY` / `ADD` copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copy {
    /// Paths (or `*`/`?` patterns in their last part) in the build context.
    pub sources: Vec<String>,
    pub dest: String,
    /// `--chown=USER[:GROUP]`.
    pub chown: Option<String>,
    /// `--chmod=OCTAL`.
    pub chmod: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Instruction {
    From {
        image: String,
    },
    Run(Command),
    Copy(Copy),
    /// As `Copy`; a local tar archive (plain or gzip) is unpacked at `dest`.
    Add(Copy),
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
    Cmd(Command),
    Entrypoint(Command),
    Label(Vec<(String, String)>),
    Expose(Vec<String>),
    /// Build arguments: each a name and its default, if any (before `FROM`:
    /// for `FROM` itself).
    Arg(Vec<(String, Option<String>)>),
}

/// One instruction, with where it is and how it reads (continuations
/// joined): what a build's cache key and history are made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub line: usize,
    pub text: String,
    pub instruction: Instruction,
}

/// Reads a Dockerfile into its steps: `ARG`s, if any, then its `FROM`, then the rest.
pub fn parse(text: &str) -> Result<Vec<Step>, DockerfileError> {
    if text.len() > MAX_DOCKERFILE {
        return Err(DockerfileError::TooLarge { size: text.len() });
    }
    let mut steps = Vec::new();
    for (line, joined) in logical_lines(text) {
        let bad = |message: String| DockerfileError::Bad { line, message };
        let (word, rest) = match joined.split_once(char::is_whitespace) {
            Some((w, r)) => (w, r.trim()),
            None => (joined.as_str(), ""),
        };
        let word = word.to_ascii_uppercase();
        if rest.is_empty() {
            return Err(bad(format!("{word} needs arguments")));
        }
        if rest.starts_with("<<") {
            return Err(bad("here-documents (`<<EOF`) are not supported; write the file with COPY, or the command on one line".into()));
        }
        let instruction = match word.as_str() {
            "FROM" => {
                let parts: Vec<&str> = rest.split_whitespace().collect();
                if parts.iter().any(|p| p.starts_with("--")) || parts.len() != 1 {
                    return Err(bad(format!(
                        "FROM takes one image (a name `tine image ls` lists); {rest:?} is more: stages (`AS`) and `--platform` are not supported"
                    )));
                }
                Instruction::From {
                    image: parts[0].to_string(),
                }
            }
            "RUN" => {
                if rest.starts_with("--") {
                    return Err(bad(format!(
                        "RUN options ({}) are not supported",
                        rest.split_whitespace().next().unwrap_or(rest)
                    )));
                }
                Instruction::Run(command(rest).map_err(bad)?)
            }
            "CMD" => Instruction::Cmd(command(rest).map_err(bad)?),
            "ENTRYPOINT" => Instruction::Entrypoint(command(rest).map_err(bad)?),
            "COPY" | "ADD" => {
                let c = copy(rest).map_err(bad)?;
                if word == "COPY" {
                    Instruction::Copy(c)
                } else {
                    if let Some(u) = c.sources.iter().find(|s| s.contains("://")) {
                        return Err(bad(format!(
                            "ADD of a URL ({u}) is not supported: a build has no network to fetch it; download it into the context first"
                        )));
                    }
                    Instruction::Add(c)
                }
            }
            "ENV" => Instruction::Env(pairs(rest, true).map_err(bad)?),
            "LABEL" => Instruction::Label(pairs(rest, false).map_err(bad)?),
            "WORKDIR" => Instruction::Workdir(rest.to_string()),
            "USER" => Instruction::User(rest.to_string()),
            "EXPOSE" => Instruction::Expose(rest.split_whitespace().map(str::to_string).collect()),
            "ARG" => Instruction::Arg(
                split_words(rest)
                    .map_err(bad)?
                    .into_iter()
                    .map(|w| match w.split_once('=') {
                        Some((k, v)) => Ok((check_key(k)?, Some(v.to_string()))),
                        None => Ok((check_key(&w)?, None)),
                    })
                    .collect::<Result<_, String>>()
                    .map_err(bad)?,
            ),
            "MAINTAINER" => Instruction::Label(vec![("maintainer".into(), rest.to_string())]),
            other => {
                return Err(bad(format!(
                    "{other} is not supported by tine build (it runs FROM, ARG, RUN, COPY, ADD, ENV, WORKDIR, USER, CMD, ENTRYPOINT, LABEL, EXPOSE)"
                )));
            }
        };
        let from_seen = steps
            .iter()
            .any(|s: &Step| matches!(s.instruction, Instruction::From { .. }));
        // Before FROM only ARGs (for FROM itself).
        if !from_seen && !matches!(instruction, Instruction::From { .. } | Instruction::Arg(_)) {
            return Err(DockerfileError::NoFrom);
        }
        if from_seen && matches!(instruction, Instruction::From { .. }) {
            return Err(bad(
                "a second FROM: multi-stage builds are not supported".into()
            ));
        }
        steps.push(Step {
            line,
            text: format!("{word} {rest}"),
            instruction,
        });
    }
    if !steps
        .iter()
        .any(|s| matches!(s.instruction, Instruction::From { .. }))
    {
        return Err(DockerfileError::NoFrom);
    }
    Ok(steps)
}

/// The instructions' lines: comments and blank lines dropped, a line
/// ending in `\` joined with the next, each with the line it began on.
fn logical_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut cur: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let t = raw.trim();
        // Comments only at the start of a line (inside a continuation too).
        if t.starts_with('#') || (t.is_empty() && cur.is_none()) {
            continue;
        }
        let (body, more) = match t.strip_suffix('\\') {
            Some(b) => (b.trim_end(), true),
            None => (t, false),
        };
        match &mut cur {
            Some((_, s)) => {
                if !body.is_empty() {
                    s.push(' ');
                    s.push_str(body);
                }
            }
            None => cur = Some((i + 1, body.to_string())),
        }
        if !more && let Some(c) = cur.take() {
            out.push(c);
        }
    }
    out.extend(cur);
    out
}

/// Shell form, or JSON form when it is a JSON array of strings.
fn command(rest: &str) -> Result<Command, String> {
    if rest.starts_with('[')
        && let Ok(v) = serde_json::from_str::<Vec<String>>(rest)
    {
        if v.is_empty() {
            return Err("an empty command ([])".into());
        }
        return Ok(Command::Exec(v));
    }
    Ok(Command::Shell(rest.to_string()))
}

/// `COPY [--chown=U[:G]] [--chmod=OCT] SRC... DEST`, or its JSON form.
fn copy(rest: &str) -> Result<Copy, String> {
    let mut chown = None;
    let mut chmod = None;
    let mut words = rest;
    while let Some(w) = words.strip_prefix("--") {
        let (opt, after) = w.split_once(char::is_whitespace).unwrap_or((w, ""));
        words = after.trim_start();
        match opt.split_once('=') {
            Some(("chown", v)) if !v.is_empty() => chown = Some(v.to_string()),
            Some(("chmod", v)) => {
                chmod = Some(
                    u32::from_str_radix(v, 8)
                        .ok()
                        .filter(|m| *m <= 0o7777)
                        .ok_or_else(|| format!("--chmod={v}: give an octal mode such as 755"))?,
                )
            }
            Some(("from", _)) => {
                return Err("--from: multi-stage builds are not supported".into());
            }
            _ => {
                return Err(format!(
                    "--{opt} is not supported (--chown and --chmod are)"
                ));
            }
        }
    }
    let parts: Vec<String> = if words.starts_with('[') {
        serde_json::from_str(words).map_err(|e| format!("its JSON form does not parse: {e}"))?
    } else {
        split_words(words)?
    };
    if parts.len() < 2 {
        return Err("give one or more sources in the build context, then the destination".into());
    }
    let (dest, sources) = parts.split_last().expect("two or more");
    Ok(Copy {
        sources: sources.to_vec(),
        dest: dest.clone(),
        chown,
        chmod,
    })
}

/// Words split at blanks, with `"..."` and `'...'` quoting and `\`
/// escapes (kept as `\` where Docker keeps them: before a `$`, so that a
/// later expansion leaves it).
fn split_words(s: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = s.chars();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (Some(q), c) if c == q => quote = None,
            (Some('\''), c) => cur.push(c),
            (_, '\\') => {
                in_word = true;
                match chars.next() {
                    Some('$') => cur.push_str("\\$"),
                    Some(n) => cur.push(n),
                    None => cur.push('\\'),
                }
            }
            (_, c) => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if quote.is_some() {
        return Err("a quote is not closed".into());
    }
    if in_word {
        out.push(cur);
    }
    Ok(out)
}

/// `KEY=VALUE ...` pairs, or (`legacy`: ENV's old form) `KEY VALUE...`.
fn pairs(rest: &str, legacy: bool) -> Result<Vec<(String, String)>, String> {
    let first = rest.split_whitespace().next().unwrap_or("");
    if !first.contains('=') {
        if !legacy {
            return Err(format!("{first:?}: give KEY=VALUE"));
        }
        let (k, v) = rest
            .split_once(char::is_whitespace)
            .ok_or_else(|| format!("{rest:?}: give KEY=VALUE, or KEY VALUE"))?;
        let v = split_words(v.trim())?.join(" ");
        return Ok(vec![(check_key(k)?, v)]);
    }
    split_words(rest)?
        .into_iter()
        .map(|w| {
            let (k, v) = w
                .split_once('=')
                .ok_or_else(|| format!("{w:?}: give KEY=VALUE"))?;
            Ok((check_key(k)?, v.to_string()))
        })
        .collect()
}

fn check_key(k: &str) -> Result<String, String> {
    let ok = !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '/'));
    if ok {
        Ok(k.to_string())
    } else {
        Err(format!("{k:?} is not a name for a variable or label"))
    }
}

/// `s` with `$NAME`, `${NAME}`, `${NAME:-default}` and `${NAME:+alt}`
/// replaced from `env` (unset: empty); `\$` stays a `$`.
pub fn expand(s: &str, env: &[(String, String)]) -> String {
    let get = |k: &str| {
        env.iter()
            .rev()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    };
    let mut out = String::new();
    let cs: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if c == '\\' && cs.get(i + 1) == Some(&'$') {
            out.push('$');
            i += 2;
            continue;
        }
        if c != '$' {
            out.push(c);
            i += 1;
            continue;
        }
        if cs.get(i + 1) == Some(&'{')
            && let Some(end) = cs[i + 2..].iter().position(|&c| c == '}')
        {
            let inner: String = cs[i + 2..i + 2 + end].iter().collect();
            let v = if let Some((k, d)) = inner.split_once(":-") {
                get(k).filter(|v| !v.is_empty()).unwrap_or(d).to_string()
            } else if let Some((k, a)) = inner.split_once(":+") {
                if get(k).is_some_and(|v| !v.is_empty()) {
                    a.to_string()
                } else {
                    String::new()
                }
            } else {
                get(&inner).unwrap_or("").to_string()
            };
            out.push_str(&v);
            i += 3 + end;
            continue;
        }
        let name: String = cs[i + 1..]
            .iter()
            .take_while(|c| c.is_ascii_alphanumeric() || **c == '_')
            .collect();
        if name.is_empty() {
            out.push('$');
            i += 1;
        } else {
            out.push_str(get(&name).unwrap_or(""));
            i += 1 + name.chars().count();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_parse_in_both_forms_with_continuations_and_comments() {
        let steps = parse(
            "# a comment\nFROM busybox\n\nRUN echo a \\\n  && echo b\n# inside\nENV A=1 B=\"two words\"\nENV C legacy value\nCOPY --chown=app:app --chmod=640 a.txt b/ /srv/\nCMD [\"sh\", \"-c\", \"echo hi\"]\nentrypoint /bin/sh\nWORKDIR /srv\nUSER app\nLABEL k=v\nEXPOSE 80 443/udp\n",
        )
        .unwrap();
        assert_eq!(
            steps[0].instruction,
            Instruction::From {
                image: "busybox".into()
            }
        );
        assert_eq!(steps[1].line, 4);
        assert_eq!(
            steps[1].instruction,
            Instruction::Run(Command::Shell("echo a && echo b".into()))
        );
        assert_eq!(
            steps[2].instruction,
            Instruction::Env(vec![
                ("A".into(), "1".into()),
                ("B".into(), "two words".into())
            ])
        );
        assert_eq!(
            steps[3].instruction,
            Instruction::Env(vec![("C".into(), "legacy value".into())])
        );
        assert_eq!(
            steps[4].instruction,
            Instruction::Copy(Copy {
                sources: vec!["a.txt".into(), "b/".into()],
                dest: "/srv/".into(),
                chown: Some("app:app".into()),
                chmod: Some(0o640),
            })
        );
        assert_eq!(
            steps[5].instruction,
            Instruction::Cmd(Command::Exec(vec![
                "sh".into(),
                "-c".into(),
                "echo hi".into()
            ]))
        );
        assert_eq!(
            steps[6].instruction.clone(),
            Instruction::Entrypoint(Command::Shell("/bin/sh".into()))
        );
        assert_eq!(steps[6].text, "ENTRYPOINT /bin/sh");
        assert_eq!(steps.len(), 11);
    }

    #[test]
    fn what_a_build_cannot_run_is_refused_naming_its_line() {
        let e = |t: &str| parse(t).unwrap_err().to_string();
        assert!(e("RUN true").contains("no FROM"));
        assert!(e("").contains("no FROM"));
        assert!(e("FROM a\nFROM b").contains("line 2"));
        assert!(e("FROM a AS x").contains("stages"));
        assert!(e("FROM a\nCOPY --from=x a b").contains("multi-stage"));
        assert!(e("FROM a\nADD http://x/y /y").contains("URL"));
        assert!(e("FROM a\nHEALTHCHECK CMD true").contains("HEALTHCHECK is not supported"));
        assert!(e("FROM a\nRUN <<EOF").contains("here-documents"));
        assert!(e("FROM a\nCOPY onlyone").contains("destination"));
        assert!(e("FROM a\nCOPY --chmod=9x a b").contains("octal"));
        assert!(e("FROM a\nENV").contains("line 2"));
        let big = "#".repeat(MAX_DOCKERFILE + 1);
        assert!(matches!(parse(&big), Err(DockerfileError::TooLarge { .. })));
    }

    #[test]
    fn build_arguments_come_before_from_and_after_it() {
        let steps = parse("ARG BASE=bb\nFROM $BASE\nARG V=1 W\nRUN echo $V\n").unwrap();
        assert_eq!(
            steps[0].instruction,
            Instruction::Arg(vec![("BASE".into(), Some("bb".into()))])
        );
        assert_eq!(
            steps[1].instruction,
            Instruction::From {
                image: "$BASE".into()
            }
        );
        assert_eq!(
            steps[2].instruction,
            Instruction::Arg(vec![("V".into(), Some("1".into())), ("W".into(), None)])
        );
        // Only ARG before FROM.
        assert!(
            parse("ARG A\nRUN x\nFROM b")
                .unwrap_err()
                .to_string()
                .contains("no FROM")
        );
        assert!(parse("ARG A").unwrap_err().to_string().contains("no FROM"));
    }

    #[test]
    fn variables_expand_with_defaults_and_escapes() {
        let env = vec![
            ("A".to_string(), "x".to_string()),
            ("E".to_string(), String::new()),
        ];
        assert_eq!(
            expand("$A/${A}/$B/${B:-d}/${E:-d}/${A:+y}/\\$A/$", &env),
            "x/x//d/d/y/$A/$"
        );
    }

    #[test]
    fn commands_run_as_docker_runs_them() {
        assert_eq!(
            Command::Shell("echo hi".into()).argv(),
            vec!["/bin/sh", "-c", "echo hi"]
        );
        // Not a JSON array of strings: the shell form.
        assert_eq!(command("[1, 2]").unwrap(), Command::Shell("[1, 2]".into()));
    }
}
