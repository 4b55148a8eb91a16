//! The wire protocol of Fathom's OpenEnv-compatible server: the JSON bodies of its HTTP
//! routes and the messages of its WebSocket, shared by [`crate::server`] and
//! [`crate::client`], with the validation that turns them into the environment's own
//! [`ResetRequest`] and [`AgentAction`].
//!
//! The shapes follow OpenEnv's (the `openenv` package's `core.env_server.types`): a step
//! answers `{"observation": {…}, "reward": …, "done": …}`; WebSocket messages are
//! `{"type": …, "data": …}`; errors carry OpenEnv's codes. What is Fathom's own is the content
//! of `observation`, `state`, the reset parameters and the action (see the README's
//! "Server" section for the whole protocol). Every request type rejects unknown fields, and
//! validation errors name the field (`loc`) in the style of FastAPI's 422 bodies.

mod parse;

pub use parse::{FieldError, Shape, from_value, parse_json};

use fathom_rewards::record::{EndReason, Message, Split, Step, Task, Trajectory};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::env::{AgentAction, Observation, ResetRequest};

/// Longest `episode_id` accepted (OpenEnv's limit).
pub const MAX_EPISODE_ID_CHARS: usize = 255;

/// Longest `request_id` of `POST /step` accepted (OpenEnv's limit).
pub const MAX_REQUEST_ID_CHARS: usize = 255;

/// Who answers the `llm()` calls of an episode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LlmMode {
    /// The server's own sub-LM (configured when it starts).
    #[default]
    Server,
    /// The client: the server sends an `llm` message during the step and waits for the
    /// client's `llm_result` (WebSocket sessions only).
    Client,
}

/// How to start an episode: the body of `POST /reset` and the `data` of a WebSocket `reset`.
///
/// Give at most one way to choose the task: `seed`; `split` with `index`; a whole `task`;
/// or `context` with `task_prompt` (and optionally `expected_answer`), as OpenEnv's REPL
/// environment takes them. With none, the task is generated from a fresh random seed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = ResetRequest)]
pub struct ResetParams {
    /// Generate the task from this seed (outside the fixed splits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Your identifier for the episode (at most 255 characters); generated when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub episode_id: Option<String>,
    /// A fixed split (`train`, `eval`, `heldout`); needs `index`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<Split>,
    /// Position in `split`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    /// A whole task (one line of `xtask data`'s JSONL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<Box<Task>>,
    /// A document of your own, loaded as `context`; needs `task_prompt`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    /// The question about `context`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_prompt: Option<String>,
    /// The expected answer for `context`; when given, the final step is scored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_answer: Option<String>,
    /// Who answers `llm()` calls (default `server`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llm: Option<LlmMode>,
    /// HTTP only: start the episode in this existing session instead of a new one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
}

/// Where a validated reset takes its task from.
#[derive(Clone, Debug, PartialEq)]
pub enum ResetSource {
    /// A request the environment understands directly.
    Request(ResetRequest),
    /// No task was named: the server picks a random seed.
    Random,
}

/// A reset request that passed validation.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidReset {
    /// The task.
    pub source: ResetSource,
    /// The caller's episode id, if any.
    pub episode_id: Option<String>,
    /// Who answers `llm()`.
    pub llm: LlmMode,
    /// The HTTP session to reuse, if any.
    pub session_id: Option<String>,
}

impl ResetParams {
    /// The parameters that ask for `request` (what the Rust client sends).
    pub fn from_request(request: &ResetRequest) -> ResetParams {
        let mut p = ResetParams::default();
        match request {
            ResetRequest::Split { split, index } => {
                p.split = Some(*split);
                p.index = Some(*index);
            }
            ResetRequest::Seed(seed) => p.seed = Some(*seed),
            ResetRequest::Task(task) => p.task = Some(task.clone()),
            ResetRequest::Custom {
                document,
                question,
                answer,
            } => {
                p.context = Some(document.clone());
                p.task_prompt = Some(question.clone());
                p.expected_answer = answer.clone();
            }
        }
        p
    }

