//! The composite reward: a weighted list of components, the cap (and optional floor) on
//! incorrect answers, and the per-component breakdown the trainer logs.
//!
//! For components `i` with weights `wᵢ` and values `vᵢ`:
//!
//! ```text
//! sum   = Σᵢ wᵢ · vᵢ                  (in the composite's component order)
//! total = min(sum, cap)   when the answer is not correct and a cap is set (default 0.25)
//! total = max(total, floor)  then, when the answer is not correct and a floor is set (default none)
//! total = sum             otherwise
//! ```
//!
//! The cap only ever lowers the total; it applies whenever the episode is not correct (no
//! single well-formed answer matching the gold answer or an alias), whether or not a
//! `Correctness` component is in the list. With the default weights an incorrect episode scores
//! at most `0.10`, so the cap binds only when custom or step-level components add positive
//! value to wrong answers.
//!
//! The floor only ever raises the total of an incorrect episode, so that negative components
//! (the token budget) do not rank wrong answers among themselves. With `cap = floor = 0` every
//! wrong answer scores exactly 0: a GRPO group that solves nothing then has no spread and
//! teaches nothing, instead of teaching whatever its failures differ in (shorter failures
//! spend fewer tokens).

use thiserror::Error;

use crate::normalize::AnswerMatcher;
use crate::record::{Task, Trajectory};
use crate::reward::{Episode, Reward, ValueRange};

/// Why an episode could not be scored.
#[derive(Debug, Error, PartialEq)]
pub enum ScoreError {
    /// The trajectory is about a different task than the one given.
    #[error("trajectory.task_id is {trajectory:?} but task.id is {task:?}")]
    TaskMismatch {
        /// `Task::id`.
        task: String,
        /// `Trajectory::task_id`.
        trajectory: String,
    },
    /// A component returned NaN, an infinity, or a value outside its declared range.
    #[error("reward component {component:?} returned {value}, outside its range [{min}, {max}]")]
    OutOfRange {
        /// The component's name.
        component: String,
        /// What it returned.
        value: f64,
        /// Its declared minimum.
        min: f64,
        /// Its declared maximum.
        max: f64,
    },
    /// The output buffer given to [`Composite::score_into`] has the wrong length.
    #[error("values buffer has {got} slots but the composite has {expected} components")]
    BufferLength {
        /// Number of components.
        expected: usize,
        /// Length of the buffer given.
        got: usize,
    },
}

/// Why a composite could not be built.
#[derive(Debug, Error, PartialEq)]
pub enum CompositeError {
    /// Two components share a name, so their logs would collide.
    #[error("two reward components are named {0:?}; component names must be unique")]
    DuplicateName(String),
    /// A weight is NaN or infinite.
    #[error("reward component {component:?} has a non-finite weight {weight}")]
    NonFiniteWeight {
        /// The component's name.
        component: String,
        /// The weight.
        weight: f64,
    },
    /// The cap is NaN or infinite.
    #[error("incorrect_cap must be finite, got {0}")]
    NonFiniteCap(f64),
    /// The floor is NaN or infinite.
    #[error("incorrect_floor must be finite, got {0}")]
    NonFiniteFloor(f64),
    /// The floor is above the cap, so an incorrect total would have no consistent value.
    #[error("incorrect_floor {floor} is above incorrect_cap {cap}")]
    FloorAboveCap {
        /// The floor.
        floor: f64,
        /// The cap.
        cap: f64,
    },
    /// A component declares an empty or non-finite range.
    #[error("reward component {component:?} declares an invalid range [{min}, {max}]")]
    BadRange {
        /// The component's name.
        component: String,
        /// Declared minimum.
        min: f64,
        /// Declared maximum.
        max: f64,
    },
}

/// One weighted component of a composite.
struct Weighted {
    weight: f64,
    reward: Box<dyn Reward>,
}

/// A weighted list of rewards with the incorrect-answer cap; the reward the trainer uses.
///
/// ```
/// use fathom_rewards::composite::Composite;
/// use fathom_rewards::fixture::{task, TrajectoryBuilder};
/// use fathom_rewards::record::Family;
///
/// let task = task("t", Family::Needle, "k=Paris", "k?", "Paris");
/// let traj = TrajectoryBuilder::new("t").answer("<answer>Paris</answer>").build();
/// let composite = Composite::default();
/// let scores = composite.score(&task, &traj).unwrap();
/// assert!((scores.total - 0.95).abs() < 1e-12); // 0.10 + 0.70 + 0.15, no tokens spent
/// assert_eq!(scores.get("correctness"), Some(1.0));
/// ```
pub struct Composite {
    components: Vec<Weighted>,
    incorrect_cap: Option<f64>,
    incorrect_floor: Option<f64>,
    matcher: AnswerMatcher,
}

