//! A Python interpreter with the pinned `openenv` and `schemathesis` packages, for the OpenEnv
//! integration test and the schemathesis fuzz test.
//!
//! `FATHOM_OPENENV_PYTHON`, if set, names a ready interpreter (it must import `openenv` and
//! `schemathesis` at the pinned versions). Otherwise the test makes a virtualenv under the cargo target
//! directory, `openenv-venv-<hash of requirements.txt>`, with the base interpreter
//! `FATHOM_PYTHON` (default `python3`, 3.10 or newer) and installs `requirements.txt` from
//! PyPI into it; later runs reuse it. A file lock keeps concurrent test binaries from
//! building it twice, and the venv is built in a temporary directory and renamed into place
//! only once `openenv` imports. Every failure panics with the command's output: the test is
//! never skipped.

#![allow(dead_code)]

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The `openenv` version the test is written against.
pub const OPENENV_VERSION: &str = "0.10.0";

/// The `schemathesis` version the fuzz test is written against.
pub const SCHEMATHESIS_VERSION: &str = "4.32.5";

/// The pinned packages.
pub const REQUIREMENTS: &str = include_str!("requirements.txt");

/// The interpreter to run the driver with.
pub fn interpreter() -> PathBuf {
    if let Some(python) = std::env::var_os("FATHOM_OPENENV_PYTHON").filter(|v| !v.is_empty()) {
        let python = PathBuf::from(python);
        check_openenv(&python)
            .unwrap_or_else(|e| panic!("FATHOM_OPENENV_PYTHON={}: {e}", python.display()));
        return python;
    }
    let target = target_dir();
    let venv = target.join(format!(
        "openenv-venv-{:016x}",
        fnv(REQUIREMENTS.as_bytes())
    ));
    let python = venv.join("bin").join("python");
    let lock_path = target.join("openenv-venv.lock");
    let lock = File::create(&lock_path)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", lock_path.display()));
    // SAFETY: flock on a descriptor we own; released when `lock` is closed.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        panic!(
            "cannot lock {}: {}",
            lock_path.display(),
            std::io::Error::last_os_error()
        );
    }
    if venv.join(".fathom-ready").is_file() {
        return python;
    }
    build(&venv);
    drop(lock);
    python
}

/// The cargo target directory this test binary was built into (`<target>/<profile>/deps/…`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.ancestors()
        .nth(3)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| panic!("cannot find the target directory above {}", exe.display()))
}

/// Builds the venv in a temporary directory and renames it to `venv`.
fn build(venv: &Path) {
    let base = std::env::var("FATHOM_PYTHON")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "python3".into());
    let tmp = venv.with_extension(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let _ = std::fs::remove_dir_all(venv);
    eprintln!(
        "openenv test: creating {} with {base} (first run only)",
        venv.display()
    );
    run(
        Command::new(&base).arg("-m").arg("venv").arg(&tmp),
        Duration::from_secs(300),
        "python -m venv",
    );
    let requirements = tmp.join("requirements.txt");
    std::fs::write(&requirements, REQUIREMENTS).expect("write requirements");
    let python = tmp.join("bin").join("python");
    eprintln!(
        "openenv test: pip install -r requirements.txt (openenv=={OPENENV_VERSION}, schemathesis=={SCHEMATHESIS_VERSION}); this takes a few minutes once"
    );
    run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-input",
                "--timeout",
                "60",
                "-r",
            ])
            .arg(&requirements),
        Duration::from_secs(1800),
        "pip install",
    );
    check_openenv(&python).unwrap_or_else(|e| panic!("the new venv at {}: {e}", tmp.display()));
    std::fs::write(tmp.join(".fathom-ready"), OPENENV_VERSION).expect("mark the venv");
    std::fs::rename(&tmp, venv)
        .unwrap_or_else(|e| panic!("cannot move {} to {}: {e}", tmp.display(), venv.display()));
}

/// Checks that `python` imports `openenv` and `schemathesis` at the pinned versions.
fn check_openenv(python: &Path) -> Result<(), String> {
    let script = "import importlib.metadata as m, openenv.core, openenv.cli._validation, schemathesis.cli; print(m.version('openenv'), m.version('schemathesis'))";
    let out = output(
        Command::new(python).args(["-c", script]),
        Duration::from_secs(300),
    )?;
    let mut versions = out.split_whitespace();
    for (name, pinned) in [
        ("openenv", OPENENV_VERSION),
        ("schemathesis", SCHEMATHESIS_VERSION),
    ] {
        let version = versions.next().unwrap_or("no version");
        if version != pinned {
            return Err(format!(
                "{name} {version} is installed; the tests need {pinned}"
            ));
        }
    }
    Ok(())
}

/// Runs a command to completion within `limit`, panicking with its output on failure.
fn run(cmd: &mut Command, limit: Duration, what: &str) {
    if let Err(e) = output(cmd, limit) {
        panic!("{what} failed: {e}");
    }
}

/// Runs a command within `limit` and returns its stdout, or why it failed (with stderr).
pub fn output(cmd: &mut Command, limit: Duration) -> Result<String, String> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break Some(status);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = out_reader.join().unwrap_or_default();
    let err = err_reader.join().unwrap_or_default();
    let tail = |s: &str| {
        s.chars()
            .rev()
            .take(6000)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<String>()
    };
    match status {
        Some(s) if s.success() => Ok(out),
        Some(s) => Err(format!(
            "{cmd:?} exited with {s}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            tail(&out),
            tail(&err)
        )),
        None => Err(format!(
            "{cmd:?} ran past {limit:?}\n--- stderr ---\n{}",
            tail(&err)
        )),
    }
}

/// 64-bit FNV-1a (stable across Rust versions, unlike `DefaultHasher`).
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}
