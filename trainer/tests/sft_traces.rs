//! Expert SFT traces through the real environment and sandbox: they vary in wording and
//! strategy, a set fraction wastes a turn the way base models do, they stay correct, and they
//! render into training examples.
//!
//! This test binary serves as its own sandbox worker (`harness = false`: `main` first hands
//! over to the worker when started as one), so it needs no other binary.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use fathom_env::env::{ReplEnv, Services};
use fathom_env::expert::PassageReader;
use fathom_env::sandbox::{SandboxConfig, SandboxPool, WorkerCommand};
use fathom_env::tasks::{self, TaskConfig};
use fathom_model::Tokenizer;
use fathom_rewards::Composite;
use fathom_rewards::record::{Family, Role, Split};
use fathom_trainer::sft::expert::Detour;
use fathom_trainer::sft::{Trace, TraceSettings, chat_messages, generate_traces, render};

fn env() -> ReplEnv {
    let mut config = SandboxConfig::new(WorkerCommand::CurrentExe);
    config.idle_workers = 1;
    config.step_timeout = Duration::from_secs(10);
    config.limits.memory_bytes = 512 << 20;
    config.limits.cpu_seconds = 60;
    let pool = SandboxPool::new(config).expect("sandbox pool");
    ReplEnv::new(Services::new(pool, Arc::new(PassageReader)))
}

fn expert_traces_vary_waste_on_purpose_and_stay_correct() {
    let config = TaskConfig {
        context_window: 512,
        min_doc_tokens: 300,
        max_window_factor: 4.0,
    };
    let tasks: Vec<_> = (0..15)
        .map(|i| tasks::split_task(Split::Train, i, &config).unwrap())
        .collect();
    let settings = TraceSettings {
        count: 45,
        wasteful_fraction: 0.3,
        short_search: false,
        prose: true,
        multi_hop_detours: false,
        count_hops: false,
        tally_hops: false,
        llm_share: 0.5,
    };
    let rewards = Composite::default();
    let mut env = env();
    let traces = generate_traces(&mut env, &tasks, &rewards, &settings, 7).unwrap();
    assert_eq!(traces.len(), 45);

    let correct = traces.iter().filter(|t| t.correct).count();
    let failures: Vec<_> = traces
        .iter()
        .filter(|t| !t.correct)
        .map(|t| (&t.task_id, &t.style, t.messages.last().map(|m| &m.content)))
        .collect();
    assert!(
        correct >= 44,
        "{correct}/45 correct; failures: {failures:#?}"
    );
    eprintln!("{correct}/45 traces correct");

    // Wording and strategy vary: many distinct first turns, both fences, both needle
    // strategies.
    let firsts: BTreeSet<&str> = traces
        .iter()
        .filter_map(|t| t.messages.iter().find(|m| m.role == Role::Assistant))
        .map(|m| m.content.as_str())
        .collect();
    assert!(firsts.len() >= 25, "{} distinct first turns", firsts.len());
    eprintln!(
        "{} distinct first assistant turns in 45 traces",
        firsts.len()
    );
    let text = |t: &Trace| {
        t.messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .map(|m| m.content.clone())
            .collect::<String>()
    };
    assert!(traces.iter().any(|t| text(t).contains("```python")));
    assert!(traces.iter().any(|t| text(t).contains("```repl")));
    let needles: Vec<_> = traces
        .iter()
        .filter(|t| t.family == Family::Needle)
        .collect();
    assert!(needles.iter().any(|t| t.style.windows) && needles.iter().any(|t| !t.style.windows));

    // Waste: about the set fraction, and it shows in the record.
    let wasteful: Vec<_> = traces.iter().filter(|t| t.style.detour.is_some()).collect();
    assert!(
        (6..=24).contains(&wasteful.len()),
        "{} wasteful of 45",
        wasteful.len()
    );
    eprintln!("{} of 45 traces waste their first turn", wasteful.len());
    for t in &wasteful {
        let first_obs = &t.messages[3].content;
        match t.style.detour.unwrap() {
            Detour::Overread { .. } => assert!(
                first_obs.len() > 1500,
                "{}: the over-read printed only {} characters",
                t.task_id,
                first_obs.len()
            ),
            Detour::LlmOveruse { .. } => assert!(t.llm_calls >= 1, "{}", t.task_id),
        }
    }
    for t in traces.iter().filter(|t| t.style.detour.is_none()) {
        if t.family != Family::Passage {
            assert_eq!(t.llm_calls, 0, "{}: only passages need llm()", t.task_id);
        }
    }
    // Genuinely multi-turn: code, output, more code or an answer.
    assert!(traces.iter().all(|t| t.messages.len() >= 5));

    // They render into examples whose targets are the assistant turns.
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen2.5-tokenizer");
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    for t in traces.iter().take(10) {
        let ex = render(&tokenizer, &chat_messages(&t.messages)).unwrap();
        let turns = t
            .messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count();
        let runs = ex.targets.windows(2).filter(|w| w[1] && !w[0]).count();
        assert_eq!(runs, turns, "{}", t.task_id);
    }
}