impl std::fmt::Debug for Composite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Composite")
            .field(
                "components",
                &self.names().zip(self.weights()).collect::<Vec<_>>(),
            )
            .field("incorrect_cap", &self.incorrect_cap)
            .field("incorrect_floor", &self.incorrect_floor)
            .field("matcher", &self.matcher)
            .finish()
    }
}

impl Default for Composite {
    /// The default composite of DESIGN §5 (see [`crate::config::RewardsConfig::default`]).
    fn default() -> Self {
        crate::config::RewardsConfig::default()
            .build(&crate::registry::RewardRegistry::new())
            .expect("the default rewards configuration is valid")
    }
}

impl Composite {
    /// Builds a composite from `(weight, reward)` pairs, in the order given.
    pub fn new(
        components: Vec<(f64, Box<dyn Reward>)>,
        incorrect_cap: Option<f64>,
        matcher: AnswerMatcher,
    ) -> Result<Self, CompositeError> {
        let mut names = std::collections::HashSet::new();
        for (weight, reward) in &components {
            let name = reward.name();
            if !names.insert(name.to_owned()) {
                return Err(CompositeError::DuplicateName(name.to_owned()));
            }
            if !weight.is_finite() {
                return Err(CompositeError::NonFiniteWeight {
                    component: name.to_owned(),
                    weight: *weight,
                });
            }
            let ValueRange { min, max } = reward.range();
            if !(min.is_finite() && max.is_finite() && min <= max) {
                return Err(CompositeError::BadRange {
                    component: name.to_owned(),
                    min,
                    max,
                });
            }
        }
        if let Some(cap) = incorrect_cap
            && !cap.is_finite()
        {
            return Err(CompositeError::NonFiniteCap(cap));
        }
        let components = components
            .into_iter()
            .map(|(weight, reward)| Weighted { weight, reward })
            .collect();
        Ok(Self {
            components,
            incorrect_cap,
            incorrect_floor: None,
            matcher,
        })
    }

    /// Sets the floor on the total of incorrect episodes (`None`: no floor, the default). It is
    /// applied after the cap and must not exceed it.
    ///
    /// ```
    /// use fathom_rewards::composite::Composite;
    /// use fathom_rewards::components::{Correctness, TokenBudget};
    /// use fathom_rewards::fixture::{task, TrajectoryBuilder};
    /// use fathom_rewards::normalize::AnswerMatcher;
    /// use fathom_rewards::record::Family;
    ///
    /// let budget = TokenBudget { free_tokens: 0, saturate_tokens: 10 };
    /// let composite = Composite::new(
    ///     vec![(0.7, Box::new(Correctness)), (-0.15, Box::new(budget))],
    ///     Some(0.0),
    ///     AnswerMatcher::default(),
    /// )
    /// .unwrap()
    /// .with_incorrect_floor(Some(0.0))
    /// .unwrap();
    /// let task = task("t", Family::Needle, "k=Paris", "k?", "Paris");
    /// let wrong = TrajectoryBuilder::new("t")
    ///     .code("print(context)", "k=Paris ... a long output")
    ///     .answer("<answer>Rome</answer>")
    ///     .build();
    /// let scores = composite.score(&task, &wrong).unwrap();
    /// assert!(scores.sum < 0.0);
    /// assert_eq!(scores.total, 0.0); // raised to the floor
    /// ```
    pub fn with_incorrect_floor(mut self, floor: Option<f64>) -> Result<Self, CompositeError> {
        if let Some(floor) = floor {
            if !floor.is_finite() {
                return Err(CompositeError::NonFiniteFloor(floor));
            }
            if let Some(cap) = self.incorrect_cap
                && floor > cap
            {
                return Err(CompositeError::FloorAboveCap { floor, cap });
            }
        }
        self.incorrect_floor = floor;
        Ok(self)
    }