    /// Checks the combination of fields; every error names its field.
    pub fn validate(self) -> Result<ValidReset, Vec<FieldError>> {
        let mut errors = Vec::new();
        if let Some(id) = &self.episode_id
            && (id.is_empty() || id.chars().count() > MAX_EPISODE_ID_CHARS)
        {
            errors.push(FieldError::value(
                &["episode_id"],
                format!("episode_id must have 1 to {MAX_EPISODE_ID_CHARS} characters"),
            ));
        }
        let mut named: Vec<&'static str> = Vec::new();
        if self.seed.is_some() {
            named.push("seed");
        }
        match (self.split, self.index) {
            (Some(_), Some(_)) => named.push("split"),
            (Some(_), None) => errors.push(FieldError::missing(
                &["index"],
                "index is required with split",
            )),
            (None, Some(_)) => errors.push(FieldError::missing(
                &["split"],
                "split is required with index",
            )),
            (None, None) => {}
        }
        if self.task.is_some() {
            named.push("task");
        }
        match (&self.context, &self.task_prompt) {
            (Some(_), Some(_)) => named.push("context"),
            (Some(_), None) => errors.push(FieldError::missing(
                &["task_prompt"],
                "task_prompt (the question) is required with context",
            )),
            (None, Some(_)) => errors.push(FieldError::missing(
                &["context"],
                "context (the document) is required with task_prompt",
            )),
            (None, None) => {}
        }
        if self.expected_answer.is_some() && self.context.is_none() {
            errors.push(FieldError::value(
                &["expected_answer"],
                "expected_answer goes with context; tasks from seed, split or task carry their own answer",
            ));
        }
        if named.len() > 1 {
            errors.push(FieldError::value(
                &[named[1]],
                format!(
                    "{} are exclusive: choose the task one way (seed, split with index, task, or context)",
                    named.join(" and ")
                ),
            ));
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        let source = if let Some(seed) = self.seed {
            ResetSource::Request(ResetRequest::Seed(seed))
        } else if let (Some(split), Some(index)) = (self.split, self.index) {
            ResetSource::Request(ResetRequest::Split { split, index })
        } else if let Some(task) = self.task {
            ResetSource::Request(ResetRequest::Task(task))
        } else if let (Some(document), Some(question)) = (self.context, self.task_prompt) {
            ResetSource::Request(ResetRequest::Custom {
                document,
                question,
                answer: self.expected_answer,
            })
        } else {
            ResetSource::Random
        };
        Ok(ValidReset {
            source,
            episode_id: self.episode_id,
            llm: self.llm.unwrap_or_default(),
            session_id: self.session_id,
        })
    }
}

/// One assistant turn: exactly one of `message`, `code`, `answer` or `abort`.
///
/// `message` is the model's raw text, parsed as the in-process environment parses it (code
/// in a ```` ```repl ```` fence, the answer in `<answer>…</answer>`); `code` and `answer` skip
/// the parsing; `abort` ends the episode with an error (e.g. generation failed).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = Action)]
pub struct ActionParams {
    /// The model's raw message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Code to run, as if written in a `repl` block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// A final answer, as if written in answer tags.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// End the episode with this error message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort: Option<String>,
    /// OpenEnv's action metadata; accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

/// A validated action.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireAction {
    /// An assistant turn.
    Turn(AgentAction),
    /// End the episode with an error.
    Abort(String),
}

impl ActionParams {
    /// The parameters for `action`.
    pub fn from_action(action: &WireAction) -> ActionParams {
        let mut p = ActionParams::default();
        match action {
            WireAction::Turn(AgentAction::Message(m)) => p.message = Some(m.clone()),
            WireAction::Turn(AgentAction::Code(c)) => p.code = Some(c.clone()),
            WireAction::Turn(AgentAction::Answer(a)) => p.answer = Some(a.clone()),
            WireAction::Abort(reason) => p.abort = Some(reason.clone()),
        }
        p
    }

    /// Checks that exactly one kind of action is given.
    pub fn validate(self) -> Result<WireAction, FieldError> {
        let given: Vec<(&str, WireAction)> = [
            (
                "message",
                self.message
                    .map(|m| WireAction::Turn(AgentAction::Message(m))),
            ),
            (
                "code",
                self.code.map(|c| WireAction::Turn(AgentAction::Code(c))),
            ),
            (
                "answer",
                self.answer
                    .map(|a| WireAction::Turn(AgentAction::Answer(a))),
            ),
            ("abort", self.abort.map(WireAction::Abort)),
        ]
        .into_iter()
        .filter_map(|(name, a)| a.map(|a| (name, a)))
        .collect();
        match given.len() {
            0 => Err(FieldError::missing(
                &["message"],
                "the action needs one of message, code, answer or abort",
            )),
            1 => Ok(given.into_iter().next().expect("one action").1),
            _ => Err(FieldError::value(
                &[given[1].0],
                format!(
                    "{} are exclusive: give one of message, code, answer or abort",
                    given.iter().map(|g| g.0).collect::<Vec<_>>().join(" and ")
                ),
            )),
        }
    }
}

/// The body of `POST /step`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = StepRequest)]
pub struct StepParams {
    /// The action.
    pub action: ActionParams,
    /// The session `POST /reset` returned (in `metadata.session_id`). Required.
    #[serde(default)]
    pub session_id: Option<String>,
    /// Give up on the step after this many seconds (at most the server's step limit).
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Your identifier for the request (logged).
    #[serde(default)]
    pub request_id: Option<String>,
}

/// One component of the final reward.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ComponentScore {
    /// The component's name (e.g. `correctness`).
    pub name: String,
    /// Its weight in the composite.
    pub weight: f64,
    /// Its value, within the component's range.
    pub value: f64,
    /// `weight × value`.
    pub contribution: f64,
}

