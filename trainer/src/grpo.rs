//! GRPO over multi-turn episodes: group-normalised advantages, the learner's batch built from
//! finished episodes, and the clipped policy-gradient loss with its statistics. Plain
//! functions over plain data; the training loop calls them in order (advantages → batch →
//! learner log-probabilities → loss → backward).
//!
//! # The objective
//!
//! For a batch of `B` episodes (`G` per prompt), with per-token log-probabilities `ℓ` under
//! the learner, `ℓ_old` under the rollout policy and optionally `ℓ_ref` under the frozen
//! reference, and one advantage `A_b` per episode:
//!
//! ```text
//! r_t      = exp(ℓ_t − ℓ_old,t)
//! loss_t   = −min(r_t·A_b, clip(r_t, 1 − ε_low, 1 + ε_high)·A_b) + β·k3_t
//! k3_t     = exp(ℓ_ref,t − ℓ_t) − (ℓ_ref,t − ℓ_t) − 1
//! loss     = Σ_{b,t} m_{b,t} · loss_t · w_{b}      (m: the loss mask)
//! ```
//!
//! with the weights `w` chosen by [`LossNormalization`]: `1 / (B · n_b)` per sequence (GRPO),
//! `1 / Σ n` over the batch (DAPO's token-level mean), or `1 / (B · L)` for a constant `L`
//! (Dr. GRPO), where `n_b` is the number of loss tokens of episode `b`.
//!
//! # Where this departs from the papers
//!
//! - **Multi-turn episodes.** GRPO (DeepSeekMath), DAPO and Dr. GRPO score one completion per
//!   sample. Here a sample is a whole episode — system prompt, question, assistant turns, and
//!   the environment's observations between them — and the loss mask is 1 only on tokens the
//!   policy sampled. Prompt and observation tokens are context, never targets. One advantage
//!   per episode applies to every sampled token of every turn (outcome supervision).
//! - **Advantages.** `A = (R − mean_g) / (std_g + 1e-4)` with the *sample* standard deviation
//!   (`n − 1`, as TRL computes it); the paper leaves the estimator unspecified. Division by
//!   the standard deviation is optional ([`group_advantages`]'s `scale_by_std`), since
//!   Dr. GRPO shows it biases updates toward easy and hard prompts. Groups whose rewards are
//!   all equal get advantage 0 and are reported ([`Advantages::zero_variance`]); RAPO decides
//!   what to do with them (`crate::rapo`).
//! - **The ratio** is taken against the log-probabilities recorded while sampling, so with one
//!   optimiser step per batch it is exactly 1 at that step (GRPO with μ = 1); with several
//!   steps per batch it is PPO's ratio. The log-ratio is clamped to `[−20, 20]` before
//!   exponentiation so that one token far off-policy (a replayed trajectory, see
//!   `crate::rapo`) cannot overflow f32; inside that range nothing changes.
//! - **Clip-higher** (DAPO): `ε_low` and `ε_high` are separate. No dual clip: for negative
//!   advantages the ratio is unbounded above, as in PPO and GRPO.
//! - **KL.** The k3 estimator per token, inside the normalisation, as GRPO writes it; β = 0 by
//!   default (DAPO and Dr. GRPO drop the term), and then no reference pass is needed.
//! - **Per-sequence normalisation** divides by the number of episodes `B` including those with
//!   no sampled token (an episode that failed before generating anything contributes 0).
//! - **Dr. GRPO's constant** `L` is the recipe's `max_tokens` (the generation budget of an
//!   episode), not the batch's longest episode, so the weight of a token never depends on
//!   what else is in the batch.
//! - Entropy is reported, never added to the loss.

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Tensor, TensorData};
use serde::{Deserialize, Serialize};

/// Added to the group's standard deviation before dividing.
pub const STD_EPS: f64 = 1e-4;

/// Rewards closer than this count as equal when deciding that a group has zero variance.
pub const ZERO_VARIANCE_TOL: f64 = 1e-9;

/// The bound on `|ℓ − ℓ_old|` before exponentiation.
pub const MAX_LOG_RATIO: f64 = 20.0;

