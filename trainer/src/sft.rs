//! The SFT warm-start's data and loss: expert traces run through the real environment
//! ([`generate_traces`], with the variety of [`expert`]), rendered with the model's chat
//! template into token ids and a mask of the assistant's tokens ([`render`]), and the
//! cross-entropy on those tokens only ([`sft_loss`]).
//!
//! **What is a target.** The assistant's message content and the end-of-turn token that
//! closes it (`<|im_end|>` in ChatML templates), so the model learns to stop; not the
//! `<|im_start|>assistant\n` header, the system prompt, the question, nor any observation.
//! Spans are found by rendering the conversation turn by turn (the text of a prefix with the
//! generation prompt, then with the assistant's message) and mapped to tokens through the
//! tokenizer's offsets on the whole conversation, so the ids are exactly the template's
//! tokenization of the whole text.

pub mod expert;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use fathom_env::env::{EnvError, Environment, ResetRequest};
use fathom_env::policy::run_episode;
use fathom_model::ModelBackend;
use fathom_model::{ChatMessage, ChatRole, ModelError, Qwen2ForCausalLM, Tokenizer};
use fathom_rewards::record::{Family, Message, Role, Task};
use fathom_rewards::{Composite, ScoreError};
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::checkpoint::TrainRng;
use expert::{Style, VariedExpert};

/// How expert traces are made (a recipe's `sft.traces` section).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceSettings {
    /// Traces to run (train tasks are taken in turn).
    pub count: usize,
    /// Fraction of traces with a wasted first turn (over-reading, or an unneeded `llm()`
    /// call), in `[0, 1]`.
    pub wasteful_fraction: f64,
    /// Needle traces search with a two-line `re.findall` of the key's sentences instead of the
    /// expert's helper function: for small models, which learn the short form far sooner.
    /// Multi-hop traces then make one such search per hop, for the sentence in which the
    /// current courier hands the parcel on, and waste no turn unless `multi_hop_detours`
    /// says so. Optional; `false` when absent.
    #[serde(default)]
    pub short_search: bool,
    /// With `short_search`, multi-hop traces are drawn wasteful as other families' are
    /// (`wasteful_fraction`, `llm_share`): the wasted turn comes first and the hops follow, so
    /// the environment needs six turns for a four-hop chain (`env.max_turns`, checked with
    /// the recipe). Optional; `false` when absent, when multi-hop traces never waste a turn.
    #[serde(default)]
    pub multi_hop_detours: bool,
    /// With `short_search`, each hop's search in a multi-hop trace opens with the comment
    /// `# hop K of N` (N from the question), so the decision to search again or answer is a
    /// comparison of two numbers the model has just written, not a count of its own turns.
    /// On SmolLM2-135M it did not make the model count: it still learned one number of
    /// searches for every chain (docs/trainer.md). Optional; `false` when absent.
    #[serde(default)]
    pub count_hops: bool,
    /// With `short_search`, every turn of a multi-hop trace, the answer's included, opens with
    /// the line `Handed on N times, hops left: R.` (N in the question's own words, R the hops
    /// less the searches so far): the model copies N and writes the count, one less than its
    /// previous turn's, before it chooses between searching again and answering, and answers
    /// after `hops left: 0.` On SmolLM2-135M with LoRA the SFT model did not count (one seed
    /// each for two earlier forms of the line); with `tuning: Full` and this form it stopped
    /// at the question's number on two- and three-hop chains (one seed; docs/trainer.md).
    /// Optional; `false` when absent.
    #[serde(default)]
    pub tally_hops: bool,
    /// Sentences around the code and the answer (several openers, follow-ups and answer
    /// forms). With `false`, every assistant turn is a bare code block or a bare
    /// `<answer>…</answer>`, so a small model's first token is `` ``` `` or `<answer>` rather
    /// than a choice among many openings. Optional; `true` when absent.
    #[serde(default = "prose_by_default")]
    pub prose: bool,
    /// Of the wasteful traces, the fraction whose wasted turn sends a slice of the document to
    /// `llm()`; the others over-read (print a large slice). In `[0, 1]`; optional, `0.5` when
    /// absent. Over-reading is capped by the observation limit and costs little reward, while
    /// every `llm()` call lowers the recursion-efficiency reward, so a recipe that wants GRPO
    /// to learn to cut calls raises this.
    #[serde(default = "half")]
    pub llm_share: f64,
}

fn prose_by_default() -> bool {
    true
}

fn half() -> f64 {
    0.5
}

