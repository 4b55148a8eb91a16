//! Answering `llm()` calls: the per-episode router that counts, caps and size-checks calls,
//! records them, and answers each either with the [`crate::sublm::SubLm`] or, below the
//! configured depth, with a recursive sub-episode (its own REPL over the prompt, driven by
//! the policy).
//!
//! Calls made inside a sub-episode are listed in the parent step's `llm_calls` right after
//! the call that started it, each with its own `depth`, so a trajectory's call count covers
//! the whole tree. Each (sub-)episode has its own call budget.

use fathom_rewards::record::{Action, LlmCall};

use crate::env::{Services, sub_episode};
use crate::sublm::SubContext;

/// Counts and answers the `llm()` calls of one episode.
pub(crate) struct LlmRouter {
    depth: u32,
    used: usize,
    refused: usize,
}

/// The question a sub-episode gets when the whole prompt is its document.
pub const WHOLE_PROMPT_QUESTION: &str =
    "Carry out the request stated in `context` and give the result as your answer.";

impl LlmRouter {
    /// A router for calls made at `depth` (1 for a top-level episode).
    pub(crate) fn new(depth: u32) -> LlmRouter {
        LlmRouter {
            depth,
            used: 0,
            refused: 0,
        }
    }

    /// Answers one call, appending its record (and those of any nested calls) to `calls`.
    pub(crate) fn call(
        &mut self,
        services: &Services,
        prompt: &str,
        calls: &mut Vec<LlmCall>,
    ) -> String {
        let limits = &services.config.llm;
        let tokens = &services.tokens;
        let prompt_tokens = tokens.count(prompt);
        let refusal = if self.used >= limits.max_calls {
            Some(format!(
                "the limit of {} llm() calls per episode is reached",
                limits.max_calls
            ))
        } else if prompt_tokens > limits.max_prompt_tokens {
            Some(format!(
                "the prompt has about {prompt_tokens} tokens; the limit is {}. Pass a shorter slice",
                limits.max_prompt_tokens
            ))
        } else {
            None
        };
        if let Some(reason) = refusal {
            let response = format!("[llm() refused: {reason}]");
            if self.refused < limits.max_refused_records {
                self.refused += 1;
                let kept: String = prompt.chars().take(limits.refused_prompt_chars).collect();
                calls.push(LlmCall {
                    prompt: kept,
                    response_tokens: tokens.count(&response),
                    response: response.clone(),
                    depth: self.depth,
                    prompt_tokens,
                    refused: Some(reason),
                });
            }
            return response;
        }
        self.used += 1;
        let slot = calls.len();
        let mut nested = Vec::new();
        let (response, failed) = match (&services.policy, self.depth < limits.max_depth) {
            (Some(policy), true) => {
                let (question, document) = split_prompt(prompt, &services.config.sub_context);
                match sub_episode(services, policy.as_ref(), self.depth, question, document) {
                    Ok(traj) => {
                        nested = traj
                            .steps
                            .iter()
                            .flat_map(|s| s.llm_calls.iter().cloned())
                            .collect();
                        match traj.steps.last().map(|s| &s.action) {
                            Some(Action::Answer { text }) => (text.clone(), None),
                            _ => {
                                let why = format!(
                                    "the sub-episode ended without an answer ({:?})",
                                    traj.end_reason
                                );
                                (format!("[llm() failed: {why}]"), Some(why))
                            }
                        }
                    }
                    Err(e) => (format!("[llm() failed: {e}]"), Some(e.to_string())),
                }
            }
            _ => match services.sub_lm.complete(prompt) {
                Ok(text) => (text, None),
                Err(e) => (format!("[llm() failed: {e}]"), Some(e.to_string())),
            },
        };
        calls.insert(
            slot,
            LlmCall {
                prompt: prompt.to_string(),
                response_tokens: tokens.count(&response),
                response: response.clone(),
                depth: self.depth,
                prompt_tokens,
                refused: failed,
            },
        );
        calls.extend(nested);
        response
    }
}

/// Splits an `llm()` prompt into a sub-episode's question and document.
fn split_prompt(prompt: &str, how: &SubContext) -> (String, String) {
    if let SubContext::SplitAt(marker) = how
        && let Some((question, document)) = prompt.split_once(marker.as_str())
    {
        return (question.trim().to_string(), document.to_string());
    }
    (WHOLE_PROMPT_QUESTION.to_string(), prompt.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_splits_at_the_marker_or_stays_whole() {
        let how = SubContext::SplitAt("\n---\n".into());
        assert_eq!(
            split_prompt("Who?\n---\ndoc", &how),
            ("Who?".into(), "doc".into())
        );
        assert_eq!(
            split_prompt("no marker", &how),
            (WHOLE_PROMPT_QUESTION.into(), "no marker".into())
        );
        assert_eq!(
            split_prompt("a\n---\nb", &SubContext::WholePrompt).1,
            "a\n---\nb"
        );
    }
}
