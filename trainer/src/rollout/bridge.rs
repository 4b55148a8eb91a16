//! The queue between environments and the generation loop: `llm()` calls (a [`SubLm`]) and
//! the turns of recursive sub-episodes (a [`Policy`]) are requests the generation loop
//! drains and answers with the policy model itself, batched with the top-level turns.
//!
//! An environment's step runs on its own thread and blocks in `complete` / `respond` until the
//! loop answers; the loop never waits on an environment while it has rows to generate, so a
//! step blocked on `llm()` cannot deadlock it.

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, bounded, unbounded};
use fathom_env::policy::{Policy, PolicyError};
use fathom_env::sublm::{SubLm, SubLmError};
use fathom_rewards::record::Message;

/// How long a request waits for the generation loop before it fails (no loop is running, or it
/// stopped).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

/// What a request asks the policy to continue.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// An `llm(prompt)` call: the prompt as the single user message.
    Text(String),
    /// The next assistant turn of a conversation (a recursive sub-episode).
    Conversation(Vec<Message>),
}

/// A request with the channel its answer goes back on.
#[derive(Debug)]
pub struct Request {
    /// What to continue.
    pub prompt: Prompt,
    /// Where the completion (or why there is none) goes.
    pub reply: Sender<Result<String, String>>,
}

/// Both ends of the request queue. Environments get [`Bridge::sub_lm`] and [`Bridge::policy`];
/// the rollout engine drains [`Bridge::requests`].
#[derive(Clone, Debug)]
pub struct Bridge {
    tx: Sender<Request>,
    rx: Receiver<Request>,
}

impl Default for Bridge {
    fn default() -> Self {
        Self::new()
    }
}

impl Bridge {
    /// An empty queue.
    pub fn new() -> Self {
        let (tx, rx) = unbounded();
        Self { tx, rx }
    }

    /// A sub-LM whose calls become requests.
    pub fn sub_lm(&self) -> Arc<dyn SubLm> {
        Arc::new(QueueSubLm {
            tx: self.tx.clone(),
        })
    }

    /// A policy whose turns become requests.
    pub fn policy(&self) -> Arc<dyn Policy> {
        Arc::new(QueuePolicy {
            tx: self.tx.clone(),
        })
    }

    /// The receiving end.
    pub fn requests(&self) -> &Receiver<Request> {
        &self.rx
    }
}

fn ask(tx: &Sender<Request>, prompt: Prompt) -> Result<String, String> {
    let (reply, answer) = bounded(1);
    tx.send(Request { prompt, reply })
        .map_err(|_| "the generation loop is gone".to_string())?;
    match answer.recv_timeout(REQUEST_TIMEOUT) {
        Ok(result) => result,
        Err(_) => Err(format!(
            "no generation loop answered within {} s",
            REQUEST_TIMEOUT.as_secs()
        )),
    }
}

/// A [`SubLm`] that queues its calls.
struct QueueSubLm {
    tx: Sender<Request>,
}

impl SubLm for QueueSubLm {
    fn complete(&self, prompt: &str) -> Result<String, SubLmError> {
        ask(&self.tx, Prompt::Text(prompt.to_string())).map_err(SubLmError)
    }
}

/// A [`Policy`] that queues its turns.
struct QueuePolicy {
    tx: Sender<Request>,
}

impl Policy for QueuePolicy {
    fn respond(&self, messages: &[Message]) -> Result<String, PolicyError> {
        ask(&self.tx, Prompt::Conversation(messages.to_vec())).map_err(PolicyError)
    }
}
