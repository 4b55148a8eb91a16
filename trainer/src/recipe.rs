//! Recipes: a run described in RON, read with unknown fields rejected and validated once
//! into a resolved [`Plan`].
//!
//! Every field must be written out (no silent defaults, except where a value is an `Option`
//! and may be left out as `None`), so a recipe says everything the run does. An unknown or
//! missing field, a wrong type or a value out of range is an error that names the field by
//! its path and gives its line in the file, e.g.
//! `recipes/a100.ron:57: grpo.optimizer.lr: must be a positive number, got -0.00001`.
//!
//! The RON extension `unwrap_variant_newtypes` is on: write `tuning: Lora(rank: 16, …)`
//! rather than `Lora((rank: 16, …))`. Optional values are `None` or `Some(…)`, and `Some`
//! around a section takes its fields directly: `sft: Some(steps: 60, …)`.
//!
//! `recipes/` holds the recipes this repository ships: `a100.ron` (the reference system's run
//! on CUDA), `laptop.ron` (the embedded default, [`LAPTOP`]) and `tiny.ron` (CI).
//!
//! Paths in a recipe (model directory, tokenizer, output directory, token file) are kept as
//! written; the caller resolves them (relative to the working directory) when it loads them,
//! so a plan validates without the model present.

mod locate;
mod model;
mod validate;

use std::path::{Path, PathBuf};

use fathom_env::env::EnvConfig;
use fathom_env::tasks::TaskConfig;
use fathom_model::Sampling;
use fathom_rewards::record::{Family, Split};
use fathom_rewards::{Composite, RewardRegistry, RewardsConfig};
use serde::{Deserialize, Serialize};

use crate::checkpoint::CheckpointSettings;
use crate::grpo::LossSettings;
use crate::optim::{AdamWSettings, Schedule};
use crate::rapo::RapoSettings;
use crate::sft::TraceSettings;

pub use locate::{best_line, line_of, path_at};
pub use model::{ModelSection, ModelSource, Quantization, Shape, Tuning};
pub use validate::SandboxLimits;

/// The embedded default recipe (`recipes/laptop.ron`).
pub const LAPTOP: &str = include_str!("../../recipes/laptop.ron");

/// The name [`LAPTOP`] reports in errors.
pub const LAPTOP_ORIGIN: &str = "recipes/laptop.ron";

/// A recipe as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// The model, its quantization and what is trained.
    pub model: ModelSection,
    /// Where it runs.
    pub device: DeviceSection,
    /// Tasks: splits, families, document lengths.
    pub data: DataSection,
    /// Environment limits.
    pub env: EnvSection,
    /// Reward components and weights (`fathom_rewards::config`).
    pub rewards: RewardsConfig,
    /// The SFT warm-start; `None` skips it.
    pub sft: Option<SftSection>,
    /// GRPO.
    pub grpo: GrpoSection,
    /// RAPO's options.
    pub rapo: RapoSettings,
    /// Logs, plots and progress bars.
    pub output: OutputSection,
    /// Checkpoints.
    pub checkpoints: CheckpointSettings,
    /// Remote environment servers; `None` runs environments in process.
    pub remote: Option<RemoteSection>,
    /// Seeds.
    pub seeds: Seeds,
}

/// A compute backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Backend {
    /// burn's Flex CPU backend (`fathom_model::Cpu`).
    Cpu,
    /// wgpu (Vulkan, Metal, DX12); needs the `wgpu` feature.
    Wgpu,
    /// CUDA; needs the `cuda` feature.
    Cuda,
}

impl Backend {
    /// Whether this build can run the backend.
    pub fn compiled(self) -> bool {
        match self {
            Backend::Cpu => true,
            Backend::Wgpu => cfg!(feature = "wgpu"),
            Backend::Cuda => cfg!(feature = "cuda"),
        }
    }
}

/// Where the run computes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSection {
    /// The backend.
    pub backend: Backend,
    /// The device index (0 for the CPU).
    pub index: usize,
}

/// Which tasks of a split a stage uses.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitSelection {
    /// The split.
    pub split: Split,
    /// How many tasks: the first `count` of the split that belong to the recipe's families
    /// (and, where `data.max_hops` is set, whose chains are no longer).
    pub count: usize,
}

impl SplitSelection {
    /// The indices into the split of the first `count` tasks of `families` (without
    /// `data.max_hops`; [`DataSection::indices`] applies it).
    pub fn indices(&self, families: &[Family]) -> Vec<usize> {
        let fams = fathom_env::tasks::FAMILIES;
        (0..fathom_env::tasks::split_len(self.split))
            .filter(|i| families.contains(&fams[i % fams.len()]))
            .take(self.count)
            .collect()
    }
}

