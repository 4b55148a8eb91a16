//! The sandbox: pooled worker processes that each embed CPython and run one REPL session.
//!
//! - [`protocol`]: the typed messages between parent and worker.
//! - [`worker`]: the code that runs in the worker ([`run_worker_if_requested`]).
//! - [`harden`]: descriptor hygiene, rlimits and the seccomp allow-list.
//! - [`process`]: one worker as the parent sees it (spawn, deadlines, kill).
//! - [`pool`]: pre-started workers, handed out one session each.
//! - [`session`]: one REPL session (one episode) over a worker, restarted if it dies.
//!
//! # Which binary is the worker
//!
//! A worker is a process started from a binary that calls [`run_worker_if_requested`] first
//! thing in `main`. The crate ships one, `fathom-sandbox`; any other binary (xtask, the
//! trainer) can serve as its own worker the same way and pass [`WorkerCommand::CurrentExe`].
//! [`WorkerCommand::discover`] picks a default: the `FATHOM_SANDBOX_WORKER` environment
//! variable if set, else a `fathom-sandbox` binary next to the current executable (or one
//! directory up, where test binaries live). Integration tests use
//! `env!("CARGO_BIN_EXE_fathom-sandbox")`.
//!
//! Binaries that embed Python must find `libpython` at run time: the crate's build script
//! links its own binaries and tests with an rpath to the interpreter's library directory,
//! and other binaries that serve as workers do the same with `pyo3-build-config`'s
//! `add_libpython_rpath_link_args()` in their build script.

pub mod harden;
pub mod pool;
pub mod process;
pub mod protocol;
pub mod session;
pub mod worker;

use std::path::PathBuf;
use std::time::Duration;

pub use pool::SandboxPool;
pub use protocol::WorkerLimits;
pub use session::{Cell, Session};
pub use worker::{WORKER_ARG, run_worker_if_requested};

/// Environment variable naming the worker binary, overriding discovery.
pub const WORKER_ENV: &str = "FATHOM_SANDBOX_WORKER";

/// Name of the worker binary shipped with this crate.
pub const WORKER_BIN: &str = "fathom-sandbox";

/// Errors of the sandbox machinery itself (never of the code it runs).
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// No worker binary could be found.
    #[error(
        "no sandbox worker binary: set {WORKER_ENV} or build `{WORKER_BIN}` (looked for {looked:?})"
    )]
    NoWorkerBinary {
        /// Paths that were tried.
        looked: Vec<PathBuf>,
    },
    /// The worker binary could not be started.
    #[error("cannot start sandbox worker {path:?}: {message}")]
    Spawn {
        /// The binary.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// A worker failed to set up a session.
    #[error("sandbox worker {path:?} failed to start a session: {message}")]
    Init {
        /// The binary.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// A worker could not be had in time.
    #[error("no sandbox worker became available within {0:?}")]
    Unavailable(Duration),
    /// The session lost its worker too many times.
    #[error("the REPL was restarted {0} times in one session; giving up")]
    TooManyRestarts(u32),
}

/// Which binary to start as a worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerCommand {
    /// The running executable, which calls [`run_worker_if_requested`] at the top of `main`.
    CurrentExe,
    /// A binary at this path (e.g. `fathom-sandbox`).
    Path(PathBuf),
}

impl WorkerCommand {
    /// The default worker: `$FATHOM_SANDBOX_WORKER`, else `fathom-sandbox` beside the current
    /// executable or in its parent directory.
    pub fn discover() -> Result<WorkerCommand, SandboxError> {
        if let Some(path) = std::env::var_os(WORKER_ENV) {
            return Ok(WorkerCommand::Path(PathBuf::from(path)));
        }
        let mut looked = Vec::new();
        if let Ok(exe) = std::env::current_exe() {
            for dir in exe.ancestors().skip(1).take(2) {
                let candidate = dir.join(WORKER_BIN);
                if candidate.is_file() {
                    return Ok(WorkerCommand::Path(candidate));
                }
                looked.push(candidate);
            }
        }
        Err(SandboxError::NoWorkerBinary { looked })
    }

    /// The binary to execute.
    pub fn program(&self) -> Result<PathBuf, SandboxError> {
        match self {
            WorkerCommand::Path(p) => Ok(p.clone()),
            WorkerCommand::CurrentExe => std::env::current_exe().map_err(|e| SandboxError::Spawn {
                path: PathBuf::from("<current executable>"),
                message: e.to_string(),
            }),
        }
    }
}

/// How the sandbox runs code.
#[derive(Clone, Debug)]
pub struct SandboxConfig {
    /// The worker binary.
    pub worker: WorkerCommand,
    /// Workers kept started and waiting for a session.
    pub idle_workers: usize,
    /// Wall-clock limit per cell (time spent answering `llm()` calls is not counted).
    pub step_timeout: Duration,
    /// How long a worker may take to start or to load a document.
    pub startup_timeout: Duration,
    /// Limits each worker applies to itself.
    pub limits: WorkerLimits,
    /// Largest message accepted from a worker, in bytes.
    pub max_frame_bytes: usize,
    /// Times a session may lose its worker (timeout, crash) before it gives up.
    pub max_restarts: u32,
}

impl SandboxConfig {
    /// Defaults around the given worker: 2 idle workers, 10 s per cell, 1 GiB of address
    /// space, 300 s of CPU per session, 4000 characters of output per stream, 256 recorded
    /// accesses per cell.
    pub fn new(worker: WorkerCommand) -> SandboxConfig {
        SandboxConfig {
            worker,
            idle_workers: 2,
            step_timeout: Duration::from_secs(10),
            startup_timeout: Duration::from_secs(20),
            limits: WorkerLimits {
                memory_bytes: 1 << 30,
                cpu_seconds: 300,
                max_output_chars: 4000,
                max_accesses: 256,
            },
            max_frame_bytes: 64 << 20,
            max_restarts: 3,
        }
    }
}
