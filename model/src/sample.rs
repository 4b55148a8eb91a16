//! Choosing next tokens from logits: greedy, or a draw from the temperature-scaled
//! distribution truncated by top-k and top-p, with one random stream per sequence (a
//! sequence's draws never depend on which other sequences share its batch).
//!
//! Nothing sorts the whole vocabulary: top-k and top-p partially select the candidates
//! (the top 64, then four times more while the nucleus is not yet covered), and an untruncated
//! draw walks the cumulative distribution once. On host backends the logits are read in
//! place; on GPU backends the reductions (max, log-sum-exp, top-k, cumulative sum) run on the
//! device and only a few values per sequence come back.
//!
//! Each chosen token comes with its log-probability under `log_softmax(logits / temperature)`
//! over the whole vocabulary, before truncation (greedy decoding uses temperature 1): the
//! quantity a policy-gradient importance ratio needs when the learner recomputes it.

use burn::tensor::{Tensor, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::backend::ModelBackend;
use crate::error::{ModelError, Result};

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

impl Sampling {
    /// Checks the parameters; returns what is wrong.
    pub fn validate(&self) -> Result<()> {
        if let Sampling::Sample {
            temperature, top_p, ..
        } = *self
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
        Ok(())
    }

    /// The softmax temperature (1 for greedy decoding).
    pub fn temperature(&self) -> f32 {
        match self {
            Sampling::Greedy => 1.0,
            Sampling::Sample { temperature, .. } => *temperature,
        }
    }
}

/// The random stream of sequence `stream` under `seed`: independent streams for different
/// sequences, the same stream for the same pair.
pub fn sequence_rng(seed: u64, stream: u64) -> StdRng {
    // splitmix64 of the pair, so nearby seeds and streams give unrelated states.
    let mut z = seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    StdRng::seed_from_u64(z ^ (z >> 31))
}

/// Candidates the first partial selection keeps when only top-p truncates.
const FIRST_CANDIDATES: usize = 64;

/// Chooses one token per row of `logits` `[rows, vocab]`, drawing from `rngs[row]`; returns each
/// token with its log-probability (see the module docs).
pub fn sample<B: ModelBackend>(
    logits: Tensor<B, 2>,
    sampling: Sampling,
    rngs: &mut [StdRng],
) -> Result<Vec<(u32, f32)>> {
    sampling.validate()?;
    let [rows, vocab] = logits.dims();
    if rngs.len() != rows {
        return Err(ModelError::Input(format!(
            "{} random streams for {rows} rows",
            rngs.len()
        )));
    }
    if B::HOST {
        // Rows in parallel: each draws from its own stream, so the choices are those of a
        // sequential pass.
        let values = read_f32(logits.into_data())?;
        return Ok(values
            .par_chunks_exact(vocab)
            .zip(rngs.par_iter_mut())
            .map(|(row, rng)| choose(row, sampling, rng))
            .collect());
    }
    sample_on_device(logits, sampling, rngs)
}

fn read_f32(data: TensorData) -> Result<Vec<f32>> {
    data.into_vec::<f32>()
        .map_err(|e| ModelError::Input(format!("reading logits: {e:?}")))
}

fn read_i64(data: TensorData) -> Result<Vec<i64>> {
    Ok(data.iter::<i64>().collect())
}

/// The device path: reductions on the device, a few values per row to the host.
fn sample_on_device<B: ModelBackend>(
    logits: Tensor<B, 2>,
    sampling: Sampling,
    rngs: &mut [StdRng],
) -> Result<Vec<(u32, f32)>> {
    let [rows, vocab] = logits.dims();
    let device = logits.device();
    let z = pad_row(logits, &device).div_scalar(sampling.temperature());
    let max = z.clone().max_dim(1);
    let lse = max.clone() + (z.clone() - max).exp().sum_dim(1).log();
    match sampling {
        Sampling::Greedy => {
            let (best, index) = z.max_dim_with_indices(1);
            let logp = read_f32((best - lse).into_data())?;
            let index = read_i64(index.into_data())?;
            Ok(index
                .into_iter()
                .zip(logp)
                .map(|(i, lp)| (i as u32, lp))
                .collect())
        }
        Sampling::Sample { top_p, top_k, .. } if top_k == 0 && top_p >= 1.0 => {
            // Inverse CDF on the device: count the cumulative probabilities below each draw.
            let draws: Vec<f32> = rngs.iter_mut().map(|r| r.random::<f32>()).collect();
            let draws = Tensor::<B, 2>::from_data(TensorData::new(draws, [rows, 1]), &device);
            let cumulative = (z.clone() - lse.clone()).exp().cumsum(1);
            let index = cumulative
                .lower(draws.expand([rows, z.dims()[1]]))
                .int()
                .sum_dim(1)
                .clamp_max(vocab as i64 - 1);
            let logp = z.gather(1, index.clone()) - lse;
            let logp = read_f32(logp.into_data())?;
            let index = read_i64(index.into_data())?;
            Ok(index
                .into_iter()
                .zip(logp)
                .map(|(i, lp)| (i as u32, lp))
                .collect())
        }
        Sampling::Sample { top_p, top_k, .. } => {
            let lse_host = read_f32(lse.into_data())?;
            let mut k = if top_k > 0 { top_k } else { FIRST_CANDIDATES }.min(vocab);
            loop {
                let (values, index) = z.clone().topk_with_indices(k, 1);
                let values = read_f32(values.into_data())?;
                let index = read_i64(index.into_data())?;
                // Enough candidates when top-k bounds them, or each row's nucleus is covered.
                let covered = top_k > 0
                    || k == vocab
                    || values.chunks_exact(k).zip(&lse_host).all(|(row, &lse)| {
                        row.iter().map(|&v| ((v - lse) as f64).exp()).sum::<f64>() >= top_p as f64
                    });
                if covered {
                    return Ok((0..rows)
                        .map(|r| {
                            let cand: Vec<(usize, f32)> = (0..k)
                                .map(|j| (index[r * k + j] as usize, values[r * k + j]))
                                .collect();
                            let pick = nucleus_draw(&cand, lse_host[r], top_p, &mut rngs[r]);
                            (pick.0 as u32, pick.1 - lse_host[r])
                        })
                        .collect());
                }
                k = (k * 4).min(vocab);
            }
        }
    }
}

/// Rows of `logits` padded with `-inf` to a multiple of [`ROW_ALIGN`] columns, which no
/// reduction, top-k or cumulative sum below can pick or count (an index past the vocabulary is
/// clamped back into it). Why: burn 0.21's reductions on wgpu read a row as 4-wide lines only
/// when its length is a multiple of 4, and with single-element lines they drop elements once a
/// row holds more than 65,535 of them — on Qwen2.5's 151,665-token tokenizer, the argmax came
/// back 0 and the log-sum-exp counted 65,532 logits (found by `xtask/tests/infer.rs`' CPU
/// against wgpu episode).
fn pad_row<B: ModelBackend>(logits: Tensor<B, 2>, device: &B::Device) -> Tensor<B, 2> {
    let [rows, vocab] = logits.dims();
    let pad = vocab.next_multiple_of(ROW_ALIGN) - vocab;
    if pad == 0 {
        return logits;
    }
    let fill = Tensor::<B, 2>::full([rows, pad], f32::NEG_INFINITY, device);
    Tensor::cat(vec![logits, fill], 1)
}

/// Columns the device path pads a row of logits to (see [`pad_row`]).
const ROW_ALIGN: usize = 4;

/// Picks a token from one row of logits; returns it with its log-probability.
pub fn choose(logits: &[f32], sampling: Sampling, rng: &mut StdRng) -> (u32, f32) {
    let temperature = sampling.temperature();
    let scaled: Vec<f32> = logits.iter().map(|l| l / temperature).collect();
    let max = scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Unnormalised probabilities, kept for the draw's walk over them.
    let weights: Vec<f64> = scaled.iter().map(|l| ((l - max) as f64).exp()).collect();
    let sum: f64 = weights.iter().sum();
    let log_z = max + sum.ln() as f32;
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
        Sampling::Sample { top_p, top_k, .. } if top_k == 0 && top_p >= 1.0 => {
            // One pass over the cumulative distribution.
            let mut draw = rng.random::<f64>() * sum;
            let mut pick = scaled.len() - 1;
            for (i, &p) in weights.iter().enumerate() {
                if draw < p {
                    pick = i;
                    break;
                }
                draw -= p;
            }
            pick
        }
        Sampling::Sample { top_p, top_k, .. } => {
            let mut k = if top_k > 0 { top_k } else { FIRST_CANDIDATES }.min(scaled.len());
            loop {
                let cand = top_candidates(&scaled, k);
                let mass: f64 = cand.iter().map(|&(_, v)| ((v - log_z) as f64).exp()).sum();
                if top_k > 0 || k == scaled.len() || mass >= top_p as f64 {
                    break nucleus_draw(&cand, log_z, top_p, rng).0;
                }
                k = (k * 4).min(scaled.len());
            }
        }
    };
    (token as u32, scaled[token] - log_z)
}