/// The scored episode: the reward and every component of the server's composite.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Score {
    /// The reward (also the response's `reward`).
    pub total: f64,
    /// `Σ weight × value` before the cap on incorrect answers.
    pub sum: f64,
    /// Whether the answer matched the gold answer.
    pub correct: bool,
    /// Whether the cap on incorrect answers lowered the total.
    pub capped: bool,
    /// Every component, in the composite's order.
    pub components: Vec<ComponentScore>,
}

/// What the caller sees after a reset or a step: the `observation` of a response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[schema(as = Observation)]
pub struct ObservationBody {
    /// The episode's id.
    pub episode_id: String,
    /// The task's id (`eval-00003`, `seed-42`, `custom`, …).
    pub task_id: String,
    /// The newest user message: the question after a reset, the REPL's output after a code
    /// turn; empty once the episode has ended on an answer.
    pub text: String,
    /// The whole conversation so far (system prompt, question, turns, observations), ready
    /// for a chat template.
    pub messages: Vec<Message>,
    /// Assistant turns taken.
    pub turn: usize,
    /// Assistant turns allowed.
    pub max_turns: usize,
    /// Why the episode ended, once it has.
    pub end_reason: Option<EndReason>,
    /// The record of the step just taken (absent after a reset).
    pub step: Option<Step>,
    /// The reward breakdown, on the final observation of an episode with a known answer.
    pub score: Option<Score>,
    /// The episode's full record, on its final observation.
    pub trajectory: Option<Trajectory>,
}

impl ObservationBody {
    /// The environment-side observation (what [`crate::env::Environment`] returns).
    pub fn to_observation(&self, done: bool) -> Observation {
        Observation {
            messages: self.messages.clone(),
            done,
            end_reason: self.end_reason.clone(),
            step: self.step.clone(),
        }
    }
}

/// The response of `POST /reset` and `POST /step`, and the `data` of a WebSocket
/// `observation`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[schema(as = StepResponse)]
pub struct StepResponse {
    /// The observation.
    pub observation: ObservationBody,
    /// The reward: the composite's total on the final step of a scorable episode, else null.
    pub reward: Option<f64>,
    /// Whether the episode has ended.
    pub done: bool,
    /// HTTP only: `{"session_id": …}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

/// The environment's state: `GET /state` and the `data` of a WebSocket `state`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[schema(as = State)]
pub struct StateBody {
    /// The current episode's id (null before the first reset).
    pub episode_id: Option<String>,
    /// Assistant turns taken in the current episode.
    pub step_count: usize,
    /// The task's id.
    pub task_id: Option<String>,
    /// The split, for split tasks.
    pub split: Option<Split>,
    /// The index in the split, for split tasks.
    pub index: Option<usize>,
    /// The generator's seed, for generated tasks.
    pub seed: Option<u64>,
    /// The question.
    pub question: Option<String>,
    /// Length of the document in characters.
    pub document_chars: usize,
    /// Whether the final step will be scored (the gold answer is known).
    pub scored: bool,
    /// Who answers `llm()`.
    pub llm: LlmMode,
    /// Assistant turns allowed.
    pub max_turns: usize,
    /// `llm()` calls made so far.
    pub llm_calls: usize,
    /// Whether the episode has ended.
    pub done: bool,
    /// Why it ended.
    pub end_reason: Option<EndReason>,
}

/// Error codes of OpenEnv's WebSocket protocol (`WSErrorCode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    /// The message is not JSON.
    InvalidJson,
    /// The message's `type` is not one the server knows.
    UnknownType,
    /// The message does not match its type's schema.
    ValidationError,
    /// The environment failed to carry out the request.
    ExecutionError,
    /// The server has as many sessions as it allows.
    CapacityReached,
    /// The environment could not be created.
    FactoryError,
    /// The session failed or ended (idle, shut down, unknown id).
    SessionError,
}

/// The `data` of a WebSocket `error` message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WsError {
    /// What went wrong (names the field for validation errors).
    pub message: String,
    /// OpenEnv's error code.
    pub code: ErrorCode,
    /// Validation errors, one per field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub errors: Option<Vec<FieldError>>,
    /// With `CAPACITY_REACHED`: sessions open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_sessions: Option<usize>,
    /// With `CAPACITY_REACHED`: sessions allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sessions: Option<usize>,
}

impl WsError {
    /// An error with a code and a message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> WsError {
        WsError {
            message: message.into(),
            code,
            errors: None,
            active_sessions: None,
            max_sessions: None,
        }
    }

    /// A validation error listing `errors`.
    pub fn invalid(errors: Vec<FieldError>) -> WsError {
        let message = format!(
            "Invalid message: {}",
            errors
                .iter()
                .map(|e| e.msg.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        );
        WsError {
            errors: Some(errors),
            ..WsError::new(ErrorCode::ValidationError, message)
        }
    }
}

