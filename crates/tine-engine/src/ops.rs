//! The one interface every client goes through: [`Operations`], implemented
//! by the [`Engine`] in process and by `tine-client` over the HTTP API. The
//! CLI takes either (local, or `--url`), the daemon serves the engine's;
//! both return the same typed results, so text and JSON are rendered once.

use std::io::Read;
use std::time::Duration;

use tine_fs::{RestoreOutcome, SnapshotOutcome};
use tine_sandbox::manager::SandboxView;
use tine_store::ObjectId;

use crate::attach::{Attach, AttachedView};
use crate::build::{BuildEvent, BuildImage, Built};
use crate::exec::{ExecOutcome, ExecRequest, Sink};
use crate::export::{ExportImage, Exported};
use crate::files::FileEntry;
use crate::graph::{GraphChange, GraphPage, GraphPut, GraphPutOutcome, GraphTuple, GraphWrites};
use crate::images::{ImageView, ImportImage, Imported};
use crate::remotes::{AddRemote, PullRequest, Pulled, PushRequest, Pushed, RemoteShow};
use crate::workspace::{CreateWorkspace, Resumed, SuspendStep, Suspended, WorkspaceView};
use crate::{
    CreateSandbox, Ctx, DiffRequest, DiffResult, Engine, EngineError, ForkRequest, ForkResult,
    MergeInto, MergeRequest, MergeResult, Removed, SandboxOp, SnapshotDetail, SnapshotEntry,
    SnapshotRequest,
};
use tine_store::RemoteRecord;
use tine_store::graph::GraphQuery;

/// What a client can ask of tine. Operations that read or write host
/// directories (`DiffRequest::dir`, `MergeInto::Dir`) are for a client on
/// the repository's host; over HTTP they are refused as `unsupported`.
pub trait Operations {
    /// Makes and starts a sandbox.
    fn create_sandbox(
        &self,
        req: &CreateSandbox,
        ctx: &Ctx<'_>,
    ) -> Result<SandboxView, EngineError>;
    /// Live sandboxes, or with `all` ended ones too.
    fn sandboxes(&self, all: bool) -> Result<Vec<SandboxView>, EngineError>;
    /// One sandbox, by name or id (prefix).
    fn sandbox(&self, sb: &str) -> Result<SandboxView, EngineError>;
    fn stop_sandbox(&self, sb: &str, timeout: Option<Duration>)
    -> Result<SandboxView, EngineError>;
    fn remove_sandbox(&self, sb: &str, force: bool) -> Result<Removed, EngineError>;
    /// Runs a command in a running sandbox, its output handed to `sink` as
    /// it comes (`sink` returning false stops it).
    fn exec(
        &self,
        sb: &str,
        req: &ExecRequest,
        sink: &mut Sink<'_>,
    ) -> Result<ExecOutcome, EngineError>;

    fn read_file(&self, sb: &str, path: &str) -> Result<Vec<u8>, EngineError>;
    fn write_file(
        &self,
        sb: &str,
        path: &str,
        data: &mut dyn Read,
        mode: Option<u32>,
    ) -> Result<FileEntry, EngineError>;
    fn list_files(&self, sb: &str, path: &str) -> Result<Vec<FileEntry>, EngineError>;

