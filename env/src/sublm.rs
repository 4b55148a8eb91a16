//! What `llm()` calls go through: the [`SubLm`] trait (the trainer implements it with the
//! policy model; tests and the scripted expert use deterministic ones), and the limits the
//! environment applies to calls before they reach it.

/// A language model answering `llm(prompt)` calls made from the REPL.
pub trait SubLm: Send + Sync {
    /// The completion for `prompt`.
    fn complete(&self, prompt: &str) -> Result<String, SubLmError>;
}

/// A sub-LM that could not answer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("sub-LM failed: {0}")]
pub struct SubLmError(pub String);

/// How `llm()` calls are limited, per episode.
#[derive(Clone, Debug, PartialEq)]
pub struct LlmLimits {
    /// Calls answered per episode; further calls are refused (and recorded as refused).
    pub max_calls: usize,
    /// Largest prompt, in tokens; longer prompts are refused.
    pub max_prompt_tokens: usize,
    /// Recursion depth. A call made at depth `d` (1 for the top-level episode) is answered
    /// by a sub-episode (its own REPL over the prompt, driven by the policy) while
    /// `d < max_depth`, and by the [`SubLm`] directly at `d == max_depth`. `1` means plain
    /// sub-LM calls.
    pub max_depth: u32,
    /// Refused calls recorded per episode beyond `max_calls` (a loop of refused calls is
    /// answered but no longer recorded, so the record stays bounded).
    pub max_refused_records: usize,
    /// Characters of a refused prompt kept in the record.
    pub refused_prompt_chars: usize,
}

impl Default for LlmLimits {
    /// 16 calls, 8192-token prompts, depth 1.
    fn default() -> LlmLimits {
        LlmLimits {
            max_calls: 16,
            max_prompt_tokens: 8192,
            max_depth: 1,
            max_refused_records: 32,
            refused_prompt_chars: 2000,
        }
    }
}

/// How a recursive sub-episode gets its question and document from an `llm()` prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SubContext {
    /// The whole prompt is the sub-episode's `context`; its question asks to carry out the
    /// request stated there.
    WholePrompt,
    /// The prompt is split at the first occurrence of the marker: the part before is the
    /// question, the part after is the `context`. Prompts without the marker are handled as
    /// [`SubContext::WholePrompt`].
    SplitAt(String),
}

/// A sub-LM that answers every prompt with the same text (handy in tests and examples).
#[derive(Clone, Debug)]
pub struct FixedSubLm(pub String);

impl SubLm for FixedSubLm {
    fn complete(&self, _prompt: &str) -> Result<String, SubLmError> {
        Ok(self.0.clone())
    }
}