    /// Component names, in the composite's stable order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.components.iter().map(|c| c.reward.name())
    }

    /// Component weights, in the same order as [`Composite::names`].
    pub fn weights(&self) -> impl Iterator<Item = f64> + '_ {
        self.components.iter().map(|c| c.weight)
    }

    /// Number of components.
    pub fn len(&self) -> usize {
        self.components.len()
    }

    /// Whether the composite has no components (its total is then always 0).
    pub fn is_empty(&self) -> bool {
        self.components.is_empty()
    }

    /// The cap on the total of incorrect episodes, if any.
    pub fn incorrect_cap(&self) -> Option<f64> {
        self.incorrect_cap
    }

    /// The floor on the total of incorrect episodes, if any.
    pub fn incorrect_floor(&self) -> Option<f64> {
        self.incorrect_floor
    }

    /// How answers are matched against the gold answer.
    pub fn matcher(&self) -> &AnswerMatcher {
        &self.matcher
    }

    /// Scores one episode: the total and every component's value and weight.
    pub fn score<'c>(
        &'c self,
        task: &Task,
        trajectory: &Trajectory,
    ) -> Result<Breakdown<'c>, ScoreError> {
        let mut values = vec![0.0; self.components.len()];
        let totals = self.score_into(task, trajectory, &mut values)?;
        let components = self
            .components
            .iter()
            .zip(values)
            .map(|(c, value)| ComponentScore {
                name: c.reward.name(),
                weight: c.weight,
                value,
            })
            .collect();
        Ok(Breakdown {
            total: totals.total,
            sum: totals.sum,
            correct: totals.correct,
            capped: totals.capped,
            components,
        })
    }

    /// Scores one episode without allocating: writes each component's value into `values`
    /// (in [`Composite::names`] order; its length must equal [`Composite::len`]).
    pub fn score_into(
        &self,
        task: &Task,
        trajectory: &Trajectory,
        values: &mut [f64],
    ) -> Result<Totals, ScoreError> {
        if task.id != trajectory.task_id {
            return Err(ScoreError::TaskMismatch {
                task: task.id.clone(),
                trajectory: trajectory.task_id.clone(),
            });
        }
        if values.len() != self.components.len() {
            return Err(ScoreError::BufferLength {
                expected: self.components.len(),
                got: values.len(),
            });
        }
        let episode = Episode::new(task, trajectory, &self.matcher);
        let mut sum = 0.0;
        for (component, slot) in self.components.iter().zip(values.iter_mut()) {
            let value = component.reward.score(&episode);
            let range = component.reward.range();
            if !range.contains(value) {
                return Err(ScoreError::OutOfRange {
                    component: component.reward.name().to_owned(),
                    value,
                    min: range.min,
                    max: range.max,
                });
            }
            *slot = value;
            sum += component.weight * value;
        }
        let (total, capped) = match self.incorrect_cap {
            Some(cap) if !episode.correct && sum > cap => (cap, true),
            _ => (sum, false),
        };
        let total = match self.incorrect_floor {
            Some(floor) if !episode.correct && total < floor => floor,
            _ => total,
        };
        Ok(Totals {
            total,
            sum,
            correct: episode.correct,
            capped,
        })
    }
}

/// The totals of one scored episode (see the module docs for how `total` follows from `sum`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Totals {
    /// The reward.
    pub total: f64,
    /// `Σ weight · value`, before the cap.
    pub sum: f64,
    /// Whether the answer was correct.
    pub correct: bool,
    /// Whether the cap lowered the total.
    pub capped: bool,
}

/// One component's contribution to a scored episode.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ComponentScore<'c> {
    /// The component's name.
    pub name: &'c str,
    /// Its weight in the composite.
    pub weight: f64,
    /// Its value, within its range.
    pub value: f64,
}

impl ComponentScore<'_> {
    /// `weight · value`.
    pub fn contribution(&self) -> f64 {
        self.weight * self.value
    }
}

/// A scored episode: the total and every component, in the composite's order.
#[derive(Clone, Debug, PartialEq)]
pub struct Breakdown<'c> {
    /// The reward.
    pub total: f64,
    /// `Σ weight · value`, before the cap.
    pub sum: f64,
    /// Whether the answer was correct.
    pub correct: bool,
    /// Whether the cap lowered the total.
    pub capped: bool,
    /// Every component, in the composite's order.
    pub components: Vec<ComponentScore<'c>>,
}

impl Breakdown<'_> {
    /// The value of the component with this name.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.components
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.value)
    }
}

