//! A per-family weighting of correctness: harder task families can pay more.
//!
//! Value: `weights[family]` (or `default` for a family not listed) when the answer is correct,
//! else `0`. Weights must be finite and ≥ 0; the range is `[0, max weight]`. Use it in place of
//! (or next to) `Correctness` when a training mix over-represents easy families, e.g. pay
//! `multi_hop` and `aggregate` 1.5× what a `needle` lookup earns.

use std::collections::BTreeMap;

use fathom_rewards::record::Family;
use fathom_rewards::registry::{Params, ParamsError};
use fathom_rewards::reward::{Episode, Reward, ValueRange};
use serde::Deserialize;

/// The name recipes use.
pub const NAME: &str = "family_weighted";

/// See the module docs.
///
/// ```
/// use fathom_examples::family::FamilyWeighted;
/// use fathom_rewards::registry::Params;
/// use fathom_rewards::fixture::{task, TrajectoryBuilder};
/// use fathom_rewards::normalize::AnswerMatcher;
/// use fathom_rewards::record::Family;
/// use fathom_rewards::reward::{Episode, Reward};
///
/// let params = Params::from_ron("(weights: {aggregate: 1.5}, default: 1.0)").unwrap();
/// let reward = FamilyWeighted::from_params(&params).unwrap();
/// let task = task("t", Family::Aggregate, "3 records", "How many?", "3");
/// let traj = TrajectoryBuilder::new("t").answer("<answer>3</answer>").build();
/// assert_eq!(reward.score(&Episode::new(&task, &traj, &AnswerMatcher::default())), 1.5);
/// assert_eq!(reward.range().max, 1.5);
/// ```
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FamilyWeighted {
    /// Weight per family, keyed by the family's RON identifier: `needle`, `multi_hop`,
    /// `aggregate`, `compare`, `passage` (e.g. `{multi_hop: 1.5, aggregate: 1.5}`).
    #[serde(default)]
    pub weights: BTreeMap<Family, f64>,
    /// Weight of families not listed (default 1).
    #[serde(default = "one")]
    pub default: f64,
}

fn one() -> f64 {
    1.0
}

impl FamilyWeighted {
    /// The factory registered under [`NAME`]: parses and validates
    /// `(weights: {family: w, …}, default: w)`.
    pub fn from_params(params: &Params) -> Result<Box<dyn Reward>, ParamsError> {
        let reward: FamilyWeighted = params.parse()?;
        let check = |what: String, w: f64| {
            if w.is_finite() && w >= 0.0 {
                Ok(())
            } else {
                Err(ParamsError::new(format!(
                    "{what} must be a finite number ≥ 0, got {w}"
                )))
            }
        };
        check("default".to_owned(), reward.default)?;
        for (family, w) in &reward.weights {
            check(format!("weights[{family:?}]"), *w)?;
        }
        Ok(Box::new(reward))
    }

    /// The weight of a family.
    pub fn weight(&self, family: Family) -> f64 {
        self.weights.get(&family).copied().unwrap_or(self.default)
    }
}

impl Reward for FamilyWeighted {
    fn name(&self) -> &str {
        NAME
    }

    fn range(&self) -> ValueRange {
        let max = self.weights.values().copied().fold(self.default, f64::max);
        ValueRange { min: 0.0, max }
    }

    fn score(&self, episode: &Episode<'_>) -> f64 {
        if episode.correct {
            self.weight(episode.task.family)
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_params_are_rejected_with_the_offending_field() {
        for (text, needle) in [
            ("(weights: {aggregate: -1.0})", "Aggregate"),
            ("(default: inf)", "default"),
            ("(weights: {agregate: 1.0})", "agregate"),
            ("(weight: {})", "weight"),
        ] {
            let err = FamilyWeighted::from_params(&Params::from_ron(text).unwrap())
                .err()
                .unwrap();
            assert!(err.to_string().contains(needle), "{text}: {err}");
        }
    }

    #[test]
    fn unlisted_families_use_the_default() {
        let Ok(reward) = Params::from_ron("(weights: {multi_hop: 2.0}, default: 0.5)")
            .unwrap()
            .parse::<FamilyWeighted>()
        else {
            panic!("valid params")
        };
        assert_eq!(reward.weight(Family::MultiHop), 2.0);
        assert_eq!(reward.weight(Family::Needle), 0.5);
        assert_eq!(reward.range(), ValueRange { min: 0.0, max: 2.0 });
    }
}
