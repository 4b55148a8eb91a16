//! The environment: the [`Environment`] trait (reset / step, stepped by the caller) and
//! [`ReplEnv`], the in-process implementation over the sandbox.
//!
//! A caller (the trainer, the OpenEnv server, `xtask episode`) resets an environment with a
//! task, then feeds it one assistant turn at a time and reads back the observation; when the
//! episode is done, [`Environment::trajectory`] gives the record rewards consume. Nothing in
//! a step calls the policy, except to drive a recursive `llm()` sub-episode, so a trainer can
//! keep G environments side by side and batch generation across them (each environment is
//! `Send`; step them from threads).

use std::sync::Arc;
use std::time::Instant;

use fathom_rewards::record::{Action, EndReason, Message, Role, Split, Step, Task, Trajectory};

use crate::parse::{self, ParsedTurn};
use crate::policy::{Policy, run_episode};
use crate::prompt::{self, PromptSettings};
use crate::recursion::LlmRouter;
use crate::sandbox::{SandboxError, SandboxPool, Session};
use crate::sublm::{LlmLimits, SubContext, SubLm};
use crate::tasks::{self, TaskConfig, TaskError};
use crate::tokens::TokenCounter;

/// How an episode starts.
#[derive(Clone, Debug, PartialEq)]
pub enum ResetRequest {
    /// A task from a fixed split.
    Split {
        /// The split.
        split: Split,
        /// Position in the split.
        index: usize,
    },
    /// A task generated from a seed (outside the fixed splits).
    Seed(u64),
    /// A task the caller already has.
    Task(Box<Task>),
    /// A caller-supplied document and question (and, optionally, the expected answer, kept
    /// for whoever scores the episode).
    Custom {
        /// The document, loaded as `context`.
        document: String,
        /// The question.
        question: String,
        /// The expected answer, if known.
        answer: Option<String>,
    },
}

/// One assistant turn given to [`Environment::step`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentAction {
    /// The model's raw message, parsed by the environment (see [`crate::parse`]).
    Message(String),
    /// Code to run, as if written in a `repl` block.
    Code(String),
    /// A final answer, as if written in answer tags.
    Answer(String),
}

/// What the caller sees after a reset or a step.
#[derive(Clone, Debug, PartialEq)]
pub struct Observation {
    /// The whole conversation so far: system prompt, question, turns and observations.
    pub messages: Vec<Message>,
    /// Whether the episode has ended.
    pub done: bool,
    /// Why it ended, once it has.
    pub end_reason: Option<EndReason>,
    /// The record of the step just taken (`None` after a reset).
    pub step: Option<Step>,
}

/// Errors of the environment's API (never of the model's code, which becomes observations).
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// `step` or `trajectory` before any `reset`.
    #[error("no episode: call reset first")]
    NoEpisode,
    /// `step` after the episode ended.
    #[error("episode {0} has already ended")]
    EpisodeOver(String),
    /// `trajectory` before the episode ended.
    #[error("episode {0} is still running")]
    NotFinished(String),
    /// The task could not be made.
    #[error(transparent)]
    Task(#[from] TaskError),
    /// The sandbox could not start a session.
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// A remote environment failed (used by clients of remote servers).
    #[error("remote environment: {0}")]
    Remote(String),
}

/// An RLM environment the caller steps.
pub trait Environment: Send {
    /// Starts a new episode (ending any current one).
    fn reset(&mut self, request: ResetRequest) -> Result<Observation, EnvError>;
    /// Takes one assistant turn.
    fn step(&mut self, action: AgentAction) -> Result<Observation, EnvError>;
    /// Ends the current episode with an error (e.g. generation failed).
    fn abort(&mut self, reason: &str) -> Result<(), EnvError>;
    /// The record of the ended episode.
    fn trajectory(&self) -> Result<Trajectory, EnvError>;
}

/// Settings of [`ReplEnv`].
#[derive(Clone, Debug)]
pub struct EnvConfig {
    /// Assistant turns per episode.
    pub max_turns: usize,
    /// Characters of the document previewed in the first user turn.
    pub preview_chars: usize,
    /// Limits on `llm()` calls.
    pub llm: LlmLimits,
    /// How recursive sub-episodes read their prompt.
    pub sub_context: SubContext,
    /// Task generation (for split and seed resets).
    pub tasks: TaskConfig,
}

