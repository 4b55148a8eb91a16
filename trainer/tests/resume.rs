//! Resuming is exact: a run stopped after a GRPO step and resumed, and a run killed with
//! SIGKILL mid-run and resumed, write the same metrics (timings aside) and the same final
//! adapter, byte for byte, as the uninterrupted run; and so does a run that fine-tunes every
//! weight (`tuning: Full`, with a KL term to the base), whose final output is the whole model.
//!
//! The run is `recipes/tiny.ron` shortened, with one extra reward component (the share of
//! even code points among the characters the assistant wrote) so that a random model's groups
//! have reward variance and every GRPO step updates the adapter.
//!
//! This test binary serves as its own sandbox worker and, for the SIGKILL case, as the child
//! process that trains (`harness = false`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use fathom_env::sandbox::WorkerCommand;
use fathom_rewards::record::Role;
use fathom_rewards::reward::{Episode, Reward};
use fathom_rewards::{ParamsError, RewardRegistry};
use fathom_trainer::checkpoint::Stage;
use fathom_trainer::metrics::{StepMetrics, read_log};
use fathom_trainer::recipe::Plan;
use fathom_trainer::train::{Evaluations, RunOptions, run};

/// The share of even code points among the characters the assistant wrote: any two different
/// random texts almost surely differ in it (a share of vowels did not: a random model's
/// samples can hold no letters at all).
struct EvenChars;

impl Reward for EvenChars {
    fn name(&self) -> &str {
        "even_chars"
    }

    fn score(&self, episode: &Episode<'_>) -> f64 {
        let text: String = episode
            .trajectory
            .messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .map(|m| m.content.as_str())
            .collect();
        let all = text.chars().count();
        let even = text.chars().filter(|c| u32::from(*c) % 2 == 0).count();
        if all == 0 {
            0.0
        } else {
            even as f64 / all as f64
        }
    }
}

fn plan() -> Plan {
    plan_from(tiny_text())
}

fn tiny_text() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../recipes/tiny.ron");
    std::fs::read_to_string(&path).unwrap()
}

/// The test's recipe with every weight trained instead of an adapter, and a KL term to the base.
fn full_plan() -> Plan {
    let mut text = tiny_text();
    let start = text.find("        tuning: Lora(").unwrap();
    let end = start + text[start..].find("        ),\n").unwrap() + "        ),\n".len();
    text.replace_range(start..end, "        tuning: Full,\n");
    let text = text.replacen("beta: 0.0,", "beta: 0.05,", 1);
    let plan = plan_from(text);
    assert_eq!(plan.model.tuning, fathom_trainer::recipe::Tuning::Full);
    assert_eq!(plan.grpo.loss.beta, 0.05);
    plan
}

fn plan_from(text: String) -> Plan {
    let text = text
        .replace("steps: 4,\n        batch_size", "steps: 2,\n        batch_size")
        .replace("steps: 2,\n        prompts_per_step", "steps: 3,\n        prompts_per_step")
        // The default embedding deviation: the recipe's larger one makes the untrained model
        // nearly deterministic, and identical samples leave a group without reward variance.
        .replace("embedding_std: Some(0.25)", "embedding_std: None")
        .replace(
            "RecursionEfficiency(weight: 0.15, free_calls: 0, max_calls: 4),",
            "RecursionEfficiency(weight: 0.15, free_calls: 0, max_calls: 4),\n            Custom(name: \"even_chars\", weight: 0.2),",
        );
    let mut registry = RewardRegistry::new();
    registry
        .register("even_chars", |_| {
            Ok::<Box<dyn Reward>, ParamsError>(Box::new(EvenChars))
        })
        .unwrap();
    let plan = Plan::from_str_with(&text, "tiny (resume test)", &registry).unwrap();
    assert_eq!(plan.sft.as_ref().unwrap().steps, 2);
    assert_eq!(plan.grpo.steps, 3);
    plan
}

fn options(out: &Path, resume: bool, stop_after: Option<(Stage, u64)>) -> RunOptions {
    RunOptions {
        out: out.to_path_buf(),
        resume,
        default_base: None,
        worker: WorkerCommand::CurrentExe,
        progress: false,
        evaluations: Evaluations::default(),
        stop_after,
    }
}

/// Everything of a metrics record but its timings.
fn essence(m: &StepMetrics) -> String {
    let mut m = m.clone();
    m.time = Default::default();
    m.tokens_per_second = 0.0;
    serde_json::to_string(&m).unwrap()
}

fn assert_same_run(a: &Path, b: &Path) {
    assert_same_output(a, b, "adapter/adapter_model.safetensors");
}

/// The same metrics (timings aside) and the same final weights file `weights`.
fn assert_same_output(a: &Path, b: &Path, weights: &str) {
    let (ma, mb) = (
        read_log(&a.join("metrics.jsonl")).unwrap(),
        read_log(&b.join("metrics.jsonl")).unwrap(),
    );
    assert_eq!(ma.len(), 5, "2 SFT and 3 GRPO records");
    let (ea, eb): (Vec<String>, Vec<String>) = (
        ma.iter().map(essence).collect(),
        mb.iter().map(essence).collect(),
    );
    assert_eq!(ea, eb, "metrics differ");
    let grpo: Vec<&StepMetrics> = ma.iter().filter(|m| m.stage == Stage::Grpo).collect();
    assert!(
        grpo.iter().all(|m| m.loss != 0.0),
        "every GRPO step updated: {ea:#?}"
    );
    let read = |d: &Path| std::fs::read(d.join(weights)).unwrap();
    assert!(read(a) == read(b), "the final {weights} differ");
}

fn uninterrupted(root: &Path) -> PathBuf {
    let dir = root.join("whole");
    let summary =
        run::<fathom_model::Cpu>(&plan(), &options(&dir, false, None), &Default::default())
            .unwrap();
    assert!(!summary.interrupted);
    dir
}