/// The tasks a run draws from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// Task families used (each split's tasks take the families in turn).
    pub families: Vec<Family>,
    /// Tasks for SFT traces and GRPO prompts.
    pub train: SplitSelection,
    /// Tasks evaluated during and after training.
    pub eval: SplitSelection,
    /// Tasks of the final report.
    pub heldout: SplitSelection,
    /// The policy's context window in tokens, which documents are sized against.
    pub context_window: usize,
    /// Shortest document, in tokens.
    pub min_doc_tokens: usize,
    /// Longest document as a multiple of `context_window`.
    pub max_window_factor: f64,
    /// Longest multi-hop chain a stage sees, in hops (the generator draws 2 to 4); `None`, the
    /// default, keeps every chain. Multi-hop tasks with longer chains are skipped wherever a
    /// split's tasks are selected, so SFT, GRPO and every evaluation draw from the same subset
    /// and `count` still counts the tasks used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_hops: Option<usize>,
}

impl DataSection {
    /// The document sizes as the environment's task generator takes them.
    pub fn task_config(&self) -> TaskConfig {
        TaskConfig {
            context_window: self.context_window,
            min_doc_tokens: self.min_doc_tokens,
            max_window_factor: self.max_window_factor,
        }
    }

    /// The indices into `sel`'s split of the tasks a stage uses: the first `sel.count` that
    /// belong to the recipe's families, less multi-hop chains longer than `max_hops`.
    pub fn indices(&self, sel: &SplitSelection) -> Vec<usize> {
        self.candidates(sel.split).take(sel.count).collect()
    }

    /// How many tasks of `split` the families and `max_hops` leave to select from.
    pub fn available(&self, split: Split) -> usize {
        self.candidates(split).count()
    }

    fn candidates(&self, split: Split) -> impl Iterator<Item = usize> + '_ {
        let config = self.task_config();
        SplitSelection {
            split,
            count: usize::MAX,
        }
        .indices(&self.families)
        .into_iter()
        .filter(move |&i| {
            let fams = fathom_env::tasks::FAMILIES;
            match self.max_hops {
                Some(max) if fams[i % fams.len()] == Family::MultiHop => {
                    chain_hops(split, i, &config).is_some_and(|hops| hops <= max)
                }
                _ => true,
            }
        })
    }
}

/// The number of hops of multi-hop task `index` of `split`, read from its question as the
/// expert reads it; `None` when the task is no chain.
fn chain_hops(split: Split, index: usize, config: &TaskConfig) -> Option<usize> {
    let task = fathom_env::tasks::split_task(split, index, config).ok()?;
    match fathom_env::expert::plan(&task.question)? {
        fathom_env::expert::Plan::MultiHop { hops, .. } => Some(hops),
        _ => None,
    }
}

/// `llm()` limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmSection {
    /// Calls answered per episode.
    pub max_calls: usize,
    /// Largest prompt, in tokens.
    pub max_prompt_tokens: usize,
    /// Recursion depth (1: plain sub-LM calls).
    pub max_depth: u32,
}

/// Environment limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvSection {
    /// Assistant turns per episode.
    pub max_turns: usize,
    /// Characters of the document previewed in the first user turn.
    pub preview_chars: usize,
    /// `llm()` limits.
    pub llm: LlmSection,
    /// Characters of output kept per stream and cell (the rest is cut with a marker).
    pub max_output_chars: usize,
    /// Wall-clock limit per cell, in seconds.
    pub step_timeout_s: f64,
}

/// SFT hyper-parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SftSection {
    /// Optimiser steps.
    pub steps: usize,
    /// Conversations per step.
    pub batch_size: usize,
    /// Longest conversation in tokens; longer traces are dropped.
    pub max_length: usize,
    /// How the learner computes log-probabilities.
    pub learner: LearnerSection,
    /// AdamW.
    pub optimizer: AdamWSettings,
    /// Learning-rate schedule.
    pub schedule: Schedule,
    /// The expert traces.
    pub traces: TraceSettings,
}

/// How the learner computes log-probabilities and gradients.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LearnerSection {
    /// Recompute each decoder layer in the backward pass instead of keeping its activations
    /// (needs LoRA dropout 0).
    pub activation_checkpointing: bool,
    /// Positions of vocabulary logits computed at a time (≥ 1).
    pub logprob_chunk: usize,
    /// Run the batch in passes of whole sequences holding at most this many tokens (≥ 1; a
    /// longer sequence gets a pass of its own) and add up their gradients: the same update as
    /// one pass, with the learner's memory bounded by a pass instead of the batch, which lets
    /// a large batch go without checkpointing's recomputation. `None` (the default): one pass.
    #[serde(default)]
    pub pass_tokens: Option<usize>,
    /// Store a beginning that consecutive sequences share, when it is at least this many
    /// tokens, once per pass (a GRPO group's prompt; SFT traces' system prompt): projections,
    /// MLP and output head run on it once, attention still sees each sequence whole. The same
    /// values and gradients up to rounding, fewer tokens computed; passes count the tokens
    /// stored. 0 (the default): every sequence is packed whole.
    #[serde(default)]
    pub share_prefix: usize,
}

