//! tine-ledger: the record of what a sandbox did to the outside world (an
//! email sent, a payment made), so that a restored or forked agent sees
//! those effects as facts instead of doing them again.
//!
//! Each entry carries an HMAC-SHA256, under a per-repository key
//! (`REPO/ledger.key`, mode 0600), over its fields and its parent's MAC: a
//! chain, so that changing, removing or reordering a stored entry breaks
//! every MAC after it, and `verify` names the first bad one. Each sandbox has
//! a head (its last visible entry); a snapshot records the head, a rollback
//! moves the head back to it (the visible ledger rewinds) and a fork starts
//! from it, while every entry stays stored: effects of an abandoned branch
//! are still listed as having happened.
//!
//! Heads are authenticated too: each head carries a MAC over its sandbox,
//! its entry (id and MAC) and the value of a ledger-wide counter bumped at
//! every append and head move, and one seal MACs the counter, how many
//! entries there are, the newest id and every head. Deleting or re-pointing
//! a head, deleting entries (abandoned ones, or the newest after the last
//! snapshot) or putting back an older head breaks the seal, and `verify`
//! says which.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use serde::Serialize;
use sha2::Sha256;
use tine_store::{
    ErrorKind, HasKind, HeadRow, LedgerRow, RecordError, Repository, Seal, WriteLock, now_ns,
};

/// Where the key lives in a repository.
pub const KEY_FILE: &str = "ledger.key";

/// Requests and results are JSON of at most this size.
pub const MAX_FIELD_BYTES: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error("ledger key {0}")]
    Key(#[from] tine_store::secret::SecretError),
    #[error("ledger key {} is not 32 bytes; it is damaged", path.display())]
    KeyDamaged { path: PathBuf },
    #[error("ledger entry: {field} is not valid JSON: {reason}")]
    NotJson { field: &'static str, reason: String },
    #[error("ledger entry: {field} is {len} bytes, over the limit of {MAX_FIELD_BYTES}")]
    TooLarge { field: &'static str, len: usize },
    #[error("ledger entry: {field} must not be empty")]
    Empty { field: &'static str },
    #[error(
        "ledger entry {id} fails verification ({reason}): it or an entry before it was changed; {ok} entries before it verify"
    )]
    Tampered { id: u64, reason: String, ok: usize },
    #[error(
        "snapshot {snapshot} recorded ledger entry {entry}, which is {what}: the ledger was cut short or changed"
    )]
    HeadMismatch {
        snapshot: String,
        entry: u64,
        what: &'static str,
    },
    #[error("ledger head of sandbox {sandbox} fails verification: {reason}")]
    HeadTampered { sandbox: String, reason: String },
    #[error("the ledger's seal fails verification: {reason}")]
    Unsealed { reason: String },
    #[error(transparent)]
    Object(#[from] tine_store::ObjectError),
}

impl HasKind for LedgerError {
    fn kind(&self) -> ErrorKind {
        match self {
            LedgerError::Record(e) => e.kind(),
            LedgerError::Key(tine_store::secret::SecretError::Exposed { .. }) => {
                ErrorKind::InvalidInput
            }
            LedgerError::Key(_) => ErrorKind::Io,
            LedgerError::KeyDamaged { .. }
            | LedgerError::Tampered { .. }
            | LedgerError::HeadTampered { .. }
            | LedgerError::Unsealed { .. }
            | LedgerError::HeadMismatch { .. } => ErrorKind::Corrupt,
            LedgerError::Object(e) => e.kind(),
            LedgerError::NotJson { .. }
            | LedgerError::TooLarge { .. }
            | LedgerError::Empty { .. } => ErrorKind::InvalidInput,
        }
    }
}

/// An entry as clients see it.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Entry {
    pub id: u64,
    pub parent: Option<u64>,
    pub sandbox: String,
    pub kind: String,
    pub key: String,
    pub request: serde_json::Value,
    pub result: serde_json::Value,
    pub time_ns: u64,
    /// On its sandbox's visible chain (not only in its history).
    pub visible: bool,
}

