//! RAPO (Fathom-DeepResearch's Reward-Aware Policy Optimisation): three zero-overhead fixes
//! for GRPO's "bad groups", the groups whose G rewards are all equal and so carry no gradient.
//!
//! 1. **Pruning** ([`SolveRates`]): a prompt whose running solve rate reached a threshold
//!    (the paper drops prompts with SolveRate ≥ 0.9) is no longer drawn.
//! 2. **Dropping and rescaling** ([`drop_flat_groups`]): zero-variance groups leave the
//!    learner's batch, and the advantages of the remaining ("good") groups are multiplied by
//!    `n_groups / n_good`, so the update keeps the magnitude it would have had if every group
//!    had carried signal. (The paper writes `G / G_good` with `G` the number of groups of the
//!    batch; the group size does not enter.)
//! 3. **Replay** ([`ReplayBuffer`]): the latest trajectory of each prompt whose reward exceeded
//!    a threshold (the paper: `R > 0.5`) is kept; when a later group of that prompt fails
//!    entirely, the stored trajectory replaces its worst member, restoring variance.
//!
//! # A replayed trajectory's log-probabilities
//!
//! A replayed trajectory was sampled by an older policy `π_k'`. The buffer stores its token
//! ids, its loss mask and the log-probabilities it was *sampled with*, and those become its
//! "old" log-probabilities in the batch ([`crate::grpo::host_batch`]). The importance ratio
//! is therefore `π_θ / π_k'` — the correct ratio for data from a behaviour policy `π_k'` — and
//! it is clipped as usual. In an all-fail group the replayed sample has a positive advantage,
//! so the clip acts only above: once the current policy is already `1 + ε_high` times more
//! likely than the behaviour policy to write a token, that token stops pushing; where the
//! policy has drifted away from it (ratio < 1) the update is weighted by the ratio. We never
//! recompute its old log-probabilities under the current policy: that would pretend the
//! trajectory is on-policy and give it an unclipped full-weight update. The stored values must
//! come from the same temperature the learner uses (the rollout engine records them so).
//!
//! RAPO's step-level reward is a reward component (`fathom_rewards::step_level`), set in a
//! recipe's `rewards` section like any other.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::grpo::{Advantages, Sample};

/// RAPO's settings (a recipe's `rapo` section).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RapoSettings {
    /// Stop drawing a prompt once its running solve rate reaches this (in `(0, 1]`); `None`
    /// never prunes.
    pub prune_solve_rate: Option<f64>,
    /// Attempts a prompt needs before it can be pruned (≥ 1).
    pub min_attempts: u64,
    /// Drop zero-variance groups from the learner's batch and rescale the rest by
    /// `n_groups / n_good`.
    pub rescale_advantages: bool,
    /// The replay buffer; `None` disables it.
    pub replay: Option<ReplaySettings>,
}

impl RapoSettings {
    /// Checks the values; the error names the offending field (relative to this section).
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if let Some(t) = self.prune_solve_rate
            && !(t > 0.0 && t <= 1.0)
        {
            return Err(("prune_solve_rate", format!("must be in (0, 1], got {t}")));
        }
        if self.min_attempts == 0 {
            return Err(("min_attempts", "must be at least 1".into()));
        }
        if let Some(r) = &self.replay
            && !r.min_reward.is_finite()
        {
            return Err((
                "replay",
                format!("min_reward must be finite, got {}", r.min_reward),
            ));
        }
        Ok(())
    }
}

/// The replay buffer's settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplaySettings {
    /// A trajectory succeeds when its reward is above this; a group fails when none does.
    pub min_reward: f64,
}

/// Attempts and successes of one prompt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SolveCount {
    /// Episodes run.
    pub attempts: u64,
    /// Episodes that solved it.
    pub solved: u64,
}

impl SolveCount {
    /// `solved / attempts` (0 before any attempt).
    pub fn rate(&self) -> f64 {
        if self.attempts == 0 {
            0.0
        } else {
            self.solved as f64 / self.attempts as f64
        }
    }
}

/// Running solve rates per prompt (by task id), over the whole run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SolveRates {
    counts: BTreeMap<String, SolveCount>,
}

impl SolveRates {
    /// Records a group's outcomes for `prompt`.
    pub fn record(&mut self, prompt: &str, solved: impl IntoIterator<Item = bool>) {
        let c = self.counts.entry(prompt.to_string()).or_default();
        for s in solved {
            c.attempts += 1;
            c.solved += u64::from(s);
        }
    }

