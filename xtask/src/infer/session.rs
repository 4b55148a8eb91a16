//! One inference episode end to end, shared by `infer` (the terminal) and `demo` (the
//! browser): load a model (the recipe's base or any Hugging Face directory, dense or NF4, with
//! an optional PEFT adapter), build the environment the recipe describes (the real sandbox,
//! `llm()` answered by the same model through the rollout engine's queue, recursion to a set
//! depth), run one episode over a caller's document and question, and report what happens as
//! [`InferEvent`]s: the tokens of the turn being written, each turn's code or answer, the REPL's
//! output, every `llm()` answer, and a [`Summary`] at the end (scored when the question came
//! from a task split).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use fathom_env::env::{Environment, ResetRequest};
use fathom_env::parse::parse_turn;
use fathom_env::sandbox::WorkerCommand;
use fathom_model::{LoadOptions, ModelBackend, Qwen2ForCausalLM, Sampling, Tokenizer};
use fathom_rewards::record::{Action, EndReason, Task, Trajectory};
use fathom_trainer::envs::EnvFactory;
use fathom_trainer::policy::{end_of_turn, load_base};
use fathom_trainer::recipe::{Plan, Quantization};
use fathom_trainer::rollout::{
    Bridge, Chat, EpisodeSpec, Prompt, RolloutEvent, RolloutObserver, RolloutSettings,
    rollout_observed,
};
use serde::Serialize;

/// What to load and how to run episodes (the options `infer` and `demo` share).
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// A Hugging Face model directory; `None` for the recipe's base (by default
    /// SmolLM2-135M-Instruct, fetched on first use).
    pub model: Option<PathBuf>,
    /// A PEFT adapter directory.
    pub adapter: Option<PathBuf>,
    /// Quantize the base's projections to NF4 while loading.
    pub nf4: bool,
    /// The recipe whose environment, sandbox, token budgets and rewards apply; `None` for the
    /// embedded laptop recipe.
    pub recipe: Option<PathBuf>,
    /// Assistant turns per episode (default: the recipe's).
    pub max_turns: Option<usize>,
    /// `llm()` recursion depth (default: the recipe's; 1 = plain sub-calls).
    pub recursion_depth: Option<u32>,
    /// New tokens per assistant turn (default: the recipe's GRPO `max_new_tokens`).
    pub max_turn_tokens: Option<usize>,
    /// Tokens an episode may hold in all (default: the recipe's `max_episode_tokens`).
    pub max_episode_tokens: Option<usize>,
    /// Sampling temperature; 0 is greedy.
    pub temperature: f32,
    /// Seed of the sampling streams.
    pub seed: u64,
    /// The backend's name, for reports.
    pub backend: String,
    /// What the backend runs on (e.g. the wgpu adapter), for reports.
    pub device_name: String,
}

/// One episode to run.
#[derive(Clone, Debug)]
pub struct EpisodeRequest {
    /// The document, loaded as `context`.
    pub document: String,
    /// The question.
    pub question: String,
    /// The task the document and question came from, to score the episode against.
    pub task: Option<Task>,
}

/// What happens during an episode, in order.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum InferEvent {
    /// The episode started.
    Started {
        /// The model (directory or name) and adapter.
        model: String,
        /// The backend and its device.
        backend: String,
        /// Characters in the document.
        document_chars: usize,
        /// The question.
        question: String,
        /// The task's id, when scored against one.
        task: Option<String>,
    },
    /// More text of the turn being written.
    Token {
        /// The text since the last `Token` event.
        text: String,
    },
    /// The model ended a turn.
    Turn {
        /// Its number, from 1.
        turn: usize,
        /// The whole message.
        text: String,
        /// The code it runs, if any.
        code: Option<String>,
        /// Its answer, if it gave one (and no code).
        answer: Option<String>,
    },
    /// An `llm()` call was answered by the model.
    SubCall {
        /// What was asked (an `llm()` prompt, or a recursive sub-episode's last message).
        prompt: String,
        /// The answer.
        answer: String,
    },
    /// The environment answered a turn.
    Observation {
        /// The turn it answers.
        turn: usize,
        /// The observation as the model reads it.
        text: String,
        /// The cell's standard output.
        stdout: String,
        /// The cell's standard error and traceback.
        stderr: String,
        /// `llm()` calls the cell made.
        llm_calls: usize,
        /// Milliseconds the cell ran.
        cell_ms: f64,
    },
    /// The episode is over.
    Finished(Box<Summary>),
}