    fn snapshot_sandbox(
        &self,
        sb: &str,
        req: &SnapshotRequest,
        ctx: &Ctx<'_>,
    ) -> Result<SandboxOp<SnapshotOutcome>, EngineError>;
    fn restore_sandbox(
        &self,
        sb: &str,
        snapshot: &str,
        files_only: bool,
        ctx: &Ctx<'_>,
    ) -> Result<SandboxOp<RestoreOutcome>, EngineError>;
    fn fork(
        &self,
        snapshot: &str,
        req: &ForkRequest,
        ctx: &Ctx<'_>,
    ) -> Result<ForkResult, EngineError>;
    fn diff(&self, a: &str, req: &DiffRequest, ctx: &Ctx<'_>) -> Result<DiffResult, EngineError>;
    fn merge(
        &self,
        req: &MergeRequest,
        into: &MergeInto,
        ctx: &Ctx<'_>,
    ) -> Result<MergeResult, EngineError>;

    /// Snapshots, newest first.
    fn snapshots(&self, limit: Option<usize>) -> Result<Vec<SnapshotEntry>, EngineError>;
    fn snapshot(&self, spec: &str) -> Result<SnapshotDetail, EngineError>;
    /// Points tag `name` at a snapshot; the snapshot's id.
    fn tag(
        &self,
        snapshot: &str,
        name: &str,
        force: bool,
        ctx: &Ctx<'_>,
    ) -> Result<ObjectId, EngineError>;
    /// Deletes a tag; what it pointed at.
    fn untag(&self, name: &str, ctx: &Ctx<'_>) -> Result<ObjectId, EngineError>;
    /// Deletes a snapshot (its data goes at the next gc); its id.
    fn delete_snapshot(&self, spec: &str, ctx: &Ctx<'_>) -> Result<ObjectId, EngineError>;

    fn ledger_record(
        &self,
        sb: &str,
        rec: &tine_ledger::Record,
    ) -> Result<tine_ledger::Entry, EngineError>;
    fn ledger_lookup(&self, sb: &str, key: &str)
    -> Result<Option<tine_ledger::Entry>, EngineError>;
    /// A sandbox's visible ledger (`all`: every entry it recorded); `sb`
    /// none: every sandbox's history.
    fn ledger_list(
        &self,
        sb: Option<&str>,
        all: bool,
    ) -> Result<Vec<tine_ledger::Entry>, EngineError>;
    /// Entries checked.
    fn ledger_verify(&self) -> Result<usize, EngineError>;

    fn create_workspace(&self, req: &CreateWorkspace) -> Result<WorkspaceView, EngineError>;
    fn workspaces(&self) -> Result<Vec<WorkspaceView>, EngineError>;
    fn workspace(&self, name: &str) -> Result<WorkspaceView, EngineError>;
    fn delete_workspace(&self, name: &str) -> Result<(), EngineError>;
    /// Suspends a workspace; `on_step` hears of each step where the steps
    /// run in this process.
    fn suspend_workspace(
        &self,
        name: &str,
        on_step: &mut dyn FnMut(SuspendStep),
    ) -> Result<Suspended, EngineError>;
    fn resume_workspace(&self, name: &str) -> Result<Resumed, EngineError>;

    /// Stores a checkpoint of graph thread `thread` (snapshotting its
    /// sandbox, for a root checkpoint of a bound thread).
    fn graph_put(
        &self,
        thread: &str,
        req: &GraphPut,
        ctx: &Ctx<'_>,
    ) -> Result<GraphPutOutcome, EngineError>;
    /// A checkpoint (`id` none: the latest of `ns`) with its writes; with
    /// `rewind`, the thread's sandbox is rolled back to it.
    fn graph_get(
        &self,
        thread: &str,
        ns: &str,
        id: Option<&str>,
        rewind: bool,
        ctx: &Ctx<'_>,
    ) -> Result<Option<GraphTuple>, EngineError>;
    fn graph_list(&self, q: &GraphQuery) -> Result<GraphPage, EngineError>;
    fn graph_put_writes(
        &self,
        thread: &str,
        req: &GraphWrites,
        ctx: &Ctx<'_>,
    ) -> Result<(), EngineError>;
    fn graph_delete_thread(&self, thread: &str, ctx: &Ctx<'_>) -> Result<GraphChange, EngineError>;
    fn graph_copy_thread(
        &self,
        from: &str,
        to: &str,
        ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError>;
    fn graph_delete_runs(
        &self,
        run_ids: &[String],
        ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError>;
    fn graph_prune(
        &self,
        threads: &[String],
        keep_latest: bool,
        ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError>;

    /// Every remote, by name.
    fn remotes(&self) -> Result<Vec<RemoteRecord>, EngineError>;
    fn add_remote(&self, req: &AddRemote, ctx: &Ctx<'_>) -> Result<RemoteRecord, EngineError>;
    fn remove_remote(&self, name: &str, ctx: &Ctx<'_>) -> Result<RemoteRecord, EngineError>;
    /// What a remote holds: its snapshots and tags.
    fn remote_show(&self, name: &str) -> Result<RemoteShow, EngineError>;
    /// Pushes snapshots to `req.remote` (None: `origin`, or the only one).
    fn push(&self, req: &PushRequest, ctx: &Ctx<'_>) -> Result<Pushed, EngineError>;
    fn pull(&self, req: &PullRequest, ctx: &Ctx<'_>) -> Result<Pulled, EngineError>;
    /// Names a remote (`origin` by default) and pulls all it holds.
    fn clone_remote(&self, req: &AddRemote, ctx: &Ctx<'_>) -> Result<Pulled, EngineError>;

    /// Every image in the repository, oldest first.
    fn images(&self) -> Result<Vec<ImageView>, EngineError>;
    /// One image, by name or id (prefix).
    fn image(&self, spec: &str) -> Result<ImageView, EngineError>;
    /// Imports an image from an archive or layout (its layers as snapshots).
    fn import_image(&self, req: &ImportImage, ctx: &Ctx<'_>) -> Result<Imported, EngineError>;
    /// Removes an image, or one of its names.
    fn remove_image(
        &self,
        spec: &str,
        ctx: &Ctx<'_>,
    ) -> Result<tine_store::ImageRemoved, EngineError>;
    /// Builds an image from a Dockerfile, each step a snapshot (`events`
    /// hears each step and its output as it comes).
    fn build_image(
        &self,
        req: &BuildImage,
        ctx: &Ctx<'_>,
        events: &mut dyn FnMut(BuildEvent<'_>),
    ) -> Result<Built, EngineError>;
    /// Writes an image as an OCI archive.
    fn export_image(&self, req: &ExportImage, ctx: &Ctx<'_>) -> Result<Exported, EngineError>;
    /// Takes a running process tine did not start as an attached one (its
    /// checkpoints and rollbacks then go through the sandbox verbs).
    fn attach(&self, req: &Attach) -> Result<AttachedView, EngineError>;
    fn attached(&self) -> Result<Vec<AttachedView>, EngineError>;
    /// Lets an attached process go (its templates discarded).
    fn detach(&self, name: &str) -> Result<AttachedView, EngineError>;
}

/// Each call is the engine's own method of the same name.
impl Operations for Engine {
    fn create_sandbox(
        &self,
        req: &CreateSandbox,
        ctx: &Ctx<'_>,
    ) -> Result<SandboxView, EngineError> {
        Engine::create_sandbox(self, req, ctx)
    }
    fn sandboxes(&self, all: bool) -> Result<Vec<SandboxView>, EngineError> {
        Engine::sandboxes(self, all)
    }
    fn sandbox(&self, sb: &str) -> Result<SandboxView, EngineError> {
        Engine::sandbox(self, sb)
    }
    fn stop_sandbox(
        &self,
        sb: &str,
        timeout: Option<Duration>,
    ) -> Result<SandboxView, EngineError> {
        Engine::stop_sandbox(self, sb, timeout)
    }
    fn remove_sandbox(&self, sb: &str, force: bool) -> Result<Removed, EngineError> {
        Engine::remove_sandbox(self, sb, force)
    }
    fn exec(
        &self,
        sb: &str,
        req: &ExecRequest,
        sink: &mut Sink<'_>,
    ) -> Result<ExecOutcome, EngineError> {
        Engine::exec(self, sb, req, sink)
    }
    fn read_file(&self, sb: &str, path: &str) -> Result<Vec<u8>, EngineError> {
        Engine::read_file(self, sb, path)
    }
    fn write_file(
        &self,
        sb: &str,
        path: &str,
        data: &mut dyn Read,
        mode: Option<u32>,
    ) -> Result<FileEntry, EngineError> {
        Engine::write_file(self, sb, path, data, mode)
    }
    fn list_files(&self, sb: &str, path: &str) -> Result<Vec<FileEntry>, EngineError> {
        Engine::list_files(self, sb, path)
    }
    fn snapshot_sandbox(
        &self,
        sb: &str,
        req: &SnapshotRequest,
        ctx: &Ctx<'_>,
    ) -> Result<SandboxOp<SnapshotOutcome>, EngineError> {
        Engine::snapshot_sandbox(self, sb, req, ctx)
    }
    fn restore_sandbox(
        &self,
        sb: &str,
        snapshot: &str,
        files_only: bool,
        ctx: &Ctx<'_>,
    ) -> Result<SandboxOp<RestoreOutcome>, EngineError> {
        Engine::restore_sandbox(self, sb, snapshot, files_only, ctx)
    }
    fn fork(
        &self,
        snapshot: &str,
        req: &ForkRequest,
        ctx: &Ctx<'_>,
    ) -> Result<ForkResult, EngineError> {
        Engine::fork(self, snapshot, req, ctx)
    }
    fn diff(&self, a: &str, req: &DiffRequest, ctx: &Ctx<'_>) -> Result<DiffResult, EngineError> {
        Engine::diff(self, a, req, ctx)
    }
    fn merge(
        &self,
        req: &MergeRequest,
        into: &MergeInto,
        ctx: &Ctx<'_>,
    ) -> Result<MergeResult, EngineError> {
        Engine::merge(self, req, into, ctx)
    }
    fn snapshots(&self, limit: Option<usize>) -> Result<Vec<SnapshotEntry>, EngineError> {
        Engine::snapshots(self, limit)
    }
    fn snapshot(&self, spec: &str) -> Result<SnapshotDetail, EngineError> {
        Engine::snapshot(self, spec)
    }
    fn tag(
        &self,
        snapshot: &str,
        name: &str,
        force: bool,
        ctx: &Ctx<'_>,
    ) -> Result<ObjectId, EngineError> {
        Engine::tag(self, snapshot, name, force, ctx)
    }
    fn untag(&self, name: &str, ctx: &Ctx<'_>) -> Result<ObjectId, EngineError> {
        Engine::untag(self, name, ctx)
    }
    fn delete_snapshot(&self, spec: &str, ctx: &Ctx<'_>) -> Result<ObjectId, EngineError> {
        Engine::delete_snapshot(self, spec, ctx)
    }
    fn ledger_record(
        &self,
        sb: &str,
        rec: &tine_ledger::Record,
    ) -> Result<tine_ledger::Entry, EngineError> {
        Engine::ledger_record(self, sb, rec)
    }
    fn ledger_lookup(
        &self,
        sb: &str,
        key: &str,
    ) -> Result<Option<tine_ledger::Entry>, EngineError> {
        Engine::ledger_lookup(self, sb, key)
    }
    fn ledger_list(
        &self,
        sb: Option<&str>,
        all: bool,
    ) -> Result<Vec<tine_ledger::Entry>, EngineError> {
        Engine::ledger_list(self, sb, all)
    }
    fn ledger_verify(&self) -> Result<usize, EngineError> {
        Engine::ledger_verify(self)
    }
    fn create_workspace(&self, req: &CreateWorkspace) -> Result<WorkspaceView, EngineError> {
        Engine::create_workspace(self, req)
    }
    fn workspaces(&self) -> Result<Vec<WorkspaceView>, EngineError> {
        Engine::workspaces(self)
    }
    fn workspace(&self, name: &str) -> Result<WorkspaceView, EngineError> {
        Engine::workspace(self, name)
    }
    fn delete_workspace(&self, name: &str) -> Result<(), EngineError> {
        Engine::delete_workspace(self, name)
    }
    fn suspend_workspace(
        &self,
        name: &str,
        on_step: &mut dyn FnMut(SuspendStep),
    ) -> Result<Suspended, EngineError> {
        Engine::suspend_workspace(self, name, on_step)
    }
    fn resume_workspace(&self, name: &str) -> Result<Resumed, EngineError> {
        Engine::resume_workspace(self, name)
    }
    fn graph_put(
        &self,
        thread: &str,
        req: &GraphPut,
        ctx: &Ctx<'_>,
    ) -> Result<GraphPutOutcome, EngineError> {
        Engine::graph_put(self, thread, req, ctx)
    }
    fn graph_get(
        &self,
        thread: &str,
        ns: &str,
        id: Option<&str>,
        rewind: bool,
        ctx: &Ctx<'_>,
    ) -> Result<Option<GraphTuple>, EngineError> {
        Engine::graph_get(self, thread, ns, id, rewind, ctx)
    }
    fn graph_list(&self, q: &GraphQuery) -> Result<GraphPage, EngineError> {
        Engine::graph_list(self, q)
    }
    fn graph_put_writes(
        &self,
        thread: &str,
        req: &GraphWrites,
        ctx: &Ctx<'_>,
    ) -> Result<(), EngineError> {
        Engine::graph_put_writes(self, thread, req, ctx)
    }
    fn graph_delete_thread(&self, thread: &str, ctx: &Ctx<'_>) -> Result<GraphChange, EngineError> {
        Engine::graph_delete_thread(self, thread, ctx)
    }
    fn graph_copy_thread(
        &self,
        from: &str,
        to: &str,
        ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError> {
        Engine::graph_copy_thread(self, from, to, ctx)
    }
    fn graph_delete_runs(
        &self,
        run_ids: &[String],
        ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError> {
        Engine::graph_delete_runs(self, run_ids, ctx)
    }
    fn graph_prune(
        &self,
        threads: &[String],
        keep_latest: bool,
        ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError> {
        Engine::graph_prune(self, threads, keep_latest, ctx)
    }
    fn remotes(&self) -> Result<Vec<RemoteRecord>, EngineError> {
        Engine::remotes(self)
    }
    fn add_remote(&self, req: &AddRemote, ctx: &Ctx<'_>) -> Result<RemoteRecord, EngineError> {
        Engine::add_remote(self, req, ctx)
    }
    fn remove_remote(&self, name: &str, ctx: &Ctx<'_>) -> Result<RemoteRecord, EngineError> {
        Engine::remove_remote(self, name, ctx)
    }
    fn remote_show(&self, name: &str) -> Result<RemoteShow, EngineError> {
        Engine::remote_show(self, name)
    }
    fn push(&self, req: &PushRequest, ctx: &Ctx<'_>) -> Result<Pushed, EngineError> {
        Engine::push(self, req, ctx)
    }
    fn pull(&self, req: &PullRequest, ctx: &Ctx<'_>) -> Result<Pulled, EngineError> {
        Engine::pull(self, req, ctx)
    }
    fn clone_remote(&self, req: &AddRemote, ctx: &Ctx<'_>) -> Result<Pulled, EngineError> {
        Engine::clone_remote(self, req, ctx)
    }
    fn images(&self) -> Result<Vec<ImageView>, EngineError> {
        Engine::images(self)
    }
    fn image(&self, spec: &str) -> Result<ImageView, EngineError> {
        Engine::image(self, spec)
    }
    fn import_image(&self, req: &ImportImage, ctx: &Ctx<'_>) -> Result<Imported, EngineError> {
        Engine::import_image(self, req, ctx)
    }
    fn remove_image(
        &self,
        spec: &str,
        ctx: &Ctx<'_>,
    ) -> Result<tine_store::ImageRemoved, EngineError> {
        Engine::remove_image(self, spec, ctx)
    }
    fn build_image(
        &self,
        req: &BuildImage,
        ctx: &Ctx<'_>,
        events: &mut dyn FnMut(BuildEvent<'_>),
    ) -> Result<Built, EngineError> {
        Engine::build_image(self, req, ctx, events)
    }
    fn export_image(&self, req: &ExportImage, ctx: &Ctx<'_>) -> Result<Exported, EngineError> {
        Engine::export_image(self, req, ctx)
    }
    fn attach(&self, req: &Attach) -> Result<AttachedView, EngineError> {
        Engine::attach(self, req)
    }
    fn attached(&self) -> Result<Vec<AttachedView>, EngineError> {
        Engine::attached(self)
    }
    fn detach(&self, name: &str) -> Result<AttachedView, EngineError> {
        Engine::detach(self, name)
    }
}
