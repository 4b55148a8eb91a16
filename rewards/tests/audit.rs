//! The reward audit: one adversarial probe per known attack on the reward, each asserting the
//! bound the reward must respect. Run it alone with `cargo test -p fathom-rewards --test audit`.
//!
//! | attack | probe | bound |
//! | --- | --- | --- |
//! | masked context | answer without ever reading the document | total ≤ format credit, unless the answer is the gold one |
//! | format only | well-formed but wrong answer; malformed or repeated tags | total ≤ 0.25 (≤ 0.10 by default); no format bonus for malformed tags |
//! | length gaming | same answer, more tool tokens | total never rises |
//! | recursion spam | same answer, more `llm()` calls | total never rises; a wrong answer earns nothing for calls |
//! | copy-pasted gold | several candidates, or the gold inside extra text | not an exact match |
//! | cheap failure (cap = floor = 0) | wrong, malformed or missing answers, any tokens or calls | total exactly 0; every correct answer above it |
//!
//! Each probe runs against the default composite (DESIGN §5) and, where the bound still
//! applies, against the default plus RAPO's step-level reward. The "format credit" is the
//! `format_gate` weight plus, with the step-level reward, its weight times its own format bonus.
//! Known limit, by design of RAPO's ratio: with the step-level reward on, extra fresh `llm()`
//! calls on a *correct* trajectory can dilute its redundancy ratio; that case is priced by the
//! recursion-efficiency term, not bounded here. Every probe also checks a positive control, so
//! a reward that scored everything 0 would fail the audit.

use fathom_rewards::composite::Composite;
use fathom_rewards::fixture::{TrajectoryBuilder, task};
use fathom_rewards::record::{Family, LlmCall, Task, Trajectory};
use fathom_rewards::registry::RewardRegistry;
use fathom_rewards::reward::{Episode, Reward, ValueRange};
use fathom_rewards::{ComponentConfig, RewardsConfig};

const KEY_AT: usize = 2000;

fn document() -> String {
    let filler = "lorem ipsum dolor sit amet ".repeat(80);
    format!("{}key 7 = Paris. {}", &filler[..KEY_AT], filler)
}

fn needle_task() -> Task {
    let mut t = task(
        "audit-0",
        Family::Needle,
        &document(),
        "What is stored under key 7?",
        "Paris",
    );
    t.aliases = vec!["City of Paris".to_owned()];
    t
}

/// A trajectory that finds the key and reads it, then gives `answer_message`.
fn honest(answer_message: &str) -> Trajectory {
    TrajectoryBuilder::new("audit-0")
        .code("print(context.find('key 7'))", &KEY_AT.to_string())
        .find("key 7", 0, 4200)
        .code("print(context[2000:2014])", "key 7 = Paris")
        .slice(KEY_AT, KEY_AT + 14)
        .answer(answer_message)
        .build()
}

fn default_composite() -> Composite {
    Composite::default()
}

const STEP_WEIGHT: f64 = 0.2;
const STEP_FORMAT_BONUS: f64 = 0.1;

fn with_step_level() -> Composite {
    let mut config = RewardsConfig::default();
    config.components.push(ComponentConfig::StepLevel {
        weight: STEP_WEIGHT,
        format_bonus: STEP_FORMAT_BONUS,
        correct_floor: 0.5,
        search_credit: 0.2,
        query_credit: 0.2,
        search_cap: 8,
        query_cap: 16,
        verification_budget: 1,
    });
    config.build(&RewardRegistry::new()).unwrap()
}

/// A custom reward that pays 1 for anything: the worst case for the 0.25 cap.
struct Generous;
impl Reward for Generous {
    fn name(&self) -> &str {
        "generous"
    }
    fn range(&self) -> ValueRange {
        ValueRange::UNIT
    }
    fn score(&self, _: &Episode<'_>) -> f64 {
        1.0
    }
}

fn with_generous_custom() -> Composite {
    let mut registry = RewardRegistry::new();
    registry
        .register(
            "generous",
            |_: &_| Ok(Box::new(Generous) as Box<dyn Reward>),
        )
        .unwrap();
    let mut config = RewardsConfig::default();
    config.components.push(ComponentConfig::Custom {
        name: "generous".into(),
        weight: 1.0,
        params: Default::default(),
    });
    config.build(&registry).unwrap()
}