/// How an episode went.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// The final answer, if the model gave one.
    pub answer: Option<String>,
    /// Why the episode ended.
    pub end: String,
    /// Assistant turns.
    pub turns: usize,
    /// `llm()` calls answered.
    pub llm_calls: usize,
    /// Tokens the model sampled (turns and `llm()` answers).
    pub generated_tokens: usize,
    /// Tokens fed to the model (prompts, observations, sampled tokens).
    pub prefill_tokens: usize,
    /// Forward passes.
    pub forward_passes: usize,
    /// Wall-clock seconds of the episode.
    pub seconds: f64,
    /// Seconds in forward passes and sampling.
    pub model_seconds: f64,
    /// Sampled tokens per second of model time.
    pub tokens_per_s: f64,
    /// Largest KV-cache storage held, in MiB.
    pub peak_cache_mib: f64,
    /// The ids the episode's own turns sampled, in order (not `llm()` answers).
    pub sampled_ids: Vec<u32>,
    /// The score, when the question came from a task.
    pub reward: Option<RewardReport>,
    /// The environment's full record (only `infer --json` prints it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trajectory: Option<Trajectory>,
}

/// An episode's reward against its task.
#[derive(Clone, Debug, Serialize)]
pub struct RewardReport {
    /// The task.
    pub task: String,
    /// The gold answer.
    pub gold: String,
    /// The total reward.
    pub total: f64,
    /// Whether the answer was correct.
    pub correct: bool,
    /// Whether the incorrect-answer cap lowered the total.
    pub capped: bool,
    /// Every component, in the composite's order.
    pub components: Vec<ComponentReport>,
}

/// One reward component.
#[derive(Clone, Debug, Serialize)]
pub struct ComponentReport {
    /// Its name.
    pub name: String,
    /// Its weight.
    pub weight: f64,
    /// Its value.
    pub value: f64,
}

/// A loaded model with everything an episode needs.
pub struct Session<B: ModelBackend> {
    model: Qwen2ForCausalLM<B>,
    tokenizer: Arc<Tokenizer>,
    end_of_turn: u32,
    factory: EnvFactory,
    settings: RolloutSettings,
    plan: Plan,
    device: B::Device,
    label: String,
    backend: String,
}

/// Reads a document for an episode: it must be UTF-8 text with something in it.
pub fn read_document(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read the document {}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "the document {} is not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    if text.trim().is_empty() {
        bail!("the document {} is empty", path.display());
    }
    Ok(text)
}

/// The recipe a session uses: `path`'s, or the embedded laptop recipe.
pub fn load_plan(path: Option<&Path>) -> Result<Plan> {
    crate::train::load_plan(path)
}

