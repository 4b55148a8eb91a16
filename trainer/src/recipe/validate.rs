//! Validation of a parsed recipe into a [`Plan`]: every range and cross-field rule, each
//! failure reported with the field's path and its line in the text.

use std::time::Duration;

use fathom_env::env::EnvConfig;
use fathom_env::sandbox::SandboxConfig;
use fathom_env::sublm::{LlmLimits, SubContext};
use fathom_env::tasks::split_name;
use fathom_model::Sampling;
use fathom_rewards::record::Family;
use fathom_rewards::{ConfigError, RewardRegistry};

use super::{Backend, DataSection, Plan, Recipe, RecipeError, SplitSelection, best_line};

/// The sandbox limits a recipe sets (the rest of [`SandboxConfig`] is the caller's).
#[derive(Clone, Debug, PartialEq)]
pub struct SandboxLimits {
    /// Characters of output kept per stream and cell.
    pub max_output_chars: usize,
    /// Wall-clock limit per cell.
    pub step_timeout: Duration,
}

impl SandboxLimits {
    /// Writes these limits into a sandbox configuration.
    pub fn apply(&self, config: &mut SandboxConfig) {
        config.limits.max_output_chars = self.max_output_chars;
        config.step_timeout = self.step_timeout;
    }
}

/// A validation failure before its line is looked up: `(field path, message)`.
type Failure = (String, String);

fn fail<T>(field: impl Into<String>, message: impl Into<String>) -> Result<T, Failure> {
    Err((field.into(), message.into()))
}

