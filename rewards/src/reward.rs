//! The [`Reward`] trait every component implements, and the [`Episode`] view it scores.
//!
//! A reward is a small pure type: given one episode (the task and its trajectory, plus the
//! facts every component needs and that are derived once per episode — the parsed final
//! answer and whether it is correct), it returns one number within its declared
//! [`ValueRange`]. Rewards hold only their configuration; they never keep state between
//! calls, so the same value can score rollouts from many threads.

use crate::answer::FinalAnswer;
use crate::normalize::AnswerMatcher;
use crate::record::{Task, Trajectory};

/// One episode as the rewards see it: plain data plus facts derived once.
#[derive(Clone, Copy, Debug)]
pub struct Episode<'a> {
    /// The task the episode was about.
    pub task: &'a Task,
    /// What the policy did.
    pub trajectory: &'a Trajectory,
    /// The final answer, parsed by the strict rules of [`crate::answer`].
    pub answer: FinalAnswer<'a>,
    /// Whether exactly one well-formed answer was given and it matches the gold answer or an
    /// alias under the composite's [`AnswerMatcher`].
    pub correct: bool,
}

impl<'a> Episode<'a> {
    /// Derives the shared facts of an episode.
    ///
    /// ```
    /// use fathom_rewards::fixture::{task, TrajectoryBuilder};
    /// use fathom_rewards::normalize::AnswerMatcher;
    /// use fathom_rewards::record::Family;
    /// use fathom_rewards::reward::Episode;
    ///
    /// let task = task("t", Family::Needle, "k=Paris", "k?", "Paris");
    /// let traj = TrajectoryBuilder::new("t").answer("<answer>paris</answer>").build();
    /// assert!(Episode::new(&task, &traj, &AnswerMatcher::default()).correct);
    /// ```
    pub fn new(task: &'a Task, trajectory: &'a Trajectory, matcher: &AnswerMatcher) -> Self {
        let answer = FinalAnswer::of(trajectory);
        let correct = answer
            .text()
            .is_some_and(|text| matcher.matches(text, &task.answer, &task.aliases));
        Self {
            task,
            trajectory,
            answer,
            correct,
        }
    }
}

/// The closed interval a reward's values lie in; the composite rejects values outside it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ValueRange {
    /// Smallest value the reward can return.
    pub min: f64,
    /// Largest value the reward can return.
    pub max: f64,
}

impl ValueRange {
    /// `[0, 1]`, the range of most components.
    pub const UNIT: ValueRange = ValueRange { min: 0.0, max: 1.0 };

    /// Whether `value` is finite and within the range.
    pub fn contains(&self, value: f64) -> bool {
        value.is_finite() && self.min <= value && value <= self.max
    }
}

/// A deterministic reward component: one number per episode.
///
/// Implement this for a custom reward, register a factory for it in a
/// [`crate::registry::RewardRegistry`], and name it in a recipe (see `examples/`).
///
/// ```
/// use fathom_rewards::reward::{Episode, Reward, ValueRange};
///
/// /// 1 when the episode ended without any error observation.
/// struct NoErrors;
///
/// impl Reward for NoErrors {
///     fn name(&self) -> &str { "no_errors" }
///     fn score(&self, ep: &Episode<'_>) -> f64 {
///         let clean = ep.trajectory.steps.iter()
///             .all(|s| s.output.as_ref().is_none_or(|o| o.error.is_none()));
///         if clean { 1.0 } else { 0.0 }
///     }
/// }
/// assert_eq!(NoErrors.range(), ValueRange::UNIT);
/// ```
pub trait Reward: Send + Sync {
    /// The component's name: its key in logs and in `xtask score`'s output.
    fn name(&self) -> &str;

    /// The interval every score lies in (default `[0, 1]`).
    fn range(&self) -> ValueRange {
        ValueRange::UNIT
    }

    /// Scores one episode. Must be deterministic and within [`Reward::range`].
    fn score(&self, episode: &Episode<'_>) -> f64;
}
