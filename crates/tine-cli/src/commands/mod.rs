//! The `tine` commands: each file holds one command's arguments (its
//! clap schema) and its one handler, `run`; a family of commands has a file
//! (sandbox: run, ps, stop, logs, rm, exec; workspace; ledger; sync: remote,
//! push, pull, clone, suspend --to, resume --from; serve). Through a daemon
//! the same handlers run, their operations going to `tine-client` instead
//! of the engine ([`Cx::ops`]); what needs the repository's host says so.

use std::path::{Path, PathBuf};

use tine_engine::Operations;

use tine_store::{ObjectId, Repository};

use crate::output::{Bars, CliError};

pub mod attach;
pub mod build;
pub mod diff;
pub mod fork;
pub mod fsck;
pub mod gc;
pub mod image;
pub mod ledger;
pub mod log;
pub mod merge;
pub mod restore;
pub mod sandbox;
pub mod serve;
pub mod show;
pub mod snapshot;
pub mod sync;
pub mod tag;
pub mod workspace;

/// Where a command's operations go: the engine in this process, over the
/// repository found here, or a daemon (`--url`).
#[derive(Debug)]
pub enum Route {
    Local(PathBuf),
    Daemon(tine_client::Client),
}

/// What every handler gets: the global flags, the route, the repository
/// (local, opened on first use: commands that go through the engine let it
/// open the repository itself, and `gc` must be the only open handle in
/// its process), and the context the operations take (progress bars,
/// `--no-wait`).
pub struct Cx<'a> {
    pub json: bool,
    pub no_wait: bool,
    pub route: Route,
    pub repo: std::cell::OnceCell<Repository>,
    pub bars: &'a Bars,
    pub ctx: tine_engine::Ctx<'a>,
}

/// The operations of a command, local or through a daemon: one interface.
pub enum Ops<'a> {
    Local(Box<tine_engine::Engine>),
    Daemon(&'a tine_client::Client),
}

impl std::ops::Deref for Ops<'_> {
    type Target = dyn Operations;
    fn deref(&self) -> &(dyn Operations + 'static) {
        match self {
            Ops::Local(e) => &**e,
            Ops::Daemon(c) => *c,
        }
    }
}

/// The limits of the process-template pool (`tine snapshot --sandbox` and
/// `tine serve`): the least recently used snapshots' templates go first.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct PoolArgs {
    /// Process templates kept across the repository's sandboxes.
    #[arg(
        long,
        env = "TINE_MAX_TEMPLATES",
        default_value_t = 64,
        value_name = "N"
    )]
    pub max_templates: usize,
    /// Private memory the kept templates may hold (e.g. 8G).
    #[arg(long, env = "TINE_MAX_TEMPLATE_MEMORY", default_value = "8G", value_name = "SIZE",
          value_parser = crate::commands::sandbox::parse_size)]
    pub max_template_memory: u64,
}

impl From<PoolArgs> for tine_engine::PoolLimits {
    fn from(a: PoolArgs) -> Self {
        tine_engine::PoolLimits {
            max_templates: a.max_templates,
            max_bytes: a.max_template_memory,
        }
    }
}

/// The engine for local commands: any directory may be imported (the user
/// reads it with their own rights anyway).
pub fn local_engine(repo: &Path) -> Result<tine_engine::Engine, CliError> {
    let mut cfg = crate::commands::serve::engine_config(repo)?;
    cfg.import_roots = vec![std::path::PathBuf::from("/")];
    Ok(tine_engine::Engine::new(cfg))
}

impl Cx<'_> {
    /// The operations, where this command's route leads.
    pub fn ops(&self) -> Result<Ops<'_>, CliError> {
        self.ops_with(None)
    }

    /// The operations, with the template pool's limits for a local engine
    /// (a daemon has its own).
    pub fn ops_with(&self, pool: Option<PoolArgs>) -> Result<Ops<'_>, CliError> {
        Ok(match &self.route {
            Route::Local(path) => {
                let mut engine = local_engine(path)?;
                if let Some(p) = pool {
                    engine.config_mut().pool = p.into();
                }
                Ops::Local(Box::new(engine))
            }
            Route::Daemon(c) => Ops::Daemon(c),
        })
    }

    /// The repository's path, for `what`, which only a client on the
    /// repository's host can do.
    pub fn local(&self, what: &str) -> Result<&Path, CliError> {
        match &self.route {
            Route::Local(p) => Ok(p),
            Route::Daemon(_) => Err(tine_client::unavailable(what).into()),
        }
    }

    /// The repository (local commands), opened the first time it is asked for.
    pub fn repo(&self) -> Result<&Repository, CliError> {
        if let Some(r) = self.repo.get() {
            return Ok(r);
        }
        let opened = Repository::open(self.local("this command")?)?;
        Ok(self.repo.get_or_init(|| opened))
    }

    /// A snapshot named by tag or id prefix.
    pub fn resolve(&self, spec: &str) -> Result<ObjectId, CliError> {
        Ok(self.repo()?.resolve(spec)?)
    }
}