/// Prefixes a section-relative field name.
fn within(section: &str) -> impl Fn((&'static str, String)) -> Failure + '_ {
    move |(field, message)| (format!("{section}.{field}"), message)
}

/// A learner section: a positive chunk and pass size, and no LoRA dropout under checkpointing.
fn learner(
    section: &str,
    l: &crate::recipe::LearnerSection,
    model: &crate::recipe::ModelSection,
) -> Result<(), Failure> {
    positive(&format!("{section}.logprob_chunk"), l.logprob_chunk)?;
    if let Some(tokens) = l.pass_tokens {
        positive(&format!("{section}.pass_tokens"), tokens)?;
    }
    if let crate::recipe::Tuning::Lora(lora) = &model.tuning
        && l.activation_checkpointing
        && lora.dropout > 0.0
    {
        return fail(
            format!("{section}.activation_checkpointing"),
            format!(
                "needs model.tuning.dropout 0 (a recomputed layer would draw another dropout                  mask), got {}",
                lora.dropout
            ),
        );
    }
    Ok(())
}

fn positive(field: &str, value: usize) -> Result<(), Failure> {
    if value == 0 {
        return fail(field, "must be at least 1, got 0");
    }
    Ok(())
}

pub(super) fn plan(
    recipe: Recipe,
    text: &str,
    origin: &str,
    registry: &RewardRegistry,
) -> Result<Plan, RecipeError> {
    let invalid = |(field, message): Failure| RecipeError::Invalid {
        origin: origin.to_string(),
        line: best_line(text, &field),
        field,
        message,
    };
    check(&recipe).map_err(invalid)?;
    let rewards = recipe.rewards.build(registry).map_err(|e| match e {
        ConfigError::Invalid { field, message } => invalid((field, message)),
        ConfigError::Custom { index, error } => {
            invalid((format!("rewards.components[{index}]"), error.to_string()))
        }
        ConfigError::Composite(e) => invalid(("rewards.components".into(), e.to_string())),
        other => invalid(("rewards".into(), other.to_string())),
    })?;
    let d = &recipe.data;
    let tasks = d.task_config();
    let e = &recipe.env;
    let env = EnvConfig {
        max_turns: e.max_turns,
        preview_chars: e.preview_chars,
        llm: LlmLimits {
            max_calls: e.llm.max_calls,
            max_prompt_tokens: e.llm.max_prompt_tokens,
            max_depth: e.llm.max_depth,
            ..LlmLimits::default()
        },
        sub_context: SubContext::SplitAt(fathom_env::expert::PROMPT_MARKER.into()),
        tasks,
    };
    let s = &recipe.grpo.sampling;
    Ok(Plan {
        origin: origin.to_string(),
        text: text.to_string(),
        train_tasks: d.indices(&d.train),
        eval_tasks: d.indices(&d.eval),
        heldout_tasks: d.indices(&d.heldout),
        env,
        sandbox: SandboxLimits {
            max_output_chars: e.max_output_chars,
            step_timeout: Duration::from_secs_f64(e.step_timeout_s),
        },
        rewards,
        sampling: Sampling::Sample {
            temperature: s.temperature as f32,
            top_p: s.top_p as f32,
            top_k: s.top_k,
        },
        model: recipe.model,
        device: recipe.device,
        data: recipe.data,
        sft: recipe.sft,
        grpo: recipe.grpo,
        rapo: recipe.rapo,
        output: recipe.output,
        checkpoints: recipe.checkpoints,
        remote: recipe.remote,
        seeds: recipe.seeds,
    })
}

/// Every rule, in the order the sections are written.
fn check(r: &Recipe) -> Result<(), Failure> {
    r.model.validate()?;
    if r.device.backend == Backend::Cpu && r.device.index != 0 {
        return fail(
            "device.index",
            format!("the CPU is device 0, got {}", r.device.index),
        );
    }
    check_data(r)?;
    let e = &r.env;
    positive("env.max_turns", e.max_turns)?;
    positive("env.llm.max_prompt_tokens", e.llm.max_prompt_tokens)?;
    if e.llm.max_depth == 0 {
        return fail(
            "env.llm.max_depth",
            "must be at least 1 (1: plain sub-LM calls), got 0",
        );
    }
    positive("env.max_output_chars", e.max_output_chars)?;
    if !(e.step_timeout_s.is_finite() && e.step_timeout_s > 0.0 && e.step_timeout_s <= 86_400.0) {
        return fail(
            "env.step_timeout_s",
            format!("must be in (0, 86400] seconds, got {}", e.step_timeout_s),
        );
    }
    if let Some(sft) = &r.sft {
        positive("sft.steps", sft.steps)?;
        positive("sft.batch_size", sft.batch_size)?;
        positive("sft.max_length", sft.max_length)?;
        learner("sft.learner", &sft.learner, &r.model)?;
        sft.optimizer.validate().map_err(within("sft.optimizer"))?;
        sft.schedule
            .validate(sft.steps)
            .map_err(within("sft.schedule"))?;
        sft.traces.validate().map_err(within("sft.traces"))?;
        let t = &sft.traces;
        if t.multi_hop_detours
            && t.short_search
            && r.data.families.contains(&Family::MultiHop)
            && e.max_turns < 6
        {
            return fail(
                "sft.traces.multi_hop_detours",
                format!(
                    "a wasted turn before a four-hop chain's searches and answer needs env.max_turns \
                     of at least 6, got {}",
                    e.max_turns
                ),
            );
        }
    }
    check_grpo(r)?;
    r.rapo.validate().map_err(within("rapo"))?;
    let o = &r.output;
    if o.dir.as_os_str().is_empty() {
        return fail("output.dir", "is empty");
    }
    positive("output.metrics_every", o.metrics_every)?;
    positive("output.plot_every", o.plot_every)?;
    positive("checkpoints.every", r.checkpoints.every)?;
    positive("checkpoints.keep_last", r.checkpoints.keep_last)?;
    if let Some(remote) = &r.remote {
        fathom_env::client::ServerPool::new(&remote.urls)
            .map_err(|e| ("remote.urls".to_string(), e.to_string()))?;
        if remote
            .token_file
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty())
        {
            return fail("remote.token_file", "is empty (write None for no token)");
        }
    }
    Ok(())
}

fn check_data(r: &Recipe) -> Result<(), Failure> {
    let d = &r.data;
    if d.families.is_empty() {
        return fail("data.families", "must list at least one family");
    }
    for (i, f) in d.families.iter().enumerate() {
        if d.families[..i].contains(f) {
            return fail("data.families", format!("{f:?} is listed twice"));
        }
    }
    if let Some(max) = d.max_hops {
        if !d.families.contains(&Family::MultiHop) {
            return fail(
                "data.max_hops",
                "limits multi-hop chains, but data.families does not list multi_hop (write None)",
            );
        }
        if max < 2 {
            return fail(
                "data.max_hops",
                format!("every chain has at least 2 hops, so {max} would leave none"),
            );
        }
    }
    for (name, sel) in [
        ("train", &d.train),
        ("eval", &d.eval),
        ("heldout", &d.heldout),
    ] {
        check_selection(&format!("data.{name}"), sel, d)?;
    }
    if d.train.split == d.heldout.split {
        return fail(
            "data.heldout.split",
            "the held-out tasks must not be the ones trained on",
        );
    }
    positive("data.context_window", d.context_window)?;
    positive("data.min_doc_tokens", d.min_doc_tokens)?;
    if !(d.max_window_factor.is_finite() && d.max_window_factor > 0.0) {
        return fail(
            "data.max_window_factor",
            format!("must be positive, got {}", d.max_window_factor),
        );
    }
    Ok(())
}

fn check_selection(field: &str, sel: &SplitSelection, d: &DataSection) -> Result<(), Failure> {
    // Stops at the `count`-th candidate: counting every one is only needed for the message.
    if sel.count == 0 || d.candidates(sel.split).nth(sel.count - 1).is_none() {
        let available = d.available(sel.split);
        return fail(
            format!("{field}.count"),
            format!(
                "must be between 1 and {available} (the {} split's tasks of the listed families{}), got {}",
                split_name(sel.split),
                if d.max_hops.is_some() {
                    " and chain lengths"
                } else {
                    ""
                },
                sel.count
            ),
        );
    }
    Ok(())
}

fn check_grpo(r: &Recipe) -> Result<(), Failure> {
    let g = &r.grpo;
    positive("grpo.steps", g.steps)?;
    positive("grpo.prompts_per_step", g.prompts_per_step)?;
    if g.group_size < 2 {
        return fail(
            "grpo.group_size",
            format!(
                "must be at least 2 (advantages compare episodes of a group), got {}",
                g.group_size
            ),
        );
    }
    if g.prompts_per_step > r.data.train.count {
        return fail(
            "grpo.prompts_per_step",
            format!(
                "{} prompts per step, but data.train selects only {} tasks",
                g.prompts_per_step, r.data.train.count
            ),
        );
    }
    positive("grpo.max_new_tokens", g.max_new_tokens)?;
    if g.max_episode_tokens <= g.max_new_tokens {
        return fail(
            "grpo.max_episode_tokens",
            format!(
                "must exceed max_new_tokens ({}) to leave room for the prompt, got {}",
                g.max_new_tokens, g.max_episode_tokens
            ),
        );
    }
    let s = &g.sampling;
    if !(s.temperature.is_finite() && s.temperature > 0.0) {
        return fail(
            "grpo.sampling.temperature",
            format!("must be positive, got {}", s.temperature),
        );
    }
    if !(s.top_p > 0.0 && s.top_p <= 1.0) {
        return fail(
            "grpo.sampling.top_p",
            format!("must be in (0, 1], got {}", s.top_p),
        );
    }
    g.loss.validate().map_err(within("grpo.loss"))?;
    positive(
        "grpo.optimizer_steps_per_batch",
        g.optimizer_steps_per_batch,
    )?;
    learner("grpo.learner", &g.learner, &r.model)?;
    g.optimizer.validate().map_err(within("grpo.optimizer"))?;
    g.schedule
        .validate(g.steps * g.optimizer_steps_per_batch)
        .map_err(within("grpo.schedule"))?;
    Ok(())
}
