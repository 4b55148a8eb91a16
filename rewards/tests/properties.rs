//! Property tests over arbitrary trajectories: every component stays within its range, the
//! composite's total is exactly the weighted sum of its parts with the documented cap rule,
//! and more tool tokens or `llm()` calls never raise the default reward.
//!
//! The cap rule checked here: `total = min(Σ wᵢ·vᵢ, cap)` when the answer is not correct and a
//! cap is set, `total = Σ wᵢ·vᵢ` otherwise.

use fathom_rewards::composite::Composite;
use fathom_rewards::fixture::task;
use fathom_rewards::normalize::AnswerMatcher;
use fathom_rewards::record::{
    Access, AccessKind, Action, EndReason, ExecOutput, Family, LlmCall, Message, Role, Span, Step,
    Task, Trajectory,
};
use fathom_rewards::registry::RewardRegistry;
use fathom_rewards::{ComponentConfig, RewardsConfig};
use proptest::prelude::*;

const DOC_LEN: usize = 120;

fn the_task(aliases: Vec<String>, evidence: Vec<Span>) -> Task {
    let mut t = task("p", Family::Needle, &"x".repeat(DOC_LEN), "key 7?", "Paris");
    t.aliases = aliases;
    t.evidence = evidence;
    t
}

fn span() -> impl Strategy<Value = Span> {
    (0..DOC_LEN, 0..40usize).prop_map(|(start, len)| Span {
        start,
        end: (start + len).min(DOC_LEN),
    })
}

fn access() -> impl Strategy<Value = Access> {
    let kind = prop_oneof![
        Just(AccessKind::Slice),
        prop::sample::select(vec!["key", "k.y", "7"]).prop_map(|p| AccessKind::Search {
            pattern: p.to_owned()
        }),
        prop::sample::select(vec!["key", "Paris"]).prop_map(|n| AccessKind::Find {
            needle: n.to_owned()
        }),
    ];
    (kind, span()).prop_map(|(kind, span)| Access { kind, span })
}

fn llm_call() -> impl Strategy<Value = LlmCall> {
    (
        prop::sample::select(vec!["a", "b", "summarise", " a "]),
        any::<bool>(),
    )
        .prop_map(|(prompt, refused)| LlmCall {
            prompt: prompt.to_owned(),
            response: "Paris".to_owned(),
            depth: 1,
            prompt_tokens: 3,
            response_tokens: 1,
            refused: refused.then(|| "cap".to_owned()),
        })
}

fn code_step() -> impl Strategy<Value = Step> {
    (
        prop::sample::select(vec![
            "print(1)",
            "print(context[:9])",
            "re.findall('key', context)",
            "x = 2",
        ]),
        prop::sample::select(vec![
            "",
            "Paris",
            "key 7 = Paris",
            "Lyon",
            "<answer>Paris</answer>",
        ]),
        prop::collection::vec(access(), 0..4),
        prop::collection::vec(llm_call(), 0..3),
        0..5000usize,
        0..5000usize,
    )
        .prop_map(
            |(code, stdout, accesses, llm_calls, code_tokens, output_tokens)| Step {
                assistant: format!("```repl\n{code}\n```"),
                action: Action::Code {
                    code: code.to_owned(),
                },
                output: Some(ExecOutput {
                    stdout: stdout.to_owned(),
                    ..ExecOutput::default()
                }),
                llm_calls,
                accesses,
                completion_tokens: 10,
                code_tokens,
                output_tokens,
            },
        )
}

fn final_message() -> impl Strategy<Value = Option<String>> {
    let messages = vec![
        "<answer>Paris</answer>",
        "<answer>paris.</answer>",
        "<answer>the City of Light</answer>",
        "<answer>Lyon</answer>",
        "<answer>Paris, Lyon</answer>",
        "<answer>Paris</answer><answer>Lyon</answer>",
        "<answer>Paris",
        "<answer></answer>",
        "Paris",
    ];
    prop::option::weighted(0.9, prop::sample::select(messages).prop_map(str::to_owned))
}

fn trajectory() -> impl Strategy<Value = Trajectory> {
    (prop::collection::vec(code_step(), 0..8), final_message()).prop_map(|(mut steps, last)| {
        let end_reason = match &last {
            Some(message) => {
                steps.push(Step {
                    assistant: message.clone(),
                    action: Action::Answer {
                        text: message.clone(),
                    },
                    output: None,
                    llm_calls: Vec::new(),
                    accesses: Vec::new(),
                    completion_tokens: 5,
                    code_tokens: 0,
                    output_tokens: 0,
                });
                EndReason::Answered
            }
            None => EndReason::IterationCap,
        };
        let messages = vec![Message {
            role: Role::User,
            content: "key 7?".to_owned(),
        }];
        Trajectory {
            task_id: "p".to_owned(),
            messages,
            steps,
            end_reason,
            elapsed_ms: 1.0,
        }
    })
}

fn task_strategy() -> impl Strategy<Value = Task> {
    (
        prop::option::of(Just("the City of Light".to_owned())),
        prop::collection::vec(span(), 0..2),
    )
        .prop_map(|(alias, evidence)| the_task(alias.into_iter().collect(), evidence))
}

