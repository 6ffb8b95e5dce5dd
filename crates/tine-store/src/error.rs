//! Error types. One enum per operation family; every variant names the step that
//! failed and carries the ids and paths involved. [`ErrorKind`] is the single
//! classification that the CLI maps to exit codes (and the server to HTTP status).

use std::io;
use std::path::PathBuf;

use serde::Serialize;

use crate::codec::DecodeError;
use crate::id::{Kind, ObjectId};

/// What kind of failure an error is, independent of where it happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request itself is wrong (bad name, bad argument).
    InvalidInput,
    /// A snapshot, tag, object or path does not exist.
    NotFound,
    /// The thing to create exists already.
    AlreadyExists,
    /// A short id or name matches more than one thing.
    Ambiguous,
    /// Stored data failed verification.
    Corrupt,
    /// The filesystem refused (read-only, full, permission, ...).
    Io,
    /// Another process holds the repository lock.
    Locked,
    /// The platform or filesystem lacks something needed.
    Unsupported,
    /// A documented capacity limit was reached (too many live sandboxes or
    /// requests at once); retrying later can succeed.
    Capacity,
    /// The request carried no valid credentials (HTTP API only).
    Unauthorized,
    /// A merge finished with conflicts (its result holds markers; see the list).
    Conflict,
    /// A remote could not be reached or failed to answer; retrying later can succeed.
    Unavailable,
    /// A bug or an unexpected state.
    Internal,
}

impl ErrorKind {
    /// The stable machine-readable code (also used in JSON errors).
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::InvalidInput => "invalid_input",
            ErrorKind::NotFound => "not_found",
            ErrorKind::AlreadyExists => "already_exists",
            ErrorKind::Ambiguous => "ambiguous",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::Io => "io",
            ErrorKind::Locked => "locked",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Capacity => "capacity",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::Conflict => "conflict",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Internal => "internal",
        }
    }

    /// The one mapping from error kind to process exit code (the table in
    /// docs/ARCHITECTURE.md).
    pub fn exit_code(self) -> u8 {
        match self {
            ErrorKind::Internal => 1,
            ErrorKind::InvalidInput => 2,
            ErrorKind::NotFound => 3,
            ErrorKind::AlreadyExists | ErrorKind::Ambiguous => 4,
            ErrorKind::Corrupt => 5,
            ErrorKind::Io => 6,
            ErrorKind::Locked => 7,
            ErrorKind::Unsupported => 8,
            ErrorKind::Capacity => 9,
            ErrorKind::Unauthorized => 10,
            ErrorKind::Conflict => 11,
            ErrorKind::Unavailable => 12,
        }
    }

    /// The one mapping from error kind to HTTP status (same table).
    pub fn http_status(self) -> u16 {
        match self {
            ErrorKind::InvalidInput => 400,
            ErrorKind::Unauthorized => 401,
            ErrorKind::NotFound => 404,
            ErrorKind::AlreadyExists
            | ErrorKind::Ambiguous
            | ErrorKind::Locked
            | ErrorKind::Conflict => 409,
            ErrorKind::Unsupported => 422,
            ErrorKind::Internal | ErrorKind::Corrupt | ErrorKind::Io => 500,
            ErrorKind::Unavailable => 502,
            ErrorKind::Capacity => 503,
        }
    }

    /// The kind an error code names (what a client reads back from
    /// `{"error":{"code"}}`); unknown codes are internal.
    pub fn from_code(code: &str) -> ErrorKind {
        [
            ErrorKind::InvalidInput,
            ErrorKind::NotFound,
            ErrorKind::AlreadyExists,
            ErrorKind::Ambiguous,
            ErrorKind::Corrupt,
            ErrorKind::Io,
            ErrorKind::Locked,
            ErrorKind::Unsupported,
            ErrorKind::Capacity,
            ErrorKind::Unauthorized,
            ErrorKind::Conflict,
            ErrorKind::Unavailable,
        ]
        .into_iter()
        .find(|k| k.code() == code)
        .unwrap_or(ErrorKind::Internal)
    }
}

/// Errors that can classify themselves.
pub trait HasKind {
    fn kind(&self) -> ErrorKind;
}

