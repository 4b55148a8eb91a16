//! Fathom's trainer: recipes, SFT data and loss, GRPO and RAPO, the optimiser, checkpoints
//! and metrics — the parts of training that are not the rollout engine or the loop itself.
//!
//! - [`recipe`]: RON recipes validated once into a [`recipe::Plan`].
//! - [`sft`]: expert traces through the real environment, rendered with the chat template,
//!   and the cross-entropy on assistant tokens.
//! - [`grpo`]: group-normalised advantages, the learner's batch, the clipped policy loss.
//! - [`rapo`]: pruning, dropping and rescaling flat groups, the replay buffer.
//! - [`rollout`]: the batched multi-turn rollout engine (environments in threads, one
//!   generation loop, `llm()` calls through a queue).
//! - [`optim`]: AdamW over the trainable parameters, global-norm clipping, learning-rate
//!   schedules.
//! - [`checkpoint`]: atomic checkpoints (adapter, optimiser, RNG, data cursor, RAPO state).
//! - [`metrics`]: `metrics.jsonl`, PNG plots, progress bars.

pub mod checkpoint;
pub mod grpo;
pub mod metrics;
pub mod optim;
pub mod rapo;
pub mod recipe;
pub mod rollout;
pub mod sft;
