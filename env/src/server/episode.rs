//! One server session's environment: a [`ReplEnv`] started afresh at each reset, what the
//! server knows about its episode (id, task, gold answer), and the scoring of its final step
//! with the server's reward [`Composite`].
//!
//! Everything here blocks (the sandbox is synchronous), so the server calls it from
//! `spawn_blocking`. Errors are [`SessionError`]s, which the HTTP and WebSocket layers turn
//! into status codes and OpenEnv error codes.

use std::sync::Arc;

use fathom_rewards::Composite;
use fathom_rewards::record::{EndReason, Family, Role, Split, Task};

use crate::env::{EnvError, Environment, Observation, ReplEnv, ResetRequest, Services};
use crate::sublm::SubLm;
use crate::tasks::{self, TaskError};
use crate::wire::{
    ComponentScore, FieldError, LlmMode, ObservationBody, ResetSource, Score, StateBody,
    StepResponse, ValidReset, WireAction,
};

/// Why a session could not do what was asked.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SessionError {
    /// The request names something that does not exist or cannot be (422).
    #[error("{}", .0.iter().map(|e| e.msg.as_str()).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<FieldError>),
    /// The request does not fit the episode's state: no episode yet, or it has ended (409).
    #[error("{0}")]
    Conflict(String),
    /// The sandbox could not provide a worker (503).
    #[error("{0}")]
    Unavailable(String),
    /// Anything else (500).
    #[error("{0}")]
    Internal(String),
}

/// Random values a reset may need, drawn by the caller.
#[derive(Clone, Debug)]
pub struct Fresh {
    /// The episode id when the caller gave none.
    pub episode_id: String,
    /// The seed when no task was named.
    pub seed: u64,
}

/// What the server knows about the current episode.
struct EpisodeInfo {
    episode_id: String,
    task_id: String,
    /// The task with its gold answer, when the final step can be scored.
    gold: Option<Task>,
    split: Option<Split>,
    index: Option<usize>,
    seed: Option<u64>,
    question: String,
    document_chars: usize,
    llm: LlmMode,
    turns: usize,
    llm_calls: usize,
    done: bool,
    end_reason: Option<EndReason>,
}

/// The environment of one session.
pub struct EnvSession {
    base: Services,
    composite: Arc<Composite>,
    env: Option<ReplEnv>,
    episode: Option<EpisodeInfo>,
}

impl EnvSession {
    /// A session with no episode yet.
    pub fn new(base: Services, composite: Arc<Composite>) -> EnvSession {
        EnvSession {
            base,
            composite,
            env: None,
            episode: None,
        }
    }

    /// Starts a new episode (ending the current one and its worker). `client_lm` answers
    /// `llm()` calls when the reset asks for [`LlmMode::Client`].
    pub fn reset(
        &mut self,
        reset: ValidReset,
        fresh: Fresh,
        client_lm: Option<Arc<dyn SubLm>>,
    ) -> Result<StepResponse, SessionError> {
        self.env = None;
        self.episode = None;
        let cfg = &self.base.config.tasks;
        let (request, gold, split, index, seed) = match reset.source {
            ResetSource::Random => {
                let task = tasks::seeded_task(fresh.seed, cfg);
                (None, Some(task), None, None, Some(fresh.seed))
            }
            ResetSource::Request(ResetRequest::Seed(seed)) => (
                None,
                Some(tasks::seeded_task(seed, cfg)),
                None,
                None,
                Some(seed),
            ),
            ResetSource::Request(ResetRequest::Split { split, index }) => {
                let task = tasks::split_task(split, index, cfg).map_err(task_error)?;
                (None, Some(task), Some(split), Some(index), None)
            }
            ResetSource::Request(ResetRequest::Task(task)) => {
                let (split, index, seed) = (task.split, task.index, task.seed);
                (None, Some(*task), Some(split), Some(index), Some(seed))
            }
            ResetSource::Request(ResetRequest::Custom {
                document,
                question,
                answer,
            }) => {
                let gold =
                    answer.map(|answer| custom_task(&document, &question, answer, &self.base));
                let request = ResetRequest::Custom {
                    document,
                    question,
                    answer: None,
                };
                (Some(request), gold, None, None, None)
            }
        };
        // Generated and given tasks go in whole, so the env and the scorer see one task.
        let request = match request {
            Some(r) => r,
            None => ResetRequest::Task(Box::new(gold.clone().expect("a task was made"))),
        };
        let (task_id, question, document_chars) = match &request {
            ResetRequest::Task(t) => (t.id.clone(), t.question.clone(), t.document.chars().count()),
            ResetRequest::Custom {
                document, question, ..
            } => (
                "custom".to_string(),
                question.clone(),
                document.chars().count(),
            ),
            _ => unreachable!("split and seed requests were turned into tasks"),
        };
        let mut services = self.base.clone();
        let llm = match (reset.llm, client_lm) {
            (LlmMode::Client, Some(lm)) => {
                services.sub_lm = lm;
                LlmMode::Client
            }
            (LlmMode::Client, None) => {
                return Err(SessionError::Invalid(vec![FieldError::value(
                    &["llm"],
                    "llm=client needs a WebSocket session (/ws): HTTP cannot carry llm() calls back to the client",
                )]));
            }
            (LlmMode::Server, _) => LlmMode::Server,
        };
        let mut env = ReplEnv::new(services);
        let obs = env.reset(request).map_err(env_error)?;
        self.episode = Some(EpisodeInfo {
            episode_id: reset.episode_id.unwrap_or(fresh.episode_id),
            task_id,
            gold,
            split,
            index,
            seed,
            question,
            document_chars,
            llm,
            turns: 0,
            llm_calls: 0,
            done: false,
            end_reason: None,
        });
        self.env = Some(env);
        Ok(self.respond(&obs, None))
    }