/// How per-token losses are averaged.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum LossNormalization {
    /// GRPO: the mean over episodes of each episode's token mean.
    PerSequence,
    /// DAPO: the sum over all loss tokens of the batch divided by their number.
    TokenLevel,
    /// Dr. GRPO: the sum over all loss tokens divided by `B · max_tokens`.
    DrGrpo {
        /// The constant `L` (the generation budget of an episode, in tokens).
        max_tokens: usize,
    },
}

/// The policy loss's settings (a recipe's `grpo.loss` section).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossSettings {
    /// Lower clip range: ratios below `1 − epsilon_low` stop pushing down (in `[0, 1)`).
    pub epsilon_low: f64,
    /// Upper clip range: ratios above `1 + epsilon_high` stop pushing up (≥ 0).
    pub epsilon_high: f64,
    /// Weight of the k3 KL to the reference (≥ 0; 0 needs no reference pass).
    pub beta: f64,
    /// How per-token losses are averaged.
    pub normalization: LossNormalization,
    /// Divide advantages by the group's standard deviation (GRPO) or not (Dr. GRPO).
    pub scale_by_std: bool,
}

impl LossSettings {
    /// Checks the values; the error names the offending field (relative to this section).
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(0.0..1.0).contains(&self.epsilon_low) {
            return Err((
                "epsilon_low",
                format!("must be in [0, 1), got {}", self.epsilon_low),
            ));
        }
        if !(self.epsilon_high.is_finite() && self.epsilon_high >= 0.0) {
            return Err((
                "epsilon_high",
                format!("must be ≥ 0, got {}", self.epsilon_high),
            ));
        }
        if !(self.beta.is_finite() && self.beta >= 0.0) {
            return Err(("beta", format!("must be ≥ 0, got {}", self.beta)));
        }
        if let LossNormalization::DrGrpo { max_tokens: 0 } = self.normalization {
            return Err((
                "normalization",
                "DrGrpo's max_tokens must be positive".into(),
            ));
        }
        Ok(())
    }

    /// Whether the loss needs reference log-probabilities.
    pub fn needs_reference(&self) -> bool {
        self.beta > 0.0
    }
}

/// Errors of malformed batches (a bug in the caller, reported rather than panicking).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrpoError {
    /// The rewards do not split into whole groups.
    #[error("{rewards} rewards do not form groups of {group_size}")]
    Groups {
        /// Number of rewards.
        rewards: usize,
        /// Group size.
        group_size: usize,
    },
    /// A sample's arrays disagree in length, or it is empty.
    #[error("sample {index}: {message}")]
    Sample {
        /// Position in the batch.
        index: usize,
        /// What is wrong.
        message: String,
    },
    /// Tensors or vectors with the wrong shape.
    #[error("shape mismatch: {0}")]
    Shape(String),
}

/// Group-normalised advantages of one batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Advantages {
    /// One advantage per episode, in the order of the rewards (group after group).
    pub values: Vec<f64>,
    /// Per group: whether all its rewards were equal (its advantages are all 0).
    pub zero_variance: Vec<bool>,
    /// Per group: the mean reward.
    pub means: Vec<f64>,
    /// Per group: the sample standard deviation of the rewards.
    pub stds: Vec<f64>,
    /// The group size.
    pub group_size: usize,
}

impl Advantages {
    /// Number of groups.
    pub fn groups(&self) -> usize {
        self.zero_variance.len()
    }

    /// Fraction of groups with zero reward variance.
    pub fn zero_variance_fraction(&self) -> f64 {
        if self.zero_variance.is_empty() {
            return 0.0;
        }
        self.zero_variance.iter().filter(|z| **z).count() as f64 / self.groups() as f64
    }

    /// The (population) variance of the advantages over the batch.
    pub fn variance(&self) -> f64 {
        let n = self.values.len().max(1) as f64;
        let mean = self.values.iter().sum::<f64>() / n;
        self.values.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / n
    }
}