impl TraceSettings {
    /// Checks the values; the error names the offending field (relative to this section).
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.count == 0 {
            return Err(("count", "must be at least 1".into()));
        }
        if self.count_hops && !self.short_search {
            return Err((
                "count_hops",
                "numbers the searches of short multi-hop traces, so it needs short_search: true"
                    .into(),
            ));
        }
        if self.tally_hops && !self.short_search {
            return Err((
                "tally_hops",
                "counts the searches of short multi-hop traces, so it needs short_search: true"
                    .into(),
            ));
        }
        for (field, value) in [
            ("wasteful_fraction", self.wasteful_fraction),
            ("llm_share", self.llm_share),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err((field, format!("must be in [0, 1], got {value}")));
            }
        }
        Ok(())
    }
}

/// Errors of SFT data and loss.
#[derive(Debug, thiserror::Error)]
pub enum SftError {
    /// The environment failed (not the expert's code, which becomes observations).
    #[error("environment: {0}")]
    Env(#[from] EnvError),
    /// Scoring a trace failed.
    #[error("scoring trace of {task}: {error}")]
    Score {
        /// The task.
        task: String,
        /// The error.
        error: ScoreError,
    },
    /// The tokenizer, template or model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The chat template does not render a conversation as the concatenation of its turns.
    #[error("the chat template is not incremental at message {index}: {message}")]
    Template {
        /// The message.
        index: usize,
        /// What differed.
        message: String,
    },
    /// Malformed input.
    #[error("{0}")]
    Input(String),
}

/// One expert episode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    /// The task's id.
    pub task_id: String,
    /// Its family.
    pub family: Family,
    /// How the expert wrote it.
    pub style: Style,
    /// The conversation: system, question, assistant turns, observations, final answer.
    pub messages: Vec<Message>,
    /// Its total reward.
    pub reward: f64,
    /// Whether the answer was correct.
    pub correct: bool,
    /// `llm()` calls made.
    pub llm_calls: usize,
    /// Tool tokens (code and observations).
    pub tool_tokens: usize,
}

/// The style of trace `index` of a run seeded with `seed` (independent of other traces).
pub fn trace_style(seed: u64, index: u64, family: Family, settings: &TraceSettings) -> Style {
    let mut rng = TrainRng::seed_from_u64(seed);
    rng.set_stream(index);
    let style = Style::draw(
        &mut rng,
        family,
        settings.wasteful_fraction,
        settings.llm_share,
        settings.short_search,
        settings.multi_hop_detours,
    );
    let style = Style {
        count_hops: style.short_search && settings.count_hops && family == Family::MultiHop,
        tally_hops: style.short_search && settings.tally_hops && family == Family::MultiHop,
        ..style
    };
    if settings.prose {
        style
    } else {
        style.without_prose()
    }
}

/// Runs `settings.count` expert episodes through `env`, taking `tasks` in turn, each in a
/// style drawn from `seed` and its index, and scores them with `rewards`. Every trace is
/// returned; keep the correct ones for training ([`Trace::correct`]).
pub fn generate_traces(
    env: &mut dyn Environment,
    tasks: &[Task],
    rewards: &Composite,
    settings: &TraceSettings,
    seed: u64,
) -> Result<Vec<Trace>, SftError> {
    if tasks.is_empty() {
        return Err(SftError::Input("no tasks to write traces for".into()));
    }
    let mut out = Vec::with_capacity(settings.count);
    for i in 0..settings.count {
        let task = &tasks[i % tasks.len()];
        let style = trace_style(seed, i as u64, task.family, settings);
        let policy = VariedExpert {
            style: style.clone(),
        };
        let trajectory = run_episode(env, &policy, ResetRequest::Task(Box::new(task.clone())))?;
        let score = rewards
            .score(task, &trajectory)
            .map_err(|error| SftError::Score {
                task: task.id.clone(),
                error,
            })?;
        out.push(Trace {
            task_id: task.id.clone(),
            family: task.family,
            style,
            reward: score.total,
            correct: score.correct,
            llm_calls: trajectory.llm_call_count(),
            tool_tokens: trajectory.tool_tokens(),
            messages: trajectory.messages,
        });
    }
    Ok(out)
}

/// The environment's messages as chat-template messages.
pub fn chat_messages(messages: &[Message]) -> Vec<ChatMessage> {
    messages
        .iter()
        .map(|m| {
            let role = match m.role {
                Role::System => ChatRole::System,
                Role::User => ChatRole::User,
                Role::Assistant => ChatRole::Assistant,
            };
            ChatMessage::new(role, m.content.clone())
        })
        .collect()
}

/// A conversation as training data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SftExample {
    /// The template's tokenization of the whole conversation.
    pub ids: Vec<u32>,
    /// Per token: whether it is a target (assistant content or its end-of-turn token).
    pub targets: Vec<bool>,
}

impl SftExample {
    /// Number of target tokens.
    pub fn target_count(&self) -> usize {
        self.targets.iter().filter(|t| **t).count()
    }
}