    /// Takes one turn, or aborts the episode.
    pub fn step(&mut self, action: WireAction) -> Result<StepResponse, SessionError> {
        let (Some(env), Some(info)) = (self.env.as_mut(), self.episode.as_mut()) else {
            return Err(SessionError::Conflict(
                "no episode: send reset first".to_string(),
            ));
        };
        if info.done {
            return Err(SessionError::Conflict(format!(
                "episode {} has already ended; send reset to start another",
                info.episode_id
            )));
        }
        let obs = match action {
            WireAction::Turn(turn) => {
                let obs = env.step(turn).map_err(env_error)?;
                info.turns += 1;
                info.llm_calls += obs.step.as_ref().map_or(0, |s| s.llm_calls.len());
                obs
            }
            WireAction::Abort(reason) => {
                env.abort(&reason).map_err(env_error)?;
                let t = env.trajectory().map_err(env_error)?;
                Observation {
                    messages: t.messages,
                    done: true,
                    end_reason: Some(t.end_reason),
                    step: None,
                }
            }
        };
        info.done = obs.done;
        info.end_reason = obs.end_reason.clone();
        let final_record = if obs.done {
            let trajectory = env.trajectory().map_err(env_error)?;
            let score = match &info.gold {
                Some(task) => Some(score(&self.composite, task, &trajectory)?),
                None => None,
            };
            Some((trajectory, score))
        } else {
            None
        };
        Ok(self.respond(&obs, final_record))
    }

    /// The state of the current episode (or of a session with none).
    pub fn state(&self) -> StateBody {
        let max_turns = self.base.config.max_turns;
        let Some(info) = &self.episode else {
            return StateBody {
                max_turns,
                ..StateBody::default()
            };
        };
        StateBody {
            episode_id: Some(info.episode_id.clone()),
            step_count: info.turns,
            task_id: Some(info.task_id.clone()),
            split: info.split,
            index: info.index,
            seed: info.seed,
            question: Some(info.question.clone()),
            document_chars: info.document_chars,
            scored: info.gold.is_some(),
            llm: info.llm,
            max_turns,
            llm_calls: info.llm_calls,
            done: info.done,
            end_reason: info.end_reason.clone(),
        }
    }

    fn respond(
        &self,
        obs: &Observation,
        final_record: Option<(fathom_rewards::record::Trajectory, Option<Score>)>,
    ) -> StepResponse {
        let info = self.episode.as_ref().expect("an episode is running");
        let text = match obs.messages.last() {
            Some(m) if m.role == Role::User => m.content.clone(),
            _ => String::new(),
        };
        let (trajectory, score) = match final_record {
            Some((t, s)) => (Some(t), s),
            None => (None, None),
        };
        StepResponse {
            reward: score.as_ref().map(|s| s.total),
            done: obs.done,
            observation: ObservationBody {
                episode_id: info.episode_id.clone(),
                task_id: info.task_id.clone(),
                text,
                messages: obs.messages.clone(),
                turn: info.turns,
                max_turns: self.base.config.max_turns,
                end_reason: obs.end_reason.clone(),
                step: obs.step.clone(),
                score,
                trajectory,
            },
            metadata: None,
        }
    }
}

/// The task a caller-supplied document is scored against. Rewards read its id, document,
/// answer and evidence (none); the family is not read by any reward and is recorded as
/// needle.
fn custom_task(document: &str, question: &str, answer: String, base: &Services) -> Task {
    Task {
        id: "custom".to_string(),
        split: Split::Train,
        index: 0,
        seed: 0,
        family: Family::Needle,
        doc_tokens: base.tokens.count(document),
        document: document.to_string(),
        question: question.to_string(),
        answer,
        aliases: Vec::new(),
        evidence: Vec::new(),
    }
}

fn score(
    composite: &Composite,
    task: &Task,
    trajectory: &fathom_rewards::record::Trajectory,
) -> Result<Score, SessionError> {
    let b = composite
        .score(task, trajectory)
        .map_err(|e| SessionError::Internal(format!("scoring failed: {e}")))?;
    Ok(Score {
        total: b.total,
        sum: b.sum,
        correct: b.correct,
        capped: b.capped,
        components: b
            .components
            .iter()
            .map(|c| ComponentScore {
                name: c.name.to_string(),
                weight: c.weight,
                value: c.value,
                contribution: c.contribution(),
            })
            .collect(),
    })
}

fn task_error(e: TaskError) -> SessionError {
    match e {
        TaskError::OutOfRange { .. } => {
            SessionError::Invalid(vec![FieldError::value(&["index"], format!("index: {e}"))])
        }
        TaskError::UnknownSplit(_) => {
            SessionError::Invalid(vec![FieldError::value(&["split"], format!("split: {e}"))])
        }
    }
}

fn env_error(e: EnvError) -> SessionError {
    match e {
        EnvError::NoEpisode | EnvError::EpisodeOver(_) | EnvError::NotFinished(_) => {
            SessionError::Conflict(e.to_string())
        }
        EnvError::Task(t) => task_error(t),
        EnvError::Sandbox(s) => SessionError::Unavailable(s.to_string()),
        EnvError::Remote(m) => SessionError::Internal(m),
    }
}