/// Advantages of `rewards` laid out group after group (`group_size` consecutive rewards per
/// prompt): `(R − mean) / (std + 1e-4)` with `scale_by_std`, else `R − mean`.
///
/// ```
/// use fathom_trainer::grpo::group_advantages;
/// let a = group_advantages(&[1.0, 0.0, 0.5, 0.5], 2, false).unwrap();
/// assert_eq!(a.values, vec![0.5, -0.5, 0.0, 0.0]);
/// assert_eq!(a.zero_variance, vec![false, true]);
/// ```
pub fn group_advantages(
    rewards: &[f64],
    group_size: usize,
    scale_by_std: bool,
) -> Result<Advantages, GrpoError> {
    if group_size == 0 || rewards.is_empty() || !rewards.len().is_multiple_of(group_size) {
        return Err(GrpoError::Groups {
            rewards: rewards.len(),
            group_size,
        });
    }
    let mut out = Advantages {
        values: Vec::with_capacity(rewards.len()),
        zero_variance: Vec::new(),
        means: Vec::new(),
        stds: Vec::new(),
        group_size,
    };
    for group in rewards.chunks(group_size) {
        let n = group.len() as f64;
        let mean = group.iter().sum::<f64>() / n;
        let std = if group.len() > 1 {
            (group.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        let (lo, hi) = group
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &r| {
                (lo.min(r), hi.max(r))
            });
        let flat = hi - lo <= ZERO_VARIANCE_TOL;
        for r in group {
            out.values.push(if flat {
                0.0
            } else if scale_by_std {
                (r - mean) / (std + STD_EPS)
            } else {
                r - mean
            });
        }
        out.zero_variance.push(flat);
        out.means.push(mean);
        out.stds.push(std);
    }
    Ok(out)
}

/// One finished episode as the learner sees it: every token in order and, per token, whether
/// the policy sampled it and with what log-probability.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The conversation's token ids: prompt, sampled turns and observations, in order.
    pub ids: Vec<u32>,
    /// Per token: true where the policy sampled it (its loss mask); false for prompt and
    /// observation tokens.
    pub sampled: Vec<bool>,
    /// Per token: the log-probability it was sampled with (0 where not sampled). Serialised
    /// through f64 so that checkpoints restore it bit for bit.
    #[serde(with = "exact_f32")]
    pub logprobs: Vec<f32>,
}