impl<B: ModelBackend> Session<B> {
    /// Loads the model, its tokenizer and adapter, and starts the sandbox.
    pub fn load(options: &SessionOptions, device: B::Device) -> Result<Self> {
        let mut plan = load_plan(options.recipe.as_deref())?;
        // Inference runs its episodes here, whatever servers the recipe trains against.
        plan.remote = None;
        if let Some(turns) = options.max_turns {
            if turns == 0 {
                bail!("--max-turns must be positive");
            }
            plan.env.max_turns = turns;
        }
        if let Some(depth) = options.recursion_depth {
            if depth == 0 {
                bail!("--recursion-depth must be at least 1 (1 = plain llm() calls)");
            }
            plan.env.llm.max_depth = depth;
        }
        let (model, tokenizer, name) = match &options.model {
            Some(dir) => {
                let model = Qwen2ForCausalLM::<B>::load(
                    dir,
                    &device,
                    LoadOptions {
                        quantize_nf4: options.nf4,
                    },
                )
                .with_context(|| format!("loading the model from {}", dir.display()))?;
                let tokenizer = Tokenizer::from_dir(dir)
                    .with_context(|| format!("loading the tokenizer from {}", dir.display()))?;
                (model, tokenizer, dir.display().to_string())
            }
            None => {
                if options.nf4 {
                    plan.model.quantization = Quantization::Nf4 {
                        double_quant: false,
                    };
                }
                let base = crate::train::default_base(&plan)?;
                load_base::<B>(&plan, base.as_deref(), &device)
                    .with_context(|| format!("loading the base model of {}", plan.origin))?
            }
        };
        let model = match &options.adapter {
            Some(dir) => model
                .load_adapter(dir, &device)
                .with_context(|| format!("loading the adapter {} onto {name}", dir.display()))?,
            None => model,
        };
        let end_of_turn = end_of_turn(&tokenizer)?;
        let tokenizer = Arc::new(tokenizer);
        let bridge = Bridge::new();
        let factory = EnvFactory::new(
            &plan,
            WorkerCommand::CurrentExe,
            tokenizer.clone(),
            &bridge,
            1,
        )?;
        let sampling = if options.temperature > 0.0 {
            Sampling::Sample {
                temperature: options.temperature,
                top_p: 1.0,
                top_k: 0,
            }
        } else {
            Sampling::Greedy
        };
        let settings = RolloutSettings {
            sampling,
            max_turn_tokens: options.max_turn_tokens.unwrap_or(plan.grpo.max_new_tokens),
            max_episode_tokens: options
                .max_episode_tokens
                .unwrap_or(plan.grpo.max_episode_tokens),
            sub_call_tokens: options.max_turn_tokens.unwrap_or(plan.grpo.max_new_tokens),
            seed: options.seed,
        };
        settings
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid settings: {e}"))?;
        let label = match &options.adapter {
            Some(a) => format!("{name} + adapter {}", a.display()),
            None => name,
        };
        let quantized = if options.nf4
            || matches!(plan.model.quantization, Quantization::Nf4 { .. })
                && options.model.is_none()
        {
            ", NF4"
        } else {
            ""
        };
        Ok(Self {
            model,
            tokenizer,
            end_of_turn,
            factory,
            settings,
            plan,
            device,
            label: format!("{label}{quantized}"),
            backend: format!("{} ({})", options.backend, options.device_name),
        })
    }

    /// The recipe in use (its task generation and rewards).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The model's description (directory or name, adapter, quantization).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The backend's description.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// Runs one episode, reporting its events to `sink` as they happen.
    pub fn run(
        &self,
        request: EpisodeRequest,
        sink: &mut dyn FnMut(InferEvent),
    ) -> Result<Summary> {
        if request.document.trim().is_empty() {
            bail!("the document is empty");
        }
        if request.question.trim().is_empty() {
            bail!("the question is empty");
        }
        sink(InferEvent::Started {
            model: self.label.clone(),
            backend: self.backend.clone(),
            document_chars: request.document.chars().count(),
            question: request.question.clone(),
            task: request.task.as_ref().map(|t| t.id.clone()),
        });
        let reset = match &request.task {
            Some(task) => ResetRequest::Task(Box::new(task.clone())),
            None => ResetRequest::Custom {
                document: request.document,
                question: request.question,
                answer: None,
            },
        };
        let spec = EpisodeSpec {
            reset,
            group: 0,
            stream: 0,
        };
        let mut envs: Vec<Box<dyn Environment>> = self.factory.make(1);
        let chat = Chat::new(&self.tokenizer, self.end_of_turn);
        let mut observer = Streamer {
            tokenizer: &self.tokenizer,
            end_of_turn: self.end_of_turn,
            turn_ids: Vec::new(),
            shown: String::new(),
            turns: 0,
            sink,
        };
        let t0 = Instant::now();
        let (mut outputs, stats) = rollout_observed(
            &self.model,
            &chat,
            &mut envs,
            std::slice::from_ref(&spec),
            &self.settings,
            self.factory.bridge(),
            &self.device,
            &mut observer,
        )
        .context("the episode failed")?;
        let seconds = t0.elapsed().as_secs_f64();
        let output = outputs.pop().context("the rollout returned no episode")?;
        let trajectory = output
            .trajectory
            .map_err(|e| anyhow::anyhow!("the episode failed: {e}"))?;
        let answer = trajectory.steps.last().and_then(|s| match &s.action {
            Action::Answer { text } => Some(text.clone()),
            _ => None,
        });
        let end = match &trajectory.end_reason {
            EndReason::Answered => "answered".to_string(),
            EndReason::IterationCap => {
                format!("no answer within {} turns", self.plan.env.max_turns)
            }
            EndReason::Error { message } => format!("stopped: {message}"),
        };
        let reward = match &request.task {
            Some(task) => Some(self.score(task, &trajectory)?),
            None => None,
        };
        let sampled_ids = output
            .sample
            .ids
            .iter()
            .zip(&output.sample.sampled)
            .filter(|(_, s)| **s)
            .map(|(id, _)| *id)
            .collect();
        let summary = Summary {
            answer,
            end,
            turns: output.turns,
            llm_calls: trajectory.llm_call_count(),
            generated_tokens: stats.generated_tokens,
            prefill_tokens: stats.prefill_tokens,
            forward_passes: stats.forward_passes,
            seconds,
            model_seconds: stats.generation_s,
            tokens_per_s: if stats.generation_s > 0.0 {
                stats.generated_tokens as f64 / stats.generation_s
            } else {
                0.0
            },
            peak_cache_mib: stats.peak_cache_bytes as f64 / (1 << 20) as f64,
            sampled_ids,
            reward,
            trajectory: Some(trajectory),
        };
        let mut event = summary.clone();
        event.trajectory = None;
        (observer.sink)(InferEvent::Finished(Box::new(event)));
        Ok(summary)
    }

