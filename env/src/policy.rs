//! The [`Policy`] trait: whatever writes the assistant turns. The trainer implements it with
//! the model; the scripted expert (`crate::expert`) implements it with rules.
//!
//! The environment never calls the policy for top-level turns: the caller steps the
//! environment, so a trainer can run many episodes at once and batch their generation. The
//! policy is only called from inside a step to drive a recursive sub-episode (see
//! [`crate::sublm::LlmLimits::max_depth`]). [`run_episode`] is the simple driver for one
//! episode with one policy.

use fathom_rewards::record::{Message, Trajectory};

use crate::env::{AgentAction, EnvError, Environment, ResetRequest};

/// Produces the next assistant message.
pub trait Policy: Send + Sync {
    /// The next assistant message, given the conversation so far (system prompt first).
    fn respond(&self, messages: &[Message]) -> Result<String, PolicyError>;
}

/// A policy that could not produce a message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("policy failed: {0}")]
pub struct PolicyError(pub String);

/// Runs one episode to its end with `policy` writing every assistant turn.
///
/// A policy failure ends the episode with an error end reason rather than failing the call,
/// so the trajectory so far is kept.
pub fn run_episode(
    env: &mut dyn Environment,
    policy: &dyn Policy,
    reset: ResetRequest,
) -> Result<Trajectory, EnvError> {
    let mut obs = env.reset(reset)?;
    while !obs.done {
        match policy.respond(&obs.messages) {
            Ok(message) => obs = env.step(AgentAction::Message(message))?,
            Err(e) => {
                env.abort(&e.to_string())?;
                break;
            }
        }
    }
    env.trajectory()
}
