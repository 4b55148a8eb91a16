//! `cargo xtask bench grpo-step`: GRPO steps of a recipe's policy, timed and split into
//! generation, environment and learning, with tokens per second — on the recipe's real
//! multi-turn RLM tasks, or on the single-turn arithmetic prompts of the TRL peer
//! (`shared/peers/trl_grpo_cpu.py`), so the two can be compared at equal work: same model,
//! group size and completion length.
//!
//! Every group is learned on, flat or not (TRL computes its loss over all of them), so each
//! step does the same work whatever the rewards.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use fathom_env::env::{AgentAction, EnvError, Environment, Observation, ResetRequest};
use fathom_env::sandbox::WorkerCommand;
use fathom_model::ModelBackend;
use fathom_rewards::record::{Action, EndReason, Message, Role, Step, Trajectory};
use fathom_trainer::envs::EnvFactory;
use fathom_trainer::eval::score_episode;
use fathom_trainer::grpo::group_advantages;
use fathom_trainer::policy::load_policy;
use fathom_trainer::recipe::{Backend, Plan};
use fathom_trainer::rollout::{Bridge, Chat, EpisodeSpec, RolloutSettings, rollout};
use fathom_trainer::train::{learn, tasks_of};
use serde_json::json;

use crate::train::{default_base, load_plan};

/// Which prompts the steps use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchTask {
    /// The recipe's training tasks through the sandboxed REPL (multi-turn).
    Rlm,
    /// TRL's peer prompts, "Question i: what is i + i?", answered in one turn.
    Arithmetic,
}

/// Arguments of `bench grpo-step`.
#[derive(Args, Debug)]
pub struct GrpoStepArgs {
    /// The recipe (default: the embedded laptop recipe).
    #[arg(long, value_name = "FILE")]
    recipe: Option<PathBuf>,
    /// The prompts.
    #[arg(long, value_enum, default_value = "rlm")]
    task: BenchTask,
    /// Measured steps (after one warm-up step).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Prompts per step (default: the recipe's).
    #[arg(long)]
    prompts: Option<usize>,
    /// Samples per prompt (default: the recipe's).
    #[arg(long)]
    group: Option<usize>,
    /// New tokens per turn (default: the recipe's).
    #[arg(long)]
    max_new_tokens: Option<usize>,
    /// Turns per episode (default: the recipe's; arithmetic episodes have one).
    #[arg(long)]
    max_turns: Option<usize>,
}

/// Runs `bench grpo-step`.
pub fn run(args: GrpoStepArgs) -> Result<()> {
    let mut plan = load_plan(args.recipe.as_deref())?;
    if let Some(p) = args.prompts {
        plan.grpo.prompts_per_step = p;
    }
    if let Some(g) = args.group {
        plan.grpo.group_size = g;
    }
    if let Some(n) = args.max_new_tokens {
        plan.grpo.max_new_tokens = n;
    }
    if let Some(t) = args.max_turns {
        plan.env.max_turns = t;
    }
    if args.steps == 0 || plan.grpo.group_size < 2 || plan.grpo.prompts_per_step == 0 {
        bail!("need at least one step, one prompt and two samples per prompt");
    }
    match plan.device.backend {
        Backend::Cpu => run_on::<fathom_model::Cpu>(&args, &plan, &Default::default()),
        #[allow(unreachable_patterns)]
        other => bail!("bench grpo-step runs on the CPU; the recipe asks for {other:?}"),
    }
}

