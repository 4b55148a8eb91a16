//! Token bookkeeping against the chat template: the ids of a conversation's prompt, and of each
//! observation turn exactly as the template renders it after the assistant's sampled turn.
//!
//! An episode's ids are the prompt (the template's rendering of the system and first user turn
//! with the generation prompt), then for every turn the tokens the policy sampled, then the
//! template's text between the end of that assistant message and the next generation prompt
//! (`<|im_end|>\n<|im_start|>user\n…<|im_end|>\n<|im_start|>assistant\n` for ChatML),
//! tokenized on its own. A turn the policy ended with the end-of-turn token already holds it;
//! one cut short (a turn-length limit) gets it from the template. So the concatenated ids
//! always decode to the template's rendering of the whole conversation; they equal the
//! template's own tokenization except inside sampled turns, where the policy may have chosen a
//! different (non-canonical) split of the same text. Nothing sampled is ever re-tokenized.

use fathom_model::{ChatMessage, Tokenizer};
use fathom_rewards::record::Message;

use crate::sft::chat_messages;

/// Why a conversation could not be laid out as tokens.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The tokenizer or template failed.
    #[error(transparent)]
    Model(#[from] fathom_model::ModelError),
    /// The template does not render earlier turns verbatim inside later renderings.
    #[error("the chat template {0}")]
    Template(String),
}

/// Renders conversations for the rollout engine.
pub struct Chat<'a> {
    tokenizer: &'a Tokenizer,
    end_of_turn: u32,
}

impl<'a> Chat<'a> {
    /// A renderer whose turns end with `end_of_turn` (`<|im_end|>` for ChatML).
    pub fn new(tokenizer: &'a Tokenizer, end_of_turn: u32) -> Self {
        Self {
            tokenizer,
            end_of_turn,
        }
    }

    /// The end-of-turn token.
    pub fn end_of_turn(&self) -> u32 {
        self.end_of_turn
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        self.tokenizer
    }

    /// The ids of a conversation up to and including the generation prompt.
    pub fn prompt_ids(&self, messages: &[Message]) -> Result<Vec<u32>, ChatError> {
        self.render_ids(&chat_messages(messages))
    }

    /// The ids of chat-template messages up to and including the generation prompt.
    pub fn render_ids(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, ChatError> {
        let text = self.tokenizer.apply_chat_template(messages, true)?;
        Ok(self.tokenizer.encode(&text, false)?)
    }

    /// The ids that follow the assistant's last sampled token once the environment answered:
    /// `messages` is the whole conversation, ending with the assistant turn and the
    /// observation that answers it; `ended_with_eot` says whether the sampled turn already ends
    /// with the end-of-turn token.
    pub fn observation_ids(
        &self,
        messages: &[Message],
        ended_with_eot: bool,
    ) -> Result<Vec<u32>, ChatError> {
        let n = messages.len();
        if n < 2 {
            return Err(ChatError::Template(
                "needs an assistant turn and an observation".into(),
            ));
        }
        let chat = chat_messages(messages);
        let before = self.tokenizer.apply_chat_template(&chat[..n - 2], true)?;
        let full = self.tokenizer.apply_chat_template(&chat, true)?;
        let content = &chat[n - 2].content;
        let turn_end = before.len() + content.len();
        if !full.starts_with(&before) || full.get(before.len()..turn_end) != Some(content.as_str())
        {
            return Err(ChatError::Template(
                "does not render earlier turns verbatim inside later ones".into(),
            ));
        }
        let mut ids = self.tokenizer.encode(&full[turn_end..], false)?;
        if ended_with_eot {
            if ids.first() != Some(&self.end_of_turn) {
                return Err(ChatError::Template(
                    "does not close an assistant turn with the end-of-turn token".into(),
                ));
            }
            ids.remove(0);
        }
        Ok(ids)
    }
}