fn total(c: &Composite, task: &Task, traj: &Trajectory) -> f64 {
    c.score(task, traj).unwrap().total
}

fn component(c: &Composite, task: &Task, traj: &Trajectory, name: &str) -> f64 {
    c.score(task, traj).unwrap().get(name).unwrap()
}

const EPS: f64 = 1e-12;

/// Trajectories that never touch the document, ending on `answer`.
fn masked(answer: &str) -> Vec<Trajectory> {
    let mut guessing = TrajectoryBuilder::new("audit-0");
    for i in 0..12 {
        guessing = guessing
            .code(&format!("print('guess {i}')"), &format!("guess {i}"))
            .llm(&format!("Guess {i}?"), "Lyon");
    }
    vec![
        TrajectoryBuilder::new("audit-0").answer(answer).build(),
        TrajectoryBuilder::new("audit-0")
            .code("print(1 + 1)", "2")
            .answer(answer)
            .build(),
        guessing.answer(answer).build(),
    ]
}

#[test]
fn audit_masked_context_scores_at_most_the_format_credit() {
    let task = needle_task();
    for (composite, format_credit) in [
        (default_composite(), 0.10),
        (with_step_level(), 0.10 + STEP_WEIGHT * STEP_FORMAT_BONUS),
    ] {
        for answer in [
            "<answer>Lyon</answer>",
            "<answer>key 7</answer>",
            "Lyon",
            "<answer>Paris, Lyon</answer>",
        ] {
            for traj in masked(answer) {
                let t = total(&composite, &task, &traj);
                assert!(t <= format_credit + EPS, "{answer}: {t} > {format_credit}");
            }
        }
        // Positive control: the bound is tight for a well-formed guess with no tool use.
        let direct = TrajectoryBuilder::new("audit-0")
            .answer("<answer>Lyon</answer>")
            .build();
        assert!((total(&composite, &task, &direct) - format_credit).abs() < EPS);
    }
}

#[test]
fn audit_masked_context_gold_answer_is_the_only_exception() {
    let task = needle_task();
    let c = default_composite();
    for traj in masked("<answer>Paris</answer>") {
        assert_eq!(component(&c, &task, &traj, "correctness"), 1.0);
        assert!(total(&c, &task, &traj) > 0.25);
    }
}

#[test]
fn audit_format_only_wrong_answers_score_at_most_the_cap() {
    let task = needle_task();
    let wrong = [
        "<answer>Lyon</answer>",
        "<answer>42</answer>",
        "<answer>key 7</answer>",
    ];
    for answer in wrong {
        let traj = honest(answer);
        assert!(total(&default_composite(), &task, &traj) <= 0.10 + EPS);
        assert!(total(&with_step_level(), &task, &traj) <= 0.25 + EPS);
        // Even a custom reward paying 1.0 for anything cannot lift a wrong answer above 0.25.
        let generous = with_generous_custom();
        let b = generous.score(&task, &traj).unwrap();
        assert!(
            b.sum > 0.25 && b.capped && (b.total - 0.25).abs() < EPS,
            "{answer}: {b:?}"
        );
    }
    // Positive control: the same composite pays a correct answer more than the cap.
    assert!(
        total(
            &with_generous_custom(),
            &task,
            &honest("<answer>Paris</answer>")
        ) > 1.0
    );
}

#[test]
fn audit_format_only_malformed_or_repeated_tags_earn_no_format_bonus() {
    let task = needle_task();
    let malformed = [
        "Paris",
        "<answer>Paris",
        "Paris</answer>",
        "</answer>Paris<answer>",
        "<answer></answer>",
        "<answer>   </answer>",
        "<answer>Paris</answer><answer>Lyon</answer>",
        "<answer>Paris</answer> <answer>Paris</answer>",
        "<answer><answer>Paris</answer></answer>",
        "<answer >Paris</answer>",
    ];
    // Without the step-level reward nothing is left; with it, only RAPO's exploration credit
    // for wrong answers (c_S + c_Q = 0.4 at most, times its weight) — never a format bonus.
    for (composite, bound) in [
        (default_composite(), 0.0),
        (with_step_level(), STEP_WEIGHT * 0.4),
    ] {
        for message in malformed {
            let traj = honest(message);
            let b = composite.score(&task, &traj).unwrap();
            assert_eq!(b.get("format_gate"), Some(0.0), "{message}");
            assert_eq!(b.get("correctness"), Some(0.0), "{message}");
            assert!(b.total <= bound + EPS, "{message}: {}", b.total);
        }
        // Positive control.
        assert_eq!(
            component(
                &composite,
                &task,
                &honest("<answer>Paris</answer>"),
                "format_gate"
            ),
            1.0
        );
    }
}