/// Byte ranges of the rendered text that are assistant targets, and the rendered text.
pub fn assistant_spans(
    tokenizer: &Tokenizer,
    messages: &[ChatMessage],
) -> Result<(String, Vec<(usize, usize)>), SftError> {
    let full = tokenizer.apply_chat_template(messages, false)?;
    let mut spans = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.role != ChatRole::Assistant {
            continue;
        }
        let before = tokenizer.apply_chat_template(&messages[..i], true)?;
        let with = tokenizer.apply_chat_template(&messages[..=i], false)?;
        if !with.starts_with(&before) || !full.starts_with(&with) {
            return Err(SftError::Template {
                index: i,
                message: "a prefix of the conversation renders differently inside the whole".into(),
            });
        }
        let turn = &with[before.len()..];
        if !turn.contains(m.content.trim()) {
            return Err(SftError::Template {
                index: i,
                message: "the assistant's turn does not contain its message".into(),
            });
        }
        spans.push((before.len(), before.len() + turn.trim_end().len()));
    }
    Ok((full, spans))
}

/// Renders a conversation with the chat template and marks the assistant's tokens.
pub fn render(tokenizer: &Tokenizer, messages: &[ChatMessage]) -> Result<SftExample, SftError> {
    let (text, spans) = assistant_spans(tokenizer, messages)?;
    let (ids, offsets) = tokenizer.encode_with_offsets(&text, false)?;
    let targets = offsets
        .iter()
        .map(|&(s, e)| spans.iter().any(|&(a, b)| s < b && e > a))
        .collect();
    Ok(SftExample { ids, targets })
}

/// A batch for the SFT loss, aligned like `fathom_model::sequence_logprobs`' output.
#[derive(Clone, Debug, PartialEq)]
pub struct SftBatch {
    /// Token ids, right-padded.
    pub ids: Vec<Vec<u32>>,
    /// Attention mask.
    pub attention: Vec<Vec<u8>>,
    /// Weights `[B, T − 1]`, row-major: `1 / targets` where token `t + 1` is a target.
    pub weights: Vec<f32>,
    /// Target tokens in the batch.
    pub targets: usize,
}

/// Pads examples into a batch.
pub fn sft_batch(examples: &[&SftExample], pad_id: u32) -> Result<SftBatch, SftError> {
    let len = examples.iter().map(|e| e.ids.len()).max().unwrap_or(0);
    if len < 2 {
        return Err(SftError::Input(
            "an SFT batch needs sequences of 2 tokens or more".into(),
        ));
    }
    let targets: usize = examples
        .iter()
        .map(|e| e.targets.iter().skip(1).filter(|t| **t).count())
        .sum();
    if targets == 0 {
        return Err(SftError::Input("the batch has no assistant tokens".into()));
    }
    let cols = len - 1;
    let mut batch = SftBatch {
        ids: Vec::new(),
        attention: Vec::new(),
        weights: vec![0.0; examples.len() * cols],
        targets,
    };
    for (b, e) in examples.iter().enumerate() {
        if e.targets.len() != e.ids.len() {
            return Err(SftError::Input(format!(
                "example {b}: {} ids, {} target flags",
                e.ids.len(),
                e.targets.len()
            )));
        }
        let mut ids = e.ids.clone();
        ids.resize(len, pad_id);
        let mut attention = vec![1u8; e.ids.len()];
        attention.resize(len, 0);
        for t in 1..e.ids.len() {
            if e.targets[t] {
                batch.weights[b * cols + t - 1] = 1.0 / targets as f32;
            }
        }
        batch.ids.push(ids);
        batch.attention.push(attention);
    }
    Ok(batch)
}

/// The mean negative log-likelihood of the targets given the learner's log-probabilities
/// `[B, T − 1]` of the batch.
pub fn sft_loss_from_logprobs<B: Backend>(
    logprobs: Tensor<B, 2>,
    batch: &SftBatch,
    device: &B::Device,
) -> Tensor<B, 1> {
    let dims = logprobs.dims();
    let weights = Tensor::<B, 2>::from_data(TensorData::new(batch.weights.clone(), dims), device);
    (logprobs * weights).sum().neg()
}

/// The SFT loss of `model` on a batch (teacher-forced log-probabilities at temperature 1).
pub fn sft_loss<B: ModelBackend>(
    model: &Qwen2ForCausalLM<B>,
    batch: &SftBatch,
    device: &B::Device,
) -> Result<Tensor<B, 1>, SftError> {
    let logprobs =
        fathom_model::sequence_logprobs(model, &batch.ids, &batch.attention, 1.0, device)?;
    Ok(sft_loss_from_logprobs(logprobs, batch, device))
}

#[cfg(test)]
mod tests;
