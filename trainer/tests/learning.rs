//! The tiny recipes learn.
//!
//! - SFT: `recipes/tiny.ron`'s random model, trained on expert traces run through the real
//!   environment for 120 steps, brings its cross-entropy on the assistant's tokens from far
//!   above the uniform distribution's (`ln 1024`, the compact tokenizer's vocabulary: a random
//!   model is confidently wrong) to well below it, and then takes a GRPO step through the
//!   multi-turn environment.
//! - GRPO: `recipes/tiny-grpo.ron`, from the committed SFT adapter of the same model, raises the
//!   held-out reward on needle tasks beyond the evaluation's noise. What it improves is the form
//!   (well-formed answers within the token budget), not correctness, which this model does not
//!   reach: see docs/trainer.md.
//!
//! This test binary serves as its own sandbox worker (`harness = false`).

mod common;

use std::path::Path;

use fathom_env::sandbox::WorkerCommand;
use fathom_trainer::checkpoint::Stage;
use fathom_trainer::metrics::read_log;
use fathom_trainer::recipe::Plan;
use fathom_trainer::train::{Evaluations, RunOptions, RunSummary, run};

/// SFT steps the test runs.
const STEPS: usize = 120;

/// Nats by which the final loss must beat the uniform distribution's (`ln 1024`). Measured:
/// 3.85 over the last 10 steps, 3.08 below uniform, from 11.3 over the first 10.
const BELOW_UNIFORM: f64 = 2.5;

/// Runs `plan` on the CPU into `out`, this binary serving as the sandbox worker.
fn run_plan(plan: &Plan, out: &Path, evaluations: Evaluations) -> RunSummary {
    let options = RunOptions {
        out: out.to_path_buf(),
        resume: false,
        default_base: None,
        worker: WorkerCommand::CurrentExe,
        progress: false,
        evaluations,
        stop_after: None,
    };
    run::<fathom_model::Cpu>(plan, &options, &Default::default()).unwrap()
}

fn sft_on_expert_traces_learns() {
    let mut plan = Plan::load(Path::new("recipes/tiny.ron")).expect("recipes/tiny.ron loads");
    let sft = plan.sft.as_mut().expect("tiny.ron has an SFT stage");
    sft.steps = STEPS;
    sft.batch_size = 4;
    sft.traces.count = 40;
    plan.grpo.steps = 1;
    let out = tempfile::tempdir().unwrap();
    let summary = run_plan(&plan, out.path(), Evaluations::default());
    assert_eq!((summary.sft_steps, summary.grpo_steps), (STEPS as u64, 1));
    let log = read_log(&summary.metrics).unwrap();
    let losses: Vec<f64> = log
        .iter()
        .filter(|m| m.stage == Stage::Sft)
        .map(|m| m.loss)
        .collect();
    assert_eq!(losses.len(), STEPS);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    let (first, last) = (mean(&losses[..5]), mean(&losses[losses.len() - 10..]));
    let uniform = 1024f64.ln();
    println!("SFT loss: first 5 steps {first:.3}, last 10 steps {last:.3} (uniform {uniform:.3})");
    assert!(
        last < uniform - BELOW_UNIFORM && last < first - 5.0,
        "SFT did not learn: loss {first:.3} → {last:.3} (uniform {uniform:.3})"
    );
    assert!(
        log.iter()
            .any(|m| m.stage == Stage::Grpo && m.loss.is_finite())
    );
}

/// Paired standard errors the GRPO gain must exceed.
const GAIN_IN_STANDARD_ERRORS: f64 = 3.0;

/// The least mean gain in held-out reward GRPO must make.
const MIN_GAIN: f64 = 0.02;

/// `recipes/tiny-grpo.ron`: GRPO through the multi-turn environment from the committed SFT
/// adapter (`fixtures/tiny-sft-needle`), on needle tasks. The held-out reward (greedy, the same
/// tasks before and after) must rise by at least [`MIN_GAIN`] and by more than
/// [`GAIN_IN_STANDARD_ERRORS`] standard errors of the per-task paired difference: the
/// evaluation's noise for this seed.
fn grpo_raises_the_held_out_reward_of_the_sft_adapter() {
    let plan = Plan::load(Path::new("recipes/tiny-grpo.ron")).expect("recipes/tiny-grpo.ron loads");
    let out = tempfile::tempdir().unwrap();
    let evaluations = Evaluations {
        base: true,
        sft: false,
        grpo: true,
    };
    let summary = run_plan(&plan, out.path(), evaluations);
    assert_eq!(summary.grpo_steps, plan.grpo.steps as u64);
    let [before, after] = [&summary.evals[0], &summary.evals[1]];
    assert_eq!(
        (before.label.as_str(), after.label.as_str()),
        ("start", "grpo")
    );
    let pairs: Vec<(f64, f64)> = before
        .report
        .episodes
        .iter()
        .zip(&after.report.episodes)
        .map(|(b, a)| {
            assert_eq!(b.task_id, a.task_id);
            (b.reward, a.reward)
        })
        .collect();
    let n = pairs.len() as f64;
    let diffs: Vec<f64> = pairs.iter().map(|(b, a)| a - b).collect();
    let mean = diffs.iter().sum::<f64>() / n;
    let var = diffs.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / (n - 1.0);
    let se = (var / n).sqrt();
    let (b, a) = (&before.report.overall, &after.report.overall);
    println!(
        "held-out reward {:.3} → {:.3} (gain {mean:.3} ± {se:.3} SE over {n} tasks); format \
         gate {:.2} → {:.2}, accuracy {:.2} → {:.2}, tool tokens {:.0} → {:.0}",
        b.reward,
        a.reward,
        b.components.get("format_gate").copied().unwrap_or(f64::NAN),
        a.components.get("format_gate").copied().unwrap_or(f64::NAN),
        b.accuracy,
        a.accuracy,
        b.tool_tokens,
        a.tool_tokens,
    );
    assert!(
        mean >= MIN_GAIN && mean > GAIN_IN_STANDARD_ERRORS * se,
        "GRPO did not raise the held-out reward beyond its noise: {:.3} → {:.3}, gain {mean:.3} \
         ± {se:.3}",
        b.reward,
        a.reward
    );
}

fn main() {
    fathom_env::sandbox::run_worker_if_requested();
    // Recipe paths are relative to the repository root, as `cargo xtask` runs there.
    std::env::set_current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).unwrap();
    let tests: [(&str, fn()); 2] = [
        ("sft_on_expert_traces_learns", sft_on_expert_traces_learns),
        (
            "grpo_raises_the_held_out_reward_of_the_sft_adapter",
            grpo_raises_the_held_out_reward_of_the_sft_adapter,
        ),
    ];
    common::run_tests(&tests);
}
