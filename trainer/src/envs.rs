//! The environments a run steps: in-process sandboxed REPLs sharing one worker pool, or
//! episodes on remote OpenEnv servers (a recipe's `remote` URLs) through `fathom_env`'s
//! client. Either way their `llm()` calls (and recursive sub-episodes) go to the rollout
//! engine's queue, and token counts come from the policy's own tokenizer.

use std::sync::Arc;

use fathom_env::client::{ClientConfig, RemoteEnv, ServerPool};
use fathom_env::env::{Environment, ReplEnv, Services};
use fathom_env::sandbox::{SandboxConfig, SandboxPool, WorkerCommand};
use fathom_env::tokens::TokenCounter;
use fathom_model::Tokenizer;

use crate::recipe::Plan;
use crate::rollout::Bridge;

/// Counts tokens with the policy's tokenizer.
pub struct TokenizerCounter(pub Arc<Tokenizer>);

impl TokenCounter for TokenizerCounter {
    fn count(&self, text: &str) -> usize {
        match self.0.encode(text, false) {
            Ok(ids) => ids.len(),
            // A text the tokenizer rejects still has a size.
            Err(_) => fathom_env::tokens::ApproxTokens.count(text),
        }
    }
}

/// Why the environments could not be built.
#[derive(Debug, thiserror::Error)]
pub enum EnvsError {
    /// The sandbox pool failed to start.
    #[error("starting the sandbox: {0}")]
    Sandbox(#[from] fathom_env::sandbox::SandboxError),
    /// The remote servers are unusable.
    #[error("remote environments: {0}")]
    Remote(String),
}

/// What every environment of a run shares.
pub struct EnvFactory {
    kind: Kind,
    bridge: Bridge,
}

enum Kind {
    Local(Services),
    Remote(ServerPool),
}

impl EnvFactory {
    /// The environments of `plan`, with sandbox workers started by `worker` (local runs),
    /// counting tokens with `tokenizer`; `llm()` calls go to `bridge`. `parallel` is how many
    /// episodes run at once (the worker pool keeps that many warm, up to 8).
    pub fn new(
        plan: &Plan,
        worker: WorkerCommand,
        tokenizer: Arc<Tokenizer>,
        bridge: &Bridge,
        parallel: usize,
    ) -> Result<Self, EnvsError> {
        let kind = match &plan.remote {
            Some(remote) => {
                let token = match &remote.token_file {
                    Some(path) => Some(
                        std::fs::read_to_string(path)
                            .map_err(|e| {
                                EnvsError::Remote(format!(
                                    "reading the token file {}: {e}",
                                    path.display()
                                ))
                            })?
                            .trim()
                            .to_string(),
                    ),
                    None => None,
                };
                let config = ClientConfig {
                    token,
                    ..ClientConfig::default()
                };
                let pool = ServerPool::with_config(&remote.urls, config)
                    .map_err(|e| EnvsError::Remote(e.to_string()))?;
                Kind::Remote(pool)
            }
            None => {
                let mut config = SandboxConfig::new(worker);
                plan.sandbox.apply(&mut config);
                config.idle_workers = parallel.clamp(1, 8);
                let pool = SandboxPool::new(config)?;
                let mut services = Services::new(pool, bridge.sub_lm());
                services.config = plan.env.clone();
                if plan.env.llm.max_depth > 1 {
                    services.policy = Some(bridge.policy());
                }
                services.tokens = Arc::new(TokenizerCounter(tokenizer));
                Kind::Local(services)
            }
        };
        Ok(Self {
            kind,
            bridge: bridge.clone(),
        })
    }

    /// `n` fresh environments.
    pub fn make(&self, n: usize) -> Vec<Box<dyn Environment>> {
        (0..n)
            .map(|_| match &self.kind {
                Kind::Local(services) => {
                    Box::new(ReplEnv::new(services.clone())) as Box<dyn Environment>
                }
                Kind::Remote(pool) => {
                    Box::new(RemoteEnv::with_sub_lm(pool.clone(), self.bridge.sub_lm()))
                        as Box<dyn Environment>
                }
            })
            .collect()
    }

    /// The queue the environments' `llm()` calls go to.
    pub fn bridge(&self) -> &Bridge {
        &self.bridge
    }

    /// Whether episodes run on remote servers.
    pub fn is_remote(&self) -> bool {
        matches!(self.kind, Kind::Remote(_))
    }
}
