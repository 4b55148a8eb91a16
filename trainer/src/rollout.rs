//! The rollout engine: B prompts × G samples as concurrent multi-turn episodes, each in its own
//! [`Environment`] stepped from its own thread, while one generation loop batches every live
//! sequence — top-level turns and `llm()` sub-calls alike — into one packed forward pass per
//! iteration.
//!
//! - **Cache rows.** Each episode owns a row of the KV cache. The G samples of a prompt share
//!   it: the prompt is prefilled once and the row forked. An observation is prefilled onto the
//!   row as one segment, never by re-encoding the conversation. A finished episode's row is
//!   released and reused.
//! - **No padding.** Rows feed only their new tokens; a row decoding one token and a row taking
//!   a 500-token observation share a forward pass.
//! - **Overlap, deterministically.** Environments run their code while the next forward pass
//!   runs; at each boundary between forward passes the loop waits until every environment has
//!   either answered or is blocked on an `llm()` call it queued, then takes in everything in a
//!   fixed order. Which tokens share a forward pass therefore never depends on thread timing,
//!   so a rollout (and a resumed run) is reproducible bit for bit; the cost is that an
//!   environment step longer than a forward pass makes the loop wait (reported as environment
//!   time).
//! - **`llm()` and recursion.** Environments built with [`Bridge::sub_lm`] and
//!   [`Bridge::policy`] send their calls here; a call becomes a row of its own (the prompt as a
//!   user turn, no gradient), answered when it ends its turn. A step blocked on `llm()` never
//!   blocks the loop. Sub-episodes deeper than one level go through the same queue.
//! - **Exact bookkeeping.** The ids sampled and their log-probabilities (under
//!   `log_softmax(logits / temperature)`) are kept as generated; observations and prompts are
//!   tokenized as the chat template renders them ([`chat`]) and masked out of the loss.
//! - **Randomness.** Each episode draws from its own stream (`sequence_rng(seed, stream)`);
//!   `llm()` answers draw from a stream keyed by their prompt, so nothing depends on which
//!   thread asked first.
//!
//! The same engine runs training rollouts, evaluation and inference; remote environments (the
//! OpenEnv client) plug in as ordinary [`Environment`]s.

pub mod bridge;
pub mod chat;
mod engine;

use fathom_env::env::{Environment, ResetRequest};
use fathom_model::{ModelBackend, Qwen2ForCausalLM, Sampling};
use fathom_rewards::record::{Step, Trajectory};

pub use bridge::{Bridge, Prompt};
pub use chat::{Chat, ChatError};

use crate::grpo::Sample;

/// Settings of a rollout.
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutSettings {
    /// How tokens are chosen.
    pub sampling: Sampling,
    /// New tokens per assistant turn; a longer turn is cut there (and closed as the template
    /// closes turns).
    pub max_turn_tokens: usize,
    /// Tokens an episode may hold in all (prompt, turns, observations): the policy's context
    /// window. An episode that would exceed it is ended.
    pub max_episode_tokens: usize,
    /// New tokens of an `llm()` answer.
    pub sub_call_tokens: usize,
    /// Seed of the sampling streams.
    pub seed: u64,
}

impl RolloutSettings {
    /// Checks the settings; returns what is wrong.
    pub fn validate(&self) -> Result<(), String> {
        self.sampling.validate().map_err(|e| e.to_string())?;
        for (name, v) in [
            ("max_turn_tokens", self.max_turn_tokens),
            ("max_episode_tokens", self.max_episode_tokens),
            ("sub_call_tokens", self.sub_call_tokens),
        ] {
            if v == 0 {
                return Err(format!("{name} must be positive"));
            }
        }
        Ok(())
    }
}

/// One episode to run.
#[derive(Clone, Debug, PartialEq)]
pub struct EpisodeSpec {
    /// How the episode starts.
    pub reset: ResetRequest,
    /// Its prompt group: episodes of one group whose prompts render identically share a cache
    /// row for the prompt.
    pub group: usize,
    /// Its sampling stream.
    pub stream: u64,
}

