//! The entry points of the processes tine starts for itself (a sandbox's
//! init, a native fork's adopting init, the furnishing of a fork's
//! namespaces, a sandbox's supervisor) and the terminal `tine exec -t`
//! gives a command: the binary that hosts them reaches the sandbox layer
//! through here, as every client reaches the operations through the engine.

pub use tine_sandbox::InitSpec;
pub use tine_sandbox::ns::{
    FurnishSpec, NsError, OnPipes, OnTerminal, cloexec_inherited, furnish_here, read_init_spec,
    run_adopted, run_init, spawn_on_pipes, spawn_on_terminal,
};
pub use tine_sandbox::supervisor::{FirstRun, supervise};
