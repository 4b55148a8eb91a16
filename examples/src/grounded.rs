//! A grounded-answer reward: pay only answers that the episode actually *found*.
//!
//! An answer is grounded when its text (normalised, as whole words) appears in the standard
//! output of some code cell whose code does not itself contain the answer. The second condition
//! closes the obvious loophole — `print("Paris")` followed by `<answer>Paris</answer>` shows the
//! answer in an output without having read anything. With `require_correct: true` (the
//! default) only correct grounded answers pay, which makes this a stricter correctness: a right
//! answer that was guessed or recalled, rather than read out of `context`, earns nothing here.
//!
//! Value: `1` when grounded (and correct, if required), else `0`.
//!
//! Limits, by design of a simple example: matching is on whole normalised words, so a short
//! answer that also occurs as a word in the printing cell's code (`"2"` after `print(rows[2])`)
//! counts as typed in, and an answer seen only in an `llm()` response does not count.

use fathom_rewards::normalize::contains_words;
use fathom_rewards::record::Action;
use fathom_rewards::registry::{Params, ParamsError};
use fathom_rewards::reward::{Episode, Reward};
use serde::Deserialize;

/// The name recipes use.
pub const NAME: &str = "grounded";

/// See the module docs.
///
/// ```
/// use fathom_examples::grounded::Grounded;
/// use fathom_rewards::fixture::{task, TrajectoryBuilder};
/// use fathom_rewards::normalize::AnswerMatcher;
/// use fathom_rewards::record::Family;
/// use fathom_rewards::reward::{Episode, Reward};
///
/// let task = task("t", Family::Needle, "... key 7 = Paris ...", "key 7?", "Paris");
/// let found = TrajectoryBuilder::new("t")
///     .code("print(context[4:17])", "key 7 = Paris").slice(4, 17)
///     .answer("<answer>Paris</answer>")
///     .build();
/// let typed = TrajectoryBuilder::new("t")
///     .code("print('Paris')", "Paris")
///     .answer("<answer>Paris</answer>")
///     .build();
/// let m = AnswerMatcher::default();
/// let grounded = Grounded::default();
/// assert_eq!(grounded.score(&Episode::new(&task, &found, &m)), 1.0);
/// assert_eq!(grounded.score(&Episode::new(&task, &typed, &m)), 0.0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Grounded {
    /// Pay only correct answers (default `true`). With `false`, any grounded well-formed
    /// answer pays — a process reward for reading before answering.
    pub require_correct: bool,
}

impl Default for Grounded {
    fn default() -> Self {
        Self {
            require_correct: true,
        }
    }
}

impl Grounded {
    /// The factory registered under [`NAME`]: parses `(require_correct: bool)`, all optional.
    pub fn from_params(params: &Params) -> Result<Box<dyn Reward>, ParamsError> {
        Ok(Box::new(params.parse::<Grounded>()?))
    }

    /// Whether `answer` appeared in the output of a cell whose code did not contain it.
    pub fn is_grounded(episode: &Episode<'_>, answer: &str) -> bool {
        episode.trajectory.steps.iter().any(|step| {
            let (Action::Code { code }, Some(output)) = (&step.action, &step.output) else {
                return false;
            };
            contains_words(&output.stdout, answer) && !contains_words(code, answer)
        })
    }
}

impl Reward for Grounded {
    fn name(&self) -> &str {
        NAME
    }

    fn score(&self, episode: &Episode<'_>) -> f64 {
        let Some(answer) = episode.answer.text() else {
            return 0.0;
        };
        if self.require_correct && !episode.correct {
            return 0.0;
        }
        if Self::is_grounded(episode, answer) {
            1.0
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fathom_rewards::fixture::{TrajectoryBuilder, task};
    use fathom_rewards::normalize::AnswerMatcher;
    use fathom_rewards::record::Family;

    #[test]
    fn params_parse_and_reject_unknown_fields() {
        assert!(
            !Params::from_ron("(require_correct: false)")
                .unwrap()
                .parse::<Grounded>()
                .unwrap()
                .require_correct
        );
        assert!(
            Params::default()
                .parse::<Grounded>()
                .unwrap()
                .require_correct
        );
        let err = Grounded::from_params(&Params::from_ron("(require: false)").unwrap())
            .err()
            .unwrap();
        assert!(err.to_string().contains("require"), "{err}");
    }

    #[test]
    fn wrong_grounded_answers_pay_only_when_correctness_is_not_required() {
        let task = task(
            "t",
            Family::Needle,
            "key 7 = Paris; key 8 = Lyon",
            "key 7?",
            "Paris",
        );
        let traj = TrajectoryBuilder::new("t")
            .code("print(context[14:27])", "key 8 = Lyon")
            .slice(14, 27)
            .answer("<answer>Lyon</answer>")
            .build();
        let ep = Episode::new(&task, &traj, &AnswerMatcher::default());
        assert_eq!(
            Grounded {
                require_correct: true
            }
            .score(&ep),
            0.0
        );
        assert_eq!(
            Grounded {
                require_correct: false
            }
            .score(&ep),
            1.0
        );
    }
}