#[test]
fn audit_length_gaming_more_tool_tokens_never_raise_the_score() {
    let task = needle_task();
    for composite in [default_composite(), with_step_level()] {
        for answer in [
            "<answer>Paris</answer>",
            "<answer>Lyon</answer>",
            "<answer>Paris",
            "no answer",
        ] {
            let mut previous = f64::INFINITY;
            for tokens in (0..=40_000).step_by(250) {
                let traj = TrajectoryBuilder::new("audit-0")
                    .code("print(context[2000:2014])", "key 7 = Paris")
                    .slice(KEY_AT, KEY_AT + 14)
                    .tokens(tokens / 2, tokens - tokens / 2)
                    .answer(answer)
                    .build();
                let t = total(&composite, &task, &traj);
                assert!(
                    t <= previous + EPS,
                    "{answer}: {tokens} tokens scored {t} > {previous}"
                );
                previous = t;
            }
        }
    }
    // Positive control: the penalty does bite (full at saturation).
    let c = default_composite();
    let cheap = honest("<answer>Paris</answer>");
    let mut costly = cheap.clone();
    costly.steps[0].output_tokens = 1_000_000;
    assert!((total(&c, &task, &cheap) - total(&c, &task, &costly) - 0.15).abs() < EPS);
}

fn with_llm_calls(answer: &str, calls: usize, refused: bool) -> Trajectory {
    let mut traj = honest(answer);
    for i in 0..calls {
        traj.steps[1].llm_calls.push(LlmCall {
            prompt: format!("Read this slice, attempt {i}: key 7 = Paris"),
            response: "Paris".to_owned(),
            depth: 1,
            prompt_tokens: 12,
            response_tokens: 1,
            refused: refused.then(|| "llm() call cap reached".to_owned()),
        });
    }
    traj
}

#[test]
fn audit_recursion_spam_more_llm_calls_never_raise_the_score() {
    let task = needle_task();
    let c = default_composite();
    for answer in [
        "<answer>Paris</answer>",
        "<answer>Lyon</answer>",
        "<answer>Paris",
    ] {
        for refused in [false, true] {
            let mut previous = f64::INFINITY;
            for calls in 0..=30 {
                let t = total(&c, &task, &with_llm_calls(answer, calls, refused));
                assert!(
                    t <= previous + EPS,
                    "{answer}: {calls} calls scored {t} > {previous}"
                );
                previous = t;
            }
        }
    }
    // Positive control: calls cost a correct answer its efficiency bonus.
    let few = total(
        &c,
        &task,
        &with_llm_calls("<answer>Paris</answer>", 0, false),
    );
    let many = total(
        &c,
        &task,
        &with_llm_calls("<answer>Paris</answer>", 10, false),
    );
    assert!((few - many - 0.15).abs() < EPS);
}

#[test]
fn audit_recursion_spam_wrong_answers_earn_nothing_for_calls() {
    let task = needle_task();
    for composite in [default_composite(), with_step_level()] {
        let base = total(
            &composite,
            &task,
            &with_llm_calls("<answer>Lyon</answer>", 0, false),
        );
        for calls in 1..=30 {
            let traj = with_llm_calls("<answer>Lyon</answer>", calls, false);
            assert_eq!(
                component(&composite, &task, &traj, "recursion_efficiency"),
                0.0
            );
            assert!(
                total(&composite, &task, &traj) <= base + EPS,
                "{calls} calls"
            );
        }
    }
}

/// The default composite with wrong answers pinned to exactly 0 (`incorrect_cap: Some(0.0),
/// incorrect_floor: Some(0.0)`).
fn pinned_at_zero() -> Composite {
    RewardsConfig {
        incorrect_cap: Some(0.0),
        incorrect_floor: Some(0.0),
        ..RewardsConfig::default()
    }
    .build(&RewardRegistry::new())
    .unwrap()
}