/// Serialises f32 values as f64 (exact), so a JSON round trip restores them bit for bit
/// (serde_json's `float_roundtrip` parses f64 exactly; parsing a shortest f32 decimal
/// through f64 could round twice).
mod exact_f32 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(values: &[f32], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(values.iter().map(|v| f64::from(*v)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f32>, D::Error> {
        Ok(Vec::<f64>::deserialize(d)?
            .into_iter()
            .map(|v| v as f32)
            .collect())
    }
}

impl Sample {
    /// Number of sampled tokens.
    pub fn sampled_tokens(&self) -> usize {
        self.sampled.iter().filter(|s| **s).count()
    }

    fn check(&self, index: usize) -> Result<(), GrpoError> {
        let err = |message: String| GrpoError::Sample { index, message };
        if self.ids.len() < 2 {
            return Err(err(format!("{} tokens; at least 2 needed", self.ids.len())));
        }
        if self.sampled.len() != self.ids.len() || self.logprobs.len() != self.ids.len() {
            return Err(err(format!(
                "{} ids, {} mask entries, {} log-probabilities",
                self.ids.len(),
                self.sampled.len(),
                self.logprobs.len()
            )));
        }
        if self.sampled[0] {
            return Err(err(
                "the first token cannot be sampled (nothing precedes it)".into(),
            ));
        }
        if let Some(t) =
            (0..self.ids.len()).find(|&t| self.sampled[t] && !self.logprobs[t].is_finite())
        {
            return Err(err(format!(
                "sampled token {t} has log-probability {}",
                self.logprobs[t]
            )));
        }
        Ok(())
    }
}

/// The learner's batch on the host, aligned with `fathom_model::sequence_logprobs`: its entry
/// `[b, t]` is the log-probability of token `t + 1` given tokens `..= t`.
#[derive(Clone, Debug, PartialEq)]
pub struct HostBatch {
    /// Token ids, right-padded to a common length `T`.
    pub ids: Vec<Vec<u32>>,
    /// Attention mask, 1 on real tokens.
    pub attention: Vec<Vec<u8>>,
    /// Loss mask `[B, T − 1]`, row-major: 1 where token `t + 1` was sampled.
    pub loss_mask: Vec<f32>,
    /// Rollout log-probabilities `[B, T − 1]`, row-major (0 where the mask is 0).
    pub old_logprobs: Vec<f32>,
    /// Loss tokens per episode.
    pub row_tokens: Vec<usize>,
}

impl HostBatch {
    /// Number of episodes `B`.
    pub fn rows(&self) -> usize {
        self.ids.len()
    }

    /// Number of predicted positions per row, `T − 1`.
    pub fn cols(&self) -> usize {
        self.ids.first().map(|r| r.len() - 1).unwrap_or(0)
    }

    /// Loss tokens in the whole batch.
    pub fn tokens(&self) -> usize {
        self.row_tokens.iter().sum()
    }
}

/// Lays episodes out for the learner: right-padded with `pad_id`, shifted by one so that each
/// entry refers to the token it predicts.
pub fn host_batch(samples: &[&Sample], pad_id: u32) -> Result<HostBatch, GrpoError> {
    for (i, s) in samples.iter().enumerate() {
        s.check(i)?;
    }
    let len = samples.iter().map(|s| s.ids.len()).max().unwrap_or(0);
    if len == 0 {
        return Err(GrpoError::Shape("empty batch".into()));
    }
    let cols = len - 1;
    let mut batch = HostBatch {
        ids: Vec::with_capacity(samples.len()),
        attention: Vec::with_capacity(samples.len()),
        loss_mask: vec![0.0; samples.len() * cols],
        old_logprobs: vec![0.0; samples.len() * cols],
        row_tokens: Vec::with_capacity(samples.len()),
    };
    for (b, s) in samples.iter().enumerate() {
        let n = s.ids.len();
        let mut ids = s.ids.clone();
        ids.resize(len, pad_id);
        let mut attention = vec![1u8; n];
        attention.resize(len, 0);
        for t in 1..n {
            if s.sampled[t] {
                batch.loss_mask[b * cols + t - 1] = 1.0;
                batch.old_logprobs[b * cols + t - 1] = s.logprobs[t];
            }
        }
        batch.ids.push(ids);
        batch.attention.push(attention);
        batch.row_tokens.push(s.sampled_tokens());
    }
    Ok(batch)
}

/// The per-batch tensors of the loss, on the device.
#[derive(Clone, Debug)]
pub struct LossBatch<B: Backend> {
    /// Rollout log-probabilities `[B, T]`.
    pub old_logprobs: Tensor<B, 2>,
    /// Each episode's advantage repeated over its row, `[B, T]`.
    pub advantages: Tensor<B, 2>,
    /// Normalisation weights `[B, T]`: the loss mask times the normaliser of its row.
    pub weights: Tensor<B, 2>,
    /// True where the loss mask is 0, `[B, T]`.
    pub excluded: Tensor<B, 2, Bool>,
    /// Host copies for the statistics.
    host: HostStats,
}

#[derive(Clone, Debug)]
struct HostStats {
    mask: Vec<f32>,
    advantages: Vec<f32>,
    tokens: usize,
}

impl<B: Backend> LossBatch<B> {
    /// Uploads a host batch with one advantage per episode, choosing the weights of
    /// `normalization`.
    pub fn new(
        batch: &HostBatch,
        advantages: &[f64],
        normalization: LossNormalization,
        device: &B::Device,
    ) -> Result<Self, GrpoError> {
        let (rows, cols) = (batch.rows(), batch.cols());
        if advantages.len() != rows {
            return Err(GrpoError::Shape(format!(
                "{} advantages for {rows} episodes",
                advantages.len()
            )));
        }
        let total = batch.tokens().max(1) as f64;
        let mut adv = Vec::with_capacity(rows * cols);
        let mut weights = Vec::with_capacity(rows * cols);
        for (b, &a) in advantages.iter().enumerate() {
            let row_weight = match normalization {
                LossNormalization::PerSequence => {
                    1.0 / (rows as f64 * batch.row_tokens[b].max(1) as f64)
                }
                LossNormalization::TokenLevel => 1.0 / total,
                LossNormalization::DrGrpo { max_tokens } => {
                    1.0 / (rows as f64 * max_tokens.max(1) as f64)
                }
            };
            for t in 0..cols {
                adv.push(a as f32);
                weights.push((batch.loss_mask[b * cols + t] as f64 * row_weight) as f32);
            }
        }
        let tensor =
            |v: Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(v, [rows, cols]), device);
        let excluded: Vec<bool> = batch.loss_mask.iter().map(|m| *m == 0.0).collect();
        Ok(Self {
            old_logprobs: tensor(batch.old_logprobs.clone()),
            advantages: tensor(adv.clone()),
            weights: tensor(weights),
            excluded: Tensor::from_data(TensorData::new(excluded, [rows, cols]), device),
            host: HostStats {
                mask: batch.loss_mask.clone(),
                advantages: adv,
                tokens: batch.tokens(),
            },
        })
    }

    /// `[B, T]`.
    pub fn dims(&self) -> [usize; 2] {
        self.old_logprobs.dims()
    }

    /// Episodes `rows` of the batch, with the weights of the whole: the losses of a partition
    /// of the rows add up to the whole batch's loss (and so do their gradients).
    ///
    /// # Panics
    /// When `rows` is empty or reaches past the batch.
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Self {
        let [total, cols] = self.dims();
        assert!(
            rows.start < rows.end && rows.end <= total,
            "rows {rows:?} of a batch of {total}"
        );
        let span = rows.start * cols..rows.end * cols;
        let mask = self.host.mask[span.clone()].to_vec();
        Self {
            old_logprobs: self.old_logprobs.clone().slice([rows.clone(), 0..cols]),
            advantages: self.advantages.clone().slice([rows.clone(), 0..cols]),
            weights: self.weights.clone().slice([rows.clone(), 0..cols]),
            excluded: self.excluded.clone().slice([rows, 0..cols]),
            host: HostStats {
                tokens: mask.iter().filter(|m| **m != 0.0).count(),
                mask,
                advantages: self.host.advantages[span].to_vec(),
            },
        }
    }
}

/// What the loss saw, for the metrics (means over loss tokens).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LossStats {
    /// Fraction of loss tokens with a negative advantage whose ratio fell below `1 − ε_low`.
    pub clip_low: f64,
    /// Fraction of loss tokens with a positive advantage whose ratio rose above `1 + ε_high`.
    pub clip_high: f64,
    /// Mean importance ratio.
    pub mean_ratio: f64,
    /// Mean k3 KL to the reference, when reference log-probabilities were given.
    pub kl: Option<f64>,
    /// Mean per-token entropy, when given.
    pub entropy: Option<f64>,
    /// Loss tokens in the batch.
    pub tokens: usize,
}