/// The repository's ledger key: read, or made at first use.
pub fn key(repo: &Path) -> Result<[u8; 32], LedgerError> {
    let path = repo.join(KEY_FILE);
    let make = || -> std::io::Result<Vec<u8>> {
        let mut k = [0u8; 32];
        getrandom::fill(&mut k).map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(k.to_vec())
    };
    let (bytes, _) = tine_store::secret::load_or_create(&path, &make)?;
    bytes
        .try_into()
        .map_err(|_| LedgerError::KeyDamaged { path })
}

/// The MAC of an entry: over a domain tag, the parent's MAC (zeros for the
/// first) and every field, each length-prefixed so no two entries encode alike.
fn mac(key: &[u8; 32], parent_mac: &[u8], row: &LedgerRow) -> [u8; 32] {
    let mut m = hmac(key, b"tine-ledger 1\0");
    let zero = [0u8; 32];
    m.update(if parent_mac.is_empty() {
        &zero
    } else {
        parent_mac
    });
    m.update(&row.id.to_le_bytes());
    m.update(&row.parent.unwrap_or(0).to_le_bytes());
    for f in [&row.sandbox, &row.kind, &row.key, &row.request, &row.result] {
        field(&mut m, f.as_bytes());
    }
    m.update(&row.time_ns.to_le_bytes());
    m.finalize().into_bytes().into()
}

/// An HMAC under `key`, started with the domain tag `tag`.
fn hmac(key: &[u8; 32], tag: &[u8]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    m.update(tag);
    m
}

/// A variable-length field: its length (u64 little-endian), then its bytes,
/// so no two sequences of fields encode alike.
fn field(m: &mut Hmac<Sha256>, bytes: &[u8]) {
    m.update(&(bytes.len() as u64).to_le_bytes());
    m.update(bytes);
}

/// The MAC of a head: its sandbox, its entry (id and MAC; none: zeros) and
/// the counter value it was set at.
fn head_mac(key: &[u8; 32], sandbox: &str, entry: Option<(u64, &[u8])>, counter: u64) -> [u8; 32] {
    let mut m = hmac(key, b"tine-ledger-head 1\0");
    field(&mut m, sandbox.as_bytes());
    let (id, mac) = entry.unwrap_or((0, &[0u8; 32]));
    m.update(&id.to_le_bytes());
    field(&mut m, mac);
    m.update(&counter.to_le_bytes());
    m.finalize().into_bytes().into()
}

/// The seal: the counter, the entries' count and newest id, and every head
/// (sorted by sandbox, as the store lists them) with its authentication.
fn seal_mac(key: &[u8; 32], counter: u64, extent: (u64, u64), heads: &[HeadRow]) -> [u8; 32] {
    let mut m = hmac(key, b"tine-ledger-seal 1\0");
    m.update(&counter.to_le_bytes());
    m.update(&extent.0.to_le_bytes());
    m.update(&extent.1.to_le_bytes());
    m.update(&(heads.len() as u64).to_le_bytes());
    for h in heads {
        field(&mut m, h.sandbox.as_bytes());
        m.update(&h.entry.map_or(0, |e| e + 1).to_le_bytes());
        let (c, mac) = h
            .auth
            .as_ref()
            .map_or((0, &[][..]), |(c, m)| (*c, m.as_slice()));
        m.update(&c.to_le_bytes());
        field(&mut m, mac);
    }
    m.finalize().into_bytes().into()
}

/// A head's entry: its id and MAC (none: the ledger's start).
type EntryRef<'a> = Option<(u64, &'a [u8])>;