/// Token sampling during rollouts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingSection {
    /// Softmax temperature (> 0); the learner computes log-probabilities at the same one.
    pub temperature: f64,
    /// Nucleus mass in (0, 1].
    pub top_p: f64,
    /// Keep at most this many tokens (0 = all).
    pub top_k: usize,
}

/// GRPO hyper-parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrpoSection {
    /// Training steps (batches of rollouts).
    pub steps: usize,
    /// Prompts per step, `B`.
    pub prompts_per_step: usize,
    /// Episodes per prompt, `G` (≥ 2).
    pub group_size: usize,
    /// New tokens per assistant turn.
    pub max_new_tokens: usize,
    /// Longest episode in tokens (prompt, turns and observations); longer ones end.
    pub max_episode_tokens: usize,
    /// Token sampling.
    pub sampling: SamplingSection,
    /// The policy loss.
    pub loss: LossSettings,
    /// Optimiser steps per batch of rollouts (≥ 1).
    pub optimizer_steps_per_batch: usize,
    /// How the learner computes log-probabilities.
    pub learner: LearnerSection,
    /// AdamW.
    pub optimizer: AdamWSettings,
    /// Learning-rate schedule over the optimiser steps.
    pub schedule: Schedule,
}

/// Logs, plots and progress bars.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSection {
    /// The run's directory (metrics, plots, checkpoints, report).
    pub dir: PathBuf,
    /// Append to `metrics.jsonl` every this many steps (≥ 1).
    pub metrics_every: usize,
    /// Redraw the plots every this many steps (≥ 1).
    pub plot_every: usize,
    /// Show progress bars on the terminal.
    pub progress_bars: bool,
}

/// Remote environment servers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteSection {
    /// OpenEnv server URLs (`ws://host:port` or `http://host:port`).
    pub urls: Vec<String>,
    /// A file holding a bearer token for the servers, if they need one.
    pub token_file: Option<PathBuf>,
}

/// Seeds of the run's random streams.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Seeds {
    /// Adapter initialisation (and random model weights).
    pub model: u64,
    /// Task order and expert trace variation.
    pub data: u64,
    /// Token sampling.
    pub sampling: u64,
}

/// Why a recipe was rejected.
#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    /// The file could not be read.
    #[error("cannot read recipe {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The text does not fit the schema: a syntax error, an unknown or missing field, a
    /// wrong type. `field` is the path of the field at the error (empty at the top level).
    #[error("{origin}:{line}:{column}: {message}")]
    Parse {
        /// The recipe's name in messages.
        origin: String,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The path of the field at the error.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A value is out of range or inconsistent with another.
    #[error("{}: {field}: {message}", at(origin, *line))]
    Invalid {
        /// The recipe's name in messages.
        origin: String,
        /// The field's line, when it is written in the file.
        line: Option<usize>,
        /// The field's path, e.g. `grpo.optimizer.lr`.
        field: String,
        /// What is wrong.
        message: String,
    },
}

fn at(origin: &str, line: Option<usize>) -> String {
    match line {
        Some(l) => format!("{origin}:{l}"),
        None => origin.to_string(),
    }
}

/// A recipe validated and resolved: what a run does, with nothing left to check.
#[derive(Debug)]
pub struct Plan {
    /// The recipe's name in messages (its path, or [`LAPTOP_ORIGIN`]).
    pub origin: String,
    /// The recipe's text (saved with checkpoints).
    pub text: String,
    /// The model.
    pub model: ModelSection,
    /// The device.
    pub device: DeviceSection,
    /// The data section as written.
    pub data: DataSection,
    /// Indices of the train tasks in their split.
    pub train_tasks: Vec<usize>,
    /// Indices of the eval tasks in their split.
    pub eval_tasks: Vec<usize>,
    /// Indices of the held-out tasks in their split.
    pub heldout_tasks: Vec<usize>,
    /// The environment's settings (limits and task generation).
    pub env: EnvConfig,
    /// The sandbox's limits.
    pub sandbox: SandboxLimits,
    /// The reward composite, built.
    pub rewards: Composite,
    /// SFT, if any.
    pub sft: Option<SftSection>,
    /// GRPO.
    pub grpo: GrpoSection,
    /// GRPO's sampling as the model crate takes it.
    pub sampling: Sampling,
    /// RAPO.
    pub rapo: RapoSettings,
    /// Output.
    pub output: OutputSection,
    /// Checkpoints.
    pub checkpoints: CheckpointSettings,
    /// Remote servers.
    pub remote: Option<RemoteSection>,
    /// Seeds.
    pub seeds: Seeds,
}

