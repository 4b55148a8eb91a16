//! Hardening a worker process before it runs model code: descriptor hygiene, resource limits
//! and a seccomp-bpf allow-list applied to every thread.
//!
//! This file is separate from the REPL protocol on purpose: it only knows about the process,
//! not about Python. The allow-list is what CPython needs to run pure-Python code, allocate
//! memory and talk over the two protocol pipes it already holds; every other system call
//! (`open*`, `socket`, `connect`, `clone`/`fork`, `execve`, `kill`, `ptrace`, `prlimit64`, …)
//! fails with `EPERM`, so hostile code sees an ordinary Python `OSError` rather than a crash.

use std::collections::BTreeMap;
use std::io;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

/// Errors while sealing the worker.
#[derive(Debug, thiserror::Error)]
pub enum HardenError {
    /// A system call used for hardening failed.
    #[error("{call} failed: {source}")]
    Sys {
        /// The call that failed.
        call: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// The seccomp filter could not be built or installed.
    #[error("seccomp: {0}")]
    Seccomp(String),
}

fn check(call: &'static str, rc: libc::c_int) -> Result<(), HardenError> {
    if rc == -1 {
        Err(HardenError::Sys {
            call,
            source: io::Error::last_os_error(),
        })
    } else {
        Ok(())
    }
}

/// Moves the protocol pipes (stdin and stdout as spawned) to descriptors 3 and 4, points
/// 0, 1 and 2 at `/dev/null`, and closes every other descriptor the worker inherited.
///
/// Returns `(input, output)`, the protocol descriptors.
pub fn isolate_descriptors() -> Result<(libc::c_int, libc::c_int), HardenError> {
    const INPUT: libc::c_int = 3;
    const OUTPUT: libc::c_int = 4;
    // SAFETY: plain descriptor syscalls on descriptors this process owns; nothing in Rust
    // holds descriptors 0..=4 at this point of the worker's start.
    unsafe {
        check("dup2(stdin)", libc::dup2(0, INPUT))?;
        check("dup2(stdout)", libc::dup2(1, OUTPUT))?;
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        check("open(/dev/null)", null)?;
        for fd in 0..=2 {
            check("dup2(/dev/null)", libc::dup2(null, fd))?;
        }
        if null > OUTPUT {
            libc::close(null);
        }
        check(
            "close_range",
            libc::syscall(libc::SYS_close_range, OUTPUT + 1, u32::MAX, 0) as _,
        )?;
    }
    Ok((INPUT, OUTPUT))
}

/// Makes the worker die with its parent and never dump core.
///
/// `parent` is the pid the worker was started by; if it is already gone, the worker exits.
pub fn tie_to_parent(parent: libc::pid_t) -> Result<(), HardenError> {
    // SAFETY: prctl with integer arguments.
    unsafe {
        check(
            "prctl(PR_SET_PDEATHSIG)",
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL),
        )?;
        check(
            "prctl(PR_SET_DUMPABLE)",
            libc::prctl(libc::PR_SET_DUMPABLE, 0),
        )?;
        if libc::getppid() != parent {
            libc::_exit(0);
        }
    }
    Ok(())
}

fn set_limit(
    resource: libc::__rlimit_resource_t,
    value: u64,
    name: &'static str,
) -> Result<(), HardenError> {
    let limit = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: setrlimit reads the struct we pass.
    check(name, unsafe { libc::setrlimit(resource, &limit) })
}

/// Applies the resource limits: address space, CPU time, no file writes, no new descriptors
/// or processes, no core dumps.
pub fn apply_rlimits(
    memory_bytes: u64,
    cpu_seconds: u64,
    open_files: u64,
) -> Result<(), HardenError> {
    set_limit(libc::RLIMIT_CORE, 0, "setrlimit(RLIMIT_CORE)")?;
    set_limit(libc::RLIMIT_FSIZE, 0, "setrlimit(RLIMIT_FSIZE)")?;
    set_limit(libc::RLIMIT_NOFILE, open_files, "setrlimit(RLIMIT_NOFILE)")?;
    set_limit(libc::RLIMIT_NPROC, 0, "setrlimit(RLIMIT_NPROC)")?;
    set_limit(
        libc::RLIMIT_CPU,
        cpu_seconds.max(1),
        "setrlimit(RLIMIT_CPU)",
    )?;
    set_limit(libc::RLIMIT_AS, memory_bytes, "setrlimit(RLIMIT_AS)")?;
    Ok(())
}

/// System calls the sealed worker may make. Everything else fails with `EPERM`.
const ALLOWED: &[libc::c_long] = &[
    // The protocol pipes and captured output.
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_close,
    // Memory.
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    // Synchronisation, signals (own handlers only: no kill/tgkill), time.
    libc::SYS_futex,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_gettimeofday,
    libc::SYS_getrusage,
    libc::SYS_times,
    libc::SYS_sched_yield,
    // Harmless process facts and randomness.
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_getrandom,
    // Leaving.
    libc::SYS_exit,
    libc::SYS_exit_group,
];

fn target_arch() -> Result<TargetArch, HardenError> {
    TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|e| HardenError::Seccomp(format!("unsupported architecture: {e:?}")))
}

/// Builds the allow-list filter.
pub fn build_filter() -> Result<BpfProgram, HardenError> {
    let rules: BTreeMap<i64, Vec<seccompiler::SeccompRule>> =
        ALLOWED.iter().map(|&nr| (nr, Vec::new())).collect();
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        target_arch()?,
    )
    .map_err(|e| HardenError::Seccomp(e.to_string()))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| HardenError::Seccomp(e.to_string()))
}

/// Installs `filter` on every thread of the process (`SECCOMP_FILTER_FLAG_TSYNC`), after
/// setting `no_new_privs`.
pub fn install_filter(filter: &BpfProgram) -> Result<(), HardenError> {
    seccompiler::apply_filter_all_threads(filter).map_err(|e| HardenError::Seccomp(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_builds_for_this_architecture() {
        let filter = build_filter().unwrap();
        assert!(
            filter.len() > ALLOWED.len(),
            "one comparison per allowed syscall at least"
        );
    }

    #[test]
    fn allow_list_has_no_process_network_or_file_calls() {
        for denied in [
            libc::SYS_openat,
            libc::SYS_socket,
            libc::SYS_connect,
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_execve,
            libc::SYS_kill,
            libc::SYS_tgkill,
            libc::SYS_ptrace,
            libc::SYS_prlimit64,
            libc::SYS_unlinkat,
        ] {
            assert!(
                !ALLOWED.contains(&denied),
                "syscall {denied} must not be allowed"
            );
        }
    }
}