    fn score(&self, task: &Task, trajectory: &Trajectory) -> Result<RewardReport> {
        let b = self
            .plan
            .rewards
            .score(task, trajectory)
            .with_context(|| format!("scoring the episode against {}", task.id))?;
        Ok(RewardReport {
            task: task.id.clone(),
            gold: task.answer.clone(),
            total: b.total,
            correct: b.correct,
            capped: b.capped,
            components: b
                .components
                .iter()
                .map(|c| ComponentReport {
                    name: c.name.to_string(),
                    weight: c.weight,
                    value: c.value,
                })
                .collect(),
        })
    }
}

/// Turns the rollout's events into [`InferEvent`]s, decoding the turn being written as it
/// grows.
struct Streamer<'a, 's> {
    tokenizer: &'a Tokenizer,
    end_of_turn: u32,
    turn_ids: Vec<u32>,
    shown: String,
    turns: usize,
    sink: &'s mut dyn FnMut(InferEvent),
}

impl RolloutObserver for Streamer<'_, '_> {
    fn event(&mut self, event: RolloutEvent<'_>) {
        match event {
            RolloutEvent::Token { token, .. } => {
                if token == self.end_of_turn {
                    return;
                }
                self.turn_ids.push(token);
                let Ok(text) = self.tokenizer.decode(&self.turn_ids, true) else {
                    return;
                };
                // Hold back text that ends inside a multi-byte character, or that the
                // tokenizer rewrote (a merge across the boundary).
                if text.ends_with('\u{FFFD}') || !text.starts_with(&self.shown) {
                    return;
                }
                let delta = text[self.shown.len()..].to_string();
                if !delta.is_empty() {
                    self.shown = text;
                    (self.sink)(InferEvent::Token { text: delta });
                }
            }
            RolloutEvent::Turn { text, .. } => {
                self.turns += 1;
                self.turn_ids.clear();
                self.shown.clear();
                let parsed = parse_turn(text);
                let (code, answer) = match parsed.action {
                    Action::Code { code } => (Some(code), None),
                    Action::Answer { text } => (None, Some(text)),
                    Action::Invalid { .. } => (None, None),
                };
                (self.sink)(InferEvent::Turn {
                    turn: self.turns,
                    text: text.to_string(),
                    code,
                    answer,
                });
            }
            RolloutEvent::Observation { step, text, .. } => {
                let (stdout, stderr, cell_ms) = match step.and_then(|s| s.output.as_ref()) {
                    Some(out) => {
                        let mut err = out.stderr.clone();
                        if let Some(e) = &out.error {
                            err.push_str(e);
                        }
                        (out.stdout.clone(), err, out.elapsed_ms)
                    }
                    None => (String::new(), String::new(), 0.0),
                };
                (self.sink)(InferEvent::Observation {
                    turn: self.turns,
                    text: text.to_string(),
                    stdout,
                    stderr,
                    llm_calls: step.map_or(0, |s| s.llm_calls.len()),
                    cell_ms,
                });
            }
            RolloutEvent::SubCall { prompt, answer } => {
                let prompt = match prompt {
                    Prompt::Text(text) => text.clone(),
                    Prompt::Conversation(messages) => messages
                        .last()
                        .map(|m| m.content.clone())
                        .unwrap_or_default(),
                };
                (self.sink)(InferEvent::SubCall {
                    prompt,
                    answer: answer.to_string(),
                });
            }
            RolloutEvent::Finished { .. } => {}
        }
    }
}