    /// The counts of `prompt`, if it was attempted.
    pub fn get(&self, prompt: &str) -> Option<SolveCount> {
        self.counts.get(prompt).copied()
    }

    /// Whether `prompt` is pruned under `settings` (never when pruning is off).
    pub fn is_pruned(&self, prompt: &str, settings: &RapoSettings) -> bool {
        let Some(threshold) = settings.prune_solve_rate else {
            return false;
        };
        self.get(prompt)
            .is_some_and(|c| c.attempts >= settings.min_attempts && c.rate() >= threshold)
    }

    /// How many prompts are pruned under `settings`.
    pub fn pruned(&self, settings: &RapoSettings) -> usize {
        self.counts
            .keys()
            .filter(|p| self.is_pruned(p, settings))
            .count()
    }

    /// The solve rate over every attempt recorded.
    pub fn overall(&self) -> f64 {
        let (a, s) = self
            .counts
            .values()
            .fold((0, 0), |(a, s), c| (a + c.attempts, s + c.solved));
        SolveCount {
            attempts: a,
            solved: s,
        }
        .rate()
    }
}

/// The episodes that stay in the learner's batch after zero-variance groups are dropped.
#[derive(Clone, Debug, PartialEq)]
pub struct GoodGroups {
    /// Indices of the kept episodes (into the batch's episodes, group after group).
    pub rows: Vec<usize>,
    /// Their advantages, rescaled.
    pub advantages: Vec<f64>,
    /// The factor applied, `n_groups / n_good` (1 when nothing was dropped, or when every
    /// group was flat and `rows` is empty).
    pub factor: f64,
}

/// Drops zero-variance groups; with `rescale`, multiplies the remaining advantages by
/// `n_groups / n_good`.
///
/// The factor restores the magnitude of a loss whose normaliser counts every episode of the
/// full batch (per-sequence with `B` = all episodes, or Dr. GRPO's `B · L`), as in the paper.
/// A loss normalised over the kept episodes only (DAPO's token-level mean, or per-sequence
/// with `B` = kept episodes) already loses no magnitude by dropping, so rescaling there
/// enlarges the update by the factor; the recipe's `rescale_advantages` chooses.
///
/// ```
/// use fathom_trainer::grpo::group_advantages;
/// use fathom_trainer::rapo::drop_flat_groups;
/// let a = group_advantages(&[1.0, 0.0, 0.0, 0.0], 2, false).unwrap();
/// let good = drop_flat_groups(&a, true);
/// assert_eq!(good.rows, vec![0, 1]);
/// assert_eq!(good.advantages, vec![1.0, -1.0]);
/// ```
pub fn drop_flat_groups(advantages: &Advantages, rescale: bool) -> GoodGroups {
    let g = advantages.group_size;
    let good: Vec<usize> = (0..advantages.groups())
        .filter(|&i| !advantages.zero_variance[i])
        .collect();
    let factor = if rescale && !good.is_empty() {
        advantages.groups() as f64 / good.len() as f64
    } else {
        1.0
    };
    let rows: Vec<usize> = good.iter().flat_map(|&i| i * g..(i + 1) * g).collect();
    let values = rows
        .iter()
        .map(|&r| advantages.values[r] * factor)
        .collect();
    GoodGroups {
        rows,
        advantages: values,
        factor,
    }
}

/// A stored successful trajectory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Replayed {
    /// Its tokens, loss mask and the log-probabilities it was sampled with.
    pub sample: Sample,
    /// Its reward when it was scored.
    pub reward: f64,
    /// The training step that produced it.
    pub step: u64,
}

/// Where a replayed trajectory went.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Injection {
    /// The position in the group it replaced.
    pub index: usize,
    /// The step it was sampled at.
    pub from_step: u64,
}

/// The latest successful trajectory of each prompt.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReplayBuffer {
    entries: BTreeMap<String, Replayed>,
}

impl ReplayBuffer {
    /// Stores `sample` as `prompt`'s latest success if its reward exceeds the threshold
    /// (replacing an older one); returns whether it was stored.
    pub fn offer(
        &mut self,
        prompt: &str,
        sample: &Sample,
        reward: f64,
        step: u64,
        settings: &ReplaySettings,
    ) -> bool {
        if reward > settings.min_reward {
            self.entries.insert(
                prompt.to_string(),
                Replayed {
                    sample: sample.clone(),
                    reward,
                    step,
                },
            );
            true
        } else {
            false
        }
    }

    /// The stored trajectory of `prompt`.
    pub fn get(&self, prompt: &str) -> Option<&Replayed> {
        self.entries.get(prompt)
    }

