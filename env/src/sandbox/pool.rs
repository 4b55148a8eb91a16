//! A pool of started workers. Each worker serves exactly one session and is killed when the
//! session ends, so nothing one episode leaves in the interpreter can reach the next.
//!
//! All workers are spawned by one long-lived thread owned by the pool. This matters because
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked a worker exits: spawning from
//! whichever thread happens to ask (a short-lived rollout thread, say) would kill workers
//! early. The spawner keeps `idle_workers` workers started (interpreter up, prelude loaded,
//! waiting for a document) and starts extra ones on demand.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::process::{WorkerFault, WorkerProcess};
use super::protocol::FromWorker;
use super::session::Session;
use super::{SandboxConfig, SandboxError};

/// A shareable handle to a pool of sandbox workers.
#[derive(Clone)]
pub struct SandboxPool {
    shared: Arc<Shared>,
    _guard: Arc<Guard>,
}

struct Shared {
    config: SandboxConfig,
    program: PathBuf,
    state: Mutex<State>,
    /// Signalled when a worker was added or a spawn failed.
    changed: Condvar,
    /// Signalled when the spawner may have work.
    wake: Condvar,
}

#[derive(Default)]
struct State {
    idle: Vec<WorkerProcess>,
    waiting: usize,
    failures: u64,
    last_error: Option<String>,
    prespawn: bool,
    shutdown: bool,
}

/// Stops the spawner when the last handle is dropped.
struct Guard {
    shared: Arc<Shared>,
    spawner: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        lock(&self.shared.state).shutdown = true;
        self.shared.wake.notify_all();
        if let Some(handle) = self.spawner.lock().ok().and_then(|mut h| h.take()) {
            let _ = handle.join();
        }
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl SandboxPool {
    /// Starts the pool (and its spawner thread, which begins starting idle workers).
    pub fn new(config: SandboxConfig) -> Result<SandboxPool, SandboxError> {
        let program = config.worker.program()?;
        if !program.is_file() {
            return Err(SandboxError::NoWorkerBinary {
                looked: vec![program],
            });
        }
        let shared = Arc::new(Shared {
            config,
            program,
            state: Mutex::new(State {
                prespawn: true,
                ..State::default()
            }),
            changed: Condvar::new(),
            wake: Condvar::new(),
        });
        let for_thread = Arc::clone(&shared);
        let spawner = std::thread::Builder::new()
            .name("fathom-sandbox-spawner".into())
            .spawn(move || spawner(&for_thread))
            .map_err(|e| SandboxError::Spawn {
                path: shared.program.clone(),
                message: e.to_string(),
            })?;
        let guard = Arc::new(Guard {
            shared: Arc::clone(&shared),
            spawner: Mutex::new(Some(spawner)),
        });
        Ok(SandboxPool {
            shared,
            _guard: guard,
        })
    }

    /// The pool's configuration.
    pub fn config(&self) -> &SandboxConfig {
        &self.shared.config
    }

    /// Starts a REPL session over `context` on a fresh worker.
    pub fn session(&self, context: impl Into<Arc<str>>) -> Result<Session, SandboxError> {
        Session::start(self.clone(), context.into())
    }

    /// Takes a started worker, waiting for the spawner if none is idle.
    pub(crate) fn acquire(&self) -> Result<WorkerProcess, SandboxError> {
        let shared = &self.shared;
        let timeout = shared.config.startup_timeout * 2;
        let deadline = Instant::now() + timeout;
        let mut state = lock(&shared.state);
        let failures = state.failures;
        state.waiting += 1;
        shared.wake.notify_all();
        let result = loop {
            if let Some(worker) = state.idle.pop() {
                break Ok(worker);
            }
            if state.failures != failures {
                let message = state.last_error.clone().unwrap_or_default();
                break Err(SandboxError::Spawn {
                    path: shared.program.clone(),
                    message,
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break Err(SandboxError::Unavailable(timeout));
            }
            state = shared
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        };
        state.waiting -= 1;
        shared.wake.notify_all();
        result
    }
}

/// The spawner thread: keeps `idle_workers + waiting` workers started.
fn spawner(shared: &Shared) {
    loop {
        let mut state = lock(&shared.state);
        loop {
            if state.shutdown {
                state.idle.clear();
                return;
            }
            let target = if state.prespawn {
                shared.config.idle_workers
            } else {
                0
            } + state.waiting;
            if state.idle.len() < target {
                break;
            }
            state = shared
                .wake
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        drop(state);
        let started = start_worker(shared);
        let failed = started.is_err();
        let mut state = lock(&shared.state);
        match started {
            Ok(worker) => {
                state.idle.push(worker);
                state.prespawn = true;
            }
            Err(message) => {
                tracing::warn!(worker = ?shared.program, %message, "sandbox worker failed to start");
                state.failures += 1;
                state.last_error = Some(message);
                // Stop pre-spawning until a start succeeds; requests still retry.
                state.prespawn = false;
            }
        }
        drop(state);
        shared.changed.notify_all();
        if failed {
            // Do not spin on a binary that cannot start.
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Spawns one worker and waits for it to report that its interpreter is up.
fn start_worker(shared: &Shared) -> Result<WorkerProcess, String> {
    let started = Instant::now();
    let mut worker = WorkerProcess::spawn(&shared.program, shared.config.max_frame_bytes)
        .map_err(|e| e.to_string())?;
    match worker.recv(started + shared.config.startup_timeout) {
        Ok(FromWorker::Started) => {
            tracing::debug!(
                pid = worker.pid(),
                ms = started.elapsed().as_secs_f64() * 1e3,
                "worker started"
            );
            Ok(worker)
        }
        Ok(FromWorker::Failed { message }) => Err(message),
        Ok(other) => Err(format!("unexpected first message {other:?}")),
        Err(fault) => {
            let hint = match &fault {
                WorkerFault::Died(how) if how.contains("status 127") => {
                    " (the dynamic loader could not start it: is libpython on its rpath?)"
                }
                WorkerFault::Died(_) => {
                    " (is it a binary that calls run_worker_if_requested() first in main?)"
                }
                _ => "",
            };
            Err(format!("worker did not start: {fault}{hint}"))
        }
    }
}
