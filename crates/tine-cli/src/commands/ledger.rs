//! `tine ledger append / list / lookup / verify`: the effects ledger.

use clap::Subcommand;
use tine_store::ErrorKind;

use crate::output::{CliError, time};

#[derive(Debug, Subcommand)]
pub enum LedgerCmd {
    /// Record an effect a sandbox had on the outside world.
    Append {
        #[arg(long, value_name = "SB")]
        sandbox: String,
        /// What kind of effect (email, payment, http...).
        #[arg(long)]
        kind: String,
        /// Its idempotency key: what a restored agent looks up before acting again.
        #[arg(long)]
        key: String,
        /// The request, as JSON.
        #[arg(long, value_name = "JSON")]
        request: String,
        /// The result, as JSON.
        #[arg(long, value_name = "JSON")]
        result: String,
    },
    /// List a sandbox's visible ledger; --all: every entry ever recorded
    /// (also of branches a rollback abandoned), of one sandbox or all.
    List {
        #[arg(long, value_name = "SB")]
        sandbox: Option<String>,
        #[arg(long)]
        all: bool,
    },
    /// The effect recorded under KEY on a sandbox's visible ledger (exit 3 when none).
    Lookup {
        #[arg(long, value_name = "SB")]
        sandbox: String,
        key: String,
    },
    /// Check every entry's HMAC chain and every snapshot's recorded head.
    Verify,
}

fn line(e: &tine_ledger::Entry) -> String {
    format!(
        "{:>6} {} {:<10} {:<24} {}{}  {} -> {}\n",
        e.id,
        time(e.time_ns),
        e.kind,
        e.key,
        &e.sandbox[..e.sandbox.len().min(12)],
        if e.visible { "" } else { " (abandoned)" },
        e.request,
        e.result
    )
}

pub fn ledger(cx: &super::Cx<'_>, cmd: LedgerCmd) -> Result<(), CliError> {
    let (engine, json) = (cx.ops()?, cx.json);
    let emit = |doc: serde_json::Value, text: String| crate::emit(json, doc, || text);
    match cmd {
        LedgerCmd::Append {
            sandbox,
            kind,
            key,
            request,
            result,
        } => {
            let e = engine.ledger_record(
                &sandbox,
                &tine_ledger::Record {
                    kind,
                    key,
                    request,
                    result,
                },
            )?;
            emit(
                serde_json::to_value(&e).unwrap_or_default(),
                format!("recorded entry {} ({} {})\n", e.id, e.kind, e.key),
            );
        }
        LedgerCmd::List { sandbox, all } => {
            if sandbox.is_none() && !all {
                return Err(CliError::new(
                    ErrorKind::InvalidInput,
                    "ledger list: name a sandbox (--sandbox SB), or give --all for every entry",
                ));
            }
            let v = engine.ledger_list(sandbox.as_deref(), all)?;
            let text = if v.is_empty() {
                "(no entries)\n".to_string()
            } else {
                v.iter().map(line).collect()
            };
            emit(serde_json::to_value(&v).unwrap_or_default(), text);
        }
        LedgerCmd::Lookup { sandbox, key } => match engine.ledger_lookup(&sandbox, &key)? {
            Some(e) => emit(serde_json::to_value(&e).unwrap_or_default(), line(&e)),
            None => {
                return Err(CliError::new(
                    ErrorKind::NotFound,
                    format!(
                        "no effect with key {key:?} on the ledger of sandbox {sandbox} (as of its current state)"
                    ),
                ));
            }
        },
        LedgerCmd::Verify => {
            let n = engine.ledger_verify()?;
            emit(
                serde_json::json!({"verified": n}),
                format!("ledger verifies: {n} entries, every snapshot's head\n"),
            );
        }
    }
    Ok(())
}