    /// Number of prompts with a stored trajectory.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// If every reward of the group is at or below the threshold and `prompt` has a stored
    /// success, replaces the group's worst episode (the last of equals) with it, sample and
    /// reward alike. Groups with any success are left alone.
    pub fn inject(
        &self,
        prompt: &str,
        samples: &mut [Sample],
        rewards: &mut [f64],
        settings: &ReplaySettings,
    ) -> Option<Injection> {
        if samples.is_empty() || samples.len() != rewards.len() {
            return None;
        }
        if rewards.iter().any(|r| *r > settings.min_reward) {
            return None;
        }
        let stored = self.entries.get(prompt)?;
        let index = (0..rewards.len())
            .rev()
            .min_by(|&a, &b| rewards[a].total_cmp(&rewards[b]))?;
        samples[index] = stored.sample.clone();
        rewards[index] = stored.reward;
        Some(Injection {
            index,
            from_step: stored.step,
        })
    }
}

/// Everything RAPO carries from step to step (saved in checkpoints).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RapoState {
    /// Running solve rates.
    pub solve_rates: SolveRates,
    /// The replay buffer.
    pub replay: ReplayBuffer,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpo::{
        LossBatch, LossNormalization, LossSettings, group_advantages, host_batch, policy_loss,
    };
    use burn::backend::Autodiff;
    use burn::tensor::{Tensor, TensorData};
    use fathom_model::Cpu;

    fn settings() -> RapoSettings {
        RapoSettings {
            prune_solve_rate: Some(0.9),
            min_attempts: 8,
            rescale_advantages: true,
            replay: Some(ReplaySettings { min_reward: 0.5 }),
        }
    }

    fn sample(tag: u32) -> Sample {
        Sample {
            ids: vec![1, tag, tag + 1, 2],
            sampled: vec![false, true, true, false],
            logprobs: vec![0.0, -0.3, -1.2, 0.0],
        }
    }

    #[test]
    fn pruning_follows_the_running_solve_rate() {
        let s = settings();
        let mut rates = SolveRates::default();
        rates.record("easy", [true; 7]);
        assert!(
            !rates.is_pruned("easy", &s),
            "7 attempts are fewer than min_attempts"
        );
        rates.record("easy", [true]);
        assert!(rates.is_pruned("easy", &s));
        rates.record("hard", [true, true, true, true, true, true, false, false]);
        assert!(!rates.is_pruned("hard", &s), "6/8 < 0.9");
        // The rate is running: later failures bring a pruned prompt back under the threshold.
        rates.record("easy", [false, false]);
        assert_eq!(rates.get("easy").unwrap().rate(), 0.8);
        assert!(!rates.is_pruned("easy", &s));
        assert!(!rates.is_pruned("never-seen", &s));
        let off = RapoSettings {
            prune_solve_rate: None,
            ..s.clone()
        };
        rates.record("solved", [true; 10]);
        assert!(rates.is_pruned("solved", &s) && !rates.is_pruned("solved", &off));
        assert_eq!(rates.pruned(&s), 1);
        assert!((rates.overall() - 24.0 / 28.0).abs() < 1e-12);
    }

    #[test]
    fn flat_groups_are_dropped_and_the_rest_rescaled_by_groups_over_good_groups() {
        let rewards = [
            1.0, 0.0, 0.0, 0.0, // good
            0.0, 0.0, 0.0, 0.0, // flat (all fail)
            1.0, 1.0, 0.0, 1.0, // good
            1.0, 1.0, 1.0, 1.0, // flat (all succeed)
        ];
        let a = group_advantages(&rewards, 4, true).unwrap();
        let good = drop_flat_groups(&a, true);
        assert_eq!(good.rows, vec![0, 1, 2, 3, 8, 9, 10, 11]);
        assert_eq!(good.factor, 2.0);
        for (k, &r) in good.rows.iter().enumerate() {
            assert_eq!(good.advantages[k], 2.0 * a.values[r]);
        }
        let plain = drop_flat_groups(&a, false);
        assert_eq!(plain.rows, good.rows);
        assert_eq!(plain.factor, 1.0);
        // All flat: nothing to learn from.
        let flat = group_advantages(&[0.0; 4], 2, true).unwrap();
        let none = drop_flat_groups(&flat, true);
        assert!(none.rows.is_empty() && none.factor == 1.0);
    }

    #[test]
    fn replay_injects_the_latest_success_into_all_fail_groups_only() {
        let replay = ReplaySettings { min_reward: 0.5 };
        let mut buffer = ReplayBuffer::default();
        assert!(
            !buffer.offer("p", &sample(10), 0.25, 1, &replay),
            "a failure is not stored"
        );
        assert!(buffer.offer("p", &sample(20), 0.9, 2, &replay));
        assert!(
            buffer.offer("p", &sample(30), 0.8, 3, &replay),
            "the latest success wins"
        );
        assert_eq!(buffer.get("p").unwrap().step, 3);

        // A group with a success is untouched.
        let mut samples = vec![sample(1), sample(2), sample(3)];
        let mut rewards = vec![0.0, 0.95, 0.1];
        assert_eq!(
            buffer.inject("p", &mut samples, &mut rewards, &replay),
            None
        );
        assert_eq!(rewards, vec![0.0, 0.95, 0.1]);

        // An all-fail group gets the stored success in place of its worst member.
        let mut rewards = vec![0.1, -0.2, 0.25];
        let injected = buffer
            .inject("p", &mut samples, &mut rewards, &replay)
            .unwrap();
        assert_eq!(
            injected,
            Injection {
                index: 1,
                from_step: 3
            }
        );
        assert_eq!(samples[1], sample(30));
        assert_eq!(rewards, vec![0.1, 0.8, 0.25]);
        // ... which restores variance: the replayed episode now has the only positive advantage.
        let a = group_advantages(&rewards, 3, true).unwrap();
        assert!(!a.zero_variance[0]);
        assert!(a.values[1] > 0.0 && a.values[0] < 0.0 && a.values[2] < 0.0);

        // Nothing stored for another prompt.
        let mut rewards = vec![0.0; 3];
        assert_eq!(
            buffer.inject("q", &mut samples, &mut rewards, &replay),
            None
        );
    }

    /// The replayed sample's stored log-probabilities are its "old" log-probabilities: the ratio
    /// is taken against the behaviour policy and clipped as usual.
    #[test]
    fn a_replayed_sample_is_weighted_against_the_policy_that_sampled_it() {
        type Ad = Autodiff<Cpu>;
        let device = Default::default();
        let replayed = sample(7); // sampled with log-probs −0.3 and −1.2
        let batch = host_batch(&[&replayed], 0).unwrap();
        assert_eq!(batch.old_logprobs, vec![-0.3, -1.2, 0.0]);
        let loss_settings = LossSettings {
            epsilon_low: 0.2,
            epsilon_high: 0.28,
            beta: 0.0,
            normalization: LossNormalization::TokenLevel,
            scale_by_std: true,
        };
        let lb =
            LossBatch::<Ad>::new(&batch, &[1.0], LossNormalization::TokenLevel, &device).unwrap();
        // The current policy: much likelier than the behaviour policy on the first token
        // (ratio e^1 > 1.28: clipped, no gradient), less likely on the second (ratio e^−0.5:
        // weighted by the ratio).
        let new =
            Tensor::<Ad, 2>::from_data(TensorData::new(vec![0.7f32, -1.7, 0.0], [1, 3]), &device)
                .require_grad();
        let out = policy_loss(new.clone(), &lb, None, None, &loss_settings).unwrap();
        assert_eq!(out.stats.clip_high, 0.5);
        let grads = out.loss.backward();
        let g: Vec<f32> = new.grad(&grads).unwrap().into_data().to_vec().unwrap();
        let r = (-0.5f64).exp();
        assert!(g[0].abs() < 1e-7, "{g:?}");
        assert!((g[1] as f64 + r / 2.0).abs() < 1e-6, "{g:?}");
    }

    #[test]
    fn state_round_trips_exactly_through_json() {
        let replay = ReplaySettings { min_reward: 0.5 };
        let mut state = RapoState::default();
        state.solve_rates.record("a", [true, false]);
        let mut s = sample(3);
        s.logprobs = vec![0.0, -0.1f32, f32::MIN_POSITIVE - 1.0, -1.0e-7];
        state.replay.offer("a", &s, 0.7, 4, &replay);
        let text = serde_json::to_string(&state).unwrap();
        let back: RapoState = serde_json::from_str(&text).unwrap();
        assert_eq!(back, state);
    }

    #[test]
    fn settings_are_validated() {
        let mut s = settings();
        assert!(s.validate().is_ok());
        s.prune_solve_rate = Some(1.5);
        assert_eq!(s.validate().unwrap_err().0, "prune_solve_rate");
        s.prune_solve_rate = None;
        s.min_attempts = 0;
        assert_eq!(s.validate().unwrap_err().0, "min_attempts");
    }
}