/// Errors with a variant for an I/O failure at a step on a path (`Io { step,
/// path, source }`), so that one adapter, [`io_at`], serves them all.
pub trait FromIoAt {
    fn from_io_at(step: &'static str, path: PathBuf, source: io::Error) -> Self;
}

/// Maps an I/O error at `step` on `path` into the caller's error type:
/// `.map_err(io_at("read", &path))`.
pub fn io_at<E: FromIoAt>(
    step: &'static str,
    path: impl AsRef<std::path::Path>,
) -> impl FnOnce(io::Error) -> E {
    let path = path.as_ref().to_path_buf();
    move |source| E::from_io_at(step, path, source)
}

/// Implements [`FromIoAt`] for an error enum whose variant `Io` has the
/// fields `step`, `path` and `source`, and names [`io_at`] for it
/// (`$vis fn $name`), so that `?` needs no annotation.
#[macro_export]
macro_rules! from_io_at {
    ($error:ty, $vis:vis fn $name:ident) => {
        impl $crate::FromIoAt for $error {
            fn from_io_at(
                step: &'static str,
                path: ::std::path::PathBuf,
                source: ::std::io::Error,
            ) -> Self {
                Self::Io { step, path, source }
            }
        }

        /// An I/O error at `step` on `path`, as this module's error.
        $vis fn $name(
            step: &'static str,
            path: impl AsRef<::std::path::Path>,
        ) -> impl FnOnce(::std::io::Error) -> $error {
            $crate::io_at(step, path)
        }
    };
}

/// Reading or verifying one stored object.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("object {id} is not in the repository")]
    Missing { id: ObjectId },
    #[error(
        "object {id} in pack {pack} at offset {offset} is damaged: {reason}; run `tine fsck` for a full report"
    )]
    Damaged {
        id: ObjectId,
        pack: String,
        offset: u64,
        reason: String,
    },
    #[error("object {id} is a {found}, expected a {expected}")]
    WrongKind {
        id: ObjectId,
        expected: Kind,
        found: Kind,
    },
    #[error("cannot decode {kind} {id}: {source}")]
    Decode {
        id: ObjectId,
        kind: Kind,
        source: DecodeError,
    },
    #[error("{step} {path}: {source}")]
    Io {
        step: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("repository database ({step}): {source}")]
    Db {
        step: &'static str,
        source: rusqlite::Error,
    },
}

impl HasKind for ObjectError {
    fn kind(&self) -> ErrorKind {
        match self {
            ObjectError::Missing { .. }
            | ObjectError::Damaged { .. }
            | ObjectError::WrongKind { .. }
            | ObjectError::Decode { .. } => ErrorKind::Corrupt,
            ObjectError::Io { .. } => ErrorKind::Io,
            ObjectError::Db { source, .. } => db_kind(source),
        }
    }
}

/// Creating or opening a repository, and taking its locks.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("no tine repository at {path} (run `tine init`, or point --repo / TINE_REPO at one)")]
    NotARepository { path: PathBuf },
    #[error("a tine repository already exists at {path}")]
    AlreadyExists { path: PathBuf },
    #[error("repository {path} has format version {found}; this tine supports version {supported}")]
    Version {
        path: PathBuf,
        found: String,
        supported: u32,
    },
    #[error("repository {path} is locked by another tine process ({holder})")]
    Locked { path: PathBuf, holder: String },
    #[error("{step} {path}: {source}")]
    Io {
        step: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("repository database {path} ({step}): {source}")]
    Db {
        step: &'static str,
        path: PathBuf,
        source: rusqlite::Error,
    },
}

impl HasKind for OpenError {
    fn kind(&self) -> ErrorKind {
        match self {
            OpenError::NotARepository { .. } => ErrorKind::NotFound,
            OpenError::AlreadyExists { .. } => ErrorKind::AlreadyExists,
            OpenError::Version { .. } => ErrorKind::Unsupported,
            OpenError::Locked { .. } => ErrorKind::Locked,
            OpenError::Io { .. } => ErrorKind::Io,
            OpenError::Db { source, .. } => db_kind(source),
        }
    }
}

/// Writing objects, packs, snapshots, tags and heads.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("{step} {path}: {source}")]
    Io {
        step: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("repository database ({step}): {source}")]
    Db {
        step: &'static str,
        source: rusqlite::Error,
    },
    #[error("object {id} is {len} bytes, over the limit of {limit}")]
    TooLarge { id: ObjectId, len: u64, limit: u64 },
    #[error("invalid {what} {value:?}: {reason}")]
    Invalid {
        what: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("tag {name:?} already points at {target} (use --force to move it)")]
    TagExists { name: String, target: ObjectId },
    #[error("tag {name:?} does not exist")]
    NoSuchTag { name: String },
    #[error("snapshot {id} does not exist")]
    NoSuchSnapshot { id: ObjectId },
    #[error(
        "snapshot {} cannot be deleted: {} {} on it; delete or untag {} first",
        id.short(), by.join(", "), if by.len() == 1 { "depends" } else { "depend" },
        if by.len() == 1 { "that" } else { "those" }
    )]
    Depended { id: ObjectId, by: Vec<String> },
    #[error("pack {path} was refused: {reason}; nothing of it was recorded")]
    BadPack { path: PathBuf, reason: String },
    #[error(transparent)]
    Object(#[from] ObjectError),
}