impl LossStats {
    /// The statistics of a batch from those of the parts it was run in (means weighted by
    /// each part's loss tokens).
    pub fn merge(parts: &[LossStats]) -> LossStats {
        let tokens: usize = parts.iter().map(|p| p.tokens).sum();
        let n = tokens.max(1) as f64;
        let mean = |f: &dyn Fn(&LossStats) -> f64| {
            parts.iter().map(|p| f(p) * p.tokens as f64).sum::<f64>() / n
        };
        let optional = |f: &dyn Fn(&LossStats) -> Option<f64>| {
            parts
                .iter()
                .map(|p| f(p).map(|v| v * p.tokens as f64))
                .sum::<Option<f64>>()
                .map(|v| v / n)
        };
        LossStats {
            clip_low: mean(&|p| p.clip_low),
            clip_high: mean(&|p| p.clip_high),
            mean_ratio: mean(&|p| p.mean_ratio),
            kl: optional(&|p| p.kl),
            entropy: optional(&|p| p.entropy),
            tokens,
        }
    }
}

/// The loss tensor and its statistics.
#[derive(Debug)]
pub struct PolicyLoss<B: Backend> {
    /// The scalar loss, `[1]`, differentiable through the learner's log-probabilities.
    pub loss: Tensor<B, 1>,
    /// Statistics (computed on detached values).
    pub stats: LossStats,
}