#[test]
fn audit_cheap_failure_wrong_answers_are_flat_and_below_every_correct_one() {
    let task = needle_task();
    let c = pinned_at_zero();
    let mut lowest_correct = f64::INFINITY;
    for answer in [
        "<answer>Paris</answer>",
        "<answer>Lyon</answer>",
        "<answer>Paris",
        "<answer>Paris</answer><answer>Lyon</answer>",
        "no answer",
    ] {
        for calls in [0, 1, 3, 30] {
            for tokens in [0, 600, 5_000, 1_000_000] {
                let mut traj = with_llm_calls(answer, calls, false);
                traj.steps[0].output_tokens = tokens;
                let b = c.score(&task, &traj).unwrap();
                if b.correct {
                    lowest_correct = lowest_correct.min(b.total);
                } else {
                    // However many tokens or calls a failure spends, it scores exactly the
                    // floor: a group of failures carries no ranking among them.
                    assert_eq!(b.total, 0.0, "{answer}: {calls} calls, {tokens} tokens");
                }
            }
        }
    }
    // Positive control: correct answers were scored, and the costliest still beats a failure.
    assert!(
        lowest_correct.is_finite() && lowest_correct > 0.5,
        "{lowest_correct}"
    );
    // Without the floor, failures that spend more tokens score below zero.
    let unfloored = RewardsConfig {
        incorrect_cap: Some(0.0),
        ..RewardsConfig::default()
    }
    .build(&RewardRegistry::new())
    .unwrap();
    let mut costly = honest("<answer>Lyon</answer>");
    costly.steps[0].output_tokens = 1_000_000;
    assert!(total(&unfloored, &task, &costly) < 0.0);
}

#[test]
fn audit_copy_pasted_gold_is_not_an_exact_match() {
    let task = needle_task();
    let c = default_composite();
    let copied = [
        "Paris, Lyon",
        "Paris or Lyon",
        "Paris Lyon Berlin",
        "Paris Paris",
        "Paris/Lyon",
        "Paris\nLyon",
        "The answer is Paris",
        "key 7 = Paris",
        "Paris (key 7)",
        "Paris, France",
        "Paris; City of Paris",
    ];
    for answer in copied {
        let traj = honest(&format!("<answer>{answer}</answer>"));
        assert_eq!(component(&c, &task, &traj, "correctness"), 0.0, "{answer}");
        assert!(total(&c, &task, &traj) <= 0.25 + EPS);
    }
    // The gold answer printed by the model's own code and then listed with other candidates
    // is still not a match.
    let printed = TrajectoryBuilder::new("audit-0")
        .code("print('Paris Lyon Berlin')", "Paris Lyon Berlin")
        .answer("<answer>Paris Lyon Berlin</answer>")
        .build();
    assert_eq!(component(&c, &task, &printed, "correctness"), 0.0);
    // Positive controls: formatting differences and aliases still match.
    for answer in ["Paris", "paris.", "  PARIS ", "the Paris", "city of paris"] {
        let traj = honest(&format!("<answer>{answer}</answer>"));
        assert_eq!(component(&c, &task, &traj, "correctness"), 1.0, "{answer}");
    }
}

#[test]
fn audit_step_level_repeating_a_search_never_raises_the_score() {
    let task = needle_task();
    let c = with_step_level();
    for answer in ["<answer>Paris</answer>", "<answer>Lyon</answer>"] {
        let mut previous = f64::INFINITY;
        for repeats in 0..12 {
            let mut b = TrajectoryBuilder::new("audit-0")
                .code("print(context.find('key 7'))", "2000")
                .find("key 7", 0, 4200)
                .tokens(0, 0);
            for _ in 0..repeats {
                b = b
                    .code("print(context.find('key 7'))", "2000")
                    .find("key 7", 0, 4200)
                    .tokens(0, 0);
            }
            let traj = b.answer(answer).build();
            let t = total(&c, &task, &traj);
            assert!(
                t <= previous + EPS,
                "{answer}: {repeats} repeats scored {t} > {previous}"
            );
            previous = t;
        }
    }
    // Positive control: a correct answer never falls below the floor (0.2 · (0.1 + 0.5)).
    let mut b = TrajectoryBuilder::new("audit-0");
    for _ in 0..50 {
        b = b.code("x", "").find("key 7", 0, 4200).tokens(0, 0);
    }
    let spam = b.answer("<answer>Paris</answer>").build();
    assert!((component(&c, &task, &spam, "step_level") - 0.6).abs() < EPS);
}