/// `count` short-search traces without prose over the first `tasks` needle tasks of the train
/// split, run through the real environment.
fn bare_needle_traces(
    config: &TaskConfig,
    tasks: usize,
    count: usize,
    wasteful_fraction: f64,
    llm_share: f64,
    seed: u64,
) -> Vec<Trace> {
    let needles: Vec<_> = (0..1000)
        .map(|i| tasks::split_task(Split::Train, i, config).unwrap())
        .filter(|t| t.family == Family::Needle)
        .take(tasks)
        .collect();
    assert_eq!(needles.len(), tasks);
    let settings = TraceSettings {
        count,
        wasteful_fraction,
        short_search: true,
        prose: false,
        multi_hop_detours: false,
        count_hops: false,
        tally_hops: false,
        llm_share,
    };
    let mut env = env();
    generate_traces(&mut env, &needles, &Composite::default(), &settings, seed).unwrap()
}

/// `short_search` needle traces without prose: a bare two-line search as the first turn, still
/// correct through the real environment, with the observation holding the key's sentences,
/// then a bare answer tag.
fn short_search_traces_stay_correct() {
    let config = TaskConfig {
        context_window: 256,
        min_doc_tokens: 200,
        max_window_factor: 3.0,
    };
    let traces = bare_needle_traces(&config, 12, 24, 0.0, 0.5, 3);
    for t in &traces {
        assert!(t.correct, "{}: {:#?}", t.task_id, t.messages);
        let first = &t.messages[2].content;
        assert!(
            first.contains("re.findall(") && first.lines().count() <= 5,
            "{first}"
        );
        assert!(
            t.messages[3].content.contains("access code"),
            "{}",
            t.messages[3].content
        );
        assert_eq!(t.messages.len(), 5, "{}: search, then answer", t.task_id);
        // Without prose: a bare code block, then a bare answer tag.
        assert!(first.starts_with("```"), "{first}");
        let answer = &t.messages[4].content;
        assert!(
            answer.starts_with("<answer>") && answer.ends_with("</answer>"),
            "{answer}"
        );
    }
    eprintln!(
        "{}/{} short-search traces correct",
        traces.len(),
        traces.len()
    );
}

/// `short_search` multi-hop traces, as the embedded default writes them: one two-line search
/// per hop, each naming the courier the previous output handed the parcel to, then the
/// answer: correct through the real environment, and never a wasted turn (four hops and the
/// answer fill the default's five turns). With `count_hops`, each search opens with
/// `# hop K of N`, K counting the searches and N the chain's hops. With `tally_hops`, every
/// turn opens with `Handed on N times, hops left: R.`, R the hops less the searches before it.
fn short_multihop_traces_search_once_per_hop_and_stay_correct() {
    short_multihop_traces(false, false);
    short_multihop_traces(true, false);
    short_multihop_traces(false, true);
}

fn short_multihop_traces(count_hops: bool, tally_hops: bool) {
    let config = TaskConfig {
        context_window: 512,
        min_doc_tokens: 1024,
        max_window_factor: 4.0,
    };
    let hops: Vec<_> = (0..1000)
        .map(|i| tasks::split_task(Split::Train, i, &config).unwrap())
        .filter(|t| t.family == Family::MultiHop)
        .take(10)
        .collect();
    let settings = TraceSettings {
        count: 20,
        wasteful_fraction: 0.7,
        short_search: true,
        prose: false,
        multi_hop_detours: false,
        count_hops,
        tally_hops,
        llm_share: 1.0,
    };
    let mut env = env();
    let traces = generate_traces(&mut env, &hops, &Composite::default(), &settings, 1).unwrap();
    let mut hop_counts = BTreeSet::new();
    for t in &traces {
        assert!(t.correct, "{}: {:#?}", t.task_id, t.messages);
        assert_eq!((t.style.detour, t.llm_calls), (None, 0), "{}", t.task_id);
        let assistant: Vec<_> = t
            .messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .collect();
        let (answer, searches) = assistant.split_last().unwrap();
        // Each turn without its tally line, which must be there exactly with `tally_hops`.
        let untallied = |content: &str, done: usize| -> String {
            let n = searches.len();
            let tally = format!("Handed on {n} times, hops left: {}.\n", n - done);
            assert_eq!(content.starts_with(&tally), tally_hops, "{content}");
            content.strip_prefix(&tally).unwrap_or(content).to_string()
        };
        let answer = untallied(&answer.content, searches.len());
        assert!(answer.starts_with("<answer>"), "{answer}");
        assert!(
            (2..=4).contains(&searches.len()),
            "{}: {:#?}",
            t.task_id,
            t.messages
        );
        hop_counts.insert(searches.len());
        for (i, search) in searches.iter().enumerate() {
            let code = untallied(&search.content, i);
            assert!(
                code.starts_with("```") && code.lines().count() == 4 + usize::from(count_hops),
                "{code}"
            );
            let counter = format!("# hop {} of {}\n", i + 1, searches.len());
            assert_eq!(code.contains(&counter), count_hops, "{code}");
            // Each search after the first names a courier that only the previous output named.
            if i > 0 {
                // messages: system, question, then each search and its output in turn.
                let observation = &t.messages[1 + 2 * i].content;
                let courier = code.split("courier ").nth(1).unwrap();
                let courier = courier.split(' ').next().unwrap();
                assert!(observation.contains(courier), "{courier}: {observation}");
                let question = t.messages[1].content.split("\n\n").next().unwrap();
                assert!(!question.contains(courier), "{courier}: {question}");
            }
        }
    }
    assert!(hop_counts.len() > 1, "hop counts {hop_counts:?}");
    eprintln!(
        "{}",
        traces[0]
            .messages
            .iter()
            .skip(2)
            .map(|m| m.content.as_str())
            .collect::<Vec<_>>()
            .join("\n--\n")
    );
}