/// Sandboxes' heads moved, each to its entry (id and MAC), with the
/// entries' extent after the change: their rows, all at the counter bumped
/// once, and the new seal.
fn new_heads(
    repo: &Repository,
    key: &[u8; 32],
    moved: &[(&str, EntryRef<'_>)],
    extent: (u64, u64),
) -> Result<(Vec<HeadRow>, Seal), LedgerError> {
    let counter = repo.ledger_seal()?.map_or(0, |s| s.counter) + 1;
    let mut heads = repo.ledger_head_rows()?;
    let mut rows = Vec::with_capacity(moved.len());
    for &(sandbox, entry) in moved {
        let head = HeadRow {
            sandbox: sandbox.to_string(),
            entry: entry.map(|(id, _)| id),
            auth: Some((counter, head_mac(key, sandbox, entry, counter).to_vec())),
        };
        match heads.binary_search_by(|h| h.sandbox.as_str().cmp(sandbox)) {
            Ok(i) => heads[i] = head.clone(),
            Err(i) => heads.insert(i, head.clone()),
        }
        rows.push(head);
    }
    let seal = Seal {
        counter,
        mac: seal_mac(key, counter, extent, &heads).to_vec(),
    };
    Ok((rows, seal))
}

/// Sandbox `sandbox`'s head moved to `entry`: [`new_heads`] of one.
fn new_head(
    repo: &Repository,
    key: &[u8; 32],
    sandbox: &str,
    entry: EntryRef<'_>,
    extent: (u64, u64),
) -> Result<(HeadRow, Seal), LedgerError> {
    let (mut rows, seal) = new_heads(repo, key, &[(sandbox, entry)], extent)?;
    Ok((rows.remove(0), seal))
}

/// Points sandbox `sandbox`'s ledger at `entry` (none: empty), as a
/// rollback or a fork does; authenticated like every head.
pub fn set_head(
    lock: &WriteLock<'_>,
    sandbox: &str,
    entry: Option<u64>,
) -> Result<(), LedgerError> {
    set_heads(lock, &[sandbox], entry)
}

/// [`set_head`] of several sandboxes (the forks of one call) to the same
/// entry: one counter step, one seal, one transaction.
pub fn set_heads(
    lock: &WriteLock<'_>,
    sandboxes: &[&str],
    entry: Option<u64>,
) -> Result<(), LedgerError> {
    let repo = lock.repo();
    let k = key(repo.path())?;
    let row = match entry {
        Some(id) => Some(
            repo.ledger_row(id)?
                .ok_or_else(|| LedgerError::HeadTampered {
                    sandbox: sandboxes.first().copied().unwrap_or_default().to_string(),
                    reason: format!("its new head, entry {id}, is not in the ledger"),
                })?,
        ),
        None => None,
    };
    let extent = repo.ledger_extent()?;
    let to = row.as_ref().map(|r| (r.id, r.mac.as_slice()));
    let moved: Vec<_> = sandboxes.iter().map(|s| (*s, to)).collect();
    let (heads, seal) = new_heads(repo, &k, &moved, extent)?;
    lock.set_ledger_heads(&heads, &seal)?;
    Ok(())
}

fn json_field(field: &'static str, text: &str) -> Result<String, LedgerError> {
    if text.len() > MAX_FIELD_BYTES {
        return Err(LedgerError::TooLarge {
            field,
            len: text.len(),
        });
    }
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| LedgerError::NotJson {
        field,
        reason: e.to_string(),
    })?;
    // Canonical: what is stored (and MACed) does not depend on spacing.
    Ok(v.to_string())
}

fn entry(row: &LedgerRow, visible: bool) -> Entry {
    Entry {
        id: row.id,
        parent: row.parent,
        sandbox: row.sandbox.clone(),
        kind: row.kind.clone(),
        key: row.key.clone(),
        request: serde_json::from_str(&row.request).unwrap_or(serde_json::Value::Null),
        result: serde_json::from_str(&row.result).unwrap_or(serde_json::Value::Null),
        time_ns: row.time_ns,
        visible,
    }
}

/// What to record.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub kind: String,
    pub key: String,
    /// JSON text.
    pub request: String,
    /// JSON text.
    pub result: String,
}

