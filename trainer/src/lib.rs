//! Fathom's trainer: SFT warm-start and multi-turn GRPO with the environment inside every
//! rollout, RAPO, recipes, checkpoints and metrics.
//!
//! - [`recipe`]: RON recipes validated once into a [`recipe::Plan`].
//! - [`sft`]: expert traces through the real environment, rendered with the chat template,
//!   and the cross-entropy on assistant tokens.
//! - [`grpo`]: group-normalised advantages, the learner's batch, the clipped policy loss.
//! - [`rapo`]: pruning, dropping and rescaling flat groups, the replay buffer.
//! - [`rollout`]: the batched multi-turn rollout engine (environments in threads, one
//!   generation loop, `llm()` calls through a queue).
//! - [`policy`], [`envs`]: the model, tokenizer and environments a recipe describes.
//! - [`eval`]: scoring a split's episodes, per family.
//! - [`report`]: the run's Markdown report with plots.
//! - [`seeds`]: one recipe over several seeds: held-out mean, spread and GRPO's gain.
//! - [`train`]: the run itself, top to bottom (SFT, GRPO, evaluations, checkpoints).
//! - [`optim`]: AdamW over the trainable parameters, global-norm clipping, learning-rate
//!   schedules.
//! - [`checkpoint`]: atomic checkpoints (adapter, optimiser, RNG, data cursor, RAPO state).
//! - [`metrics`]: `metrics.jsonl`, PNG plots, progress bars.

pub mod checkpoint;
pub mod envs;
pub mod eval;
pub mod grpo;
pub mod metrics;
pub mod optim;
pub mod policy;
pub mod rapo;
pub mod recipe;
pub mod report;
pub mod rollout;
pub mod seeds;
pub mod sft;
pub mod train;
