//! Schema-only mirrors of the record types of `fathom_rewards::record` (tasks, messages,
//! steps, trajectories), so the server's OpenAPI document and `/schema` describe every
//! field of what it sends.
//!
//! `fathom-rewards` knows nothing of OpenAPI (and must not: DESIGN §2), and Rust's orphan
//! rule forbids deriving a foreign trait for its types here, so these structs restate the
//! serde shape of each record type and are referenced from the wire types with
//! `#[schema(value_type = …)]`. They are never constructed. Each is `deny_unknown_fields`,
//! which the generator turns into `additionalProperties: false`: the OpenEnv integration test
//! validates every observation and state the server sends against `/schema`, so a field
//! added to a record type and not here fails that test instead of drifting silently.

#![allow(dead_code)]

use serde::Deserialize;
use utoipa::ToSchema;

/// Which fixed split a task belongs to.
#[derive(Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// 1000 tasks for SFT traces and GRPO.
    Train,
    /// 200 tasks for evaluation during development.
    Eval,
    /// 500 tasks kept out of every training decision.
    Heldout,
}

/// The generator family of a task.
#[derive(Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// A key buried in filler.
    Needle,
    /// A chain of lookups.
    MultiHop,
    /// Counting or aggregating over records.
    Aggregate,
    /// Comparing facts from distant sections.
    Compare,
    /// Reading a short passage.
    Passage,
}

/// A half-open range of Python `str` indices into a document.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Span {
    /// First index.
    pub start: usize,
    /// One past the last index.
    pub end: usize,
}

/// One long-document question with its gold answer (a line of `xtask data`'s JSONL).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Task {
    /// Stable identifier, e.g. `train-00042`.
    pub id: String,
    /// The split.
    pub split: Split,
    /// Position within the split.
    pub index: usize,
    /// The generator's seed.
    pub seed: u64,
    /// The generator family.
    pub family: Family,
    /// The document, loaded as `context`.
    pub document: String,
    /// The question.
    pub question: String,
    /// The gold answer.
    pub answer: String,
    /// Other accepted spellings.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Spans of the deciding facts.
    #[serde(default)]
    pub evidence: Vec<Span>,
    /// Approximate length of the document in tokens.
    pub doc_tokens: usize,
}

/// Who wrote a chat message.
#[derive(Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The system prompt.
    System,
    /// The question and every observation.
    User,
    /// The policy.
    Assistant,
}

/// One chat message.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// Author.
    pub role: Role,
    /// Text.
    pub content: String,
}

/// What the environment made of one assistant turn.
#[derive(Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TurnAction {
    /// A fenced code block that ran.
    Code {
        /// The code, without its fence.
        code: String,
    },
    /// A final answer.
    Answer {
        /// The raw text between the answer tags.
        text: String,
    },
    /// Neither code nor an answer.
    Invalid {
        /// Why, as told to the model.
        reason: String,
    },
}

/// What one code cell produced.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecOutput {
    /// Captured standard output (possibly truncated).
    pub stdout: String,
    /// Captured standard error (possibly truncated).
    pub stderr: String,
    /// The traceback, or the sandbox's reason for stopping the cell.
    pub error: Option<String>,
    /// Whether an output stream was cut.
    pub truncated: bool,
    /// Wall-clock time of the cell in milliseconds.
    pub elapsed_ms: f64,
}

/// One `llm()` call made from the REPL.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LlmCall {
    /// The prompt.
    pub prompt: String,
    /// What `llm()` returned.
    pub response: String,
    /// Recursion depth (1 for a top-level call).
    pub depth: u32,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens in the response.
    pub response_tokens: usize,
    /// Set when the call was refused or failed.
    pub refused: Option<String>,
}

/// One access of the document by a cell (`kind` is `slice`, `search` with `pattern`, or
/// `find` with `needle`).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Access {
    /// `slice`, `search` or `find`.
    pub kind: AccessKindName,
    /// The regular expression, for `search`.
    #[serde(default)]
    pub pattern: Option<String>,
    /// The substring, for `find`.
    #[serde(default)]
    pub needle: Option<String>,
    /// The span of the document covered.
    pub span: Span,
}

/// The kind of a document access.
#[derive(Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AccessKindName {
    /// A slice was taken.
    Slice,
    /// A regular expression ran over the span.
    Search,
    /// A substring search ran over the span.
    Find,
}

/// One assistant turn and what the environment did with it.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Step {
    /// The assistant's message, verbatim.
    pub assistant: String,
    /// What the environment made of it.
    pub action: TurnAction,
    /// The cell's output, when code ran.
    pub output: Option<ExecOutput>,
    /// `llm()` calls the cell made.
    #[serde(default)]
    pub llm_calls: Vec<LlmCall>,
    /// How the cell touched the document.
    #[serde(default)]
    pub accesses: Vec<Access>,
    /// Tokens in the assistant message.
    pub completion_tokens: usize,
    /// Tokens of code run.
    pub code_tokens: usize,
    /// Tokens of the observation returned.
    pub output_tokens: usize,
}

/// Why an episode ended.
#[derive(Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum EndReason {
    /// The model gave an answer.
    Answered,
    /// The turn cap was reached without an answer.
    IterationCap,
    /// The episode could not continue.
    Error {
        /// What went wrong.
        message: String,
    },
}

/// The full record of one episode; what rewards consume.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Trajectory {
    /// The task's id.
    pub task_id: String,
    /// The whole conversation.
    pub messages: Vec<Message>,
    /// One entry per assistant turn.
    pub steps: Vec<Step>,
    /// Why the episode ended.
    pub end_reason: EndReason,
    /// Wall-clock time of the episode in milliseconds.
    pub elapsed_ms: f64,
}