/// The clipped policy-gradient loss (see the module docs).
///
/// # Shapes
/// - `new_logprobs`, `ref_logprobs`, `entropy`: `[B, T]`, as the batch
pub fn policy_loss<B: Backend>(
    new_logprobs: Tensor<B, 2>,
    batch: &LossBatch<B>,
    ref_logprobs: Option<Tensor<B, 2>>,
    entropy: Option<Tensor<B, 2>>,
    settings: &LossSettings,
) -> Result<PolicyLoss<B>, GrpoError> {
    let dims = batch.dims();
    for (name, t) in [
        ("new_logprobs", Some(&new_logprobs)),
        ("ref_logprobs", ref_logprobs.as_ref()),
        ("entropy", entropy.as_ref()),
    ] {
        if let Some(t) = t
            && t.dims() != dims
        {
            return Err(GrpoError::Shape(format!(
                "{name} is {:?}, the batch is {dims:?}",
                t.dims()
            )));
        }
    }
    if settings.beta > 0.0 && ref_logprobs.is_none() {
        return Err(GrpoError::Shape(
            "beta > 0 needs reference log-probabilities".into(),
        ));
    }
    // Excluded positions are replaced by constants, so whatever the learner computed there
    // (padding, observations) can neither reach the loss nor its gradient, not even as NaN.
    let new = new_logprobs.mask_fill(batch.excluded.clone(), 0.0);
    let log_ratio = (new.clone() - batch.old_logprobs.clone()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO);
    let ratio = log_ratio.exp();
    let clipped = ratio
        .clone()
        .clamp(1.0 - settings.epsilon_low, 1.0 + settings.epsilon_high);
    let surrogate =
        (ratio.clone() * batch.advantages.clone()).min_pair(clipped * batch.advantages.clone());
    let mut per_token = surrogate.neg();
    let mut kl_values = None;
    if let Some(reference) = ref_logprobs {
        let d = reference.mask_fill(batch.excluded.clone(), 0.0) - new.clone();
        let k3 = d.clone().exp() - d - 1.0;
        kl_values = Some(k3.clone().detach());
        if settings.beta > 0.0 {
            per_token = per_token + k3.mul_scalar(settings.beta);
        }
    }
    let loss = (per_token * batch.weights.clone()).sum();
    let stats = stats(&batch.host, ratio.detach(), kl_values, entropy, settings);
    Ok(PolicyLoss { loss, stats })
}

fn host_values<B: Backend>(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec()
        .expect("f32 data converts to a vector")
}

fn stats<B: Backend>(
    host: &HostStats,
    ratio: Tensor<B, 2>,
    kl: Option<Tensor<B, 2>>,
    entropy: Option<Tensor<B, 2>>,
    settings: &LossSettings,
) -> LossStats {
    let ratio = host_values(ratio);
    let n = host.tokens.max(1) as f64;
    let masked_mean = |values: &[f32]| {
        values
            .iter()
            .zip(&host.mask)
            .filter(|(_, m)| **m != 0.0)
            .map(|(v, _)| *v as f64)
            .sum::<f64>()
            / n
    };
    let (mut low, mut high) = (0usize, 0usize);
    for ((r, a), m) in ratio.iter().zip(&host.advantages).zip(&host.mask) {
        if *m == 0.0 {
            continue;
        }
        let r = *r as f64;
        if *a < 0.0 && r < 1.0 - settings.epsilon_low {
            low += 1;
        }
        if *a > 0.0 && r > 1.0 + settings.epsilon_high {
            high += 1;
        }
    }
    LossStats {
        clip_low: low as f64 / n,
        clip_high: high as f64 / n,
        mean_ratio: masked_mean(&ratio),
        kl: kl.map(|k| masked_mean(&host_values(k))),
        entropy: entropy.map(|e| masked_mean(&host_values(e.detach()))),
        tokens: host.tokens,
    }
}

#[cfg(test)]
mod tests;
