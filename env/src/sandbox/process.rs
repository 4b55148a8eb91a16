//! One worker process as the parent sees it: spawning it, talking to it with deadlines, and
//! killing it.
//!
//! The parent's ends of the pipes are non-blocking and every read or write waits with
//! `poll(2)` against a deadline, so a worker that stops reading, floods the pipe or hangs in C
//! code can never block the parent: past the deadline it is killed with `SIGKILL`.

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use super::protocol::{FromWorker, ToWorker, encode};

/// Why talking to a worker failed.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkerFault {
    /// The deadline passed; the worker was killed.
    Timeout,
    /// The worker exited or was killed by a signal.
    Died(String),
    /// The worker sent something that is not a valid message.
    Protocol(String),
}

impl std::fmt::Display for WorkerFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerFault::Timeout => write!(f, "timed out"),
            WorkerFault::Died(how) => write!(f, "the worker process {how}"),
            WorkerFault::Protocol(what) => write!(f, "protocol violation: {what}"),
        }
    }
}

/// A spawned worker process and the parent's ends of its pipes.
pub struct WorkerProcess {
    child: Child,
    to: ChildStdin,
    from: ChildStdout,
    buf: Vec<u8>,
    max_frame: usize,
    path: PathBuf,
}

fn set_nonblocking(fd: i32) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags == -1 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == -1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Waits until `fd` is ready for `events` or `deadline` passes; `Ok(false)` on timeout.
fn wait_ready(fd: i32, events: libc::c_short, deadline: Instant) -> io::Result<bool> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let ms = left.as_millis().min(i32::MAX as u128) as i32;
        let mut pfd = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if rc > 0 {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
    }
}

impl WorkerProcess {
    /// Starts `program WORKER_ARG <our pid>` with an empty environment and `/dev/null` stderr.
    ///
    /// The worker ties itself to this process as its first act (`PR_SET_PDEATHSIG`, then it
    /// exits if its parent is no longer the pid it was given), so nothing runs between fork
    /// and exec here. That lets the standard library start it with `posix_spawn` (a vfork,
    /// which shares the address space) instead of `fork`, whose copy of a parent holding a
    /// model's weights cost a tenth of a rollout's CPU time.
    pub fn spawn(program: &PathBuf, max_frame: usize) -> io::Result<WorkerProcess> {
        let mut cmd = Command::new(program);
        cmd.arg(super::worker::WORKER_ARG)
            .arg(std::process::id().to_string())
            .env_clear()
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = cmd.spawn()?;
        let (Some(to), Some(from)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::other("worker pipes missing"));
        };
        set_nonblocking(to.as_raw_fd())?;
        set_nonblocking(from.as_raw_fd())?;
        Ok(WorkerProcess {
            child,
            to,
            from,
            buf: Vec::new(),
            max_frame,
            path: program.clone(),
        })
    }

    /// The worker binary.
    pub fn path(&self) -> &PathBuf {
        &self.path
    }

    /// The worker's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends one message, failing if the worker does not take it before `deadline`.
    pub fn send(&mut self, msg: &ToWorker, deadline: Instant) -> Result<(), WorkerFault> {
        let bytes = encode(msg).map_err(|e| WorkerFault::Protocol(e.to_string()))?;
        let mut sent = 0;
        while sent < bytes.len() {
            match self.to.write(&bytes[sent..]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    match wait_ready(self.to.as_raw_fd(), libc::POLLOUT, deadline) {
                        Ok(true) => {}
                        Ok(false) => return Err(self.fail(WorkerFault::Timeout)),
                        Err(e) => return Err(self.fail(WorkerFault::Died(e.to_string()))),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Err(self.died()),
            }
        }
        Ok(())
    }

    /// Receives one message, failing if none is complete before `deadline`.
    pub fn recv(&mut self, deadline: Instant) -> Result<FromWorker, WorkerFault> {
        loop {
            if self.buf.len() >= 4 {
                let len = u32::from_le_bytes(self.buf[..4].try_into().expect("4 bytes")) as usize;
                if len > self.max_frame {
                    let why = format!(
                        "frame of {len} bytes exceeds the {}-byte limit",
                        self.max_frame
                    );
                    return Err(self.fail(WorkerFault::Protocol(why)));
                }
                if self.buf.len() >= 4 + len {
                    let parsed = serde_json::from_slice(&self.buf[4..4 + len]);
                    self.buf.drain(..4 + len);
                    return parsed.map_err(|e| self.fail(WorkerFault::Protocol(e.to_string())));
                }
            }
            let mut chunk = [0u8; 64 * 1024];
            match self.from.read(&mut chunk) {
                Ok(0) => return Err(self.died()),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    match wait_ready(self.from.as_raw_fd(), libc::POLLIN, deadline) {
                        Ok(true) => {}
                        Ok(false) => return Err(self.fail(WorkerFault::Timeout)),
                        Err(e) => return Err(self.fail(WorkerFault::Died(e.to_string()))),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Err(self.died()),
            }
        }
    }

    /// Kills the worker and returns `fault`.
    fn fail(&mut self, fault: WorkerFault) -> WorkerFault {
        self.kill();
        fault
    }

    /// The worker closed its pipe: reap it and describe how it ended.
    fn died(&mut self) -> WorkerFault {
        // A closed pipe with a live process (it closed its own descriptors) is still fatal.
        let status = match self.child.try_wait() {
            Ok(Some(status)) => Some(status),
            _ => {
                std::thread::sleep(Duration::from_millis(5));
                self.child.try_wait().ok().flatten()
            }
        };
        self.kill();
        let status = status.or_else(|| self.child.try_wait().ok().flatten());
        WorkerFault::Died(match status {
            Some(s) => match (s.code(), s.signal()) {
                (Some(code), _) => format!("exited with status {code}"),
                (_, Some(sig)) => format!("was killed by signal {sig} ({})", signal_name(sig)),
                _ => "ended".into(),
            },
            None => "closed its pipe".into(),
        })
    }

    /// Kills and reaps the worker (idempotent).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGXCPU => "SIGXCPU: CPU-time limit",
        libc::SIGXFSZ => "SIGXFSZ: file-size limit",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGSYS => "SIGSYS",
        _ => "signal",
    }
}