/// Appends an effect to sandbox `sandbox`'s ledger (after its head).
pub fn append(lock: &WriteLock<'_>, sandbox: &str, rec: &Record) -> Result<Entry, LedgerError> {
    let repo = lock.repo();
    for (field, v) in [("kind", &rec.kind), ("key", &rec.key)] {
        if v.is_empty() {
            return Err(LedgerError::Empty { field });
        }
        if v.len() > 4096 {
            return Err(LedgerError::TooLarge {
                field,
                len: v.len(),
            });
        }
    }
    let k = key(repo.path())?;
    let parent = repo.ledger_head(sandbox)?;
    let parent_mac = match parent {
        Some(p) => repo.ledger_row(p)?.map(|r| r.mac).unwrap_or_default(),
        None => Vec::new(),
    };
    let mut row = LedgerRow {
        id: repo.next_ledger_id()?,
        parent,
        sandbox: sandbox.to_string(),
        kind: rec.kind.clone(),
        key: rec.key.clone(),
        request: json_field("request", &rec.request)?,
        result: json_field("result", &rec.result)?,
        time_ns: now_ns(),
        mac: Vec::new(),
    };
    row.mac = mac(&k, &parent_mac, &row).to_vec();
    let (count, _) = repo.ledger_extent()?;
    let (head, seal) = new_head(
        repo,
        &k,
        sandbox,
        Some((row.id, row.mac.as_slice())),
        (count + 1, row.id),
    )?;
    lock.append_ledger(&row, &head, &seal)?;
    Ok(entry(&row, true))
}

/// The ids on sandbox `sandbox`'s visible chain, newest first.
fn chain(repo: &Repository, sandbox: &str) -> Result<Vec<LedgerRow>, LedgerError> {
    let mut out = Vec::new();
    let mut next = repo.ledger_head(sandbox)?;
    while let Some(id) = next {
        let Some(row) = repo.ledger_row(id)? else {
            break;
        };
        next = row.parent;
        out.push(row);
        if out.len() > 10_000_000 {
            break;
        }
    }
    Ok(out)
}

/// The visible ledger of a sandbox, oldest first.
pub fn visible(repo: &Repository, sandbox: &str) -> Result<Vec<Entry>, LedgerError> {
    let mut v: Vec<Entry> = chain(repo, sandbox)?
        .iter()
        .map(|r| entry(r, true))
        .collect();
    v.reverse();
    Ok(v)
}

/// Every entry ever recorded (of one sandbox, or all), oldest first, each
/// marked visible or not (abandoned by a rollback).
pub fn history(repo: &Repository, sandbox: Option<&str>) -> Result<Vec<Entry>, LedgerError> {
    let rows = repo.ledger_rows()?;
    let parent: std::collections::HashMap<u64, Option<u64>> =
        rows.iter().map(|r| (r.id, r.parent)).collect();
    // The visible chains, walked in memory from every head.
    let mut shown = std::collections::HashSet::new();
    for h in repo.ledger_head_rows()? {
        let mut next = h.entry;
        while let Some(id) = next {
            if !shown.insert(id) {
                break;
            }
            next = parent.get(&id).copied().flatten();
        }
    }
    Ok(rows
        .iter()
        .filter(|r| sandbox.is_none_or(|s| r.sandbox == s))
        .map(|r| entry(r, shown.contains(&r.id)))
        .collect())
}

/// The effect recorded under `key` on the sandbox's visible ledger (what
/// an agent asks before acting again): the newest such entry.
pub fn lookup(repo: &Repository, sandbox: &str, key: &str) -> Result<Option<Entry>, LedgerError> {
    Ok(chain(repo, sandbox)?
        .iter()
        .find(|r| r.key == key)
        .map(|r| entry(r, true)))
}

