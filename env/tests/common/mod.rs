//! Helpers shared by the integration tests: a sandbox pool over the crate's own worker
//! binary, and a local normalised exact-match check.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use fathom_env::env::{ReplEnv, Services};
use fathom_env::sandbox::{SandboxConfig, SandboxPool, WorkerCommand};
use fathom_env::sublm::SubLm;

/// Sandbox settings for tests: the crate's `fathom-sandbox` binary, short limits.
pub fn sandbox_config() -> SandboxConfig {
    let mut config = SandboxConfig::new(WorkerCommand::Path(
        env!("CARGO_BIN_EXE_fathom-sandbox").into(),
    ));
    config.idle_workers = 1;
    config.step_timeout = Duration::from_secs(10);
    config.limits.memory_bytes = 512 << 20;
    config.limits.cpu_seconds = 20;
    config
}

/// A pool with [`sandbox_config`].
pub fn pool() -> SandboxPool {
    SandboxPool::new(sandbox_config()).expect("sandbox pool")
}

/// An environment over `pool` whose `llm()` is `sub_lm`.
pub fn env(pool: &SandboxPool, sub_lm: Arc<dyn SubLm>) -> ReplEnv {
    ReplEnv::new(Services::new(pool.clone(), sub_lm))
}

/// Lower case, punctuation and articles removed, whitespace collapsed.
pub fn normalise(s: &str) -> String {
    let cleaned: String = s
        .to_lowercase()
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c.is_whitespace() {
                c
            } else {
                ' '
            }
        })
        .collect();
    cleaned
        .split_whitespace()
        .filter(|w| !matches!(*w, "a" | "an" | "the"))
        .collect::<Vec<_>>()
        .join(" ")
}
