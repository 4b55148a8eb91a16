//! The training run, top to bottom: load the policy, evaluate the base, SFT warm-start on
//! expert traces, GRPO through the real multi-turn environment, evaluate again, save the
//! adapter. Each GRPO step reads: sample prompts → rollouts → rewards → advantages (RAPO:
//! replay, drop flat groups) → learner log-probabilities → loss → backward → clip → AdamW →
//! metrics → checkpoint.
//!
//! Checkpoints are written every `checkpoints.every` steps and at the end of each stage;
//! a resumed run (the newest complete checkpoint under `<out>/checkpoints`) restores the
//! adapter, the optimiser, the trainer's generator, the data cursor and RAPO's state, and cuts
//! `metrics.jsonl` back to the checkpoint, so it continues exactly as the uninterrupted run
//! would have (timings aside). Every random choice is derived from the recipe's seeds and the
//! step: prompt order from the trainer's generator, token sampling from streams keyed by step
//! and episode.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use fathom_env::env::{EnvConfig, ReplEnv, ResetRequest, Services};
use fathom_env::expert::PassageReader;
use fathom_env::sandbox::{SandboxConfig, SandboxPool, WorkerCommand};
use fathom_model::{
    ModelBackend, Qwen2ForCausalLM, SequenceLogprobs, SharedPacking, Tokenizer, TrainPass,
};
use fathom_rewards::record::{Task, Trajectory};
use rand::seq::SliceRandom;

use crate::checkpoint::{
    self, AdamWOptimizer, DataCursor, RngState, Stage, TrainRng, TrainerState,
};
use crate::envs::EnvFactory;
use crate::eval::{EvalReport, evaluate, score_episode};
use crate::grpo::{LossBatch, Sample, group_advantages, host_batch, policy_loss};
use crate::metrics::progress::{bar, step_message};
use crate::metrics::{
    MetricsLog, RolloutMetrics, StepMetrics, StepTime, plot::plot_stage, read_log,
};
use crate::policy::load_policy;
use crate::rapo::{RapoState, drop_flat_groups};
use crate::recipe::{LearnerSection, Plan};
use crate::rollout::{Chat, EpisodeSpec, RolloutSettings, rollout};
use crate::sft::{chat_messages, generate_traces, render};

