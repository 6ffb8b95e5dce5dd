//! tine-store: the warm tier. Content-addressed objects (BLAKE3) in zstd-compressed
//! packs, with metadata (object index, snapshots, tags, heads) in SQLite.
//! See `docs/FORMAT.md` for the on-disk format.
#![forbid(unsafe_code)]

pub mod codec;
pub mod error;
pub mod graph;
pub mod human;
pub mod id;
pub mod images;
pub mod ledger;
pub mod maintenance;
pub mod object;
pub mod pack;
pub mod progress;
pub mod records;
pub mod remotes;
pub mod repo;
pub mod secret;
pub mod staging;
pub mod transfer;
pub mod workspaces;

pub use error::{
    ErrorKind, FromIoAt, HasKind, MaintenanceError, ObjectError, OpenError, ResolveError,
    WriteError, io_at,
};
pub use id::{Kind, ObjectId};
pub use images::{BuildStep, ImageLayer, ImageRecord, ImageRecordError, ImageRemoved};
pub use ledger::{HeadRow, LedgerRow, Seal};
pub use maintenance::{FsckReport, GcOptions, GcReport, RebuildReport, fsck, gc, rebuild_index};
pub use object::{
    Attachment, ChunkList, Content, EntryKind, Node, Owner, SnapshotObject, Tree, TreeEntry,
};
pub use progress::{NoProgress, Progress};
pub use records::{RecordError, SandboxRecord, SandboxState};
pub use remotes::RemoteRecord;
pub use repo::{
    CommitStats, NewSnapshot, PackBuilder, Repository, SnapshotInfo, WriteLock, now_ns,
    write_atomic,
};
pub use workspaces::{WorkspaceRecord, WorkspaceState, state_head};
