//! `cargo xtask eval`: the base model of a recipe, and optionally an adapter on it (or a fully
//! fine-tuned model in its place), on a split's tasks through the real environment (greedy):
//! accuracy, reward and its components, `llm()` calls, tool tokens and turns, per family.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use fathom_env::sandbox::WorkerCommand;
use fathom_model::{ModelBackend, Qwen2ForCausalLM};
use fathom_trainer::envs::EnvFactory;
use fathom_trainer::eval::{EvalReport, evaluate};
use fathom_trainer::policy::{end_of_turn, load_base};
use fathom_trainer::recipe::{Backend, Plan};
use fathom_trainer::rollout::{Bridge, Chat, RolloutSettings};
use fathom_trainer::train::tasks_of;

use crate::train::{default_base, load_plan};

/// Which tasks to evaluate on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SplitArg {
    /// The recipe's eval tasks.
    Eval,
    /// The recipe's held-out tasks.
    Heldout,
}

/// Arguments of `eval`.
#[derive(Args, Debug)]
pub struct EvalArgs {
    /// The recipe (RON); without it, the embedded default.
    #[arg(long, value_name = "FILE")]
    recipe: Option<PathBuf>,
    /// A PEFT adapter to evaluate on the recipe's base, beside the base alone; or the model
    /// directory a `tuning: Full` run writes (`<out>/model`: config.json, model.safetensors),
    /// evaluated in the base's place.
    #[arg(long, value_name = "DIR")]
    adapter: Option<PathBuf>,
    /// The split.
    #[arg(long, value_enum, default_value = "heldout")]
    split: SplitArg,
    /// Print the reports as JSON instead of tables.
    #[arg(long)]
    json: bool,
}

/// Runs `eval`.
pub fn run(args: EvalArgs) -> Result<()> {
    let plan = load_plan(args.recipe.as_deref())?;
    crate::infer::device::check_recipe(plan.device.backend)
        .with_context(|| format!("{}: device.backend", plan.origin))?;
    match plan.device.backend {
        Backend::Cpu => run_on::<fathom_model::Cpu>(&args, &plan, &Default::default()),
        #[cfg(feature = "wgpu")]
        Backend::Wgpu => run_on::<fathom_model::Wgpu>(&args, &plan, &Default::default()),
        #[cfg(feature = "cuda")]
        Backend::Cuda => run_on::<fathom_model::Cuda>(
            &args,
            &plan,
            &burn::backend::cuda::CudaDevice::new(plan.device.index),
        ),
        #[allow(unreachable_patterns)]
        other => bail!("device.backend {other:?} is not compiled into this binary"),
    }
}

fn run_on<B: ModelBackend>(args: &EvalArgs, plan: &Plan, device: &B::Device) -> Result<()> {
    let base_dir = default_base(plan)?;
    let (base, tokenizer, name) = load_base::<B>(plan, base_dir.as_deref(), device)?;
    let eot = end_of_turn(&tokenizer)?;
    let tokenizer = Arc::new(tokenizer);
    let (split, indices) = match args.split {
        SplitArg::Eval => (plan.data.eval.split, &plan.eval_tasks),
        SplitArg::Heldout => (plan.data.heldout.split, &plan.heldout_tasks),
    };
    let tasks = tasks_of(plan, split, indices)?;
    let bridge = Bridge::new();
    let parallel = plan.grpo.prompts_per_step * plan.grpo.group_size;
    let factory = EnvFactory::new(
        plan,
        WorkerCommand::CurrentExe,
        tokenizer.clone(),
        &bridge,
        parallel,
    )?;
    let chat = Chat::new(&tokenizer, eot);
    let settings = RolloutSettings {
        sampling: fathom_model::Sampling::Greedy,
        max_turn_tokens: plan.grpo.max_new_tokens,
        max_episode_tokens: plan.grpo.max_episode_tokens,
        sub_call_tokens: plan.grpo.max_new_tokens,
        seed: plan.seeds.sampling,
    };
    let run = |label: &str, model: &Qwen2ForCausalLM<B>| -> Result<EvalReport> {
        let bar = fathom_trainer::metrics::progress::bar(tasks.len() as u64, label, !args.json);
        let (report, _, _) = evaluate(
            model,
            &chat,
            &factory,
            &tasks,
            &plan.rewards,
            &settings,
            parallel,
            device,
            &mut |n| bar.set_position(n as u64),
        )?;
        bar.finish_and_clear();
        Ok(report)
    };
    let mut reports = vec![("base".to_string(), run("base", &base)?)];
    if let Some(dir) = &args.adapter {
        let full = !dir.join("adapter_config.json").is_file() && dir.join("config.json").is_file();
        let adapted = if full {
            let options = fathom_model::LoadOptions {
                quantize_nf4: false,
            };
            Qwen2ForCausalLM::load(dir, device, options)
                .with_context(|| format!("loading the fine-tuned model from {}", dir.display()))?
        } else {
            base.load_adapter(dir, device)
                .with_context(|| format!("loading the adapter from {}", dir.display()))?
        };
        reports.push((
            format!("adapter {}", dir.display()),
            run("adapter", &adapted)?,
        ));
    }
    if args.json {
        let out: serde_json::Map<String, serde_json::Value> = reports
            .iter()
            .map(|(k, r)| {
                (
                    k.clone(),
                    serde_json::to_value(r).expect("a report serialises"),
                )
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} on {} {:?} tasks ({name})",
        plan.origin,
        tasks.len(),
        split
    );
    for (label, r) in &reports {
        println!("\n{label}");
        println!(
            "  {:<10} {:>5} {:>9} {:>8} {:>7} {:>8} {:>6}",
            "family", "n", "accuracy", "reward", "llm()", "tool tok", "turns"
        );
        let mut rows: Vec<(&str, &fathom_trainer::eval::Summary)> =
            r.families.iter().map(|(k, v)| (k.as_str(), v)).collect();
        rows.push(("all", &r.overall));
        for (f, s) in rows {
            println!(
                "  {f:<10} {:>5} {:>9.3} {:>8.3} {:>7.2} {:>8.0} {:>6.2}",
                s.episodes, s.accuracy, s.reward, s.llm_calls, s.tool_tokens, s.turns
            );
        }
        let comps: Vec<String> = r
            .overall
            .components
            .iter()
            .map(|(k, v)| format!("{k} {v:.3}"))
            .collect();
        println!("  components: {}", comps.join(", "));
    }
    Ok(())
}