/// RON options for recipes.
fn ron_options() -> ron::Options {
    ron::Options::default()
        .with_default_extension(ron::extensions::Extensions::UNWRAP_VARIANT_NEWTYPES)
}

impl Recipe {
    /// Parses a recipe; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Recipe, RecipeError> {
        ron_options()
            .from_str(text)
            .map_err(|e| parse_error(text, origin, e))
    }

    /// The recipe as RON text (for `--dry-run` output and tests).
    pub fn to_ron(&self) -> String {
        ron_options()
            .to_string_pretty(self, ron::ser::PrettyConfig::default())
            .expect("a recipe serialises")
    }
}

impl Plan {
    /// Parses and validates `text`; custom reward components are looked up in `registry`.
    pub fn from_str_with(
        text: &str,
        origin: &str,
        registry: &RewardRegistry,
    ) -> Result<Plan, RecipeError> {
        let recipe = Recipe::parse(text, origin)?;
        validate::plan(recipe, text, origin, registry)
    }

    /// Parses and validates `text` with the built-in reward components only.
    pub fn from_text(text: &str, origin: &str) -> Result<Plan, RecipeError> {
        Plan::from_str_with(text, origin, &RewardRegistry::new())
    }

    /// Reads and validates a recipe file.
    pub fn load(path: &Path) -> Result<Plan, RecipeError> {
        let text = std::fs::read_to_string(path).map_err(|source| RecipeError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Plan::from_text(&text, &path.display().to_string())
    }

    /// The embedded default recipe.
    pub fn laptop() -> Result<Plan, RecipeError> {
        Plan::from_text(LAPTOP, LAPTOP_ORIGIN)
    }

    /// The same plan with every seed moved on by `offset` (wrapping), for repeating a recipe
    /// over seeds. The recipe text saved with checkpoints gains a closing comment giving the
    /// seeds actually used; the data splits and held-out tasks do not change.
    pub fn with_seed_offset(mut self, offset: u64) -> Plan {
        if offset == 0 {
            return self;
        }
        let s = &mut self.seeds;
        s.model = s.model.wrapping_add(offset);
        s.data = s.data.wrapping_add(offset);
        s.sampling = s.sampling.wrapping_add(offset);
        self.text.push_str(&format!(
            "\n// Run with seed offset {offset}: seeds (model: {}, data: {}, sampling: {}).\n",
            s.model, s.data, s.sampling
        ));
        self
    }
}

/// Turns ron's positioned error into one that names the field.
fn parse_error(text: &str, origin: &str, e: ron::error::SpannedError) -> RecipeError {
    let (line, column) = (e.span.start.line, e.span.start.col);
    let field = path_at(text, line, column);
    let inside = if field.is_empty() {
        "the recipe".to_string()
    } else {
        format!("`{field}`")
    };
    let join = |name: &str| {
        if field.is_empty() {
            name.to_string()
        } else {
            format!("{field}.{name}")
        }
    };
    let message = match &e.code {
        ron::Error::NoSuchStructField {
            expected, found, ..
        } => format!(
            "unknown field `{found}` in {inside} (expected one of: {})",
            expected.join(", ")
        ),
        ron::Error::MissingStructField { field: name, .. } => {
            format!("missing field `{}`", join(name))
        }
        ron::Error::DuplicateStructField { field: name, .. } => {
            format!("field `{}` is written twice", join(name))
        }
        ron::Error::NoSuchEnumVariant {
            expected, found, ..
        } => format!(
            "`{field}`: unknown variant `{found}` (expected one of: {})",
            expected.join(", ")
        ),
        ron::Error::ExpectedIdentifier if text_before(text, line, column).ends_with("Some(") => {
            format!(
                "`{field}`: expected a field name; `Some` around a section takes its fields \
                 directly, as in `Some(steps: 10, …)`, not `Some((steps: 10, …))`"
            )
        }
        other if field.is_empty() => other.to_string(),
        other => format!("`{field}`: {other}"),
    };
    RecipeError::Parse {
        origin: origin.to_string(),
        line,
        column,
        field,
        message,
    }
}

/// The text of `line` before `column` (1-based), without spaces.
fn text_before(text: &str, line: usize, column: usize) -> String {
    text.lines()
        .nth(line.saturating_sub(1))
        .map(|l| {
            l.chars()
                .take(column.saturating_sub(1))
                .filter(|c| !c.is_whitespace())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests;
