//! `cargo xtask repl`: run one code file in a fresh sandboxed session over a context file and
//! print `{"stdout", "stderr", "error", "elapsed_ms", "llm_calls"}`. It exits 0 whenever the
//! sandbox contained the code, whatever the code did; only a sandbox that cannot start is an
//! error. No model is loaded, so `llm()` answers with a fixed notice (calls are counted).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use fathom_env::sandbox::{SandboxConfig, SandboxPool, WorkerCommand};

/// What `llm()` returns under `xtask repl`.
const NO_MODEL: &str = "[llm() is not connected to a model in `xtask repl`]";

/// Arguments of `xtask repl`.
#[derive(clap::Args)]
pub struct ReplArgs {
    /// The document, bound to `context`.
    #[arg(long)]
    context: PathBuf,
    /// The Python code to run.
    #[arg(long)]
    code: PathBuf,
    /// Wall-clock limit in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    timeout_ms: u64,
    /// Address-space limit in MiB.
    #[arg(long, default_value_t = 1024)]
    memory_mb: u64,
}

/// Runs the code and prints the JSON result.
pub fn run(args: ReplArgs, worker: WorkerCommand) -> anyhow::Result<()> {
    if args.timeout_ms == 0 {
        bail!("--timeout-ms must be positive");
    }
    if args.memory_mb < 64 {
        bail!("--memory-mb must be at least 64 (the interpreter needs that much)");
    }
    let context = std::fs::read_to_string(&args.context)
        .with_context(|| format!("cannot read the context file {}", args.context.display()))?;
    let code = std::fs::read_to_string(&args.code)
        .with_context(|| format!("cannot read the code file {}", args.code.display()))?;
    let mut config = SandboxConfig::new(worker);
    config.idle_workers = 0;
    config.max_restarts = 0;
    config.step_timeout = Duration::from_millis(args.timeout_ms);
    config.limits.memory_bytes = args.memory_mb << 20;
    let pool = SandboxPool::new(config).context("cannot start the sandbox")?;
    let mut session = pool
        .session(context)
        .context("cannot start a sandbox session")?;
    let mut llm_calls = 0usize;
    let cell = session
        .exec(&code, &mut |_| {
            llm_calls += 1;
            NO_MODEL.to_string()
        })
        .context("the sandbox failed")?;
    let out = serde_json::json!({
        "stdout": cell.output.stdout,
        "stderr": cell.output.stderr,
        "error": cell.output.error,
        "elapsed_ms": cell.output.elapsed_ms,
        "llm_calls": llm_calls,
    });
    println!("{out}");
    Ok(())
}
