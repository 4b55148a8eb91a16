//! `cargo xtask serve`: run the environment as an OpenEnv-compatible server (see
//! `fathom_env::server` and the env README's "Server" section) until Ctrl-C or SIGTERM.
//!
//! ```text
//! cargo xtask serve [--host 127.0.0.1] [--port 8000] [--max-sessions 32] [--recipe FILE] …
//!                   [--token-file F] [--max-client-share 1.0]
//! ```
//!
//! With `--token-file F` (or `FATHOM_SERVE_TOKEN` in the environment) clients must send
//! `Authorization: Bearer <token>`; a non-loopback `--host` without one is warned about.
//!
//! No model is loaded: `llm()` calls are answered by the scripted passage reader (`--sub-lm
//! reader`, the default) or by a fixed notice (`--sub-lm none`), unless a WebSocket client
//! resets with `"llm": "client"` and answers them itself (as the trainer's `RemoteEnv` does).
//! Final steps are scored with the default rewards, or a recipe's `rewards` section. xtask is
//! its own sandbox worker.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use fathom_env::env::{EnvConfig, Services};
use fathom_env::expert::PassageReader;
use fathom_env::sandbox::{SandboxConfig, SandboxPool, WorkerCommand};
use fathom_env::server::{AccessToken, EnvServer, ServerConfig};
use fathom_env::sublm::{FixedSubLm, SubLm};
use fathom_rewards::{RewardRegistry, RewardsConfig, rewards_from_recipe};

/// What answers `llm()` calls of sessions that do not answer them themselves.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum SubLmKind {
    /// The scripted passage reader (answers "Question: …\n---\npassage" prompts).
    Reader,
    /// A fixed notice that no model is connected.
    None,
}

/// What `llm()` returns with `--sub-lm none`.
const NO_MODEL: &str = "[llm() is not connected to a model on this server]";

/// Arguments of `xtask serve`.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Sessions open at once (WebSocket and HTTP); more are refused with CAPACITY_REACHED.
    #[arg(long, default_value_t = 32)]
    max_sessions: usize,
    /// Largest request body or WebSocket message, in MiB.
    #[arg(long, default_value_t = 16)]
    max_body_mb: usize,
    /// Seconds a session may stay unused before it is ended.
    #[arg(long, default_value_t = 300)]
    idle_timeout_s: u64,
    /// Seconds a reset or step may take, llm() calls included, before the session is ended.
    #[arg(long, default_value_t = 120)]
    step_timeout_s: u64,
    /// Seconds a client-mode session waits for the client to answer one llm() call.
    #[arg(long, default_value_t = 60)]
    llm_timeout_s: u64,
    /// Wall-clock limit of one REPL cell, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    cell_timeout_ms: u64,
    /// Address-space limit of each sandbox worker, in MiB.
    #[arg(long, default_value_t = 1024)]
    memory_mb: u64,
    /// Sandbox workers kept started ahead of demand.
    #[arg(long, default_value_t = 4)]
    idle_workers: usize,
    /// Assistant turns per episode.
    #[arg(long, default_value_t = 12)]
    max_turns: usize,
    /// What answers llm() for sessions in server mode.
    #[arg(long, value_enum, default_value_t = SubLmKind::Reader)]
    sub_lm: SubLmKind,
    /// A recipe whose top-level `rewards` field configures the reward (default: DESIGN §5).
    #[arg(long)]
    recipe: Option<std::path::PathBuf>,
    /// A file holding the access token clients must send as `Authorization: Bearer <token>`
    /// (surrounding whitespace ignored). Or set FATHOM_SERVE_TOKEN; not both.
    #[arg(long)]
    token_file: Option<std::path::PathBuf>,
    /// The share of --max-sessions one client address may hold, in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    max_client_share: f64,
}

/// The environment variable that may hold the access token.
const TOKEN_VAR: &str = "FATHOM_SERVE_TOKEN";

/// The access token from `--token-file` or `FATHOM_SERVE_TOKEN`, if either is given.
fn read_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<AccessToken>> {
    let var = std::env::var(TOKEN_VAR).ok().filter(|v| !v.is_empty());
    let (text, source) = match (file, var) {
        (Some(_), Some(_)) => {
            bail!("give the token one way: --token-file or {TOKEN_VAR}, not both")
        }
        (Some(path), None) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the token file {}", path.display()))?;
            (text, path.display().to_string())
        }
        (None, Some(text)) => (text, TOKEN_VAR.to_string()),
        (None, None) => return Ok(None),
    };
    let token = AccessToken::new(&text).with_context(|| format!("the access token in {source}"))?;
    Ok(Some(token))
}

/// Starts the server and blocks until it is stopped.
pub fn run(args: ServeArgs, worker: WorkerCommand) -> anyhow::Result<()> {
    for (name, zero) in [
        ("--max-sessions", args.max_sessions == 0),
        ("--max-body-mb", args.max_body_mb == 0),
        ("--idle-timeout-s", args.idle_timeout_s == 0),
        ("--step-timeout-s", args.step_timeout_s == 0),
        ("--llm-timeout-s", args.llm_timeout_s == 0),
        ("--cell-timeout-ms", args.cell_timeout_ms == 0),
        ("--max-turns", args.max_turns == 0),
    ] {
        if zero {
            bail!("{name} must be positive");
        }
    }
    if !(args.max_client_share > 0.0 && args.max_client_share <= 1.0) {
        bail!("--max-client-share must be in (0, 1]");
    }
    let token = read_token(args.token_file.as_deref())?;
    if args.memory_mb < 64 {
        bail!("--memory-mb must be at least 64 (the interpreter needs that much)");
    }
    let mut registry = RewardRegistry::new();
    fathom_examples::register(&mut registry).context("registering the example rewards")?;
    let rewards = match &args.recipe {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            rewards_from_recipe(&text).with_context(|| format!("reading {}", path.display()))?
        }
        None => RewardsConfig::default(),
    };
    let composite = rewards.build(&registry).context("validating the rewards")?;

    let mut sandbox = SandboxConfig::new(worker);
    sandbox.idle_workers = args.idle_workers;
    sandbox.step_timeout = Duration::from_millis(args.cell_timeout_ms);
    sandbox.limits.memory_bytes = args.memory_mb << 20;
    let pool = SandboxPool::new(sandbox).context("cannot start the sandbox")?;
    let sub_lm: Arc<dyn SubLm> = match args.sub_lm {
        SubLmKind::Reader => Arc::new(PassageReader),
        SubLmKind::None => Arc::new(FixedSubLm(NO_MODEL.into())),
    };
    let mut services = Services::new(pool, sub_lm);
    services.config = EnvConfig {
        max_turns: args.max_turns,
        ..EnvConfig::default()
    };
    let config = ServerConfig {
        max_sessions: args.max_sessions,
        max_body_bytes: args.max_body_mb << 20,
        idle_timeout: Duration::from_secs(args.idle_timeout_s),
        step_timeout: Duration::from_secs(args.step_timeout_s),
        llm_timeout: Duration::from_secs(args.llm_timeout_s),
        max_client_share: args.max_client_share,
        token,
        ..ServerConfig::default()
    };
    let addr = SocketAddr::new(args.host, args.port);
    let server = EnvServer::new(services, composite, config)?;
    server
        .run(addr)
        .with_context(|| format!("serving on {addr}"))?;
    Ok(())
}
