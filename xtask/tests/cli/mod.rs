//! Running the `xtask` binary from the workspace root in integration tests, and its output as
//! text for assertion messages.

#![allow(dead_code)]

use std::process::{Command, Output};

/// `xtask ARGS…`, run in the workspace root (so `recipes/…` paths resolve).
pub fn xtask<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .args(args)
        .output()
        .expect("xtask runs")
}

/// Standard output and standard error, for assertion messages.
pub fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
