//! Counting tokens without a tokenizer: the [`TokenCounter`] trait the trainer implements
//! with the policy's real tokenizer, and the approximate default.

/// Counts the tokens of a text.
pub trait TokenCounter: Send + Sync {
    /// Number of tokens in `text`.
    fn count(&self, text: &str) -> usize;
}

/// The default counter: one token per four characters, rounded up.
///
/// Four characters per token is the usual rule of thumb for English text under byte-pair
/// tokenizers such as Qwen2's (which averages a little over four on prose, fewer on code and
/// digits). It is only used where no real tokenizer is plugged in: task lengths, the token
/// fields of a trajectory, and the `llm()` prompt-size limit.
///
/// ```
/// use fathom_env::tokens::{ApproxTokens, TokenCounter};
/// assert_eq!(ApproxTokens.count(""), 0);
/// assert_eq!(ApproxTokens.count("abcde"), 2);
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct ApproxTokens;

/// Characters per token assumed by [`ApproxTokens`].
pub const CHARS_PER_TOKEN: usize = 4;

impl TokenCounter for ApproxTokens {
    fn count(&self, text: &str) -> usize {
        text.chars().count().div_ceil(CHARS_PER_TOKEN)
    }
}
