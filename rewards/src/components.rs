//! The four components of the default composite (DESIGN §5): format gate, correctness, token
//! budget and recursion efficiency. Each returns a value in `[0, 1]`; the composite multiplies
//! it by the component's weight (the token budget's weight is negative, so its value is the
//! *fraction* of the maximum penalty).

use serde::{Deserialize, Serialize};

use crate::reward::{Episode, Reward};

/// `1` when the final turn holds exactly one well-formed `<answer>…</answer>`, else `0`.
///
/// Default weight `+0.10`. See [`crate::answer`] for what "well-formed" means; two answer tags
/// (hedging), an unclosed tag or an empty answer earn nothing.
///
/// ```
/// use fathom_rewards::components::FormatGate;
/// use fathom_rewards::fixture::{task, TrajectoryBuilder};
/// use fathom_rewards::normalize::AnswerMatcher;
/// use fathom_rewards::record::Family;
/// use fathom_rewards::reward::{Episode, Reward};
///
/// let task = task("t", Family::Needle, "k=Paris", "k?", "Paris");
/// let one = TrajectoryBuilder::new("t").answer("<answer>Lyon</answer>").build();
/// let two = TrajectoryBuilder::new("t").answer("<answer>Lyon</answer><answer>Paris</answer>").build();
/// let m = AnswerMatcher::default();
/// assert_eq!(FormatGate.score(&Episode::new(&task, &one, &m)), 1.0);
/// assert_eq!(FormatGate.score(&Episode::new(&task, &two, &m)), 0.0);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FormatGate;

impl Reward for FormatGate {
    fn name(&self) -> &str {
        "format_gate"
    }

    fn score(&self, episode: &Episode<'_>) -> f64 {
        indicator(episode.answer.text().is_some())
    }
}

/// `1` when the single well-formed answer matches the gold answer or an alias, else `0`.
///
/// Default weight `0.70`. Matching is normalised exact match ([`crate::normalize`]): NFKC,
/// case, punctuation, articles and whitespace are ignored, numbers compare numerically when both
/// sides parse; containment never counts.
///
/// ```
/// use fathom_rewards::components::Correctness;
/// use fathom_rewards::fixture::{task, TrajectoryBuilder};
/// use fathom_rewards::normalize::AnswerMatcher;
/// use fathom_rewards::record::Family;
/// use fathom_rewards::reward::{Episode, Reward};
///
/// let task = task("t", Family::Needle, "k=Paris", "k?", "Paris");
/// let right = TrajectoryBuilder::new("t").answer("<answer>paris.</answer>").build();
/// let padded = TrajectoryBuilder::new("t").answer("<answer>It is Paris</answer>").build();
/// let m = AnswerMatcher::default();
/// assert_eq!(Correctness.score(&Episode::new(&task, &right, &m)), 1.0);
/// assert_eq!(Correctness.score(&Episode::new(&task, &padded, &m)), 0.0);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Correctness;

impl Reward for Correctness {
    fn name(&self) -> &str {
        "correctness"
    }

    fn score(&self, episode: &Episode<'_>) -> f64 {
        indicator(episode.correct)
    }
}

/// Fraction of the maximum tool-token penalty incurred:
/// `min(1, max(0, tokens − free_tokens) / (saturate_tokens − free_tokens))`, where `tokens` is
/// [`crate::record::Trajectory::tool_tokens`] (code written plus observation tokens read).
///
/// Default weight `−0.15`, `free_tokens = 2048`, `saturate_tokens = 16384`: no penalty up to
/// 2048 tool tokens, the full −0.15 from 16384 on, linear in between. Applies whether or not the
/// answer is correct.
///
/// ```
/// use fathom_rewards::components::TokenBudget;
/// let budget = TokenBudget { free_tokens: 100, saturate_tokens: 300 };
/// assert_eq!(budget.penalty_fraction(50), 0.0);
/// assert_eq!(budget.penalty_fraction(200), 0.5);
/// assert_eq!(budget.penalty_fraction(10_000), 1.0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenBudget {
    /// Tool tokens that cost nothing.
    pub free_tokens: usize,
    /// Tool tokens at which the penalty reaches its cap; must exceed `free_tokens`.
    pub saturate_tokens: usize,
}

impl Default for TokenBudget {
    fn default() -> Self {
        Self {
            free_tokens: 2048,
            saturate_tokens: 16384,
        }
    }
}

impl TokenBudget {
    /// The penalty fraction for a number of tool tokens (see the type docs).
    pub fn penalty_fraction(&self, tokens: usize) -> f64 {
        let excess = tokens.saturating_sub(self.free_tokens) as f64;
        let span = self.saturate_tokens.saturating_sub(self.free_tokens).max(1) as f64;
        (excess / span).min(1.0)
    }
}

impl Reward for TokenBudget {
    fn name(&self) -> &str {
        "token_budget"
    }

    fn score(&self, episode: &Episode<'_>) -> f64 {
        self.penalty_fraction(episode.trajectory.tool_tokens())
    }
}

/// Efficiency bonus for correct answers:
/// `correct · clamp(1 − max(0, calls − free_calls) / (max_calls − free_calls), 0, 1)`, where
/// `calls` counts every `llm()` call, refused ones included.
///
/// Default weight `0.15`, `free_calls = 0`, `max_calls = 10`: a correct answer with no `llm()`
/// call earns the full bonus, each call removes a tenth of it, ten or more calls earn nothing.
/// A wrong or missing answer always earns `0`, however few calls it made.
///
/// ```
/// use fathom_rewards::components::RecursionEfficiency;
/// let r = RecursionEfficiency { free_calls: 1, max_calls: 5 };
/// assert_eq!(r.efficiency(1), 1.0);
/// assert_eq!(r.efficiency(3), 0.5);
/// assert_eq!(r.efficiency(9), 0.0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecursionEfficiency {
    /// Calls that cost nothing.
    pub free_calls: usize,
    /// Calls at which the bonus reaches zero; must exceed `free_calls`.
    pub max_calls: usize,
}

impl Default for RecursionEfficiency {
    fn default() -> Self {
        Self {
            free_calls: 0,
            max_calls: 10,
        }
    }
}

impl RecursionEfficiency {
    /// The bonus for a correct answer made with `calls` `llm()` calls.
    pub fn efficiency(&self, calls: usize) -> f64 {
        let excess = calls.saturating_sub(self.free_calls) as f64;
        let span = self.max_calls.saturating_sub(self.free_calls).max(1) as f64;
        (1.0 - excess / span).max(0.0)
    }
}

impl Reward for RecursionEfficiency {
    fn name(&self) -> &str {
        "recursion_efficiency"
    }

    fn score(&self, episode: &Episode<'_>) -> f64 {
        if episode.correct {
            self.efficiency(episode.trajectory.llm_call_count())
        } else {
            0.0
        }
    }
}

fn indicator(condition: bool) -> f64 {
    if condition { 1.0 } else { 0.0 }
}