/// Why a run stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The policy could not be built.
    #[error(transparent)]
    Policy(#[from] crate::policy::PolicyError),
    /// The environments could not be built.
    #[error(transparent)]
    Envs(#[from] crate::envs::EnvsError),
    /// A task could not be generated.
    #[error("task: {0}")]
    Task(#[from] fathom_env::tasks::TaskError),
    /// The sandbox failed.
    #[error("sandbox: {0}")]
    Sandbox(#[from] fathom_env::sandbox::SandboxError),
    /// A rollout failed.
    #[error(transparent)]
    Rollout(#[from] crate::rollout::RolloutError),
    /// SFT data failed.
    #[error(transparent)]
    Sft(#[from] crate::sft::SftError),
    /// The GRPO batch was inconsistent.
    #[error(transparent)]
    Grpo(#[from] crate::grpo::GrpoError),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] fathom_model::ModelError),
    /// A checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// Metrics or plots failed.
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    /// Writing an output failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Nothing can be trained on.
    #[error("{0}")]
    NoData(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Which evaluations a run makes (all on the held-out tasks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Evaluations {
    /// The model before any training: the base, or the base with `model.adapter` (labelled
    /// `start`).
    pub base: bool,
    /// After the SFT warm-start.
    pub sft: bool,
    /// After GRPO.
    pub grpo: bool,
}

/// How to run a plan.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The run's directory (metrics, plots, checkpoints, adapter, report).
    pub out: PathBuf,
    /// Continue from the newest checkpoint under `<out>/checkpoints`, if there is one.
    pub resume: bool,
    /// The default base's directory, for recipes that use it.
    pub default_base: Option<PathBuf>,
    /// How sandbox workers are started.
    pub worker: WorkerCommand,
    /// Show progress bars.
    pub progress: bool,
    /// Evaluations on the held-out tasks.
    pub evaluations: Evaluations,
    /// Stop (as if interrupted) after this step of this stage; for tests of resuming.
    pub stop_after: Option<(Stage, u64)>,
}

/// One evaluation of a run.
#[derive(Clone, Debug)]
pub struct StageEval {
    /// `base` (or `start` with a starting adapter), `sft` or `grpo`.
    pub label: String,
    /// The scores.
    pub report: EvalReport,
    /// The episodes (in task order; `None` where one failed).
    pub trajectories: Vec<Option<Trajectory>>,
}

/// What a run produced.
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// The run's directory.
    pub out: PathBuf,
    /// The final adapter (PEFT format), or under full fine-tuning the whole model (a Hugging
    /// Face directory, `model/`).
    pub adapter: PathBuf,
    /// `metrics.jsonl`.
    pub metrics: PathBuf,
    /// SFT steps done (over the whole run, resumed or not).
    pub sft_steps: u64,
    /// GRPO steps done.
    pub grpo_steps: u64,
    /// Whether the run stopped early at [`RunOptions::stop_after`].
    pub interrupted: bool,
    /// Evaluations made by this invocation.
    pub evals: Vec<StageEval>,
    /// Where the base came from.
    pub base: String,
}

type Ad<B> = Autodiff<B>;

/// Everything the stages share.
struct Run<'a, B: ModelBackend> {
    plan: &'a Plan,
    opts: &'a RunOptions,
    device: &'a B::Device,
    tokenizer: Arc<Tokenizer>,
    end_of_turn: u32,
    factory: EnvFactory,
    metrics: Option<MetricsLog>,
    ckpt_root: PathBuf,
    /// Under full fine-tuning with a KL term: the base as loaded, before any step (with LoRA
    /// the reference is the model without its adapters).
    full_reference: Option<Qwen2ForCausalLM<B>>,
}

/// Runs `plan` to its end (or to `opts.stop_after`).
pub fn run<B: ModelBackend>(
    plan: &Plan,
    opts: &RunOptions,
    device: &B::Device,
) -> Result<RunSummary, TrainError> {
    std::fs::create_dir_all(&opts.out).map_err(io(&opts.out))?;
    let policy = load_policy::<Ad<B>>(plan, opts.default_base.as_deref(), device)?;
    let mut model = policy.model;
    let full = matches!(plan.model.tuning, crate::recipe::Tuning::Full);
    let full_reference = (full && plan.grpo.loss.beta > 0.0).then(|| model.valid());
    let tokenizer = Arc::new(policy.tokenizer);
    let bridge = crate::rollout::Bridge::new();
    let parallel = plan.grpo.prompts_per_step * plan.grpo.group_size;
    let factory = EnvFactory::new(
        plan,
        opts.worker.clone(),
        tokenizer.clone(),
        &bridge,
        parallel,
    )?;
    let mut run = Run::<B> {
        plan,
        opts,
        device,
        tokenizer,
        end_of_turn: policy.end_of_turn,
        factory,
        metrics: None,
        ckpt_root: opts.out.join("checkpoints"),
        full_reference,
    };
    let metrics_path = opts.out.join("metrics.jsonl");
    let resume_grpo = if opts.resume {
        checkpoint::latest(&run.ckpt_root, Stage::Grpo)?
    } else {
        None
    };
    let resume_sft = if opts.resume && resume_grpo.is_none() {
        checkpoint::latest(&run.ckpt_root, Stage::Sft)?
    } else {
        None
    };
    let mut summary = RunSummary {
        out: opts.out.clone(),
        adapter: opts.out.join(if full { "model" } else { "adapter" }),
        metrics: metrics_path.clone(),
        sft_steps: 0,
        grpo_steps: 0,
        interrupted: false,
        evals: Vec::new(),
        base: policy.base,
    };
    let heldout = tasks_of(plan, plan.data.heldout.split, &plan.heldout_tasks)?;
    let fresh = resume_grpo.is_none() && resume_sft.is_none();
    run.metrics = Some(if fresh {
        MetricsLog::create(&metrics_path)?
    } else {
        let (stage, dir) = match (&resume_grpo, &resume_sft) {
            (Some(d), _) => (Stage::Grpo, d),
            (_, Some(d)) => (Stage::Sft, d),
            _ => unreachable!("not fresh"),
        };
        let step = checkpoint_step(dir)?;
        MetricsLog::resume(&metrics_path, stage, step)?
    });
    if fresh && opts.evaluations.base {
        // With a starting adapter (`model.adapter`) the first evaluation is of that adapter.
        let label = if plan.model.adapter.is_some() {
            "start"
        } else {
            "base"
        };
        summary.evals.push(run.evaluate(label, &model, &heldout)?);
    }

    // Stage 1: SFT warm-start.
    if let Some(sft) = &plan.sft
        && resume_grpo.is_none()
    {
        let (m, steps, stopped) = run.sft(model, sft, resume_sft.as_deref())?;
        model = m;
        summary.sft_steps = steps;
        if stopped {
            summary.interrupted = true;
            return Ok(summary);
        }
        if opts.evaluations.sft {
            summary.evals.push(run.evaluate("sft", &model, &heldout)?);
        }
    }

    // Stage 2: GRPO.
    let (m, steps, stopped) = run.grpo(model, resume_grpo.as_deref())?;
    model = m;
    summary.grpo_steps = steps;
    if stopped {
        summary.interrupted = true;
        return Ok(summary);
    }
    if opts.evaluations.grpo {
        summary.evals.push(run.evaluate("grpo", &model, &heldout)?);
    }
    if full {
        let tokenizer =
            crate::policy::tokenizer_dir(&plan.model.source, opts.default_base.as_deref())?;
        save_full_model(&model, &tokenizer, &summary.adapter)?;
    } else {
        model
            .save_adapter(&summary.adapter, Some(&summary.base))
            .map_err(TrainError::Model)?;
    }
    run.plot_all()?;
    Ok(summary)
}

/// Writes a fully fine-tuned model as a Hugging Face directory (`config.json`,
/// `model.safetensors` in f32, and the tokenizer's files from `tokenizer_dir`), which `infer`,
/// `eval` and recipes load like any base.
pub fn save_full_model<B: ModelBackend>(
    model: &Qwen2ForCausalLM<Ad<B>>,
    tokenizer_dir: &Path,
    dir: &Path,
) -> Result<(), TrainError> {
    model
        .save_pretrained(dir, fathom_model::save::SaveDtype::F32)
        .map_err(TrainError::Model)?;
    for name in TOKENIZER_FILES {
        let from = tokenizer_dir.join(name);
        if from.is_file() {
            std::fs::copy(&from, dir.join(name)).map_err(io(&from))?;
        }
    }
    Ok(())
}

/// The files of a Hugging Face tokenizer directory a saved model carries along.
const TOKENIZER_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
];

/// The step a checkpoint directory holds.
fn checkpoint_step(dir: &Path) -> Result<u64, TrainError> {
    let text = std::fs::read_to_string(dir.join("state.json")).map_err(io(dir))?;
    let state: TrainerState =
        serde_json::from_str(&text).map_err(|e| checkpoint::CheckpointError::Invalid {
            dir: dir.to_path_buf(),
            message: format!("state.json: {e}"),
        })?;
    Ok(state.step)
}

/// The tasks at `indices` of `split`.
pub fn tasks_of(
    plan: &Plan,
    split: fathom_rewards::record::Split,
    indices: &[usize],
) -> Result<Vec<Task>, TrainError> {
    indices
        .iter()
        .map(|&i| Ok(fathom_env::tasks::split_task(split, i, &plan.env.tasks)?))
        .collect()
}

/// The packed entries of `out` laid out as the padded `[rows, cols]` batch (zeros where a row
/// is shorter), as `grpo::host_batch` and `sft::sft_batch` align them.
fn padded<B: burn::tensor::backend::Backend>(
    values: Tensor<B, 1>,
    offsets: &[usize],
    cols: usize,
) -> Tensor<B, 2> {
    let rows = offsets.len() - 1;
    let total = offsets[rows] as i64;
    let mut index = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let n = offsets[r + 1] - offsets[r];
        index.extend((0..cols).map(|c| {
            if c < n {
                (offsets[r] + c) as i64
            } else {
                total
            }
        }));
    }
    let device = values.device();
    let extended = Tensor::cat(vec![values, Tensor::zeros([1], &device)], 0);
    let index = Tensor::<B, 1, Int>::from_data(TensorData::new(index, [rows * cols]), &device);
    extended.select(0, index).reshape([rows, cols])
}

fn pass(learner: &LearnerSection, temperature: f64) -> TrainPass {
    TrainPass {
        checkpointing: learner.activation_checkpointing,
        chunk: learner.logprob_chunk,
        temperature,
        share_prefix: learner.share_prefix,
    }
}

impl<B: ModelBackend> Run<'_, B> {
    fn chat(&self) -> Chat<'_> {
        Chat::new(&self.tokenizer, self.end_of_turn)
    }

    fn rollout_settings(&self, greedy: bool, seed: u64) -> RolloutSettings {
        let g = &self.plan.grpo;
        RolloutSettings {
            sampling: if greedy {
                fathom_model::Sampling::Greedy
            } else {
                self.plan.sampling
            },
            max_turn_tokens: g.max_new_tokens,
            max_episode_tokens: g.max_episode_tokens,
            sub_call_tokens: g.max_new_tokens,
            seed,
        }
    }

    fn log(&mut self, m: &StepMetrics, every: usize) -> Result<(), TrainError> {
        if (m.step as usize).is_multiple_of(every.max(1))
            && let Some(log) = &mut self.metrics
        {
            log.append(m)?;
        }
        Ok(())
    }

    fn plot_all(&self) -> Result<(), TrainError> {
        let records = read_log(&self.opts.out.join("metrics.jsonl"))?;
        let dir = self.opts.out.join("plots");
        for (stage, prefix) in [(Stage::Sft, "sft_"), (Stage::Grpo, "grpo_")] {
            if records.iter().any(|r| r.stage == stage) {
                plot_stage(&records, stage, &dir, prefix)?;
            }
        }
        Ok(())
    }

    /// Greedy evaluation of `model` on `tasks`.
    fn evaluate(
        &self,
        label: &str,
        model: &Qwen2ForCausalLM<Ad<B>>,
        tasks: &[Task],
    ) -> Result<StageEval, TrainError> {
        let inner = model.valid();
        let chat = self.chat();
        let settings = self.rollout_settings(true, self.plan.seeds.sampling);
        let progress = bar(
            tasks.len() as u64,
            &format!("eval {label}"),
            self.opts.progress,
        );
        let (report, trajectories, _) = evaluate(
            &inner,
            &chat,
            &self.factory,
            tasks,
            &self.plan.rewards,
            &settings,
            self.plan.grpo.prompts_per_step * self.plan.grpo.group_size,
            self.device,
            &mut |done| progress.set_position(done as u64),
        )?;
        progress.finish_and_clear();
        Ok(StageEval {
            label: label.into(),
            report,
            trajectories,
        })
    }

    /// The SFT warm-start; returns the model, the steps done and whether it stopped early.
    fn sft(
        &mut self,
        model: Qwen2ForCausalLM<Ad<B>>,
        sft: &crate::recipe::SftSection,
        resume: Option<&Path>,
    ) -> Result<(Qwen2ForCausalLM<Ad<B>>, u64, bool), TrainError> {
        let plan = self.plan;
        // Expert traces through the real environment (the expert's own passage reader answers
        // its llm() calls).
        let train = tasks_of(plan, plan.data.train.split, &plan.train_tasks)?;
        let mut config = SandboxConfig::new(self.opts.worker.clone());
        plan.sandbox.apply(&mut config);
        config.idle_workers = 1;
        let mut services = Services::new(SandboxPool::new(config)?, Arc::new(PassageReader));
        services.config = EnvConfig { ..plan.env.clone() };
        let mut expert_env = ReplEnv::new(services);
        let traces = generate_traces(
            &mut expert_env,
            &train,
            &plan.rewards,
            &sft.traces,
            plan.seeds.data,
        )?;
        let mut examples = Vec::new();
        for t in traces.iter().filter(|t| t.correct) {
            let ex = render(&self.tokenizer, &chat_messages(&t.messages))?;
            if ex.ids.len() <= sft.max_length && ex.target_count() > 0 {
                examples.push(ex);
            }
        }
        if examples.is_empty() {
            return Err(TrainError::NoData(format!(
                "no expert trace fits sft.max_length ({} tokens)",
                sft.max_length
            )));
        }
        let (mut model, mut optim, mut state, rng) =
            self.stage_start(Stage::Sft, 0x5f7, &sft.optimizer, model, resume)?;
        let progress = bar(sft.steps as u64, "sft", self.opts.progress);
        progress.set_position(state.step);
        let mut order = epoch_order(examples.len(), &rng, state.data.epoch);
        while (state.step as usize) < sft.steps {
            let started = Instant::now();
            let mut batch = Vec::with_capacity(sft.batch_size);
            while batch.len() < sft.batch_size {
                if state.data.position as usize >= order.len() {
                    state.data.epoch += 1;
                    state.data.position = 0;
                    order = epoch_order(examples.len(), &rng, state.data.epoch);
                }
                batch.push(&examples[order[state.data.position as usize]]);
                state.data.position += 1;
            }
            let total: usize = batch
                .iter()
                .map(|e| e.targets[1..].iter().filter(|t| **t).count())
                .sum();
            let (mut loss, mut grads) = (0f64, None::<GradientsParams>);
            let all: Vec<&[u32]> = batch.iter().map(|e| e.ids.as_slice()).collect();
            let l = &sft.learner;
            for part in passes(&all, l.pass_tokens, l.share_prefix) {
                let seqs = &all[part.clone()];
                let examples = &batch[part];
                let weights: Vec<f32> = examples
                    .iter()
                    .flat_map(|e| {
                        e.targets[1..]
                            .iter()
                            .map(|&t| if t { 1.0 / total.max(1) as f32 } else { 0.0 })
                    })
                    .collect();
                // Only the target tokens' log-probabilities are computed: the output head runs
                // on the assistant's positions alone, not on the prompt's and the observations'.
                let scored: Vec<&[bool]> = examples.iter().map(|e| e.targets.as_slice()).collect();
                let device = self.device.clone();
                let out = fathom_model::forward_backward_scored(
                    &model,
                    seqs,
                    &scored,
                    pass(&sft.learner, 1.0),
                    self.device,
                    |lp: &SequenceLogprobs<Ad<B>>| {
                        let n = weights.len();
                        let w = Tensor::<Ad<B>, 1>::from_data(
                            TensorData::new(weights.clone(), [n]),
                            &device,
                        );
                        ((lp.logprobs.clone() * w).sum().neg(), ())
                    },
                )?;
                loss += out.loss as f64;
                grads = Some(accumulate(&model, grads, out.grads));
            }
            let mut grads = grads.expect("a batch of at least one example has a pass");
            let clipping =
                crate::optim::clip_global_norm(&model, &mut grads, sft.optimizer.grad_clip);
            let lr = sft
                .schedule
                .lr(sft.optimizer.lr, state.step as usize, sft.steps);
            model = optim.step(lr, model, grads);
            state.step += 1;
            let elapsed = started.elapsed().as_secs_f64();
            let m = StepMetrics {
                stage: Stage::Sft,
                step: state.step,
                loss,
                learning_rate: lr,
                grad_norm: clipping.norm,
                tokens_per_second: batch.iter().map(|e| e.ids.len()).sum::<usize>() as f64
                    / elapsed,
                time: StepTime {
                    generation_s: 0.0,
                    environment_s: 0.0,
                    learning_s: elapsed,
                },
                rollout: None,
            };
            self.log(&m, plan.output.metrics_every)?;
            progress.set_position(state.step);
            progress.set_message(step_message(&m));
            if self.end_step(sft.steps, &model, &optim, &mut state, &rng)? {
                return Ok((model, state.step, true));
            }
        }
        progress.finish_and_clear();
        Ok((model, state.step, false))
    }

    /// Where a stage starts: a fresh optimiser and state (the generator seeded by
    /// `seeds.data ^ salt`), or, resuming, the checkpoint in `resume`, which also replaces the
    /// model's trained weights.
    #[allow(clippy::type_complexity)]
    fn stage_start(
        &self,
        stage: Stage,
        salt: u64,
        optimizer: &crate::optim::AdamWSettings,
        model: Qwen2ForCausalLM<Ad<B>>,
        resume: Option<&Path>,
    ) -> Result<
        (
            Qwen2ForCausalLM<Ad<B>>,
            AdamWOptimizer<Ad<B>>,
            TrainerState,
            TrainRng,
        ),
        TrainError,
    > {
        let optim: AdamWOptimizer<Ad<B>> = optimizer.init();
        let (model, optim, state) = match resume {
            Some(dir) => {
                let loaded = checkpoint::load(dir, strip(model), optim, self.device)?;
                (loaded.model, loaded.optim, loaded.state)
            }
            None => {
                let state = TrainerState {
                    step: 0,
                    stage,
                    data: DataCursor::default(),
                    rng: RngState::capture(&checkpoint::train_rng(self.plan.seeds.data ^ salt)),
                    rapo: RapoState::default(),
                };
                (model, optim, state)
            }
        };
        let rng = state
            .rng
            .restore()
            .map_err(|message| checkpoint::CheckpointError::Invalid {
                dir: self.ckpt_root.clone(),
                message,
            })?;
        Ok((model, optim, state, rng))
    }

    /// The end of a step of `state.stage` (of `steps` in all): the generator's position goes
    /// into the state, a checkpoint is written when one is due (always after the last step),
    /// and the answer says whether the run stops here, as [`RunOptions::stop_after`] asks.
    fn end_step(
        &self,
        steps: usize,
        model: &Qwen2ForCausalLM<Ad<B>>,
        optim: &AdamWOptimizer<Ad<B>>,
        state: &mut TrainerState,
        rng: &TrainRng,
    ) -> Result<bool, TrainError> {
        state.rng = RngState::capture(rng);
        let last = state.step as usize == steps;
        if last || (state.step as usize).is_multiple_of(self.plan.checkpoints.every) {
            checkpoint::save(
                &self.ckpt_root,
                model,
                optim,
                state,
                &self.plan.text,
                self.plan.checkpoints.keep_last,
            )?;
        }
        Ok(self.opts.stop_after == Some((state.stage, state.step)) && !last)
    }

    /// GRPO; returns the model, the steps done and whether it stopped early.
    fn grpo(
        &mut self,
        model: Qwen2ForCausalLM<Ad<B>>,
        resume: Option<&Path>,
    ) -> Result<(Qwen2ForCausalLM<Ad<B>>, u64, bool), TrainError> {
        let plan = self.plan;
        let g = &plan.grpo;
        let train = tasks_of(plan, plan.data.train.split, &plan.train_tasks)?;
        let (mut model, mut optim, mut state, rng) =
            self.stage_start(Stage::Grpo, 0x6a90, &g.optimizer, model, resume)?;
        let reference = match &self.full_reference {
            Some(base) => Some(base.clone()),
            None => (g.loss.beta > 0.0).then(|| strip(model.valid())),
        };
        let total_opt_steps = g.steps * g.optimizer_steps_per_batch;
        let progress = bar(g.steps as u64, "grpo", self.opts.progress);
        progress.set_position(state.step);
        let mut order = epoch_order(train.len(), &rng, state.data.epoch);
        while (state.step as usize) < g.steps {
            // Prompts: the next B tasks that RAPO has not pruned.
            let mut prompts: Vec<&Task> = Vec::with_capacity(g.prompts_per_step);
            let mut scanned = 0;
            while prompts.len() < g.prompts_per_step {
                if state.data.position as usize >= order.len() {
                    state.data.epoch += 1;
                    state.data.position = 0;
                    order = epoch_order(train.len(), &rng, state.data.epoch);
                }
                let task = &train[order[state.data.position as usize]];
                state.data.position += 1;
                scanned += 1;
                if !state.rapo.solve_rates.is_pruned(&task.id, &plan.rapo) {
                    prompts.push(task);
                }
                if scanned > 2 * train.len() + g.prompts_per_step {
                    return Err(TrainError::NoData(
                        "RAPO pruned every training prompt (their solve rate reached \
                         rapo.prune_solve_rate)"
                            .into(),
                    ));
                }
            }
            // Rollouts: G episodes per prompt, each with its own sampling stream.
            let gsize = g.group_size;
            let specs: Vec<EpisodeSpec> = prompts
                .iter()
                .enumerate()
                .flat_map(|(p, task)| {
                    (0..gsize).map(move |k| EpisodeSpec {
                        reset: ResetRequest::Task(Box::new((*task).clone())),
                        group: p,
                        stream: (p * gsize + k) as u64,
                    })
                })
                .collect();
            let inner = model.valid();
            let chat = self.chat();
            let mut envs = self.factory.make(specs.len());
            let settings = self.rollout_settings(
                false,
                plan.seeds.sampling ^ state.step.wrapping_mul(0x9e37_79b9),
            );
            let (outputs, rstats) = rollout(
                &inner,
                &chat,
                &mut envs,
                &specs,
                &settings,
                self.factory.bridge(),
                self.device,
            )?;
            // Rewards.
            let evals: Vec<_> = outputs
                .iter()
                .zip(&specs)
                .map(|(o, s)| {
                    score_episode(
                        &plan.rewards,
                        prompts[s.group],
                        &o.trajectory,
                        o.turns,
                        o.generated_tokens,
                    )
                })
                .collect();
            let mut samples: Vec<Sample> = outputs.iter().map(|o| o.sample.clone()).collect();
            let mut rewards: Vec<f64> = evals.iter().map(|e| e.reward).collect();
            // RAPO: remember successes, replay one into a group that failed entirely.
            for (p, task) in prompts.iter().enumerate() {
                let range = p * gsize..(p + 1) * gsize;
                state
                    .rapo
                    .solve_rates
                    .record(&task.id, evals[range.clone()].iter().map(|e| e.correct));
                if let Some(replay) = &plan.rapo.replay {
                    let injected = state.rapo.replay.inject(
                        &task.id,
                        &mut samples[range.clone()],
                        &mut rewards[range.clone()],
                        replay,
                    );
                    if injected.is_none()
                        && let Some(best) = range
                            .clone()
                            .max_by(|&a, &b| rewards[a].total_cmp(&rewards[b]))
                    {
                        state.rapo.replay.offer(
                            &task.id,
                            &samples[best],
                            rewards[best],
                            state.step,
                            replay,
                        );
                    }
                }
            }
            let advantages = group_advantages(&rewards, gsize, g.loss.scale_by_std)?;
            let good = drop_flat_groups(&advantages, plan.rapo.rescale_advantages);
            // The learner.
            let learn_started = Instant::now();
            let lr = g.schedule.lr(
                g.optimizer.lr,
                state.step as usize * g.optimizer_steps_per_batch,
                total_opt_steps,
            );
            let temperature = plan.sampling.temperature() as f64;
            let (m2, learned) = learn(
                model,
                &mut optim,
                &good.rows.iter().map(|&r| &samples[r]).collect::<Vec<_>>(),
                &good.advantages,
                g,
                reference.as_ref(),
                temperature,
                lr,
                self.device,
            )?;
            model = m2;
            let Learned {
                loss: loss_value,
                grad_norm,
                stats,
            } = learned;
            let learning_s = learn_started.elapsed().as_secs_f64();
            state.step += 1;
            let n = evals.len().max(1) as f64;
            let mut components = std::collections::BTreeMap::new();
            for e in &evals {
                for (k, v) in &e.components {
                    *components.entry(k.clone()).or_insert(0.0) += v / n;
                }
            }
            let time = StepTime {
                generation_s: rstats.generation_s,
                environment_s: rstats.environment_s,
                learning_s,
            };
            let m = StepMetrics {
                stage: Stage::Grpo,
                step: state.step,
                loss: loss_value,
                learning_rate: lr,
                grad_norm,
                tokens_per_second: rstats.generated_tokens as f64 / time.total_s().max(1e-9),
                time,
                rollout: Some(RolloutMetrics {
                    reward: evals.iter().map(|e| e.reward).sum::<f64>() / n,
                    reward_components: components,
                    kl: stats.kl,
                    entropy: stats.entropy,
                    completion_tokens: outputs
                        .iter()
                        .map(|o| o.generated_tokens as f64)
                        .sum::<f64>()
                        / n,
                    advantage_variance: advantages.variance(),
                    zero_variance_groups: advantages.zero_variance_fraction(),
                    clip_low: stats.clip_low,
                    clip_high: stats.clip_high,
                    llm_calls: evals.iter().map(|e| e.llm_calls as f64).sum::<f64>() / n,
                    tool_tokens: evals.iter().map(|e| e.tool_tokens as f64).sum::<f64>() / n,
                    solve_rate: evals.iter().filter(|e| e.correct).count() as f64 / n,
                }),
            };
            self.log(&m, plan.output.metrics_every)?;
            progress.set_position(state.step);
            progress.set_message(step_message(&m));
            if plan.output.plot_every > 0
                && (state.step as usize).is_multiple_of(plan.output.plot_every)
            {
                self.plot_all()?;
            }
            if self.end_step(g.steps, &model, &optim, &mut state, &rng)? {
                return Ok((model, state.step, true));
            }
        }
        progress.finish_and_clear();
        Ok((model, state.step, false))
    }
}

/// What one learner update reported.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Learned {
    /// The policy loss of the last optimiser step.
    pub loss: f64,
    /// The global gradient norm before clipping, of the last optimiser step.
    pub grad_norm: f64,
    /// The loss's statistics, of the last optimiser step.
    pub stats: crate::grpo::LossStats,
}

/// The learner's part of a GRPO step: `grpo.optimizer_steps_per_batch` optimiser steps on the
/// episodes `samples` with their `advantages` (the clipped policy loss against the sampling
/// log-probabilities, optionally k3 KL to `reference`, global-norm clipping, AdamW at `lr`).
/// Each optimiser step runs the batch in passes of `grpo.learner.pass_tokens` (whole episodes,
/// the loss normalised over the whole batch) and adds their gradients. Nothing happens for an
/// empty batch.
#[allow(clippy::too_many_arguments)]
pub fn learn<B: ModelBackend>(
    mut model: Qwen2ForCausalLM<Ad<B>>,
    optim: &mut AdamWOptimizer<Ad<B>>,
    samples: &[&Sample],
    advantages: &[f64],
    g: &crate::recipe::GrpoSection,
    reference: Option<&Qwen2ForCausalLM<B>>,
    temperature: f64,
    lr: f64,
    device: &B::Device,
) -> Result<(Qwen2ForCausalLM<Ad<B>>, Learned), TrainError> {
    let mut learned = Learned::default();
    if samples.is_empty() {
        return Ok((model, learned));
    }
    let host = host_batch(samples, 0)?;
    let cols = host.cols();
    let batch = LossBatch::<Ad<B>>::new(&host, advantages, g.loss.normalization, device)?;
    let seqs: Vec<&[u32]> = samples.iter().map(|s| s.ids.as_slice()).collect();
    let ref_logprobs = match reference {
        Some(r) => {
            let out = fathom_model::packed_logprobs(
                r,
                &seqs,
                temperature,
                g.learner.logprob_chunk,
                device,
            )?;
            Some(padded(out.logprobs, &out.offsets, cols))
        }
        None => None,
    };
    // Each pass's rows of the batch and of the reference, cut once for every optimiser step.
    let parts: Vec<_> = passes(&seqs, g.learner.pass_tokens, g.learner.share_prefix)
        .into_iter()
        .map(|part| {
            let rows = batch.rows(part.clone());
            let reference = ref_logprobs
                .as_ref()
                .map(|r| r.clone().slice([part.clone(), 0..cols]));
            (part, rows, reference)
        })
        .collect();
    // Only the sampled tokens' log-probabilities are computed (as SFT does for its targets):
    // the loss reads no others, and the output head runs on those positions alone, not on the
    // prompt's and the observations'.
    let scored: Vec<&[bool]> = samples.iter().map(|s| s.sampled.as_slice()).collect();
    for _ in 0..g.optimizer_steps_per_batch {
        let mut loss = 0f64;
        let mut stats = Vec::with_capacity(parts.len());
        let mut grads: Option<GradientsParams> = None;
        for (part, rows, reference) in &parts {
            let out = fathom_model::forward_backward_scored(
                &model,
                &seqs[part.clone()],
                &scored[part.clone()],
                pass(&g.learner, temperature),
                device,
                |lp: &SequenceLogprobs<Ad<B>>| {
                    let new = padded(lp.logprobs.clone(), &lp.offsets, cols);
                    let entropy = padded(lp.entropy.clone(), &lp.offsets, cols);
                    let reference = reference.clone().map(Tensor::from_inner);
                    match policy_loss(new, rows, reference, Some(entropy), &g.loss) {
                        Ok(p) => (p.loss, Ok(p.stats)),
                        Err(e) => (Tensor::zeros([1], &lp.logprobs.device()), Err(e)),
                    }
                },
            )?;
            stats.push(out.aux?);
            loss += out.loss as f64;
            grads = Some(accumulate(&model, grads, out.grads));
        }
        let mut grads = grads.expect("a non-empty batch has a pass");
        let clipping = crate::optim::clip_global_norm(&model, &mut grads, g.optimizer.grad_clip);
        learned.grad_norm = clipping.norm;
        learned.loss = loss;
        learned.stats = crate::grpo::LossStats::merge(&stats);
        model = optim.step(lr, model, grads);
    }
    Ok((model, learned))
}

/// `sum + grads`: the gradients of one more pass over part of a batch.
fn accumulate<B: burn::tensor::backend::AutodiffBackend>(
    model: &Qwen2ForCausalLM<B>,
    sum: Option<GradientsParams>,
    grads: GradientsParams,
) -> GradientsParams {
    match sum {
        None => grads,
        Some(mut sum) => {
            fathom_model::add_gradients(model, grads, &mut sum);
            sum
        }
    }
}

/// The learner's passes over a batch of `seqs`: consecutive runs whose packing (shared
/// prefixes stored once when `share_prefix` > 0) holds at most `budget` tokens (a longer
/// sequence alone), or the whole batch when there is no budget.
fn passes(seqs: &[&[u32]], budget: Option<usize>, share_prefix: usize) -> Vec<Range<usize>> {
    let tokens = |part: Range<usize>| SharedPacking::new(&seqs[part], share_prefix).len();
    let mut parts: Vec<Range<usize>> = Vec::new();
    for i in 0..seqs.len() {
        match parts.last_mut() {
            Some(last) if budget.is_none_or(|b| tokens(last.start..i + 1) <= b) => {
                last.end = i + 1;
            }
            _ => parts.push(i..i + 1),
        }
    }
    parts
}

/// A permutation of `0..n` drawn from `rng`.
fn shuffled(n: usize, rng: &mut TrainRng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(rng);
    order
}

/// The order of tasks in epoch `epoch`: a permutation drawn from the stage's generator on the
/// stream of that epoch, so it depends only on the seed and the epoch and a resumed run (which
/// restores the generator and the data cursor) walks the same order.
fn epoch_order(n: usize, rng: &TrainRng, epoch: u64) -> Vec<usize> {
    let mut r = rng.clone();
    r.set_stream(epoch);
    r.set_word_pos(0);
    shuffled(n, &mut r)
}

/// The model without its adapters (the reference policy, or the base to load a checkpoint's
/// adapter onto).
pub fn strip<B: burn::tensor::backend::Backend>(
    mut model: Qwen2ForCausalLM<B>,
) -> Qwen2ForCausalLM<B> {
    for (_, p) in model.layer_projections_mut() {
        p.lora = None;
    }
    model
}

#[cfg(test)]
mod tests {
    use fathom_model::lora::init_rng;
    use fathom_model::{Cpu, LoraSettings, Qwen2Config, Target};

    use super::*;
    use crate::grpo::Sample;
    use crate::recipe::Recipe;

    #[test]
    fn passes_hold_whole_sequences_within_the_budget() {
        let seqs: Vec<Vec<u32>> = [3, 4, 2, 9, 1, 1]
            .iter()
            .enumerate()
            .map(|(i, &n)| vec![i as u32; n])
            .collect();
        let seqs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        let at = |budget| passes(&seqs, budget, 0);
        assert_eq!(at(None), vec![0..6]);
        assert_eq!(at(Some(7)), vec![0..2, 2..3, 3..4, 4..6]);
        assert_eq!(at(Some(1)), (0..6).map(|i| i..i + 1).collect::<Vec<_>>());
        assert_eq!(at(Some(100)), vec![0..6]);
        assert!(passes(&[], Some(4), 0).is_empty());
        // A group's shared prompt counts once: 6 + 1 + 1 + 2 tokens, then a new prompt.
        let group: [&[u32]; 4] = [
            &[1, 2, 3, 4, 5, 6, 7],
            &[1, 2, 3, 4, 5, 6, 8],
            &[1, 2, 3, 4, 5, 6, 9, 9],
            &[5, 5, 5],
        ];
        assert_eq!(passes(&group, Some(10), 0), vec![0..1, 1..2, 2..3, 3..4]);
        assert_eq!(passes(&group, Some(10), 4), vec![0..3, 3..4]);
        assert_eq!(passes(&group, Some(13), 4), vec![0..4]);
    }

    /// The adapter weights of a model, in parameter order.
    fn adapter(model: &Qwen2ForCausalLM<Ad<Cpu>>) -> Vec<f32> {
        let mut out = Vec::new();
        for (_, p) in model.projections() {
            let lora = p.lora.as_ref().expect("every projection has an adapter");
            for w in [&lora.lora_a, &lora.lora_b] {
                out.extend(w.val().into_data().to_vec::<f32>().unwrap());
            }
        }
        out
    }

    #[test]
    fn a_grpo_update_in_passes_equals_the_update_in_one_pass() {
        let device = Default::default();
        let recipe = Recipe::parse(include_str!("../../recipes/tiny-grpo.ron"), "tiny-grpo.ron")
            .expect("the tiny recipe parses");
        let lora = LoraSettings {
            rank: 2,
            alpha: 4.0,
            dropout: 0.0,
            rslora: false,
            targets: Target::ALL.to_vec(),
        };
        let samples: Vec<Sample> = (0..4)
            .map(|i| {
                let n = 6 + 3 * i;
                Sample {
                    ids: (0..n).map(|t| ((t * 7 + i * 5) % 48) as u32).collect(),
                    sampled: (0..n).map(|t| t >= 3).collect(),
                    logprobs: (0..n)
                        .map(|t| if t >= 3 { -3.0 - 0.1 * t as f32 } else { 0.0 })
                        .collect(),
                }
            })
            .collect();
        let refs: Vec<&Sample> = samples.iter().collect();
        let advantages = [1.0, -0.5, 0.25, -0.75];
        let update = |pass_tokens| {
            let mut g = recipe.grpo.clone();
            g.learner.pass_tokens = pass_tokens;
            g.optimizer_steps_per_batch = 2;
            let model = Qwen2ForCausalLM::<Ad<Cpu>>::random(
                Qwen2Config::with_shape(48, 16, 24, 2, 4, 2),
                5,
                false,
                &device,
            )
            .attach_lora(&lora, &mut init_rng(3), &device);
            let mut optim = g.optimizer.init();
            let (model, learned) = learn::<Cpu>(
                model,
                &mut optim,
                &refs,
                &advantages,
                &g,
                None,
                1.0,
                1e-2,
                &device,
            )
            .expect("the update runs");
            (adapter(&model), learned)
        };
        let (whole, one) = update(None);
        // 6 + 9 tokens, then 12 and 15 alone: three passes
        let (parts, three) = update(Some(15));
        assert_eq!(
            passes(
                &refs.iter().map(|s| s.ids.as_slice()).collect::<Vec<_>>(),
                Some(15),
                0
            )
            .len(),
            3
        );
        assert!((one.loss - three.loss).abs() < 1e-5, "{one:?} vs {three:?}");
        assert!((one.grad_norm - three.grad_norm).abs() < 1e-5 * one.grad_norm.max(1.0));
        assert_eq!(one.stats.tokens, three.stats.tokens);
        assert!((one.stats.mean_ratio - three.stats.mean_ratio).abs() < 1e-6);
        let moved = whole.iter().filter(|w| **w != 0.0).count();
        assert!(moved > whole.len() / 2, "the update moved the adapter");
        for (a, b) in whole.iter().zip(&parts) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}