/// The `k` largest values with their indices, largest first (ties: lower index first), by
/// partial selection.
fn top_candidates(values: &[f32], k: usize) -> Vec<(usize, f32)> {
    let order = |a: &u32, b: &u32| {
        values[*b as usize]
            .total_cmp(&values[*a as usize])
            .then(a.cmp(b))
    };
    let mut index: Vec<u32> = (0..values.len() as u32).collect();
    if k < index.len() {
        index.select_nth_unstable_by(k - 1, order);
        index.truncate(k);
    }
    index.sort_unstable_by(order);
    index
        .into_iter()
        .map(|i| (i as usize, values[i as usize]))
        .collect()
}

/// Draws from the smallest prefix of `candidates` (largest first) whose probability reaches
/// `top_p`; returns the candidate.
fn nucleus_draw(
    candidates: &[(usize, f32)],
    log_z: f32,
    top_p: f32,
    rng: &mut StdRng,
) -> (usize, f32) {
    let probs: Vec<f64> = candidates
        .iter()
        .map(|&(_, v)| ((v - log_z) as f64).exp())
        .collect();
    let mut keep = probs.len();
    let mut mass = 0.0;
    for (i, p) in probs.iter().enumerate() {
        mass += p;
        if mass >= top_p as f64 {
            keep = i + 1;
            break;
        }
    }
    let kept: f64 = probs[..keep].iter().sum();
    let mut draw = rng.random::<f64>() * kept;
    for (i, p) in probs[..keep].iter().enumerate() {
        if draw < *p {
            return candidates[i];
        }
        draw -= p;
    }
    candidates[keep - 1]
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
        let top1 = Sampling::Sample {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 1,
        };
        for _ in 0..20 {
            assert_eq!(choose(&logits, top1, &mut rng).0, 1);
        }
        let draw = |seed, sampling| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..50)
                .map(|_| choose(&logits, sampling, &mut rng).0)
                .collect::<Vec<_>>()
        };
        for sampling in [
            Sampling::Sample {
                temperature: 1.5,
                top_p: 0.9,
                top_k: 0,
            },
            Sampling::Sample {
                temperature: 1.5,
                top_p: 1.0,
                top_k: 0,
            },
        ] {
            assert_eq!(draw(3, sampling), draw(3, sampling));
            assert!(draw(3, sampling).contains(&3), "both likely tokens appear");
            assert!(draw(3, sampling).contains(&1), "both likely tokens appear");
        }
    }

    #[test]
    fn top_p_restricts_to_the_nucleus_even_beyond_the_first_candidates() {
        // token 0 holds ~88% of the mass; top_p 0.5 keeps it alone.
        let logits = [4.0, 2.0, 0.0, 0.0];
        let mut rng = StdRng::seed_from_u64(1);
        let nucleus = Sampling::Sample {
            temperature: 1.0,
            top_p: 0.5,
            top_k: 0,
        };
        for _ in 0..50 {
            assert_eq!(choose(&logits, nucleus, &mut rng).0, 0);
        }
        // A flat distribution over 1000 tokens: top_p 0.9 needs 900 candidates, more than the
        // first partial selection keeps; every draw stays inside the first 900 indices (ties
        // break by index).
        let flat = vec![0.0f32; 1000];
        let wide = Sampling::Sample {
            temperature: 1.0,
            top_p: 0.9,
            top_k: 0,
        };
        let picks: Vec<u32> = (0..200).map(|_| choose(&flat, wide, &mut rng).0).collect();
        assert!(picks.iter().all(|&t| t < 900));
        assert!(
            picks.iter().any(|&t| t >= 64),
            "the nucleus grew past 64 candidates"
        );
    }

    #[test]
    fn partial_selection_matches_a_full_sort() {
        let values: Vec<f32> = (0..500).map(|i| ((i * 7919) % 101) as f32 / 7.0).collect();
        let mut full: Vec<(usize, f32)> = values.iter().copied().enumerate().collect();
        full.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for k in [1, 5, 64, 499, 500] {
            assert_eq!(top_candidates(&values, k), full[..k].to_vec(), "k = {k}");
        }
    }

    #[test]
    fn streams_differ_by_sequence_and_repeat_by_seed() {
        let first = |seed, stream| sequence_rng(seed, stream).random::<u64>();
        assert_eq!(first(1, 2), first(1, 2));
        assert_ne!(first(1, 2), first(1, 3));
        assert_ne!(first(1, 2), first(2, 2));
    }
}