impl From<crate::pack::PackWriteError> for WriteError {
    fn from(e: crate::pack::PackWriteError) -> WriteError {
        WriteError::Io {
            step: e.step,
            path: e.path,
            source: e.source,
        }
    }
}

impl HasKind for WriteError {
    fn kind(&self) -> ErrorKind {
        match self {
            WriteError::Io { .. } => ErrorKind::Io,
            WriteError::Db { source, .. } => db_kind(source),
            WriteError::TooLarge { .. } | WriteError::Invalid { .. } => ErrorKind::InvalidInput,
            WriteError::TagExists { .. } | WriteError::Depended { .. } => ErrorKind::AlreadyExists,
            WriteError::NoSuchTag { .. } | WriteError::NoSuchSnapshot { .. } => ErrorKind::NotFound,
            WriteError::BadPack { .. } => ErrorKind::Corrupt,
            WriteError::Object(e) => e.kind(),
        }
    }
}

/// Turning a name (tag or id prefix) into a snapshot id.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("no snapshot or tag named {spec:?} (see `tine log`)")]
    NotFound { spec: String },
    #[error("{spec:?} matches several snapshots: {}; give more digits", candidates.join(", "))]
    Ambiguous {
        spec: String,
        candidates: Vec<String>,
    },
    #[error("{spec:?} is too short to name a snapshot: give at least {min} hex digits or a tag")]
    TooShort { spec: String, min: usize },
    #[error("repository database ({step}): {source}")]
    Db {
        step: &'static str,
        source: rusqlite::Error,
    },
}

impl HasKind for ResolveError {
    fn kind(&self) -> ErrorKind {
        match self {
            ResolveError::NotFound { .. } => ErrorKind::NotFound,
            ResolveError::Ambiguous { .. } => ErrorKind::Ambiguous,
            ResolveError::TooShort { .. } => ErrorKind::InvalidInput,
            ResolveError::Db { source, .. } => db_kind(source),
        }
    }
}

/// `gc` and `fsck`.
#[derive(Debug, thiserror::Error)]
pub enum MaintenanceError {
    #[error("{step} {path}: {source}")]
    Io {
        step: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("repository database ({step}): {source}")]
    Db {
        step: &'static str,
        source: rusqlite::Error,
    },
    #[error("gc stopped: {0}")]
    Object(#[from] ObjectError),
    #[error("gc stopped: {0}")]
    Write(#[from] WriteError),
    /// Boxed: it is rare, and large beside the others.
    #[error("gc stopped: {0}")]
    Images(Box<crate::images::ImageRecordError>),
}

impl HasKind for MaintenanceError {
    fn kind(&self) -> ErrorKind {
        match self {
            MaintenanceError::Io { .. } => ErrorKind::Io,
            MaintenanceError::Db { source, .. } => db_kind(source),
            MaintenanceError::Object(e) => e.kind(),
            MaintenanceError::Write(e) => e.kind(),
            MaintenanceError::Images(e) => e.kind(),
        }
    }
}

/// What a database error says about the repository: a file that is not a
/// database or is damaged, or rows whose values are not what tine wrote, is
/// corruption (exit 5), not a bug of tine's; contention is a lock.
pub fn db_kind(e: &rusqlite::Error) -> ErrorKind {
    use rusqlite::ErrorCode as C;
    match e {
        rusqlite::Error::SqliteFailure(f, _) => match f.code {
            C::DatabaseCorrupt | C::NotADatabase => ErrorKind::Corrupt,
            C::DatabaseBusy | C::DatabaseLocked => ErrorKind::Locked,
            C::CannotOpen | C::ReadOnly | C::DiskFull | C::SystemIoFailure => ErrorKind::Io,
            _ => ErrorKind::Internal,
        },
        rusqlite::Error::FromSqlConversionFailure(..)
        | rusqlite::Error::IntegralValueOutOfRange(..)
        | rusqlite::Error::InvalidColumnType(..)
        | rusqlite::Error::Utf8Error(..) => ErrorKind::Corrupt,
        _ => ErrorKind::Internal,
    }
}
