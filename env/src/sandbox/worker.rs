//! The worker side of the sandbox: the code that runs inside a worker process.
//!
//! A worker is started by the parent (see [`crate::sandbox::WorkerCommand`]) with
//! [`WORKER_ARG`] and the parent's pid as arguments. It ties itself to its parent, moves the
//! protocol pipes out of the way and closes every other descriptor, starts an isolated
//! CPython (no site, no environment variables, no user directories), runs the prelude, and
//! announces `Started`. On `Init` it builds the REPL around the document, then applies the
//! resource limits and installs the seccomp filter (see [`super::harden`]) before answering
//! `Ready`; from then on it only runs cells. It serves one session and is killed afterwards.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::{Arc, Mutex};

use fathom_rewards::record::{Access, AccessKind, Span};
use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyDict, PyTuple};

use super::harden;
use super::protocol::{CellDone, FromWorker, ToWorker, WorkerLimits, read_frame, write_frame};

/// The first argument that puts a binary into worker mode (see [`run_worker_if_requested`]).
pub const WORKER_ARG: &str = "__fathom_sandbox_worker__";

/// The largest frame a worker accepts from its parent (the `Init` frame carries the document).
const MAX_INBOUND_FRAME: usize = 1 << 30;

/// The Python prelude (pre-imports, instrumented `context`, cell runner).
const PRELUDE: &str = include_str!("prelude.py");

/// Runs the sandbox worker and exits if this process was started as one; returns otherwise.
///
/// Call it first thing in `main` of any binary that should be able to serve as its own
/// sandbox worker (the `fathom-sandbox` binary and `xtask` do), then configure the parent
/// with [`super::WorkerCommand::CurrentExe`].
pub fn run_worker_if_requested() {
    let mut args = std::env::args_os().skip(1);
    if args.next().is_some_and(|a| a == WORKER_ARG) {
        let parent = args
            .next()
            .and_then(|p| p.to_str()?.parse().ok())
            .unwrap_or(0);
        let code = match run(parent) {
            Ok(()) => 0,
            Err(_) => 1,
        };
        // SAFETY: ends the process without running atexit handlers or flushing Python.
        unsafe { libc::_exit(code) }
    }
}

/// The two protocol pipes, shared by the cell loop and the `llm()` callback.
struct Channel {
    input: File,
    output: File,
}

impl Channel {
    fn send(&mut self, msg: &FromWorker) -> Result<(), String> {
        write_frame(&mut self.output, msg).map_err(|e| e.to_string())
    }

    fn recv(&mut self) -> Result<ToWorker, String> {
        read_frame(&mut self.input, MAX_INBOUND_FRAME).map_err(|e| e.to_string())
    }
}

fn run(parent: libc::pid_t) -> Result<(), String> {
    harden::tie_to_parent(parent).map_err(|e| e.to_string())?;
    let (input, output) = harden::isolate_descriptors().map_err(|e| e.to_string())?;
    // SAFETY: `isolate_descriptors` just made these two descriptors ours alone.
    let channel = unsafe {
        Channel {
            input: File::from_raw_fd(input),
            output: File::from_raw_fd(output),
        }
    };
    let channel = Arc::new(Mutex::new(channel));
    let result = serve(&channel);
    if let Err(message) = &result
        && let Ok(mut ch) = channel.lock()
    {
        let _ = ch.send(&FromWorker::Failed {
            message: message.clone(),
        });
    }
    result
}

fn lock(channel: &Mutex<Channel>) -> std::sync::MutexGuard<'_, Channel> {
    channel
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn serve(channel: &Arc<Mutex<Channel>>) -> Result<(), String> {
    start_interpreter()?;
    let prelude = CString::new(PRELUDE).map_err(|e| e.to_string())?;
    let make_repl: Py<PyAny> = Python::attach(|py| -> PyResult<_> {
        let module = PyModule::from_code(py, &prelude, c"<fathom-prelude>", c"_fathom_prelude")?;
        Ok(module.getattr("make_repl")?.unbind())
    })
    .map_err(|e| format!("prelude failed: {e}"))?;
    lock(channel).send(&FromWorker::Started)?;

    let (context, limits) = match lock(channel).recv()? {
        ToWorker::Init { context, limits } => (context, limits),
        other => return Err(format!("expected init, got {other:?}")),
    };
    let run_cell = build_repl(&make_repl, context, &limits, channel)?;
    seal(&limits)?;
    lock(channel).send(&FromWorker::Ready)?;

    loop {
        let msg = match lock(channel).recv() {
            Ok(msg) => msg,
            // The parent closed the pipe: the session is over.
            Err(_) => return Ok(()),
        };
        let ToWorker::Exec { code } = msg else {
            return Err(format!("expected exec, got {msg:?}"));
        };
        let done = Python::attach(|py| run_one(py, &run_cell, &code));
        lock(channel).send(&FromWorker::Done(done))?;
    }
}