impl Default for EnvConfig {
    /// 12 turns, a 300-character preview, default `llm()` limits and tasks.
    fn default() -> EnvConfig {
        EnvConfig {
            max_turns: 12,
            preview_chars: 300,
            llm: LlmLimits::default(),
            sub_context: SubContext::SplitAt("\n---\n".into()),
            tasks: TaskConfig::default(),
        }
    }
}

/// What every episode of an environment (and its sub-episodes) shares.
#[derive(Clone)]
pub struct Services {
    /// The sandbox workers.
    pub pool: SandboxPool,
    /// Answers `llm()` calls at the deepest level.
    pub sub_lm: Arc<dyn SubLm>,
    /// Drives recursive sub-episodes (needed only when `llm.max_depth > 1`).
    pub policy: Option<Arc<dyn Policy>>,
    /// Counts tokens for the record and the limits.
    pub tokens: Arc<dyn TokenCounter>,
    /// Settings.
    pub config: EnvConfig,
}

impl Services {
    /// Services with the approximate token counter, no recursion policy and default settings.
    pub fn new(pool: SandboxPool, sub_lm: Arc<dyn SubLm>) -> Services {
        Services {
            pool,
            sub_lm,
            policy: None,
            tokens: Arc::new(crate::tokens::ApproxTokens),
            config: EnvConfig::default(),
        }
    }
}

/// Who an episode is about.
struct Subject {
    id: String,
    question: String,
    document: Arc<str>,
}

struct Episode {
    subject: Subject,
    session: Session,
    messages: Vec<Message>,
    steps: Vec<Step>,
    router: LlmRouter,
    started: Instant,
    end: Option<EndReason>,
    elapsed_ms: f64,
}

/// The in-process environment: each episode is a sandbox session.
pub struct ReplEnv {
    services: Services,
    /// Recursion depth of this environment's episodes (0 for top level).
    depth: u32,
    episode: Option<Episode>,
}

impl ReplEnv {
    /// A top-level environment.
    pub fn new(services: Services) -> ReplEnv {
        ReplEnv {
            services,
            depth: 0,
            episode: None,
        }
    }

    /// An environment for sub-episodes started by an `llm()` call made at `depth`.
    pub(crate) fn nested(services: Services, depth: u32) -> ReplEnv {
        ReplEnv {
            services,
            depth,
            episode: None,
        }
    }

    /// The shared services.
    pub fn services(&self) -> &Services {
        &self.services
    }

    fn settings(&self) -> PromptSettings {
        let c = &self.services.config;
        PromptSettings {
            max_turns: c.max_turns,
            max_output_chars: self.services.pool.config().limits.max_output_chars,
            preview_chars: c.preview_chars,
        }
    }

    fn subject(&self, request: ResetRequest) -> Result<Subject, EnvError> {
        let cfg = &self.services.config.tasks;
        let task = match request {
            ResetRequest::Split { split, index } => tasks::split_task(split, index, cfg)?,
            ResetRequest::Seed(seed) => tasks::seeded_task(seed, cfg),
            ResetRequest::Task(task) => *task,
            ResetRequest::Custom {
                document, question, ..
            } => {
                return Ok(Subject {
                    id: "custom".into(),
                    question,
                    document: document.into(),
                });
            }
        };
        Ok(Subject {
            id: task.id,
            question: task.question,
            document: task.document.into(),
        })
    }

    fn episode(&mut self) -> Result<&mut Episode, EnvError> {
        let ep = self.episode.as_mut().ok_or(EnvError::NoEpisode)?;
        if ep.end.is_some() {
            return Err(EnvError::EpisodeOver(ep.subject.id.clone()));
        }
        Ok(ep)
    }

    fn observe(&self, step: Option<Step>) -> Observation {
        let ep = self.episode.as_ref().expect("episode present");
        Observation {
            messages: ep.messages.clone(),
            done: ep.end.is_some(),
            end_reason: ep.end.clone(),
            step,
        }
    }
}

impl Episode {
    fn finish(&mut self, reason: EndReason) {
        self.elapsed_ms = self.started.elapsed().as_secs_f64() * 1e3;
        self.end = Some(reason);
    }
}

