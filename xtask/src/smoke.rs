//! `cargo xtask smoke`: one SFT step and one GRPO step end to end on the tiny recipe's model,
//! through the real environment, with each check recorded in `SMOKE_RESULT.md`: the model
//! loads and the environment resets; a multi-turn rollout completes with finite rewards; the
//! loss is finite and the LoRA weights changed; a checkpoint round-trips.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use burn::module::AutodiffModule;
use clap::Args;
use fathom_env::env::ResetRequest;
use fathom_env::sandbox::WorkerCommand;
use fathom_model::Cpu;
use fathom_rewards::record::Split;
use fathom_trainer::checkpoint::{self, Stage};
use fathom_trainer::envs::EnvFactory;
use fathom_trainer::eval::score_episode;
use fathom_trainer::metrics::read_log;
use fathom_trainer::policy::load_policy;
use fathom_trainer::recipe::Plan;
use fathom_trainer::rollout::{Bridge, Chat, EpisodeSpec, RolloutSettings, rollout};
use fathom_trainer::train::{Evaluations, RunOptions, run, strip, tasks_of};

/// The recipe the smoke test runs (`recipes/tiny.ron`), embedded.
const TINY: &str = include_str!("../../recipes/tiny.ron");

/// Arguments of `smoke`.
#[derive(Args, Debug)]
pub struct SmokeArgs {
    /// Where to write `SMOKE_RESULT.md` and the run's files.
    #[arg(long, value_name = "DIR", default_value = "runs/smoke")]
    out: PathBuf,
}

type Ad = burn::backend::Autodiff<Cpu>;

struct Checks {
    rows: Vec<(String, bool, String)>,
}

impl Checks {
    fn record(&mut self, name: &str, result: Result<String>) -> bool {
        let (ok, detail) = match result {
            Ok(d) => (true, d),
            Err(e) => (false, format!("{e:#}")),
        };
        eprintln!("[{}] {name}: {detail}", if ok { "pass" } else { "FAIL" });
        self.rows.push((name.to_string(), ok, detail));
        ok
    }
}

