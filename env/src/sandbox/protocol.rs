//! The typed protocol between the parent and a sandbox worker: serde-tagged messages, each
//! sent as one frame (a little-endian `u32` length followed by that many bytes of JSON).
//!
//! The exchange is strictly request/reply. A worker announces `Started` once its interpreter
//! is up; the parent sends `Init` (the document and limits) and gets `Ready` once the sandbox
//! is sealed; then, for each cell, `Exec` is answered by any number of `Llm` requests (each
//! answered by `LlmReply`) and finally by `Done`. Anything else is a protocol error, and the
//! parent treats every frame from a worker as untrusted input.

use std::io::{Read, Write};

use fathom_rewards::record::Access;
use serde::{Deserialize, Serialize};

/// Limits the worker applies to itself before running model code.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerLimits {
    /// Address-space limit (`RLIMIT_AS`) in bytes.
    pub memory_bytes: u64,
    /// CPU-time limit (`RLIMIT_CPU`) in seconds, over the worker's whole life.
    pub cpu_seconds: u64,
    /// Characters of stdout (and, separately, of stderr) kept per cell.
    pub max_output_chars: usize,
    /// Document accesses recorded per cell; further ones are counted, not kept.
    pub max_accesses: usize,
}

/// A message from the parent to a worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToWorker {
    /// Start the session: load the document, apply the limits, seal the sandbox.
    Init {
        /// The document, bound to `context` in the REPL.
        context: String,
        /// The limits to apply.
        limits: WorkerLimits,
    },
    /// Run one cell.
    Exec {
        /// Python source of the cell.
        code: String,
    },
    /// The answer to the worker's last `Llm` request.
    LlmReply {
        /// What `llm()` returns to the code.
        response: String,
    },
}

/// A message from a worker to the parent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromWorker {
    /// The interpreter is initialised; the worker waits for `Init`.
    Started,
    /// The session is loaded and the sandbox sealed; the worker waits for `Exec`.
    Ready,
    /// The running cell called `llm(prompt)` and waits for `LlmReply`.
    Llm {
        /// The prompt passed to `llm()`.
        prompt: String,
    },
    /// The cell finished (normally or with a Python exception).
    Done(CellDone),
    /// The worker could not set itself up; it exits after sending this.
    Failed {
        /// What went wrong.
        message: String,
    },
}

/// What a finished cell reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CellDone {
    /// Captured stdout, with a truncation marker when cut.
    pub stdout: String,
    /// Captured stderr, with a truncation marker when cut.
    pub stderr: String,
    /// The Python traceback, when the cell raised.
    pub error: Option<String>,
    /// Whether stdout or stderr was cut.
    pub truncated: bool,
    /// How the cell touched the document (at most `max_accesses`).
    pub accesses: Vec<Access>,
    /// Accesses past `max_accesses`, counted but not recorded.
    pub accesses_dropped: usize,
}

/// Errors reading or writing a frame.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The underlying pipe failed or closed.
    #[error("pipe error: {0}")]
    Io(#[from] std::io::Error),
    /// A frame announced more bytes than allowed.
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A frame's payload was not a valid message.
    #[error("malformed message: {0}")]
    Malformed(#[from] serde_json::Error),
}

/// Serialises `msg` as one frame (length prefix included).
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let mut buf = vec![0u8; 4];
    serde_json::to_writer(&mut buf, msg)?;
    let len = u32::try_from(buf.len() - 4).map_err(|_| FrameError::TooLarge {
        len: buf.len() - 4,
        max: u32::MAX as usize,
    })?;
    buf[..4].copy_from_slice(&len.to_le_bytes());
    Ok(buf)
}

/// Blocking write of one frame (the worker's side).
pub fn write_frame<T: Serialize>(out: &mut impl Write, msg: &T) -> Result<(), FrameError> {
    out.write_all(&encode(msg)?)?;
    out.flush()?;
    Ok(())
}

/// Blocking read of one frame of at most `max` bytes (the worker's side).
pub fn read_frame<T: for<'de> Deserialize<'de>>(
    input: &mut impl Read,
    max: usize,
) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    input.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    let mut payload = vec![0u8; len];
    input.read_exact(&mut payload)?;
    Ok(serde_json::from_slice(&payload)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fathom_rewards::record::{AccessKind, Span};

    #[test]
    fn frames_round_trip() {
        let done = FromWorker::Done(CellDone {
            stdout: "hi\n".into(),
            accesses: vec![Access {
                kind: AccessKind::Search {
                    pattern: r"\d+".into(),
                },
                span: Span { start: 3, end: 9 },
            }],
            ..CellDone::default()
        });
        let bytes = encode(&done).unwrap();
        let back: FromWorker = read_frame(&mut bytes.as_slice(), 1 << 20).unwrap();
        assert_eq!(back, done);
    }

    #[test]
    fn oversized_frame_is_rejected_before_reading_it() {
        let bytes = encode(&ToWorker::Exec {
            code: "x".repeat(100),
        })
        .unwrap();
        let err = read_frame::<ToWorker>(&mut bytes.as_slice(), 10).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { max: 10, .. }), "{err}");
    }

    #[test]
    fn malformed_payload_is_an_error() {
        let mut bytes = 5u32.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{nope");
        let err = read_frame::<ToWorker>(&mut bytes.as_slice(), 100).unwrap_err();
        assert!(matches!(err, FrameError::Malformed(_)), "{err}");
    }
}