impl Environment for ReplEnv {
    fn reset(&mut self, request: ResetRequest) -> Result<Observation, EnvError> {
        self.episode = None;
        let started = Instant::now();
        let subject = self.subject(request)?;
        let session = self.services.pool.session(Arc::clone(&subject.document))?;
        let settings = self.settings();
        let doc_tokens = self.services.tokens.count(&subject.document);
        let messages = vec![
            Message {
                role: Role::System,
                content: prompt::system_prompt(&settings),
            },
            Message {
                role: Role::User,
                content: prompt::first_user_message(
                    &subject.question,
                    &subject.document,
                    doc_tokens,
                    &settings,
                ),
            },
        ];
        let router = LlmRouter::new(self.depth + 1);
        self.episode = Some(Episode {
            subject,
            session,
            messages,
            steps: Vec::new(),
            router,
            started,
            end: None,
            elapsed_ms: 0.0,
        });
        Ok(self.observe(None))
    }

    fn step(&mut self, action: AgentAction) -> Result<Observation, EnvError> {
        let services = self.services.clone();
        let max_turns = services.config.max_turns;
        let ep = self.episode()?;
        let (assistant, ParsedTurn { action, notes }) = match action {
            AgentAction::Message(text) => {
                let parsed = parse::parse_turn(&text);
                (text, parsed)
            }
            AgentAction::Code(code) => {
                let text = parse::code_message(&code);
                (
                    text,
                    ParsedTurn {
                        action: Action::Code { code },
                        notes: Vec::new(),
                    },
                )
            }
            AgentAction::Answer(answer) => {
                let text = parse::answer_message(&answer);
                (
                    text,
                    ParsedTurn {
                        action: Action::Answer { text: answer },
                        notes: Vec::new(),
                    },
                )
            }
        };
        ep.messages.push(Message {
            role: Role::Assistant,
            content: assistant.clone(),
        });
        let turn = ep.steps.len() + 1;
        let turns_left = max_turns.saturating_sub(turn);
        let tokens = &services.tokens;
        let mut step = Step {
            completion_tokens: tokens.count(&assistant),
            assistant,
            action: action.clone(),
            output: None,
            llm_calls: Vec::new(),
            accesses: Vec::new(),
            code_tokens: 0,
            output_tokens: 0,
        };
        let observation = match &action {
            Action::Answer { .. } => None,
            Action::Invalid { reason } => {
                Some(prompt::invalid_observation(reason, &notes, turns_left))
            }
            Action::Code { code } => {
                step.code_tokens = tokens.count(code);
                let router = &mut ep.router;
                let mut calls = Vec::new();
                let result = ep
                    .session
                    .exec(code, &mut |p: &str| router.call(&services, p, &mut calls));
                step.llm_calls = calls;
                match result {
                    Ok(cell) => {
                        step.accesses = cell.accesses;
                        let text = prompt::observation(&cell.output, &notes, turns_left);
                        step.output = Some(cell.output);
                        Some(text)
                    }
                    Err(e) => {
                        ep.steps.push(step.clone());
                        ep.finish(EndReason::Error {
                            message: e.to_string(),
                        });
                        return Ok(self.observe(Some(step)));
                    }
                }
            }
        };
        if let Some(text) = observation {
            step.output_tokens = tokens.count(&text);
            ep.messages.push(Message {
                role: Role::User,
                content: text,
            });
        }
        ep.steps.push(step.clone());
        if matches!(action, Action::Answer { .. }) {
            ep.finish(EndReason::Answered);
        } else if turn >= max_turns {
            ep.finish(EndReason::IterationCap);
        }
        Ok(self.observe(Some(step)))
    }

    fn abort(&mut self, reason: &str) -> Result<(), EnvError> {
        let ep = self.episode()?;
        ep.finish(EndReason::Error {
            message: reason.to_string(),
        });
        Ok(())
    }

    fn trajectory(&self) -> Result<Trajectory, EnvError> {
        let ep = self.episode.as_ref().ok_or(EnvError::NoEpisode)?;
        let end_reason = ep
            .end
            .clone()
            .ok_or_else(|| EnvError::NotFinished(ep.subject.id.clone()))?;
        Ok(Trajectory {
            task_id: ep.subject.id.clone(),
            messages: ep.messages.clone(),
            steps: ep.steps.clone(),
            end_reason,
            elapsed_ms: ep.elapsed_ms,
        })
    }
}

/// Runs a recursive sub-episode for an `llm()` call made at `depth` (used by the router).
pub(crate) fn sub_episode(
    services: &Services,
    policy: &dyn Policy,
    depth: u32,
    question: String,
    document: String,
) -> Result<Trajectory, EnvError> {
    let mut env = ReplEnv::nested(services.clone(), depth);
    run_episode(
        &mut env,
        policy,
        ResetRequest::Custom {
            document,
            question,
            answer: None,
        },
    )
}