/// Starts CPython in isolated mode: no `site`, no environment, no bytecode writing, and the
/// home of the interpreter the crate was built against (see the build script).
fn start_interpreter() -> Result<(), String> {
    // SAFETY: the interpreter is not running yet; the config is initialised by
    // `PyConfig_InitIsolatedConfig` before use and cleared after.
    unsafe {
        let mut config = std::mem::MaybeUninit::<pyo3::ffi::PyConfig>::zeroed();
        pyo3::ffi::PyConfig_InitIsolatedConfig(config.as_mut_ptr());
        let mut config = config.assume_init();
        config.site_import = 0;
        config.write_bytecode = 0;
        config.install_signal_handlers = 0;
        config.user_site_directory = 0;
        let home = CString::new(env!("FATHOM_PYTHON_HOME")).map_err(|e| e.to_string())?;
        let status =
            pyo3::ffi::PyConfig_SetBytesString(&mut config, &mut config.home, home.as_ptr());
        if pyo3::ffi::PyStatus_Exception(status) != 0 {
            pyo3::ffi::PyConfig_Clear(&mut config);
            return Err("cannot set the Python home".into());
        }
        let status = pyo3::ffi::Py_InitializeFromConfig(&config);
        pyo3::ffi::PyConfig_Clear(&mut config);
        if pyo3::ffi::PyStatus_Exception(status) != 0 {
            return Err("Python failed to initialise".into());
        }
        // Release the GIL taken by initialisation; `Python::attach` takes it per use.
        pyo3::ffi::PyEval_SaveThread();
    }
    Ok(())
}

fn build_repl(
    make_repl: &Py<PyAny>,
    context: String,
    limits: &WorkerLimits,
    channel: &Arc<Mutex<Channel>>,
) -> Result<Py<PyAny>, String> {
    let for_llm = Arc::clone(channel);
    Python::attach(|py| -> PyResult<Py<PyAny>> {
        let llm_raw = PyCFunction::new_closure(
            py,
            Some(c"llm"),
            None,
            move |args: &Bound<'_, PyTuple>, _kw: Option<&Bound<'_, PyDict>>| -> PyResult<String> {
                let (prompt,): (String,) = args.extract()?;
                let mut ch = lock(&for_llm);
                ch.send(&FromWorker::Llm { prompt })
                    .map_err(pyo3::exceptions::PyRuntimeError::new_err)?;
                match ch
                    .recv()
                    .map_err(pyo3::exceptions::PyRuntimeError::new_err)?
                {
                    ToWorker::LlmReply { response } => Ok(response),
                    other => Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                        "llm(): unexpected reply {other:?}"
                    ))),
                }
            },
        )?;
        let run_cell = make_repl.call1(
            py,
            (
                context,
                llm_raw,
                limits.max_output_chars,
                limits.max_accesses,
            ),
        )?;
        Ok(run_cell)
    })
    .map_err(|e| format!("building the REPL failed: {e}"))
}

fn seal(limits: &WorkerLimits) -> Result<(), String> {
    let filter = harden::build_filter().map_err(|e| e.to_string())?;
    // Descriptors 0..=4 are open; no new ones may be created.
    harden::apply_rlimits(limits.memory_bytes, limits.cpu_seconds, 5).map_err(|e| e.to_string())?;
    harden::install_filter(&filter).map_err(|e| e.to_string())
}

type Record = (String, Option<String>, usize, usize);

fn run_one(py: Python<'_>, run_cell: &Py<PyAny>, code: &str) -> CellDone {
    let result = run_cell
        .call1(py, (code,))
        .and_then(|r| r.extract::<(String, String, Option<String>, bool, Vec<Record>, usize)>(py));
    match result {
        Ok((stdout, stderr, error, truncated, records, accesses_dropped)) => CellDone {
            stdout,
            stderr,
            error,
            truncated,
            accesses: records.into_iter().filter_map(to_access).collect(),
            accesses_dropped,
        },
        // The runner itself failed (e.g. memory exhausted while formatting the output).
        Err(e) => CellDone {
            error: Some(format!("{e}\n")),
            ..CellDone::default()
        },
    }
}

fn to_access((kind, arg, start, end): Record) -> Option<Access> {
    let kind = match (kind.as_str(), arg) {
        ("slice", _) => AccessKind::Slice,
        ("find", Some(needle)) => AccessKind::Find { needle },
        ("search", Some(pattern)) => AccessKind::Search { pattern },
        _ => return None,
    };
    Some(Access {
        kind,
        span: Span { start, end },
    })
}