fn stopped_and_resumed_runs_are_exact() {
    let root = tempfile::tempdir().unwrap();
    let whole = uninterrupted(root.path());
    let dir = root.path().join("stopped");
    let device = Default::default();
    let first = run::<fathom_model::Cpu>(
        &plan(),
        &options(&dir, false, Some((Stage::Grpo, 1))),
        &device,
    )
    .unwrap();
    assert!(first.interrupted);
    let second = run::<fathom_model::Cpu>(&plan(), &options(&dir, true, None), &device).unwrap();
    assert!(!second.interrupted);
    assert_eq!(second.grpo_steps, 3);
    assert_same_run(&whole, &dir);
    // Stopped inside SFT too.
    let dir = root.path().join("stopped-sft");
    run::<fathom_model::Cpu>(
        &plan(),
        &options(&dir, false, Some((Stage::Sft, 1))),
        &device,
    )
    .unwrap();
    run::<fathom_model::Cpu>(&plan(), &options(&dir, true, None), &device).unwrap();
    assert_same_run(&whole, &dir);
}

fn full_fine_tuning_resumes_exactly() {
    let root = tempfile::tempdir().unwrap();
    let device = Default::default();
    let whole = root.path().join("whole-full");
    run::<fathom_model::Cpu>(&full_plan(), &options(&whole, false, None), &device).unwrap();
    let dir = root.path().join("stopped-full");
    let first = run::<fathom_model::Cpu>(
        &full_plan(),
        &options(&dir, false, Some((Stage::Grpo, 1))),
        &device,
    )
    .unwrap();
    assert!(first.interrupted);
    let second =
        run::<fathom_model::Cpu>(&full_plan(), &options(&dir, true, None), &device).unwrap();
    assert_eq!(second.adapter, dir.join("model"));
    assert_same_output(&whole, &dir, "model/model.safetensors");
    assert!(
        !dir.join("adapter").exists(),
        "a fully fine-tuned run writes no adapter"
    );
    // The output is a model directory like any base: config, weights and the tokenizer.
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(
            dir.join("model").join(file).is_file(),
            "model/{file} is missing"
        );
    }
    let trained = fathom_model::Qwen2ForCausalLM::<fathom_model::Cpu>::load(
        &dir.join("model"),
        &device,
        fathom_model::LoadOptions {
            quantize_nf4: false,
        },
    )
    .unwrap();
    // Every kind of weight moved away from the random base the run started from.
    let base = fathom_trainer::policy::load_base::<fathom_model::Cpu>(&full_plan(), None, &device)
        .unwrap()
        .0;
    let moved = |a: burn::tensor::Tensor<fathom_model::Cpu, 1>,
                 b: burn::tensor::Tensor<fathom_model::Cpu, 1>| {
        (a - b).abs().max().into_scalar() > 1e-6
    };
    let flat = |t: burn::tensor::Tensor<fathom_model::Cpu, 2>| t.flatten::<1>(0, 1);
    let (t, b) = (&trained.model, &base.model);
    assert!(moved(
        flat(t.embed_tokens.weight()),
        flat(b.embed_tokens.weight())
    ));
    assert!(moved(t.norm.weight.val(), b.norm.weight.val()));
    let (tl, bl) = (&t.layers[0], &b.layers[0]);
    assert!(moved(
        tl.input_layernorm.weight.val(),
        bl.input_layernorm.weight.val()
    ));
    assert!(moved(
        flat(tl.mlp.down_proj.dense_weight()),
        flat(bl.mlp.down_proj.dense_weight())
    ));
    assert!(moved(
        tl.self_attn.q_proj.bias.as_ref().unwrap().val(),
        bl.self_attn.q_proj.bias.as_ref().unwrap().val()
    ));
}

const CHILD: &str = "FATHOM_RESUME_TEST_CHILD";

fn killed_runs_resume_exactly() {
    let root = tempfile::tempdir().unwrap();
    let whole = uninterrupted(root.path());
    let dir = root.path().join("killed");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(CHILD, &dir)
        .spawn()
        .unwrap();
    // Kill it as soon as the first GRPO step is logged: it is then inside step 2.
    let metrics = dir.join("metrics.jsonl");
    let start = Instant::now();
    loop {
        let logged = read_log(&metrics)
            .map(|m| m.iter().any(|r| r.stage == Stage::Grpo))
            .unwrap_or(false);
        if logged {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "the child never reached GRPO"
        );
        assert!(child.try_wait().unwrap().is_none(), "the child ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let done = read_log(&metrics).unwrap().len();
    assert!(
        done < 5,
        "the child finished before it was killed ({done} records)"
    );
    eprintln!("killed after {done} logged steps");
    run::<fathom_model::Cpu>(&plan(), &options(&dir, true, None), &Default::default()).unwrap();
    assert_same_run(&whole, &dir);
}

fn main() {
    fathom_env::sandbox::run_worker_if_requested();
    // Recipe paths are relative to the repository root, as `cargo xtask` runs there.
    std::env::set_current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).unwrap();
    if let Some(dir) = std::env::var_os(CHILD) {
        run::<fathom_model::Cpu>(
            &plan(),
            &options(Path::new(&dir), false, None),
            &Default::default(),
        )
        .unwrap();
        return;
    }
    let tests: [(&str, fn()); 3] = [
        (
            "stopped_and_resumed_runs_are_exact",
            stopped_and_resumed_runs_are_exact,
        ),
        ("killed_runs_resume_exactly", killed_runs_resume_exactly),
        (
            "full_fine_tuning_resumes_exactly",
            full_fine_tuning_resumes_exactly,
        ),
    ];
    common::run_tests(&tests);
}
