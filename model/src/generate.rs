//! Batched generation with a KV cache (left-padded prompts, greedy or sampled with temperature,
//! top-k and top-p from a seeded generator, EOS and stop strings), and teacher-forced per-token
//! log-probabilities of given sequences for the trainer's loss.
//!
//! Each generated token comes with its log-probability under the distribution it was drawn
//! from: `log_softmax(logits / temperature)` over the whole vocabulary, before top-k / top-p
//! truncation (greedy decoding uses temperature 1). That is the quantity a policy-gradient
//! importance ratio needs when the learner recomputes it at the same temperature.

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::nf4::Nf4Backend;
use crate::qwen2::Qwen2ForCausalLM;
use crate::tokenizer::Tokenizer;

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Sampling {
    /// The most likely token (the first one on ties).
    Greedy,
    /// A draw from the temperature-scaled distribution, truncated to the `top_k` most likely
    /// tokens (0 = no limit) and then to the smallest set whose probability reaches `top_p`.
    Sample {
        /// Softmax temperature (> 0).
        temperature: f32,
        /// Nucleus mass in (0, 1].
        top_p: f32,
        /// Keep at most this many tokens (0 = all).
        top_k: usize,
    },
}

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
    /// Seed of the sampling generator.
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
    /// Log-probability of each new token (see the module docs).
    pub logprobs: Vec<Vec<f32>>,
    /// Why each sequence stopped.
    pub finish: Vec<FinishReason>,
}

/// Generates continuations of `prompts` (token ids, any lengths; they are left-padded).
pub fn generate<B: Nf4Backend>(
    model: &Qwen2ForCausalLM<B>,
    prompts: &[Vec<u32>],
    config: &GenerateConfig,
    tokenizer: Option<&Tokenizer>,
    device: &B::Device,
) -> Result<Generated> {
    if prompts.is_empty() {
        return Ok(Generated {
            tokens: vec![],
            logprobs: vec![],
            finish: vec![],
        });
    }
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        return Err(ModelError::Input(format!("prompt {i} is empty")));
    }
    if let Sampling::Sample {
        temperature, top_p, ..
    } = config.sampling
    {
        if !(temperature > 0.0 && temperature.is_finite()) {
            return Err(ModelError::Input(format!(
                "temperature must be positive, got {temperature}"
            )));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ModelError::Input(format!(
                "top_p must be in (0, 1], got {top_p}"
            )));
        }
    }
    if !config.stop_strings.is_empty() && tokenizer.is_none() {
        return Err(ModelError::Input("stop strings need a tokenizer".into()));
    }
    let n = prompts.len();
    let width = prompts.iter().map(Vec::len).max().unwrap_or(0);
    // Left-pad with token 0 (masked out).
    let mut seqs: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| [vec![0; width - p.len()], p.clone()].concat())
        .collect();
    let mut masks: Vec<Vec<u8>> = prompts
        .iter()
        .map(|p| [vec![0u8; width - p.len()], vec![1u8; p.len()]].concat())
        .collect();
    let mut out = Generated {
        tokens: vec![vec![]; n],
        logprobs: vec![vec![]; n],
        finish: vec![FinishReason::Length; n],
    };
    if config.max_new_tokens == 0 {
        return Ok(out);
    }
    let mut rng = StdRng::seed_from_u64(config.seed);
    let mut active: Vec<usize> = (0..n).collect();
    let mut cache = config.use_cache.then(|| model.new_cache());
    let max_stop = config
        .stop_strings
        .iter()
        .map(|s| s.len())
        .max()
        .unwrap_or(0);

    // First step: the whole (padded) prompt.
    let mut logits = last_logits(model, &seqs, &masks, 0, cache.as_mut(), device)?;
    for step in 0..config.max_new_tokens {
        let vocab = logits.len() / active.len();
        let mut still = Vec::with_capacity(active.len());
        let mut next_tokens = Vec::with_capacity(active.len());
        for (slot, &row) in active.iter().enumerate() {
            let row_logits = &logits[slot * vocab..(slot + 1) * vocab];
            let (token, logprob) = choose(row_logits, config.sampling, &mut rng);
            out.tokens[row].push(token);
            out.logprobs[row].push(logprob);
            seqs[row].push(token);
            masks[row].push(1);
            if config.eos_ids.contains(&token) {
                out.finish[row] = FinishReason::Eos;
            } else if let Some(stop) =
                stop_hit(tokenizer, &out.tokens[row], &config.stop_strings, max_stop)
            {
                out.finish[row] = FinishReason::Stop { text: stop };
            } else {
                still.push(slot);
                next_tokens.push(token);
            }
        }
        if still.is_empty() || step + 1 == config.max_new_tokens {
            break;
        }
        let rows: Vec<usize> = still.iter().map(|&s| active[s]).collect();
        logits = match cache.as_mut() {
            Some(cache) => {
                if still.len() != active.len() {
                    cache.select_rows(&still);
                }
                let past = cache.len();
                let ids: Vec<Vec<u32>> = next_tokens.iter().map(|&t| vec![t]).collect();
                let mask: Vec<Vec<u8>> = rows.iter().map(|&r| masks[r].clone()).collect();
                last_logits(model, &ids, &mask, past, Some(cache), device)?
            }
            None => {
                let ids: Vec<Vec<u32>> = rows.iter().map(|&r| seqs[r].clone()).collect();
                let mask: Vec<Vec<u8>> = rows.iter().map(|&r| masks[r].clone()).collect();
                last_logits(model, &ids, &mask, 0, None, device)?
            }
        };
        active = rows;
    }
    Ok(out)
}

