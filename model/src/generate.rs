//! Generation, split at the seams a rollout engine drives: [`prefill`] appends token segments
//! to cache rows and returns each segment's next-token logits, [`crate::sample::sample`]
//! chooses tokens, and [`stop_hit`] checks stop strings. [`generate`] puts them together for a
//! batch of prompts (greedy or sampled, EOS and stop strings, one random stream per prompt).
//!
//! Prompts are packed, never padded: each prompt owns a cache row, and a step feeds only the
//! rows still running.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use crate::backend::ModelBackend;
use crate::cache::KvCache;
use crate::error::{ModelError, Result};
use crate::qwen2::Qwen2ForCausalLM;
use crate::sample::{Sampling, sample, sequence_rng};
use crate::tokenizer::Tokenizer;

/// Settings of one generation call.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateConfig {
    /// Upper bound on new tokens per sequence.
    pub max_new_tokens: usize,
    /// Token choice.
    pub sampling: Sampling,
    /// Tokens that end a sequence (kept as its last token).
    pub eos_ids: Vec<u32>,
    /// Strings that end a sequence once its generated text contains one (needs a tokenizer).
    pub stop_strings: Vec<String>,
    /// Seed of the sampling streams (prompt `i` draws from `sequence_rng(seed, i)`).
    pub seed: u64,
    /// Use the KV cache (prefill, then one token per step); without it every step re-runs the
    /// whole sequence (slow; for checking the cache).
    pub use_cache: bool,
}

impl GenerateConfig {
    /// Greedy decoding of up to `max_new_tokens` with the cache and no stop condition.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            sampling: Sampling::Greedy,
            eos_ids: Vec::new(),
            stop_strings: Vec::new(),
            seed: 0,
            use_cache: true,
        }
    }
}

/// Why a sequence stopped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token was produced.
    Eos,
    /// A stop string appeared in the generated text.
    Stop {
        /// The stop string.
        text: String,
    },
    /// `max_new_tokens` was reached.
    Length,
}

/// The result of a generation call, one entry per prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    /// New tokens per prompt.
    pub tokens: Vec<Vec<u32>>,
    /// Log-probability of each new token (see [`crate::sample`]).
    pub logprobs: Vec<Vec<f32>>,
    /// Why each sequence stopped.
    pub finish: Vec<FinishReason>,
}

/// Appends each `(row, ids)` segment to its cache row and returns the logits after each
/// segment's last token, `[segments, vocab]`, in segment order.
pub fn prefill<B: ModelBackend>(
    model: &Qwen2ForCausalLM<B>,
    cache: &mut KvCache<B>,
    segments: &[(usize, &[u32])],
    device: &B::Device,
) -> Result<Tensor<B, 2>> {
    let input = model.cached_input(cache, segments, device)?;
    let hidden = model.forward_hidden(&input, Some(cache));
    Ok(model.logits(last_positions(hidden, &input.spans)))
}

/// The rows of packed hidden states at each span's last token.
///
/// # Shapes
/// - `hidden`: `[n, hidden]`; output: `[spans, hidden]`
pub fn last_positions<B: Backend>(
    hidden: Tensor<B, 2>,
    spans: &[crate::backend::Span],
) -> Tensor<B, 2> {
    let index: Vec<i64> = spans.iter().map(|s| (s.start + s.len - 1) as i64).collect();
    let n = index.len();
    let device = hidden.device();
    hidden.select(
        0,
        Tensor::<B, 1, Int>::from_data(TensorData::new(index, [n]), &device),
    )
}