/// Runs `smoke`.
pub fn run_cmd(args: SmokeArgs) -> Result<()> {
    if args.out.exists() {
        std::fs::remove_dir_all(&args.out)
            .with_context(|| format!("clearing {}", args.out.display()))?;
    }
    std::fs::create_dir_all(&args.out)?;
    let mut plan = Plan::from_text(TINY, "recipes/tiny.ron")?;
    plan.grpo.steps = 1;
    plan.checkpoints.every = 1;
    if let Some(sft) = &mut plan.sft {
        sft.steps = 1;
    }
    let mut checks = Checks { rows: Vec::new() };
    let device = Default::default();

    // 1. The model loads and the environment resets.
    let loaded = load_policy::<Ad>(&plan, None, &device);
    let ok = checks.record(
        "the model loads and the environment resets",
        (|| {
            let policy = loaded.as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
            let bridge = Bridge::new();
            let tokenizer = Arc::new(policy.tokenizer.clone());
            let factory = EnvFactory::new(&plan, WorkerCommand::CurrentExe, tokenizer, &bridge, 1)?;
            let mut env = factory.make(1).pop().expect("one environment");
            let obs = env.reset(ResetRequest::Split {
                split: Split::Train,
                index: plan.train_tasks[0],
            })?;
            env.abort("smoke test")?;
            Ok(format!(
                "{} weights ({}); reset gave {} messages",
                policy.model.num_weights(),
                policy.base,
                obs.messages.len()
            ))
        })(),
    );
    if !ok {
        return finish(&args.out, &checks);
    }
    let policy = loaded.expect("checked above");

    // 2. A multi-turn rollout completes and its rewards are finite.
    checks.record(
        "a multi-turn rollout completes and its rewards are finite",
        (|| {
            let bridge = Bridge::new();
            let tokenizer = Arc::new(policy.tokenizer.clone());
            let g = plan.grpo.group_size;
            let factory = EnvFactory::new(
                &plan,
                WorkerCommand::CurrentExe,
                tokenizer.clone(),
                &bridge,
                g,
            )?;
            let task = tasks_of(&plan, plan.data.train.split, &plan.train_tasks[..1])?.remove(0);
            let specs: Vec<EpisodeSpec> = (0..g)
                .map(|k| EpisodeSpec {
                    reset: ResetRequest::Task(Box::new(task.clone())),
                    group: 0,
                    stream: k as u64,
                })
                .collect();
            let settings = RolloutSettings {
                sampling: plan.sampling,
                max_turn_tokens: plan.grpo.max_new_tokens,
                max_episode_tokens: plan.grpo.max_episode_tokens,
                sub_call_tokens: plan.grpo.max_new_tokens,
                seed: 1,
            };
            let chat = Chat::new(&tokenizer, policy.end_of_turn);
            let mut envs = factory.make(g);
            let (outs, stats) = rollout(
                &policy.model.valid(),
                &chat,
                &mut envs,
                &specs,
                &settings,
                &bridge,
                &device,
            )?;
            let mut detail = Vec::new();
            for o in &outs {
                let e = score_episode(
                    &plan.rewards,
                    &task,
                    &o.trajectory,
                    o.turns,
                    o.generated_tokens,
                );
                if !e.reward.is_finite() {
                    bail!("reward {} is not finite", e.reward);
                }
                if o.turns < 2 {
                    bail!("an episode took {} turn(s) ({})", o.turns, e.end);
                }
                detail.push(format!("{} turns, reward {:.3}", o.turns, e.reward));
            }
            Ok(format!(
                "{}; {} tokens sampled",
                detail.join("; "),
                stats.generated_tokens
            ))
        })(),
    );

    // 3. One SFT and one GRPO step: finite losses, changed adapter weights.
    let run_dir = args.out.join("run");
    let opts = RunOptions {
        out: run_dir.clone(),
        resume: false,
        default_base: None,
        worker: WorkerCommand::CurrentExe,
        progress: false,
        evaluations: Evaluations::default(),
        stop_after: None,
    };
    let summary = run::<Cpu>(&plan, &opts, &device);
    checks.record(
        "the loss is finite and the LoRA weights changed",
        (|| {
            let summary = summary.as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
            let records = read_log(&summary.metrics)?;
            let losses: Vec<String> = records
                .iter()
                .map(|r| format!("{:?} step {} loss {:.4}", r.stage, r.step, r.loss))
                .collect();
            if records.len() < 2 || records.iter().any(|r| !r.loss.is_finite()) {
                bail!("metrics: {losses:?}");
            }
            let before = adapter_values(&fresh_adapter(&plan, &args.out)?)?;
            let after = adapter_values(&summary.adapter)?;
            let changed = before
                .iter()
                .zip(&after)
                .filter(|(a, b)| a.1 != b.1)
                .count();
            if changed == 0 {
                bail!("no adapter tensor changed");
            }
            Ok(format!(
                "{}; {changed}/{} adapter tensors changed",
                losses.join(", "),
                after.len()
            ))
        })(),
    );

    // 4. A checkpoint round-trips.
    checks.record(
        "a checkpoint round-trips",
        (|| {
            let summary = summary.as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
            let dir = checkpoint::latest(&run_dir.join("checkpoints"), Stage::Grpo)?
                .context("no GRPO checkpoint was written")?;
            let base = strip(load_policy::<Ad>(&plan, None, &device)?.model);
            let optim = plan.grpo.optimizer.init();
            let loaded = checkpoint::load(&dir, base, optim, &device)?;
            let reloaded = args.out.join("reloaded-adapter");
            loaded.model.save_adapter(&reloaded, None)?;
            if adapter_values(&reloaded)? != adapter_values(&summary.adapter)? {
                bail!("the reloaded adapter differs from the final one");
            }
            Ok(format!(
                "{} restored at step {} (adapter identical to the final one)",
                dir.display(),
                loaded.state.step
            ))
        })(),
    );
    finish(&args.out, &checks)
}

/// The adapter a fresh policy starts with, saved under `out`.
fn fresh_adapter(plan: &Plan, out: &Path) -> Result<PathBuf> {
    let policy = load_policy::<Ad>(plan, None, &Default::default())?;
    let dir = out.join("initial-adapter");
    policy.model.save_adapter(&dir, None)?;
    Ok(dir)
}

/// Every tensor of an adapter as raw bytes, by name.
fn adapter_values(dir: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let ck = fathom_model::checkpoint::Checkpoint::open_files(
        dir,
        &[dir.join("adapter_model.safetensors")],
    )?;
    ck.names()
        .into_iter()
        .map(|n| {
            let raw = ck.raw(&n)?;
            Ok((n, raw.data.to_vec()))
        })
        .collect()
}

fn finish(out: &Path, checks: &Checks) -> Result<()> {
    let passed = checks.rows.iter().all(|r| r.1) && checks.rows.len() == 4;
    let mut md = String::new();
    let _ = writeln!(md, "# Smoke test\n");
    let _ = writeln!(
        md,
        "Verdict: **{}** — one SFT step and one GRPO step of `recipes/tiny.ron` on the CPU, \
         through the sandboxed environment.\n",
        if passed { "PASS" } else { "FAIL" }
    );
    let _ = writeln!(md, "| check | result | detail |\n| --- | --- | --- |");
    for (name, ok, detail) in &checks.rows {
        let _ = writeln!(
            md,
            "| {name} | {} | {} |",
            if *ok { "pass" } else { "FAIL" },
            detail.replace('|', "\\|").replace('\n', " ")
        );
    }
    let path = out.join("SMOKE_RESULT.md");
    std::fs::write(&path, md).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    if !passed {
        bail!("the smoke test failed (see {})", path.display());
    }
    Ok(())
}