/// Runs one step and returns the logits of each row's last position, row-major `[rows, vocab]`.
fn last_logits<B: Nf4Backend>(
    model: &Qwen2ForCausalLM<B>,
    ids: &[Vec<u32>],
    mask: &[Vec<u8>],
    past: usize,
    cache: Option<&mut crate::cache::KvCache<B>>,
    device: &B::Device,
) -> Result<Vec<f32>> {
    let input = model.step_input(ids, mask, past, device)?;
    let hidden = model.forward_hidden(&input, cache);
    let [batch, seq, width] = hidden.dims();
    let last = hidden.slice([0..batch, seq - 1..seq, 0..width]);
    let logits = model.logits(last);
    logits
        .into_data()
        .to_vec::<f32>()
        .map_err(|e| ModelError::Input(format!("reading logits: {e:?}")))
}

/// Picks a token from one row of logits; returns it with its log-probability.
fn choose(logits: &[f32], sampling: Sampling, rng: &mut StdRng) -> (u32, f32) {
    let temperature = match sampling {
        Sampling::Greedy => 1.0,
        Sampling::Sample { temperature, .. } => temperature,
    };
    let scaled: Vec<f32> = logits.iter().map(|l| l / temperature).collect();
    let max = scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_z = max
        + scaled
            .iter()
            .map(|l| ((l - max) as f64).exp())
            .sum::<f64>()
            .ln() as f32;
    let token = match sampling {
        Sampling::Greedy => {
            let mut best = 0;
            for (i, &l) in scaled.iter().enumerate() {
                if l > scaled[best] {
                    best = i;
                }
            }
            best
        }
        Sampling::Sample { top_p, top_k, .. } => {
            let mut order: Vec<usize> = (0..scaled.len()).collect();
            order.sort_unstable_by(|&a, &b| scaled[b].total_cmp(&scaled[a]).then(a.cmp(&b)));
            if top_k > 0 {
                order.truncate(top_k);
            }
            let probs: Vec<f64> = order
                .iter()
                .map(|&i| ((scaled[i] - max) as f64).exp())
                .collect();
            let total: f64 = probs.iter().sum();
            // nucleus: the smallest prefix whose mass reaches top_p
            let mut keep = probs.len();
            let mut mass = 0.0;
            for (i, p) in probs.iter().enumerate() {
                mass += p / total;
                if mass >= top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            let kept_total: f64 = probs[..keep].iter().sum();
            let mut draw = rng.random::<f64>() * kept_total;
            let mut pick = order[keep - 1];
            for (i, p) in probs[..keep].iter().enumerate() {
                if draw < *p {
                    pick = order[i];
                    break;
                }
                draw -= p;
            }
            pick
        }
    };
    (token as u32, scaled[token] - log_z)
}

/// The stop string the generated tokens now contain, if any. Only the tail of the text is
/// decoded (enough tokens to cover the longest stop string), so the check stays cheap.
fn stop_hit(
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

/// Teacher-forced log-probabilities: entry `[b, t]` is `log p(ids[b][t + 1] | ids[b][..=t])`.
/// Differentiable under autodiff (the trainer's loss is built on it). Rows must have equal
/// length; `mask` marks real tokens (left padding allowed).
///
/// # Shapes
/// - output: `[batch, seq - 1]`
pub fn sequence_logprobs<B: Nf4Backend>(
    model: &Qwen2ForCausalLM<B>,
    ids: &[Vec<u32>],
    mask: &[Vec<u8>],
    temperature: f32,
    device: &B::Device,
) -> Result<Tensor<B, 2>> {
    let seq = ids.first().map(Vec::len).unwrap_or(0);
    if seq < 2 {
        return Err(ModelError::Input(
            "sequences need at least two tokens".into(),
        ));
    }
    let input = model.step_input(ids, mask, 0, device)?;
    let logits = model.forward(&input, None);
    Ok(token_logprobs(logits, ids, temperature, device))
}

/// `log_softmax(logits / temperature)` gathered at the next token of each position.
///
/// # Shapes
/// - `logits`: `[batch, seq, vocab]`
/// - output: `[batch, seq - 1]`
pub fn token_logprobs<B: Backend>(
    logits: Tensor<B, 3>,
    ids: &[Vec<u32>],
    temperature: f32,
    device: &B::Device,
) -> Tensor<B, 2> {
    let [batch, seq, vocab] = logits.dims();
    let logp = log_softmax(
        logits
            .slice([0..batch, 0..seq - 1, 0..vocab])
            .div_scalar(temperature),
        2,
    );
    let targets: Vec<i64> = ids
        .iter()
        .flat_map(|row| row[1..].iter().map(|&t| t as i64))
        .collect();
    let targets =
        Tensor::<B, 3, Int>::from_data(TensorData::new(targets, [batch, seq - 1, 1]), device);
    logp.gather(2, targets).reshape([batch, seq - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum_and_reports_its_logprob() {
        let mut rng = StdRng::seed_from_u64(0);
        let (t, lp) = choose(&[0.0, 2.0, 2.0, -1.0], Sampling::Greedy, &mut rng);
        assert_eq!(t, 1);
        let z = (0f64.exp() + 2f64.exp() * 2.0 + (-1f64).exp()).ln();
        assert!((lp as f64 - (2.0 - z)).abs() < 1e-6);
    }

    #[test]
    fn top_k_one_is_greedy_and_sampling_is_seeded() {
        let logits = [0.5, 3.0, 1.0, 2.9];
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..20 {
            let (t, _) = choose(
                &logits,
                Sampling::Sample {
                    temperature: 1.0,
                    top_p: 1.0,
                    top_k: 1,
                },
                &mut rng,
            );
            assert_eq!(t, 1);
        }
        let draw = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..50)
                .map(|_| {
                    choose(
                        &logits,
                        Sampling::Sample {
                            temperature: 1.5,
                            top_p: 0.9,
                            top_k: 0,
                        },
                        &mut rng,
                    )
                    .0
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert!(draw(3).iter().any(|&t| t == 3), "both likely tokens appear");
    }

    #[test]
    fn top_p_restricts_to_the_nucleus() {
        // token 0 holds ~88% of the mass; top_p 0.5 keeps it alone.
        let logits = [4.0, 2.0, 0.0, 0.0];
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..50 {
            let (t, _) = choose(
                &logits,
                Sampling::Sample {
                    temperature: 1.0,
                    top_p: 0.5,
                    top_k: 0,
                },
                &mut rng,
            );
            assert_eq!(t, 0);
        }
    }
}
