//! Fathom's RLM environment: a sandboxed CPython REPL holding a long document as `context`,
//! `llm()` sub-calls routed through a [`sublm::SubLm`], deterministic long-document tasks,
//! and a scripted expert that solves them.
//!
//! # Layout
//!
//! - [`sandbox`]: worker processes embedding CPython through PyO3, hardened with seccomp and
//!   rlimits, pooled, talking to the parent over a typed pipe protocol.
//! - [`env`](mod@env): the [`env::Environment`] trait (reset / step, stepped by the caller) and
//!   [`env::ReplEnv`], which produces the [`fathom_rewards::record::Trajectory`] rewards score.
//! - [`parse`], [`prompt`]: the model-facing protocol (fenced code, `<answer>` tags) and the
//!   texts the model reads.
//! - [`recursion`], [`sublm`], [`policy`], [`tokens`]: `llm()` routing and limits, the traits
//!   the trainer implements (`SubLm`, `Policy`, `TokenCounter`).
//! - [`tasks`]: the five task families and the fixed splits.
//! - [`expert`]: the scripted expert policy and its passage-reading sub-LM.
//! - `server` (feature `server`, on by default): the environment as an OpenEnv-compatible
//!   HTTP/WebSocket server (axum).
//! - `client` (feature `client`, on by default): `RemoteEnv`, an [`env::Environment`] whose
//!   episodes run on such servers, over a pool of URLs.
//! - `wire` (either feature): the protocol types both share.
//!
//! # Features
//!
//! `server` brings axum, tokio and utoipa; `client` brings only a blocking WebSocket client
//! (tungstenite). A user of the in-process environment alone can depend on the crate with
//! `default-features = false`; the trainer needs `client`.
//!
//! # What the sandbox covers, and what it does not
//!
//! Covered (each has a test in `tests/adversarial.rs`):
//! - **Files**: no file can be opened, created, listed, stat'ed or removed once the worker is
//!   sealed (`open*`, `stat*`, `getdents*`, `mkdir*`, `unlink*`, … are denied by seccomp;
//!   `RLIMIT_FSIZE` is 0). The worker's own stdin/stdout/stderr point at `/dev/null`; the
//!   protocol pipes are its only other descriptors (`close_range` at start, `RLIMIT_NOFILE`).
//! - **Processes and threads**: `fork`, `clone`, `clone3`, `vfork`, `execve*`, and so
//!   `os.system`, `subprocess`, `posix_spawn` and new threads, all fail (`RLIMIT_NPROC` 0 too).
//! - **Network**: `socket`, `connect` and the rest are denied (and the `socket` module cannot
//!   even be imported, since imports from disk are impossible after sealing).
//! - **Signals**: `kill`, `tkill`, `tgkill` are denied, so neither the parent nor any other
//!   process can be signalled; `getppid` is denied too.
//! - **Memory and CPU**: `RLIMIT_AS` (default 1 GiB) turns memory bombs into `MemoryError`;
//!   the parent kills a cell that runs past its wall-clock limit (Python loops and C loops
//!   alike, e.g. catastrophic regexes); `RLIMIT_CPU` bounds a worker's total CPU time.
//! - **Output**: stdout and stderr are captured in bounded buffers with a visible truncation
//!   marker; raw writes to descriptors 1 and 2 go to `/dev/null`.
//! - **Crashes and exits**: `sys.exit` is an ordinary exception; `os._exit`, a C stack
//!   overflow or a segfault kill only the worker: the cell gets an error, the next cell runs
//!   in a fresh worker (state lost, which the error says). The parent treats every message
//!   from a worker as untrusted (size-limited frames, strict parsing, deadlines on every read
//!   and write), so a worker that forges protocol frames only loses itself.
//! - **Isolation between episodes**: each worker serves one episode and is killed after it;
//!   nothing can carry over.
//! - **Environment**: workers start with an empty environment, in `/`, with `no_new_privs`,
//!   not dumpable (no core files), and die with the spawning thread (`PR_SET_PDEATHSIG`; the
//!   pool spawns from one long-lived thread) or when the parent's pipe closes.
//! - **`llm()`**: calls are capped per episode, prompts above a token limit are refused, and
//!   recursion is bounded by depth; the record of refused calls is bounded too.
//!
//! Not covered:
//! - **Reading memory the worker already holds**: code can read its own interpreter's state,
//!   including the document (that is the point) and the Python prelude's internals.
//! - **Access records are advisory**: code that wants to hide how it touched the document can
//!   (`str(context)` is an untracked copy; the log is reachable by introspection). Rewards
//!   must not treat `Step::accesses` as tamper-proof.
//! - **Side channels and timing**: CPU time, memory use and timing are observable; the sandbox
//!   makes no constant-time promises.
//! - **Kernel bugs**: the allow-list is small (read/write on held descriptors, memory
//!   management, futex, signal handling for itself, clocks, `getrandom`, exit), but a kernel
//!   flaw reachable through it is not defended against. There are no namespaces or cgroups:
//!   the worker runs as the parent's user, so a seccomp escape would have that user's rights.
//! - **Denial of service of the host's CPU** is bounded per cell (wall clock) and per worker
//!   (`RLIMIT_CPU`), not across many concurrent workers: size the pool for the machine.
//!
//! # Worker binary
//!
//! See [`sandbox`] for how the worker process is started (`fathom-sandbox`, or any binary
//! calling [`sandbox::run_worker_if_requested`] first in `main`, as xtask does).

#[cfg(feature = "client")]
pub mod client;
pub mod env;
pub mod expert;
pub mod parse;
pub mod policy;
pub mod prompt;
pub mod recursion;
pub mod sandbox;
#[cfg(feature = "server")]
pub mod server;
pub mod sublm;
pub mod tasks;
pub mod tokens;
#[cfg(feature = "wire")]
pub mod wire;