/// An `llm()` call the server asks a client-mode session to answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LlmRequest {
    /// Echo this in the `llm_result`.
    pub id: u64,
    /// The prompt passed to `llm()`.
    pub prompt: String,
}

/// A client's answer to an [`LlmRequest`]: `response`, or `error` if it could not answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LlmResult {
    /// The request's id.
    pub id: u64,
    /// The completion.
    #[serde(default)]
    pub response: Option<String>,
    /// Why there is no completion.
    #[serde(default)]
    pub error: Option<String>,
}

/// A message from the server on the WebSocket: `{"type": …, "data": …}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "data", rename_all = "snake_case")]
pub enum ServerMessage {
    /// The answer to `reset` and `step`.
    Observation(Box<StepResponse>),
    /// The answer to `state`.
    State(Box<StateBody>),
    /// A request failed.
    Error(WsError),
    /// The answer to `mcp` (a JSON-RPC response).
    Mcp(serde_json::Value),
    /// Client-mode sessions: answer this `llm()` call with `llm_result`.
    Llm(LlmRequest),
}

/// A message from the client on the WebSocket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "data", rename_all = "snake_case")]
pub enum ClientMessage {
    /// Start an episode.
    Reset(ResetParams),
    /// Take one turn.
    Step(ActionParams),
    /// Ask for the state.
    State,
    /// End the session.
    Close,
    /// A JSON-RPC request for the MCP endpoint.
    Mcp(serde_json::Value),
    /// Client-mode sessions: the answer to an `llm` message.
    LlmResult(LlmResult),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_sources_are_exclusive_and_complete() {
        let p = |json: &str| {
            parse_json::<ResetParams>(json.as_bytes())
                .unwrap()
                .validate()
        };
        let errs = p(r#"{"seed": 1, "split": "eval", "index": 3}"#).unwrap_err();
        assert_eq!(errs[0].loc, ["split"]);
        assert!(
            errs[0].msg.contains("seed and split are exclusive"),
            "{}",
            errs[0].msg
        );
        assert_eq!(p(r#"{"split": "eval"}"#).unwrap_err()[0].loc, ["index"]);
        assert_eq!(
            p(r#"{"context": "doc"}"#).unwrap_err()[0].loc,
            ["task_prompt"]
        );
        assert_eq!(
            p(r#"{"expected_answer": "x"}"#).unwrap_err()[0].loc,
            ["expected_answer"]
        );
        assert_eq!(
            p(r#"{"episode_id": ""}"#).unwrap_err()[0].loc,
            ["episode_id"]
        );
        assert_eq!(p("{}").unwrap().source, ResetSource::Random);
        let v =
            p(r#"{"context": "d", "task_prompt": "q?", "expected_answer": "a", "llm": "client"}"#)
                .unwrap();
        assert_eq!(v.llm, LlmMode::Client);
        assert_eq!(
            v.source,
            ResetSource::Request(ResetRequest::Custom {
                document: "d".into(),
                question: "q?".into(),
                answer: Some("a".into())
            })
        );
        // Round trip of what the client sends.
        let req = ResetRequest::Split {
            split: Split::Eval,
            index: 7,
        };
        let back = ResetParams::from_request(&req).validate().unwrap();
        assert_eq!(back.source, ResetSource::Request(req));
    }

    #[test]
    fn actions_need_exactly_one_kind() {
        let a = |json: &str| {
            parse_json::<ActionParams>(json.as_bytes())
                .unwrap()
                .validate()
        };
        assert_eq!(a("{}").unwrap_err().loc, ["message"]);
        let two = a(r#"{"code": "1", "answer": "2"}"#).unwrap_err();
        assert_eq!(two.loc, ["answer"]);
        assert!(two.msg.contains("code and answer are exclusive"));
        assert_eq!(
            a(r#"{"code": "x = 1", "metadata": {}}"#).unwrap(),
            WireAction::Turn(AgentAction::Code("x = 1".into()))
        );
        for action in [
            WireAction::Turn(AgentAction::Message("m".into())),
            WireAction::Abort("gen failed".into()),
        ] {
            assert_eq!(
                ActionParams::from_action(&action).validate().unwrap(),
                action
            );
        }
    }

    #[test]
    fn server_messages_have_openenv_shape() {
        let e = ServerMessage::Error(WsError::new(ErrorCode::CapacityReached, "full"));
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"type":"error","data":{"message":"full","code":"CAPACITY_REACHED"}}"#
        );
        let c: ClientMessage = serde_json::from_str(r#"{"type":"close"}"#).unwrap();
        assert_eq!(c, ClientMessage::Close);
    }
}
