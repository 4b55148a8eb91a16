//! Finding the final answer in a trajectory: exactly one well-formed `<answer>…</answer>`.
//!
//! The rewards re-parse the final assistant message themselves instead of trusting the
//! environment's [`Action::Answer`] text, so a lenient environment parser can never make a
//! malformed answer pay. The rules:
//!
//! - only the **final** step counts, and only when the environment treated it as an answer
//!   ([`Action::Answer`]); an episode that ended on the iteration cap or an error is unanswered
//!   even if some message contains answer tags;
//! - tags are matched ASCII-case-insensitively (`<answer>`, `<ANSWER>`), with no attributes or
//!   inner spaces;
//! - the message must contain exactly one opening and exactly one closing tag, the opening one
//!   first, with non-blank text between them; anything else — no tags, an unclosed tag, two
//!   answers (hedging across candidates), nested tags, an empty answer — is not an answer.

use crate::record::{Action, Trajectory};

const OPEN: &str = "<answer>";
const CLOSE: &str = "</answer>";

/// What the final turn of a trajectory holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinalAnswer<'a> {
    /// Exactly one well-formed answer; the text between the tags, trimmed.
    Given(&'a str),
    /// The episode did not end on an answer turn, or the final turn has no answer tags.
    Missing,
    /// Answer tags are present but not exactly one well-formed pair (unclosed, reversed,
    /// repeated, nested or empty).
    Malformed,
}

impl<'a> FinalAnswer<'a> {
    /// Parses the final answer of a trajectory (see the module docs for the rules).
    ///
    /// ```
    /// use fathom_rewards::answer::FinalAnswer;
    /// use fathom_rewards::fixture::TrajectoryBuilder;
    ///
    /// let t = TrajectoryBuilder::new("t").answer("<answer> Paris </answer>").build();
    /// assert_eq!(FinalAnswer::of(&t), FinalAnswer::Given("Paris"));
    /// let hedged = TrajectoryBuilder::new("t")
    ///     .answer("<answer>Paris</answer> or <answer>Lyon</answer>")
    ///     .build();
    /// assert_eq!(FinalAnswer::of(&hedged), FinalAnswer::Malformed);
    /// ```
    pub fn of(trajectory: &'a Trajectory) -> Self {
        match trajectory.steps.last() {
            Some(step) if matches!(step.action, Action::Answer { .. }) => {
                Self::parse(&step.assistant)
            }
            _ => Self::Missing,
        }
    }

    /// Parses one assistant message (see the module docs for the rules).
    ///
    /// ```
    /// use fathom_rewards::answer::FinalAnswer;
    /// assert_eq!(FinalAnswer::parse("so <ANSWER>42</ANSWER>"), FinalAnswer::Given("42"));
    /// assert_eq!(FinalAnswer::parse("<answer>42"), FinalAnswer::Malformed);
    /// assert_eq!(FinalAnswer::parse("<answer>  </answer>"), FinalAnswer::Malformed);
    /// assert_eq!(FinalAnswer::parse("42"), FinalAnswer::Missing);
    /// ```
    pub fn parse(message: &'a str) -> Self {
        let opens = find_all(message, OPEN);
        let closes = find_all(message, CLOSE);
        match (opens.as_slice(), closes.as_slice()) {
            ([], []) => Self::Missing,
            ([open], [close]) if open + OPEN.len() <= *close => {
                let text = message[open + OPEN.len()..*close].trim();
                if text.is_empty() {
                    Self::Malformed
                } else {
                    Self::Given(text)
                }
            }
            _ => Self::Malformed,
        }
    }

    /// The answer text, when exactly one well-formed answer was given.
    pub fn text(&self) -> Option<&'a str> {
        match self {
            Self::Given(text) => Some(text),
            Self::Missing | Self::Malformed => None,
        }
    }
}

/// Byte offsets of every ASCII-case-insensitive occurrence of `tag` (an ASCII string).
fn find_all(haystack: &str, tag: &str) -> Vec<usize> {
    let hay = haystack.as_bytes();
    let tag = tag.as_bytes();
    if hay.len() < tag.len() {
        return Vec::new();
    }
    (0..=hay.len() - tag.len())
        .filter(|&i| hay[i..i + tag.len()].eq_ignore_ascii_case(tag))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::TrajectoryBuilder;

    #[test]
    fn parse_rules() {
        assert_eq!(
            FinalAnswer::parse("x <answer>a</answer> y"),
            FinalAnswer::Given("a")
        );
        assert_eq!(
            FinalAnswer::parse("</answer>a<answer>"),
            FinalAnswer::Malformed
        );
        assert_eq!(
            FinalAnswer::parse("<answer><answer>a</answer>"),
            FinalAnswer::Malformed
        );
        assert_eq!(
            FinalAnswer::parse("<answer>a</answer></answer>"),
            FinalAnswer::Malformed
        );
        assert_eq!(FinalAnswer::parse("a</answer>"), FinalAnswer::Malformed);
        assert_eq!(
            FinalAnswer::parse("<answer></answer>"),
            FinalAnswer::Malformed
        );
        // `<answer >` is not an opening tag, so only the closing tag is seen.
        assert_eq!(
            FinalAnswer::parse("<answer >a</answer>"),
            FinalAnswer::Malformed
        );
        assert_eq!(
            FinalAnswer::parse("<answer>é</answer>"),
            FinalAnswer::Given("é")
        );
    }

    #[test]
    fn only_an_answer_action_counts() {
        let capped = TrajectoryBuilder::new("t")
            .code("print('<answer>x</answer>')", "<answer>x</answer>")
            .end_on_iteration_cap()
            .build();
        assert_eq!(FinalAnswer::of(&capped), FinalAnswer::Missing);
        assert_eq!(
            FinalAnswer::of(&TrajectoryBuilder::new("t").build()),
            FinalAnswer::Missing
        );
    }
}