/// A configuration with arbitrary (valid) weights, constants and cap, all components on.
fn config() -> impl Strategy<Value = RewardsConfig> {
    (
        (
            0.0..2.0f64,
            0.0..2.0f64,
            -2.0..=0.0f64,
            0.0..2.0f64,
            0.0..2.0f64,
        ),
        (0..5000usize, 1..20000usize, 0..5usize, 1..20usize),
        (
            0.0..0.5f64,
            0.0..=1.0f64,
            0.0..1.0f64,
            0.0..1.0f64,
            1..10usize,
            1..20usize,
            0..3usize,
        ),
        prop::option::of(-0.5..1.5f64),
        prop::option::of(0.0..1.0f64),
    )
        .prop_map(
            |(w, (free_t, extra_t, free_c, extra_c), s, incorrect_cap, floor_gap)| RewardsConfig {
                incorrect_cap,
                // At or below the cap when both are set.
                incorrect_floor: floor_gap.map(|g| incorrect_cap.unwrap_or(0.5) - g),
                matching: AnswerMatcher::default(),
                components: vec![
                    ComponentConfig::FormatGate { weight: w.0 },
                    ComponentConfig::Correctness { weight: w.1 },
                    ComponentConfig::TokenBudget {
                        weight: w.2,
                        free_tokens: free_t,
                        saturate_tokens: free_t + extra_t,
                    },
                    ComponentConfig::RecursionEfficiency {
                        weight: w.3,
                        free_calls: free_c,
                        max_calls: free_c + extra_c,
                    },
                    ComponentConfig::StepLevel {
                        weight: w.4,
                        format_bonus: s.0,
                        correct_floor: s.1,
                        search_credit: s.2,
                        query_credit: s.3,
                        search_cap: s.4,
                        query_cap: s.5,
                        verification_budget: s.6,
                    },
                ],
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn components_stay_in_range(config in config(), task in task_strategy(), traj in trajectory()) {
        let composite = config.build(&RewardRegistry::new()).unwrap();
        let b = composite.score(&task, &traj).unwrap();
        let (fb, floor, cs, cq) = match config.components[4] {
            ComponentConfig::StepLevel { format_bonus, correct_floor, search_credit, query_credit, .. } =>
                (format_bonus, correct_floor, search_credit, query_credit),
            _ => unreachable!(),
        };
        for c in &b.components {
            let max = if c.name == "step_level" { fb + 1.0f64.max(floor).max(cs + cq) } else { 1.0 };
            prop_assert!((0.0..=max).contains(&c.value), "{} = {}", c.name, c.value);
        }
        if b.correct {
            prop_assert_eq!(b.get("format_gate"), Some(1.0));
            prop_assert_eq!(b.get("correctness"), Some(1.0));
            prop_assert!(b.get("step_level").unwrap() >= floor + fb - 1e-12);
        } else {
            prop_assert_eq!(b.get("correctness"), Some(0.0));
            prop_assert_eq!(b.get("recursion_efficiency"), Some(0.0));
            prop_assert!(b.get("step_level").unwrap() <= fb + cs + cq + 1e-12);
        }
    }

    #[test]
    fn total_is_the_weighted_sum_with_the_cap_and_floor_rules(config in config(), task in task_strategy(), traj in trajectory()) {
        let composite = config.build(&RewardRegistry::new()).unwrap();
        let b = composite.score(&task, &traj).unwrap();
        let sum: f64 = b.components.iter().map(|c| c.weight * c.value).sum();
        prop_assert!((b.sum - sum).abs() < 1e-12);
        let expected = match config.incorrect_cap {
            Some(cap) if !b.correct => sum.min(cap),
            _ => sum,
        };
        let expected = match config.incorrect_floor {
            Some(floor) if !b.correct => expected.max(floor),
            _ => expected,
        };
        prop_assert!((b.total - expected).abs() < 1e-12, "total {} expected {}", b.total, expected);
        prop_assert_eq!(b.capped, !b.correct && config.incorrect_cap.is_some_and(|cap| sum > cap));
        let weights: Vec<f64> = composite.weights().collect();
        prop_assert_eq!(weights, b.components.iter().map(|c| c.weight).collect::<Vec<_>>());
    }

    #[test]
    fn scoring_is_deterministic_and_survives_json(task in task_strategy(), traj in trajectory()) {
        let composite = Composite::default();
        let first = composite.score(&task, &traj).unwrap();
        let task2: Task = serde_json::from_str(&serde_json::to_string(&task).unwrap()).unwrap();
        let traj2: Trajectory = serde_json::from_str(&serde_json::to_string(&traj).unwrap()).unwrap();
        prop_assert_eq!(first, composite.score(&task2, &traj2).unwrap());
    }

    #[test]
    fn more_tool_tokens_never_raise_the_default_total(
        task in task_strategy(), traj in trajectory(), step in 0..8usize, extra in 0..50_000usize,
    ) {
        let composite = Composite::default();
        let before = composite.score(&task, &traj).unwrap().total;
        let mut more = traj.clone();
        if let Some(s) = more.steps.get_mut(step) {
            s.output_tokens += extra;
        }
        prop_assert!(composite.score(&task, &more).unwrap().total <= before + 1e-12);
    }

    #[test]
    fn more_llm_calls_never_raise_the_default_total(
        task in task_strategy(), traj in trajectory(), step in 0..8usize, calls in prop::collection::vec(llm_call(), 1..6),
    ) {
        let composite = Composite::default();
        let before = composite.score(&task, &traj).unwrap().total;
        let mut more = traj.clone();
        if let Some(s) = more.steps.get_mut(step) {
            s.llm_calls.extend(calls);
        }
        prop_assert!(composite.score(&task, &more).unwrap().total <= before + 1e-12);
    }
}
