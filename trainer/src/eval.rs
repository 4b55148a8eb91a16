//! Evaluation: a model runs a split's tasks through the rollout engine (greedy by default) and
//! every episode is scored; the report gives accuracy, reward and each component, `llm()`
//! calls, tool tokens and turns, per family and overall.

use std::collections::BTreeMap;

use fathom_env::env::ResetRequest;
use fathom_model::{ModelBackend, Qwen2ForCausalLM};
use fathom_rewards::Composite;
use fathom_rewards::record::{Family, Task, Trajectory};
use serde::{Deserialize, Serialize};

use crate::envs::EnvFactory;
use crate::rollout::{Chat, EpisodeSpec, RolloutError, RolloutSettings, RolloutStats, rollout};

/// One evaluated episode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpisodeEval {
    /// The task.
    pub task_id: String,
    /// Its family.
    pub family: Family,
    /// Whether the answer was correct.
    pub correct: bool,
    /// The total reward.
    pub reward: f64,
    /// Each component's value (unweighted), by name.
    pub components: BTreeMap<String, f64>,
    /// `llm()` calls.
    pub llm_calls: usize,
    /// Tool tokens (code and observations).
    pub tool_tokens: usize,
    /// Assistant turns.
    pub turns: usize,
    /// Tokens the model sampled.
    pub generated_tokens: usize,
    /// Why the episode ended (or why it failed).
    pub end: String,
}

/// Means over a set of episodes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Episodes.
    pub episodes: usize,
    /// Fraction correct.
    pub accuracy: f64,
    /// Mean total reward.
    pub reward: f64,
    /// Mean of each component.
    pub components: BTreeMap<String, f64>,
    /// Mean `llm()` calls.
    pub llm_calls: f64,
    /// Mean tool tokens.
    pub tool_tokens: f64,
    /// Mean turns.
    pub turns: f64,
}

impl Summary {
    /// The means of `episodes`.
    pub fn of<'a>(episodes: impl IntoIterator<Item = &'a EpisodeEval>) -> Self {
        let list: Vec<&EpisodeEval> = episodes.into_iter().collect();
        let n = list.len().max(1) as f64;
        let mut components: BTreeMap<String, f64> = BTreeMap::new();
        for e in &list {
            for (k, v) in &e.components {
                *components.entry(k.clone()).or_default() += v / n;
            }
        }
        Self {
            episodes: list.len(),
            accuracy: list.iter().filter(|e| e.correct).count() as f64 / n,
            reward: list.iter().map(|e| e.reward).sum::<f64>() / n,
            components,
            llm_calls: list.iter().map(|e| e.llm_calls as f64).sum::<f64>() / n,
            tool_tokens: list.iter().map(|e| e.tool_tokens as f64).sum::<f64>() / n,
            turns: list.iter().map(|e| e.turns as f64).sum::<f64>() / n,
        }
    }
}

/// An evaluation's results.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    /// Every episode, in task order.
    pub episodes: Vec<EpisodeEval>,
    /// Per family.
    pub families: BTreeMap<String, Summary>,
    /// Over all episodes.
    pub overall: Summary,
}

impl EvalReport {
    /// Builds the summaries of `episodes`.
    pub fn new(episodes: Vec<EpisodeEval>) -> Self {
        let mut families: BTreeMap<String, Summary> = BTreeMap::new();
        let names: std::collections::BTreeSet<String> =
            episodes.iter().map(|e| family_name(e.family)).collect();
        for name in names {
            families.insert(
                name.clone(),
                Summary::of(episodes.iter().filter(|e| family_name(e.family) == name)),
            );
        }
        let overall = Summary::of(&episodes);
        Self {
            episodes,
            families,
            overall,
        }
    }
}

/// A family's name as recipes spell it.
pub fn family_name(family: Family) -> String {
    serde_json::to_value(family)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{family:?}"))
}

/// Scores a finished episode.
pub fn score_episode(
    rewards: &Composite,
    task: &Task,
    trajectory: &Result<Trajectory, String>,
    turns: usize,
    generated_tokens: usize,
) -> EpisodeEval {
    let base = EpisodeEval {
        task_id: task.id.clone(),
        family: task.family,
        correct: false,
        reward: 0.0,
        components: rewards.names().map(|n| (n.to_string(), 0.0)).collect(),
        llm_calls: 0,
        tool_tokens: 0,
        turns,
        generated_tokens,
        end: String::new(),
    };
    let t = match trajectory {
        Ok(t) => t,
        Err(e) => {
            return EpisodeEval {
                end: format!("failed: {e}"),
                ..base
            };
        }
    };
    let end = serde_json::to_string(&t.end_reason).unwrap_or_default();
    match rewards.score(task, t) {
        Ok(score) => EpisodeEval {
            correct: score.correct,
            reward: score.total,
            components: score
                .components
                .iter()
                .map(|c| (c.name.to_string(), c.value))
                .collect(),
            llm_calls: t.llm_call_count(),
            tool_tokens: t.tool_tokens(),
            end,
            ..base
        },
        Err(e) => EpisodeEval {
            end: format!("unscored: {e}"),
            ..base
        },
    }
}

/// Runs `tasks` with `model`, `parallel` episodes at a time, and scores them. Returns the
/// report, the trajectories (in task order; `None` where an episode failed) and the summed
/// rollout statistics. `progress` is called with the number of episodes done.
#[allow(clippy::too_many_arguments)]
pub fn evaluate<B: ModelBackend>(
    model: &Qwen2ForCausalLM<B>,
    chat: &Chat<'_>,
    factory: &EnvFactory,
    tasks: &[Task],
    rewards: &Composite,
    settings: &RolloutSettings,
    parallel: usize,
    device: &B::Device,
    progress: &mut dyn FnMut(usize),
) -> Result<(EvalReport, Vec<Option<Trajectory>>, RolloutStats), RolloutError> {
    let mut episodes = Vec::with_capacity(tasks.len());
    let mut trajectories = Vec::with_capacity(tasks.len());
    let mut stats = RolloutStats::default();
    let parallel = parallel.max(1);
    for (chunk_index, chunk) in tasks.chunks(parallel).enumerate() {
        let specs: Vec<EpisodeSpec> = chunk
            .iter()
            .enumerate()
            .map(|(i, task)| EpisodeSpec {
                reset: ResetRequest::Task(Box::new(task.clone())),
                group: chunk_index * parallel + i,
                stream: (chunk_index * parallel + i) as u64,
            })
            .collect();
        let mut envs = factory.make(specs.len());
        let (outputs, s) = rollout(
            model,
            chat,
            &mut envs,
            &specs,
            settings,
            factory.bridge(),
            device,
        )?;
        add_stats(&mut stats, &s);
        for (task, out) in chunk.iter().zip(outputs) {
            episodes.push(score_episode(
                rewards,
                task,
                &out.trajectory,
                out.turns,
                out.generated_tokens,
            ));
            trajectories.push(out.trajectory.ok());
        }
        progress(episodes.len());
    }
    Ok((EvalReport::new(episodes), trajectories, stats))
}

/// Adds one rollout's statistics to a running total.
pub fn add_stats(total: &mut RolloutStats, s: &RolloutStats) {
    total.generation_s += s.generation_s;
    total.environment_s += s.environment_s;
    total.forward_passes += s.forward_passes;
    total.generated_tokens += s.generated_tokens;
    total.prefill_tokens += s.prefill_tokens;
    total.sub_calls += s.sub_calls;
    total.peak_cache_bytes = total.peak_cache_bytes.max(s.peak_cache_bytes);
}