/// Generates continuations of `prompts` (token ids, any lengths).
pub fn generate<B: ModelBackend>(
    model: &Qwen2ForCausalLM<B>,
    prompts: &[Vec<u32>],
    config: &GenerateConfig,
    tokenizer: Option<&Tokenizer>,
    device: &B::Device,
) -> Result<Generated> {
    let n = prompts.len();
    let mut out = Generated {
        tokens: vec![vec![]; n],
        logprobs: vec![vec![]; n],
        finish: vec![FinishReason::Length; n],
    };
    if n == 0 {
        return Ok(out);
    }
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        return Err(ModelError::Input(format!("prompt {i} is empty")));
    }
    config.sampling.validate()?;
    if !config.stop_strings.is_empty() && tokenizer.is_none() {
        return Err(ModelError::Input("stop strings need a tokenizer".into()));
    }
    if config.max_new_tokens == 0 {
        return Ok(out);
    }
    let mut rngs: Vec<StdRng> = (0..n)
        .map(|i| sequence_rng(config.seed, i as u64))
        .collect();
    let max_stop = config
        .stop_strings
        .iter()
        .map(String::len)
        .max()
        .unwrap_or(0);
    let mut cache = model.new_cache();
    cache.add_rows(n);
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    let mut active: Vec<usize> = (0..n).collect();
    // First step: every prompt whole.
    let segments: Vec<(usize, &[u32])> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| (i, p.as_slice()))
        .collect();
    let mut logits = if config.use_cache {
        prefill(model, &mut cache, &segments, device)?
    } else {
        uncached_logits(model, &seqs, &active, device)?
    };
    for step in 0..config.max_new_tokens {
        let mut row_rngs: Vec<StdRng> = active.iter().map(|&r| rngs[r].clone()).collect();
        let picks = sample(logits, config.sampling, &mut row_rngs)?;
        for (&row, rng) in active.iter().zip(row_rngs) {
            rngs[row] = rng;
        }
        let mut still = Vec::with_capacity(active.len());
        for (&row, (token, logprob)) in active.iter().zip(picks) {
            out.tokens[row].push(token);
            out.logprobs[row].push(logprob);
            seqs[row].push(token);
            if config.eos_ids.contains(&token) {
                out.finish[row] = FinishReason::Eos;
            } else if let Some(stop) =
                stop_hit(tokenizer, &out.tokens[row], &config.stop_strings, max_stop)
            {
                out.finish[row] = FinishReason::Stop { text: stop };
            } else {
                still.push(row);
            }
        }
        if still.is_empty() || step + 1 == config.max_new_tokens {
            break;
        }
        active = still;
        logits = if config.use_cache {
            let last: Vec<[u32; 1]> = active
                .iter()
                .map(|&r| [*seqs[r].last().expect("token")])
                .collect();
            let segments: Vec<(usize, &[u32])> = active
                .iter()
                .zip(&last)
                .map(|(&r, t)| (r, t.as_slice()))
                .collect();
            prefill(model, &mut cache, &segments, device)?
        } else {
            uncached_logits(model, &seqs, &active, device)?
        };
    }
    Ok(out)
}

/// The next-token logits of the given sequences, recomputed from scratch.
fn uncached_logits<B: ModelBackend>(
    model: &Qwen2ForCausalLM<B>,
    seqs: &[Vec<u32>],
    rows: &[usize],
    device: &B::Device,
) -> Result<Tensor<B, 2>> {
    let chosen: Vec<&[u32]> = rows.iter().map(|&r| seqs[r].as_slice()).collect();
    let input = model.packed_input(&chosen, device)?;
    let hidden = model.forward_hidden(&input, None);
    Ok(model.logits(last_positions(hidden, &input.spans)))
}

/// The stop string the generated tokens now contain, if any. Only the tail of the text is
/// decoded (enough tokens to cover the longest stop string), so the check stays cheap.
pub fn stop_hit(
    tokenizer: Option<&Tokenizer>,
    tokens: &[u32],
    stops: &[String],
    max_stop: usize,
) -> Option<String> {
    let tokenizer = tokenizer?;
    if stops.is_empty() {
        return None;
    }
    // A token decodes to at least one byte or is part of a multi-byte character; max_stop + 8
    // tokens always cover max_stop bytes of text.
    let tail = &tokens[tokens.len().saturating_sub(max_stop + 8)..];
    let text = tokenizer.decode(tail, false).ok()?;
    stops.iter().find(|s| text.contains(s.as_str())).cloned()
}