/// Checks every stored entry's MAC against its parent's, and every
/// snapshot's recorded head against the entry it names (which catches a
/// ledger cut short); returns how many entries verified, or names the first
/// (lowest id) that does not.
pub fn verify(repo: &Repository) -> Result<usize, LedgerError> {
    let rows = repo.ledger_rows()?;
    let by_id: std::collections::HashMap<u64, &LedgerRow> =
        rows.iter().map(|r| (r.id, r)).collect();
    let heads = repo.ledger_head_rows()?;
    let seal = repo.ledger_seal()?;
    if !(rows.is_empty() && heads.is_empty() && seal.is_none()) {
        let k = key(repo.path())?;
        verify_macs(&k, &rows, &by_id)?;
        verify_heads(&k, &rows, &by_id, &heads, seal)?;
    }
    for s in repo.snapshots()? {
        let Some((entry, mac_hex)) = tine_store::ledger::head_note_of(repo, &s.id)? else {
            continue;
        };
        let what = match by_id.get(&entry) {
            None => "missing",
            Some(r) if tine_store::ledger::mac_hex(&r.mac) == mac_hex => continue,
            Some(_) => "not the entry it recorded",
        };
        return Err(LedgerError::HeadMismatch {
            snapshot: s.id.short(),
            entry,
            what,
        });
    }
    Ok(rows.len())
}

/// Every head: authenticated, at a counter the seal has reached, naming an
/// entry that exists (its chain was checked with the entries); the seal over
/// the counter, the entries' extent and every head.
fn verify_heads(
    k: &[u8; 32],
    rows: &[LedgerRow],
    by_id: &std::collections::HashMap<u64, &LedgerRow>,
    heads: &[HeadRow],
    seal: Option<Seal>,
) -> Result<(), LedgerError> {
    let Some(seal) = seal else {
        return Err(LedgerError::Unsealed {
            reason: "it has none (removed, or the ledger was last written by a tine from before heads were authenticated; the next record or rollback seals it)".into(),
        });
    };
    for h in heads {
        let bad = |reason: String| LedgerError::HeadTampered {
            sandbox: h.sandbox.clone(),
            reason,
        };
        let Some((counter, mac)) = &h.auth else {
            return Err(bad("it has no MAC".into()));
        };
        if *counter > seal.counter {
            return Err(bad(format!(
                "it was set at {counter}, after the ledger's last change ({})",
                seal.counter
            )));
        }
        let entry = match h.entry {
            None => None,
            Some(id) => match by_id.get(&id) {
                Some(r) => Some((id, r.mac.as_slice())),
                None => return Err(bad(format!("its entry {id} is missing"))),
            },
        };
        if !same(&head_mac(k, &h.sandbox, entry, *counter), mac) {
            return Err(bad(
                "its MAC does not match (it was pointed at another entry, or changed)".into(),
            ));
        }
    }
    let extent = (rows.len() as u64, rows.last().map_or(0, |r| r.id));
    if !same(&seal_mac(k, seal.counter, extent, heads), &seal.mac) {
        return Err(LedgerError::Unsealed {
            reason: format!(
                "it does not match the ledger's {} entries (newest {}) and {} heads: entries or heads were removed, added or put back",
                extent.0,
                extent.1,
                heads.len()
            ),
        });
    }
    Ok(())
}

/// Two MACs compared in constant time.
fn same(a: &[u8], b: &[u8]) -> bool {
    bool::from(subtle::ConstantTimeEq::ct_eq(a, b))
}

fn verify_macs(
    k: &[u8; 32],
    rows: &[LedgerRow],
    by_id: &std::collections::HashMap<u64, &LedgerRow>,
) -> Result<(), LedgerError> {
    for (n, r) in rows.iter().enumerate() {
        let bad = |reason: &str| LedgerError::Tampered {
            id: r.id,
            reason: reason.to_string(),
            ok: n,
        };
        let parent_mac: &[u8] = match r.parent {
            None => &[],
            Some(p) if p >= r.id => return Err(bad("its parent comes after it")),
            Some(p) => match by_id.get(&p) {
                Some(pr) => &pr.mac,
                None => return Err(bad("its parent is missing")),
            },
        };
        if !same(&mac(k, parent_mac, r), &r.mac) {
            return Err(bad("its MAC does not match its contents and its parent's"));
        }
    }
    Ok(())
}