fn run_on<B: ModelBackend>(args: &GrpoStepArgs, plan: &Plan, device: &B::Device) -> Result<()> {
    let base = default_base(plan)?;
    let t0 = Instant::now();
    let policy = load_policy::<burn::backend::Autodiff<B>>(plan, base.as_deref(), device)?;
    let load_s = t0.elapsed().as_secs_f64();
    let mut model = policy.model;
    let tokenizer = Arc::new(policy.tokenizer);
    let chat = Chat::new(&tokenizer, policy.end_of_turn);
    let bridge = Bridge::new();
    let g = &plan.grpo;
    let episodes = g.prompts_per_step * g.group_size;
    let factory = EnvFactory::new(
        plan,
        WorkerCommand::CurrentExe,
        tokenizer.clone(),
        &bridge,
        episodes,
    )?;
    let train = tasks_of(plan, plan.data.train.split, &plan.train_tasks)?;
    let mut optim = g.optimizer.init();
    let mut steps = Vec::new();
    for step in 0..=args.steps {
        let specs: Vec<EpisodeSpec> = (0..episodes)
            .map(|i| {
                let p = step * g.prompts_per_step + i / g.group_size;
                let reset = match args.task {
                    BenchTask::Rlm => ResetRequest::Task(Box::new(train[p % train.len()].clone())),
                    BenchTask::Arithmetic => ResetRequest::Custom {
                        document: String::new(),
                        question: format!("Question {}: what is {} + {}?", p % 64, p % 64, p % 64),
                        answer: Some((2 * (p % 64)).to_string()),
                    },
                };
                EpisodeSpec {
                    reset,
                    group: i / g.group_size,
                    stream: i as u64,
                }
            })
            .collect();
        let mut envs: Vec<Box<dyn Environment>> = match args.task {
            BenchTask::Rlm => factory.make(episodes),
            BenchTask::Arithmetic => (0..episodes)
                .map(|_| Box::new(Arithmetic::default()) as Box<dyn Environment>)
                .collect(),
        };
        let settings = RolloutSettings {
            sampling: plan.sampling,
            max_turn_tokens: g.max_new_tokens,
            max_episode_tokens: g.max_episode_tokens,
            sub_call_tokens: g.max_new_tokens,
            seed: plan.seeds.sampling + step as u64,
        };
        let started = Instant::now();
        let inner = burn::module::AutodiffModule::valid(&model);
        let (outputs, stats) =
            rollout(&inner, &chat, &mut envs, &specs, &settings, &bridge, device)?;
        let rewards: Vec<f64> = outputs
            .iter()
            .zip(&specs)
            .map(|(o, s)| match (&args.task, &s.reset) {
                (BenchTask::Arithmetic, ResetRequest::Custom { answer, .. }) => {
                    let last = o
                        .trajectory
                        .as_ref()
                        .ok()
                        .and_then(|t| t.final_assistant().map(str::to_string));
                    f64::from(u8::from(
                        last.zip(answer.as_ref())
                            .is_some_and(|(t, a)| t.contains(a.as_str())),
                    ))
                }
                _ => {
                    let p = step * g.prompts_per_step + s.group;
                    score_episode(
                        &plan.rewards,
                        &train[p % train.len()],
                        &o.trajectory,
                        o.turns,
                        o.generated_tokens,
                    )
                    .reward
                }
            })
            .collect();
        let advantages = group_advantages(&rewards, g.group_size, g.loss.scale_by_std)?;
        let samples: Vec<_> = outputs.iter().map(|o| &o.sample).collect();
        let learn_started = Instant::now();
        let lr = g.optimizer.lr;
        let (m, learned) = learn(
            model,
            &mut optim,
            &samples,
            &advantages.values,
            g,
            None,
            plan.sampling.temperature() as f64,
            lr,
            device,
        )?;
        model = m;
        let learning_s = learn_started.elapsed().as_secs_f64();
        let total_s = started.elapsed().as_secs_f64();
        let sampled: usize = outputs.iter().map(|o| o.generated_tokens).sum();
        let trained: usize = outputs.iter().map(|o| o.sample.ids.len()).sum();
        let record = json!({
            "step": step, "total_s": total_s,
            "generation_s": stats.generation_s, "environment_s": stats.environment_s,
            "learning_s": learning_s, "sampled_tokens": sampled, "trained_tokens": trained,
            "generation_tok_s": sampled as f64 / stats.generation_s.max(1e-9),
            "learning_tok_s": trained as f64 / learning_s.max(1e-9),
            "completions_per_s": episodes as f64 / total_s,
            "mean_reward": rewards.iter().sum::<f64>() / rewards.len() as f64,
            "loss": learned.loss,
        });
        eprintln!("{record}");
        if step > 0 {
            steps.push(record);
        }
    }
    let median = |key: &str| {
        let mut v: Vec<f64> = steps
            .iter()
            .map(|r| r[key].as_f64().unwrap_or(0.0))
            .collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "{}",
        json!({
            "system": "fathom", "recipe": plan.origin, "task": format!("{:?}", args.task).to_lowercase(),
            "prompts": g.prompts_per_step, "group": g.group_size, "max_new_tokens": g.max_new_tokens,
            "max_turns": plan.env.max_turns, "load_s": load_s,
            "s_per_step": median("total_s"), "generation_s": median("generation_s"),
            "environment_s": median("environment_s"), "learning_s": median("learning_s"),
            "generation_tok_s": median("generation_tok_s"), "learning_tok_s": median("learning_tok_s"),
            "completions_per_s": median("completions_per_s"), "steps": steps,
        })
    );
    Ok(())
}

/// One question answered in one turn (the TRL peer's task).
#[derive(Default)]
struct Arithmetic {
    episode: Option<(String, Vec<Message>, Vec<Step>, bool)>,
}

impl Environment for Arithmetic {
    fn reset(&mut self, request: ResetRequest) -> Result<Observation, EnvError> {
        let ResetRequest::Custom { question, .. } = request else {
            return Err(EnvError::Remote(
                "the arithmetic benchmark takes custom questions".into(),
            ));
        };
        let messages = vec![Message {
            role: Role::User,
            content: question.clone(),
        }];
        self.episode = Some((question, messages.clone(), Vec::new(), false));
        Ok(Observation {
            messages,
            done: false,
            end_reason: None,
            step: None,
        })
    }

    fn step(&mut self, action: AgentAction) -> Result<Observation, EnvError> {
        let (id, messages, steps, done) = self.episode.as_mut().ok_or(EnvError::NoEpisode)?;
        if *done {
            return Err(EnvError::EpisodeOver(id.clone()));
        }
        let AgentAction::Message(text) = action else {
            return Err(EnvError::Remote(
                "the arithmetic benchmark takes messages".into(),
            ));
        };
        messages.push(Message {
            role: Role::Assistant,
            content: text.clone(),
        });
        let step = Step {
            assistant: text.clone(),
            action: Action::Answer { text },
            output: None,
            llm_calls: Vec::new(),
            accesses: Vec::new(),
            completion_tokens: 0,
            code_tokens: 0,
            output_tokens: 0,
        };
        steps.push(step.clone());
        *done = true;
        Ok(Observation {
            messages: messages.clone(),
            done: true,
            end_reason: Some(EndReason::Answered),
            step: Some(step),
        })
    }

    fn abort(&mut self, _: &str) -> Result<(), EnvError> {
        if let Some(ep) = &mut self.episode {
            ep.3 = true;
        }
        Ok(())
    }

    fn trajectory(&self) -> Result<Trajectory, EnvError> {
        let (id, messages, steps, _) = self.episode.as_ref().ok_or(EnvError::NoEpisode)?;
        Ok(Trajectory {
            task_id: id.clone(),
            messages: messages.clone(),
            steps: steps.clone(),
            end_reason: EndReason::Answered,
            elapsed_ms: 0.0,
        })
    }
}
