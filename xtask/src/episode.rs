//! `cargo xtask episode`: run one episode of a split's task with a policy and print the
//! trajectory, as JSON (`--json`, exactly one serialized `Trajectory`) or as a transcript.

use std::sync::Arc;

use anyhow::Context;
use fathom_env::env::{EnvConfig, Environment, ReplEnv, ResetRequest, Services};
use fathom_env::expert::{Expert, PassageReader};
use fathom_env::policy::{Policy, run_episode};
use fathom_env::sandbox::{SandboxConfig, SandboxPool, WorkerCommand};
use fathom_env::tasks;
use fathom_rewards::record::{Role, Trajectory};

/// Which policy writes the turns.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum PolicyKind {
    /// The scripted expert (with the scripted passage reader as `llm()`).
    Expert,
}

/// Arguments of `xtask episode`.
#[derive(clap::Args)]
pub struct EpisodeArgs {
    /// The split: train, eval or heldout.
    #[arg(long)]
    split: String,
    /// The task's index in the split.
    #[arg(long)]
    index: usize,
    /// The policy.
    #[arg(long, value_enum)]
    policy: PolicyKind,
    /// Print exactly one JSON trajectory instead of a transcript.
    #[arg(long)]
    json: bool,
}

/// Runs the episode and prints it.
pub fn run(args: EpisodeArgs, worker: WorkerCommand) -> anyhow::Result<()> {
    let split = tasks::parse_split(&args.split)?;
    let config = EnvConfig::default();
    let task = tasks::split_task(split, args.index, &config.tasks)?;
    let mut sandbox = SandboxConfig::new(worker);
    sandbox.idle_workers = 0;
    let pool = SandboxPool::new(sandbox).context("cannot start the sandbox")?;
    let (policy, sub_lm): (&dyn Policy, _) = match args.policy {
        PolicyKind::Expert => (&Expert, Arc::new(PassageReader)),
    };
    let mut services = Services::new(pool, sub_lm);
    services.config = config;
    let mut env = ReplEnv::new(services);
    let trajectory = run_episode(&mut env, policy, ResetRequest::Task(Box::new(task.clone())))
        .with_context(|| format!("episode on {} failed", task.id))?;
    debug_assert!(env.trajectory().is_ok());
    if args.json {
        println!("{}", serde_json::to_string(&trajectory)?);
    } else {
        print_transcript(&trajectory, &task.answer);
    }
    Ok(())
}

fn print_transcript(t: &Trajectory, gold: &str) {
    for m in t.messages.iter().skip(1) {
        let who = match m.role {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        };
        println!("── {who} ──\n{}\n", m.content);
    }
    let llm: usize = t.llm_call_count();
    println!(
        "── end: {:?} after {} turns, {} llm() calls, {} tool tokens, {:.1} ms; gold answer: {gold}",
        t.end_reason,
        t.steps.len(),
        llm,
        t.tool_tokens(),
        t.elapsed_ms
    );
}