/// Serialises as the JSON that `xtask score` prints, with map keys in the composite's order:
/// `{"total": …, "components": {"name": value, …}, "weights": {"name": weight, …},
/// "correct": …, "capped": …}`.
///
/// ```
/// use fathom_rewards::composite::Composite;
/// use fathom_rewards::fixture::{task, TrajectoryBuilder};
/// use fathom_rewards::record::Family;
///
/// let task = task("t", Family::Needle, "k=Paris", "k?", "Paris");
/// let traj = TrajectoryBuilder::new("t").answer("<answer>Lyon</answer>").build();
/// let composite = Composite::default();
/// let json = serde_json::to_string(&composite.score(&task, &traj).unwrap()).unwrap();
/// assert!(json.starts_with(r#"{"total":0.1,"components":{"format_gate":1.0,"correctness":0.0,"#));
/// ```
impl serde::Serialize for Breakdown<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;

        struct Ordered<'a, 'c>(&'a [ComponentScore<'c>], fn(&ComponentScore<'c>) -> f64);
        impl serde::Serialize for Ordered<'_, '_> {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let mut map = serializer.serialize_map(Some(self.0.len()))?;
                for c in self.0 {
                    map.serialize_entry(c.name, &(self.1)(c))?;
                }
                map.end()
            }
        }

        let mut map = serializer.serialize_map(Some(5))?;
        map.serialize_entry("total", &self.total)?;
        map.serialize_entry("components", &Ordered(&self.components, |c| c.value))?;
        map.serialize_entry("weights", &Ordered(&self.components, |c| c.weight))?;
        map.serialize_entry("correct", &self.correct)?;
        map.serialize_entry("capped", &self.capped)?;
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::components::{Correctness, FormatGate};
    use crate::fixture::{TrajectoryBuilder, task};
    use crate::record::Family;

    struct Fixed(&'static str, f64);
    impl Reward for Fixed {
        fn name(&self) -> &str {
            self.0
        }
        fn score(&self, _: &Episode<'_>) -> f64 {
            self.1
        }
    }

    fn episode(answer: &str) -> (Task, Trajectory) {
        let task = task("t", Family::Needle, "k=Paris", "k?", "Paris");
        let traj = TrajectoryBuilder::new("t").answer(answer).build();
        (task, traj)
    }

    fn composite(extra: f64, cap: Option<f64>) -> Composite {
        Composite::new(
            vec![
                (0.1, Box::new(FormatGate)),
                (0.7, Box::new(Correctness)),
                (0.5, Box::new(Fixed("extra", extra))),
            ],
            cap,
            AnswerMatcher::default(),
        )
        .unwrap()
    }

    #[test]
    fn cap_lowers_only_incorrect_totals() {
        let (task, wrong) = episode("<answer>Lyon</answer>");
        let capped = composite(1.0, Some(0.25));
        let uncapped = composite(1.0, None);
        let b = capped.score(&task, &wrong).unwrap();
        assert!((b.sum - 0.6).abs() < 1e-12);
        assert_eq!((b.total, b.capped, b.correct), (0.25, true, false));

        let (task, right) = episode("<answer>Paris</answer>");
        let b = capped.score(&task, &right).unwrap();
        assert!((b.total - 1.3).abs() < 1e-12 && !b.capped && b.correct);

        let b = uncapped.score(&task, &wrong).unwrap();
        assert!((b.total - 0.6).abs() < 1e-12 && !b.capped);

        // The cap never raises a total that is already below it.
        let zero = composite(0.0, Some(0.25));
        let b = zero.score(&task, &wrong).unwrap();
        assert!((b.total - 0.1).abs() < 1e-12 && !b.capped);
    }

    fn with_cost(cap: Option<f64>, floor: Option<f64>) -> Result<Composite, CompositeError> {
        Composite::new(
            vec![
                (0.1, Box::new(FormatGate)),
                (0.7, Box::new(Correctness)),
                (-1.0, Box::new(Fixed("cost", 0.3))),
            ],
            cap,
            AnswerMatcher::default(),
        )?
        .with_incorrect_floor(floor)
    }

    #[test]
    fn floor_raises_only_incorrect_totals() {
        let (task, wrong) = episode("<answer>Lyon</answer>");
        let (_, right) = episode("<answer>Paris</answer>");
        let exact = with_cost(Some(0.0), Some(0.0)).unwrap();
        let b = exact.score(&task, &wrong).unwrap();
        assert!((b.sum + 0.2).abs() < 1e-12);
        assert_eq!((b.total, b.capped, b.correct), (0.0, false, false));
        // A correct episode keeps its sum, whatever the floor.
        let b = exact.score(&task, &right).unwrap();
        assert!((b.total - 0.5).abs() < 1e-12 && b.correct);
        // Without a floor the cost ranks wrong answers below zero.
        let uncapped = with_cost(Some(0.0), None).unwrap();
        assert!((uncapped.score(&task, &wrong).unwrap().total + 0.2).abs() < 1e-12);
        // A floor without a cap, and one the sum is already above.
        let low = with_cost(None, Some(-0.1)).unwrap();
        assert!((low.score(&task, &wrong).unwrap().total + 0.1).abs() < 1e-12);
        let below = with_cost(None, Some(-0.5)).unwrap();
        assert!((below.score(&task, &wrong).unwrap().total + 0.2).abs() < 1e-12);
        assert_eq!(exact.incorrect_floor(), Some(0.0));
    }

    #[test]
    fn floor_must_be_finite_and_not_above_the_cap() {
        assert!(matches!(
            with_cost(None, Some(f64::NAN)),
            Err(CompositeError::NonFiniteFloor(_))
        ));
        let err = with_cost(Some(0.0), Some(0.1)).unwrap_err();
        assert_eq!(
            err,
            CompositeError::FloorAboveCap {
                floor: 0.1,
                cap: 0.0
            }
        );
        assert_eq!(
            err.to_string(),
            "incorrect_floor 0.1 is above incorrect_cap 0"
        );
    }

    #[test]
    fn out_of_range_and_non_finite_values_are_errors() {
        let (task, traj) = episode("<answer>Paris</answer>");
        for bad in [1.5, -0.1, f64::NAN, f64::INFINITY] {
            let err = composite(bad, Some(0.25)).score(&task, &traj).unwrap_err();
            assert!(
                matches!(&err, ScoreError::OutOfRange { component, .. } if component == "extra"),
                "{err}"
            );
        }
    }

    #[test]
    fn mismatched_task_is_an_error() {
        let (task, _) = episode("");
        let other = TrajectoryBuilder::new("u")
            .answer("<answer>Paris</answer>")
            .build();
        let err = Composite::default().score(&task, &other).unwrap_err();
        assert_eq!(
            err.to_string(),
            "trajectory.task_id is \"u\" but task.id is \"t\""
        );
    }

    #[test]
    fn score_into_checks_the_buffer_and_matches_score() {
        let (task, traj) = episode("<answer>Paris</answer>");
        let c = Composite::default();
        let mut short = [0.0; 2];
        assert!(matches!(
            c.score_into(&task, &traj, &mut short),
            Err(ScoreError::BufferLength {
                expected: 4,
                got: 2
            })
        ));
        let mut values = [0.0; 4];
        let totals = c.score_into(&task, &traj, &mut values).unwrap();
        let b = c.score(&task, &traj).unwrap();
        assert_eq!(totals.total, b.total);
        assert_eq!(
            values.to_vec(),
            b.components.iter().map(|c| c.value).collect::<Vec<_>>()
        );
    }

    #[test]
    fn construction_rejects_duplicates_and_bad_numbers() {
        let m = AnswerMatcher::default;
        let dup = Composite::new(
            vec![(1.0, Box::new(Correctness)), (1.0, Box::new(Correctness))],
            None,
            m(),
        );
        assert_eq!(
            dup.unwrap_err(),
            CompositeError::DuplicateName("correctness".into())
        );
        let nan = Composite::new(vec![(f64::NAN, Box::new(Correctness))], None, m());
        assert!(matches!(nan, Err(CompositeError::NonFiniteWeight { .. })));
        let cap = Composite::new(vec![(1.0, Box::new(Correctness))], Some(f64::NAN), m());
        assert!(matches!(cap, Err(CompositeError::NonFiniteCap(_))));
    }

    #[test]
    fn json_keeps_component_order() {
        let (task, traj) = episode("<answer>Paris</answer>");
        let c = composite(0.5, Some(0.25));
        let json = serde_json::to_string(&c.score(&task, &traj).unwrap()).unwrap();
        let rest = json.split_once(',').unwrap().1;
        assert!(json.starts_with(r#"{"total":1.04"#), "{json}");
        assert_eq!(
            rest,
            r#""components":{"format_gate":1.0,"correctness":1.0,"extra":0.5},"weights":{"format_gate":0.1,"correctness":0.7,"extra":0.5},"correct":true,"capped":false}"#
        );
    }
}
