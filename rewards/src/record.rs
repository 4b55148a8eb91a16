//! Plain data shared by the environment (which produces it) and the rewards (which score it):
//! tasks, and the record of one episode (`Trajectory`).
//!
//! These types are the contract between `fathom-env` and `fathom-rewards` (see `docs/` and
//! `DESIGN.md` §2): the environment fills them in, the rewards read them, and both serialise
//! them as JSON (`xtask data` writes tasks, `xtask episode --json` writes trajectories,
//! `xtask score` reads both). They carry no behaviour beyond small accessors, so a reward can
//! be written and tested without an environment.
//!
//! Offsets into a task's document are Python `str` indices (Unicode code points), because
//! they are produced and consumed inside the REPL.
//!
//! With the `schema` feature, every type also derives `utoipa::ToSchema`, so the environment's
//! server describes these types in its OpenAPI document and `/schema` from the types themselves
//! (`Action` is named `TurnAction` there, apart from the server's own `Action`).

use serde::{Deserialize, Serialize};

/// Which of the three fixed task splits a task belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// 1000 tasks used for SFT traces and GRPO.
    Train,
    /// 200 tasks used for evaluation during development.
    Eval,
    /// 500 tasks kept out of every training and tuning decision.
    Heldout,
}

/// The kind of reasoning a task needs; each family is produced by its own generator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// A single key buried in filler; the answer is the value stored under it.
    Needle,
    /// A chain of lookups: the answer to one is the key of the next.
    MultiHop,
    /// Counting or aggregating over many records (sum, max, count matching a condition).
    Aggregate,
    /// Comparing facts stated in distant sections of the document.
    Compare,
    /// A short natural-language passage must be read (an `llm()` call on the slice helps).
    Passage,
}

/// A half-open range `[start, end)` of Python `str` indices into a task's document.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Span {
    /// First index in the range.
    pub start: usize,
    /// One past the last index in the range.
    pub end: usize,
}

impl Span {
    /// Whether the two ranges share at least one index.
    pub fn overlaps(&self, other: &Span) -> bool {
        self.start < other.end && other.start < self.end
    }
}

/// One long-document question with its gold answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Task {
    /// Stable identifier, e.g. `train-00042`.
    pub id: String,
    /// The split the task belongs to.
    pub split: Split,
    /// Position of the task within its split.
    pub index: usize,
    /// The seed the generator used for this task (reproduces it exactly).
    pub seed: u64,
    /// The generator family.
    pub family: Family,
    /// The document, loaded into the REPL as `context` and never shown whole to the model.
    pub document: String,
    /// The question asked of the model.
    pub question: String,
    /// The gold answer.
    pub answer: String,
    /// Other spellings accepted as correct (e.g. `"7"` and `"seven"`).
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Where in the document the facts that determine the answer are stated.
    #[serde(default)]
    pub evidence: Vec<Span>,
    /// Approximate length of the document in tokens.
    pub doc_tokens: usize,
}

/// Who wrote a chat message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The system prompt.
    System,
    /// The question, and every observation the environment returns.
    User,
    /// The policy.
    Assistant,
}

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Message {
    /// Author of the message.
    pub role: Role,
    /// Text of the message.
    pub content: String,
}

/// What the environment made of one assistant turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema), schema(as = TurnAction))]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Action {
    /// A fenced code block that was run in the REPL.
    Code {
        /// The code, without its fence.
        code: String,
    },
    /// A final answer; the episode ended on it.
    Answer {
        /// The raw text between the answer tags (rewards re-parse the final message themselves).
        text: String,
    },
    /// Neither code nor an answer the environment could act on.
    Invalid {
        /// Why the turn could not be acted on, as told to the model.
        reason: String,
    },
}

/// What one code cell produced.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ExecOutput {
    /// Captured standard output (possibly truncated).
    pub stdout: String,
    /// Captured standard error (possibly truncated).
    pub stderr: String,
    /// The Python traceback, or the sandbox's reason for stopping the cell (timeout, memory).
    pub error: Option<String>,
    /// Whether stdout or stderr was cut to the configured size.
    pub truncated: bool,
    /// Wall-clock time of the cell in milliseconds.
    pub elapsed_ms: f64,
}

/// One `llm()` call made from inside the REPL.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct LlmCall {
    /// The prompt passed to `llm()`.
    pub prompt: String,
    /// What `llm()` returned to the code (an error text when refused).
    pub response: String,
    /// Recursion depth of the call (1 for a call made by the top-level episode).
    pub depth: u32,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens in the response.
    pub response_tokens: usize,
    /// Set when the environment refused the call (cap reached, prompt too long, too deep).
    pub refused: Option<String>,
}

/// How a cell touched the document, recorded by the REPL's instrumented `context`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AccessKind {
    /// A slice of the document was taken.
    Slice,
    /// A regular expression was run over the span.
    Search {
        /// The pattern, as written.
        pattern: String,
    },
    /// A plain substring search (`find`, `index`, `count`, `in`, `split`) over the span.
    Find {
        /// The substring searched for.
        needle: String,
    },
}

/// One access of the document by a cell.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Access {
    /// What kind of access it was.
    #[serde(flatten)]
    pub kind: AccessKind,
    /// The span of the document it covered.
    pub span: Span,
}

/// One assistant turn and what the environment did with it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Step {
    /// The assistant's message, verbatim.
    pub assistant: String,
    /// What the environment made of it.
    pub action: Action,
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
    /// Tokens of code run (0 when no code ran).
    pub code_tokens: usize,
    /// Tokens of the observation returned to the model.
    pub output_tokens: usize,
}

/// Why an episode ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EndReason {
    /// The model gave an answer.
    Answered,
    /// The iteration cap was reached without an answer.
    IterationCap,
    /// The episode could not continue.
    Error {
        /// What went wrong.
        message: String,
    },
}

/// The full record of one episode; what rewards consume.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Trajectory {
    /// The task the episode was about.
    pub task_id: String,
    /// The whole conversation: system prompt, question, assistant turns and observations.
    pub messages: Vec<Message>,
    /// One entry per assistant turn.
    pub steps: Vec<Step>,
    /// Why the episode ended.
    pub end_reason: EndReason,
    /// Wall-clock time of the episode in milliseconds.
    pub elapsed_ms: f64,
}

impl Trajectory {
    /// The last assistant message, where the final answer is looked for.
    pub fn final_assistant(&self) -> Option<&str> {
        self.steps.last().map(|s| s.assistant.as_str())
    }

    /// Tool-call tokens: code written plus observation tokens read, over all steps.
    pub fn tool_tokens(&self) -> usize {
        self.steps
            .iter()
            .map(|s| s.code_tokens + s.output_tokens)
            .sum()
    }

    /// Number of `llm()` calls made during the episode, refused ones included.
    pub fn llm_call_count(&self) -> usize {
        self.steps.iter().map(|s| s.llm_calls.len()).sum()
    }

    /// All `llm()` calls in order.
    pub fn llm_calls(&self) -> impl Iterator<Item = &LlmCall> {
        self.steps.iter().flat_map(|s| s.llm_calls.iter())
    }
}
