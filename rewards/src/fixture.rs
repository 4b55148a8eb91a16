//! Small builders for tasks and trajectories, for tests, doctests and hand-written fixtures.
//!
//! Real trajectories come from the environment (`xtask episode --json`); these builders make
//! the same plain records without one, so a reward can be unit-tested in a few lines. Token
//! counts are estimated as one token per four characters (rounded up) unless set explicitly
//! with [`TrajectoryBuilder::tokens`].

use crate::record::{
    Access, AccessKind, Action, EndReason, ExecOutput, Family, LlmCall, Message, Role, Span, Split,
    Step, Task, Trajectory,
};

/// A task in the `train` split with the given fields and no aliases or evidence.
///
/// ```
/// use fathom_rewards::fixture::task;
/// use fathom_rewards::record::Family;
/// let t = task("train-00001", Family::Needle, "key 7 = Paris", "Value of key 7?", "Paris");
/// assert_eq!(t.doc_tokens, 4);
/// ```
pub fn task(id: &str, family: Family, document: &str, question: &str, answer: &str) -> Task {
    Task {
        id: id.to_owned(),
        split: Split::Train,
        index: 0,
        seed: 0,
        family,
        document: document.to_owned(),
        question: question.to_owned(),
        answer: answer.to_owned(),
        aliases: Vec::new(),
        evidence: Vec::new(),
        doc_tokens: estimate_tokens(document),
    }
}

/// One token per four characters, rounded up.
pub fn estimate_tokens(text: &str) -> usize {
    text.chars().count().div_ceil(4)
}

/// Builds a [`Trajectory`] step by step.
///
/// ```
/// use fathom_rewards::fixture::TrajectoryBuilder;
/// let t = TrajectoryBuilder::new("train-00001")
///     .code("print(context.find('key 7'))", "0")
///     .find("key 7", 0, 13)
///     .code("print(context[0:13])", "key 7 = Paris")
///     .slice(0, 13)
///     .llm("What is key 7?", "Paris")
///     .answer("<answer>Paris</answer>")
///     .build();
/// assert_eq!(t.steps.len(), 3);
/// assert_eq!(t.llm_call_count(), 1);
/// ```
#[derive(Clone, Debug)]
pub struct TrajectoryBuilder {
    task_id: String,
    steps: Vec<Step>,
    end_reason: Option<EndReason>,
}

impl TrajectoryBuilder {
    /// An empty trajectory for the task with this id.
    pub fn new(task_id: &str) -> Self {
        Self {
            task_id: task_id.to_owned(),
            steps: Vec::new(),
            end_reason: None,
        }
    }

    /// Adds a code step whose cell printed `stdout`.
    pub fn code(mut self, code: &str, stdout: &str) -> Self {
        self.steps.push(Step {
            assistant: format!("```repl\n{code}\n```"),
            action: Action::Code {
                code: code.to_owned(),
            },
            output: Some(ExecOutput {
                stdout: stdout.to_owned(),
                ..ExecOutput::default()
            }),
            llm_calls: Vec::new(),
            accesses: Vec::new(),
            completion_tokens: estimate_tokens(code) + 4,
            code_tokens: estimate_tokens(code),
            output_tokens: estimate_tokens(stdout),
        });
        self
    }

    /// Records that the last step sliced `context[start:end]`.
    ///
    /// # Panics
    /// If there is no step yet (a builder misuse in a test).
    pub fn slice(self, start: usize, end: usize) -> Self {
        self.access(AccessKind::Slice, start, end)
    }

    /// Records that the last step ran the regular expression `pattern` over `[start, end)`.
    ///
    /// # Panics
    /// If there is no step yet.
    pub fn search(self, pattern: &str, start: usize, end: usize) -> Self {
        self.access(
            AccessKind::Search {
                pattern: pattern.to_owned(),
            },
            start,
            end,
        )
    }

    /// Records that the last step searched for the substring `needle` over `[start, end)`.
    ///
    /// # Panics
    /// If there is no step yet.
    pub fn find(self, needle: &str, start: usize, end: usize) -> Self {
        self.access(
            AccessKind::Find {
                needle: needle.to_owned(),
            },
            start,
            end,
        )
    }

    /// Records a document access of any kind by the last step.
    ///
    /// # Panics
    /// If there is no step yet.
    pub fn access(mut self, kind: AccessKind, start: usize, end: usize) -> Self {
        self.last_step().accesses.push(Access {
            kind,
            span: Span { start, end },
        });
        self
    }

    /// Records an `llm(prompt)` call (depth 1) made by the last step.
    ///
    /// # Panics
    /// If there is no step yet.
    pub fn llm(mut self, prompt: &str, response: &str) -> Self {
        self.last_step().llm_calls.push(LlmCall {
            prompt: prompt.to_owned(),
            response: response.to_owned(),
            depth: 1,
            prompt_tokens: estimate_tokens(prompt),
            response_tokens: estimate_tokens(response),
            refused: None,
        });
        self
    }

    /// Overrides the last step's code and output token counts.
    ///
    /// # Panics
    /// If there is no step yet.
    pub fn tokens(mut self, code_tokens: usize, output_tokens: usize) -> Self {
        let step = self.last_step();
        step.code_tokens = code_tokens;
        step.output_tokens = output_tokens;
        self
    }

    /// Adds a final answer turn with this verbatim assistant message; the episode ends on it.
    pub fn answer(mut self, message: &str) -> Self {
        let text = crate::answer::FinalAnswer::parse(message)
            .text()
            .unwrap_or(message);
        self.steps.push(Step {
            assistant: message.to_owned(),
            action: Action::Answer {
                text: text.to_owned(),
            },
            output: None,
            llm_calls: Vec::new(),
            accesses: Vec::new(),
            completion_tokens: estimate_tokens(message),
            code_tokens: 0,
            output_tokens: 0,
        });
        self.end_reason = Some(EndReason::Answered);
        self
    }

    /// Adds a turn the environment could not act on.
    pub fn invalid(mut self, message: &str, reason: &str) -> Self {
        self.steps.push(Step {
            assistant: message.to_owned(),
            action: Action::Invalid {
                reason: reason.to_owned(),
            },
            output: None,
            llm_calls: Vec::new(),
            accesses: Vec::new(),
            completion_tokens: estimate_tokens(message),
            code_tokens: 0,
            output_tokens: 0,
        });
        self
    }

    /// Ends the episode on the iteration cap instead of an answer.
    pub fn end_on_iteration_cap(mut self) -> Self {
        self.end_reason = Some(EndReason::IterationCap);
        self
    }

    /// The finished trajectory. Its messages are rebuilt from the steps (a placeholder system
    /// prompt and question, then each assistant turn and its observation).
    pub fn build(self) -> Trajectory {
        let mut messages = vec![
            Message {
                role: Role::System,
                content: "You have a Python REPL.".to_owned(),
            },
            Message {
                role: Role::User,
                content: "Question.".to_owned(),
            },
        ];
        for step in &self.steps {
            messages.push(Message {
                role: Role::Assistant,
                content: step.assistant.clone(),
            });
            if let Some(out) = &step.output {
                messages.push(Message {
                    role: Role::User,
                    content: out.stdout.clone(),
                });
            }
        }
        Trajectory {
            task_id: self.task_id,
            messages,
            steps: self.steps,
            end_reason: self.end_reason.unwrap_or(EndReason::IterationCap),
            elapsed_ms: 0.0,
        }
    }

    fn last_step(&mut self) -> &mut Step {
        self.steps
            .last_mut()
            .expect("TrajectoryBuilder: add a step before describing it")
    }
}