/// `llm_share: 1.0`, as the embedded default writes them: every wasteful needle trace sends a
/// slice to `llm()` first (one call, recorded), then searches and answers, still correct.
fn llm_detour_traces_call_once_and_stay_correct() {
    // The embedded default's task shape (recipes/laptop.ron).
    let config = TaskConfig {
        context_window: 512,
        min_doc_tokens: 1024,
        max_window_factor: 4.0,
    };
    let traces = bare_needle_traces(&config, 8, 16, 1.0, 1.0, 1);
    for t in &traces {
        assert!(t.correct, "{}: {:#?}", t.task_id, t.messages);
        assert!(matches!(t.style.detour, Some(Detour::LlmOveruse { .. })));
        assert_eq!(t.llm_calls, 1, "{}: {:#?}", t.task_id, t.messages);
        let first = &t.messages[2].content;
        assert!(
            first.contains("print(llm(") && first.lines().count() == 3,
            "{first}"
        );
        assert!(
            t.messages[4].content.contains("re.findall("),
            "{}",
            t.messages[4].content
        );
        assert_eq!(t.messages.len(), 7, "{}: llm(), search, answer", t.task_id);
    }
    eprintln!("first observation: {}", traces[0].messages[3].content);
}

/// `multi_hop_detours`, as a recipe that sets it writes multi-hop traces: a wasteful trace first
/// sends a slice to `llm()` (one call, recorded), then makes one search per hop and answers,
/// still correct; the others are the plain chains above; both kinds occur.
fn multihop_detour_traces_call_once_then_search_per_hop() {
    let config = TaskConfig {
        context_window: 512,
        min_doc_tokens: 1024,
        max_window_factor: 4.0,
    };
    let hops: Vec<_> = (0..1000)
        .map(|i| tasks::split_task(Split::Train, i, &config).unwrap())
        .filter(|t| t.family == Family::MultiHop)
        .take(10)
        .collect();
    let settings = TraceSettings {
        count: 20,
        wasteful_fraction: 0.7,
        short_search: true,
        prose: false,
        multi_hop_detours: true,
        count_hops: false,
        tally_hops: false,
        llm_share: 1.0,
    };
    let mut env = env();
    let traces = generate_traces(&mut env, &hops, &Composite::default(), &settings, 1).unwrap();
    let mut wasteful = 0;
    for t in &traces {
        assert!(t.correct, "{}: {:#?}", t.task_id, t.messages);
        let assistant: Vec<_> = t
            .messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .collect();
        let searches = match t.style.detour {
            Some(Detour::LlmOveruse { .. }) => {
                wasteful += 1;
                assert_eq!(t.llm_calls, 1, "{}: {:#?}", t.task_id, t.messages);
                assert!(
                    assistant[0].content.contains("print(llm("),
                    "{}",
                    assistant[0].content
                );
                &assistant[1..assistant.len() - 1]
            }
            None => {
                assert_eq!(t.llm_calls, 0, "{}", t.task_id);
                &assistant[..assistant.len() - 1]
            }
            Some(other) => panic!("{}: llm_share 1.0 drew {other:?}", t.task_id),
        };
        assert!(
            (2..=4).contains(&searches.len()),
            "{}: {:#?}",
            t.task_id,
            t.messages
        );
        for search in searches {
            assert!(search.content.contains("re.findall("), "{}", search.content);
            assert!(search.content.contains("courier "), "{}", search.content);
        }
        assert!(assistant.last().unwrap().content.starts_with("<answer>"));
    }
    assert!(
        (8..=19).contains(&wasteful),
        "{wasteful} of 20 wasteful at 0.7"
    );
}

fn main() {
    fathom_env::sandbox::run_worker_if_requested();
    let tests: [(&str, fn()); 5] = [
        (
            "multihop_detour_traces_call_once_then_search_per_hop",
            multihop_detour_traces_call_once_then_search_per_hop,
        ),
        (
            "short_multihop_traces_search_once_per_hop_and_stay_correct",
            short_multihop_traces_search_once_per_hop_and_stay_correct,
        ),
        (
            "llm_detour_traces_call_once_and_stay_correct",
            llm_detour_traces_call_once_and_stay_correct,
        ),
        (
            "expert_traces_vary_waste_on_purpose_and_stay_correct",
            expert_traces_vary_waste_on_purpose_and_stay_correct,
        ),
        (
            "short_search_traces_stay_correct",
            short_search_traces_stay_correct,
        ),
    ];
    common::run_tests(&tests);
}