/// A finished episode.
#[derive(Clone, Debug)]
pub struct EpisodeOutput {
    /// The environment's record, or why there is none.
    pub trajectory: Result<Trajectory, String>,
    /// Every token with its loss mask and sampling log-probability.
    pub sample: Sample,
    /// Assistant turns taken.
    pub turns: usize,
    /// Tokens the policy sampled.
    pub generated_tokens: usize,
    /// Whether the episode was ended for reaching its token budget.
    pub truncated: bool,
}

/// Where a rollout's time and tokens went.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RolloutStats {
    /// Seconds in forward passes and sampling.
    pub generation_s: f64,
    /// Seconds the loop waited at forward-pass boundaries for environments to answer.
    pub environment_s: f64,
    /// Forward passes.
    pub forward_passes: usize,
    /// Tokens sampled (episodes and `llm()` answers).
    pub generated_tokens: usize,
    /// Tokens fed to the model (prompts, observations, sampled tokens).
    pub prefill_tokens: usize,
    /// `llm()` calls (and sub-episode turns) answered.
    pub sub_calls: usize,
    /// Largest KV-cache storage held, in bytes.
    pub peak_cache_bytes: usize,
}

/// Why a rollout failed as a whole (an episode's own failure is its output's error instead).
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    /// The request cannot be run.
    #[error("rollout: {0}")]
    Setup(String),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] fathom_model::ModelError),
    /// The conversation could not be laid out as tokens.
    #[error(transparent)]
    Chat(#[from] ChatError),
}

/// What a rollout reports while it runs (for front ends that stream an episode).
#[derive(Clone, Copy, Debug)]
pub enum RolloutEvent<'a> {
    /// Episode `episode` sampled `token` in its current turn.
    Token {
        /// The episode.
        episode: usize,
        /// The token.
        token: u32,
    },
    /// Episode `episode` ended a turn; `text` goes to its environment.
    Turn {
        /// The episode.
        episode: usize,
        /// The assistant's message.
        text: &'a str,
    },
    /// The environment answered episode `episode`'s turn.
    Observation {
        /// The episode.
        episode: usize,
        /// The record of the step (code run, output, `llm()` calls).
        step: Option<&'a Step>,
        /// The observation as the model reads it.
        text: &'a str,
    },
    /// An `llm()` call (or a sub-episode's turn) was answered.
    SubCall {
        /// What was asked.
        prompt: &'a Prompt,
        /// The answer.
        answer: &'a str,
    },
    /// Episode `episode` is over.
    Finished {
        /// The episode.
        episode: usize,
        /// Its record, or why there is none.
        trajectory: &'a Result<Trajectory, String>,
    },
}

/// Receives a rollout's events as they happen.
pub trait RolloutObserver {
    /// Called for each event, on the generation loop's thread.
    fn event(&mut self, event: RolloutEvent<'_>);
}

/// An observer that ignores everything.
pub struct Quiet;

impl RolloutObserver for Quiet {
    fn event(&mut self, _: RolloutEvent<'_>) {}
}

/// Runs `specs[i]` in `envs[i]` to the end, generating with `model`; returns one output per
/// spec, in order, and the rollout's statistics.
pub fn rollout<B: ModelBackend>(
    model: &Qwen2ForCausalLM<B>,
    chat: &Chat<'_>,
    envs: &mut [Box<dyn Environment>],
    specs: &[EpisodeSpec],
    settings: &RolloutSettings,
    bridge: &Bridge,
    device: &B::Device,
) -> Result<(Vec<EpisodeOutput>, RolloutStats), RolloutError> {
    engine::run(
        model, chat, envs, specs, settings, bridge, device, &mut Quiet,
    )
}

/// [`rollout`], reporting every event to `observer` as it happens.
#[allow(clippy::too_many_arguments)]
pub fn rollout_observed<B: ModelBackend>(
    model: &Qwen2ForCausalLM<B>,
    chat: &Chat<'_>,
    envs: &mut [Box<dyn Environment>],
    specs: &[EpisodeSpec],
    settings: &RolloutSettings,
    bridge: &Bridge,
    device: &B::Device,
    observer: &mut dyn RolloutObserver,
) -> Result<(Vec<EpisodeOutput>, RolloutStats), RolloutError> {
    engine::run(model, chat, envs, specs, settings, bridge, device, observer)
}
