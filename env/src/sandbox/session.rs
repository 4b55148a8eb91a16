//! One REPL session: a worker holding one document, whose state persists from cell to cell.
//!
//! A cell that runs past the wall-clock limit, crashes the interpreter, exits it, or breaks
//! the protocol costs the session its worker: the cell's output carries an error saying
//! what happened, and the next cell runs in a fresh worker over the same document (earlier
//! variables are gone, which the error says). After `max_restarts` such losses the session
//! gives up with [`SandboxError::TooManyRestarts`].

use std::sync::Arc;
use std::time::Instant;

use fathom_rewards::record::{Access, ExecOutput};

use super::SandboxError;
use super::pool::SandboxPool;
use super::process::{WorkerFault, WorkerProcess};
use super::protocol::{CellDone, FromWorker, ToWorker};

/// What running one cell produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Cell {
    /// Output and error, as recorded in a trajectory.
    pub output: ExecOutput,
    /// How the cell touched the document.
    pub accesses: Vec<Access>,
    /// Accesses past the per-cell cap (counted, not recorded).
    pub accesses_dropped: usize,
    /// Set when the cell cost the session its worker (timeout, crash, protocol violation).
    pub fault: Option<String>,
}

/// A REPL session over one document.
pub struct Session {
    pool: SandboxPool,
    context: Arc<str>,
    worker: Option<WorkerProcess>,
    restarts: u32,
}

impl Session {
    pub(crate) fn start(pool: SandboxPool, context: Arc<str>) -> Result<Session, SandboxError> {
        let mut session = Session {
            pool,
            context,
            worker: None,
            restarts: 0,
        };
        session.worker = Some(session.fresh_worker()?);
        Ok(session)
    }

    /// The document this session holds.
    pub fn context(&self) -> &Arc<str> {
        &self.context
    }

    /// Times this session has lost its worker so far.
    pub fn restarts(&self) -> u32 {
        self.restarts
    }

    fn fresh_worker(&self) -> Result<WorkerProcess, SandboxError> {
        let config = self.pool.config();
        let mut worker = self.pool.acquire()?;
        let deadline = Instant::now() + config.startup_timeout;
        let init = ToWorker::Init {
            context: self.context.to_string(),
            limits: config.limits.clone(),
        };
        let fail = |worker: &WorkerProcess, message: String| SandboxError::Init {
            path: worker.path().clone(),
            message,
        };
        worker
            .send(&init, deadline)
            .map_err(|f| fail(&worker, f.to_string()))?;
        match worker.recv(deadline) {
            Ok(FromWorker::Ready) => Ok(worker),
            Ok(FromWorker::Failed { message }) => Err(fail(&worker, message)),
            Ok(other) => Err(fail(&worker, format!("unexpected reply {other:?}"))),
            Err(fault) => Err(fail(&worker, fault.to_string())),
        }
    }

    /// Runs `code` as the next cell. `llm` answers each `llm(prompt)` call the code makes;
    /// time spent in it does not count against the cell's wall-clock limit.
    ///
    /// Errors only when no worker can be had; whatever the code does is reported in the
    /// returned [`Cell`].
    pub fn exec(
        &mut self,
        code: &str,
        llm: &mut dyn FnMut(&str) -> String,
    ) -> Result<Cell, SandboxError> {
        if self.worker.is_none() {
            if self.restarts > self.pool.config().max_restarts {
                return Err(SandboxError::TooManyRestarts(self.restarts));
            }
            self.worker = Some(self.fresh_worker()?);
        }
        let worker = self.worker.as_mut().expect("worker present");
        let timeout = self.pool.config().step_timeout;
        let started = Instant::now();
        let outcome = run_cell(worker, code, started + timeout, llm);
        let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
        match outcome {
            Ok(done) => Ok(Cell {
                output: ExecOutput {
                    stdout: done.stdout,
                    stderr: done.stderr,
                    error: done.error,
                    truncated: done.truncated,
                    elapsed_ms,
                },
                accesses: done.accesses,
                accesses_dropped: done.accesses_dropped,
                fault: None,
            }),
            Err(fault) => {
                self.worker = None;
                self.restarts += 1;
                let message = describe_fault(&fault, timeout.as_millis());
                tracing::debug!(%fault, "sandbox cell lost its worker");
                Ok(Cell {
                    output: ExecOutput {
                        error: Some(message.clone()),
                        elapsed_ms,
                        ..ExecOutput::default()
                    },
                    fault: Some(fault.to_string()),
                    ..Cell::default()
                })
            }
        }
    }
}

fn run_cell(
    worker: &mut WorkerProcess,
    code: &str,
    mut deadline: Instant,
    llm: &mut dyn FnMut(&str) -> String,
) -> Result<CellDone, WorkerFault> {
    worker.send(
        &ToWorker::Exec {
            code: code.to_string(),
        },
        deadline,
    )?;
    loop {
        match worker.recv(deadline)? {
            FromWorker::Llm { prompt } => {
                let asked = Instant::now();
                let response = llm(&prompt);
                deadline += asked.elapsed();
                worker.send(&ToWorker::LlmReply { response }, deadline)?;
            }
            FromWorker::Done(done) => return Ok(done),
            other => {
                worker.kill();
                return Err(WorkerFault::Protocol(format!(
                    "unexpected message {other:?}"
                )));
            }
        }
    }
}

/// The error text the model sees when a cell cost the REPL its process.
fn describe_fault(fault: &WorkerFault, timeout_ms: u128) -> String {
    let what = match fault {
        WorkerFault::Timeout => {
            format!(
                "TimeoutError: the cell ran longer than the {timeout_ms} ms limit and was stopped."
            )
        }
        WorkerFault::Died(how) => format!(
            "SandboxError: the REPL process {how} (out of memory, a crash, or an exit) while running the cell."
        ),
        WorkerFault::Protocol(what) => {
            format!("SandboxError: the REPL was stopped after a protocol violation ({what}).")
        }
    };
    format!(
        "{what}\nThe REPL has been restarted: variables from earlier cells are gone; `context` and `llm` are still defined.\n"
    )
}
