//! Episodes through the real sandbox: the turn protocol, the iteration cap, token counts,
//! API misuse, recursive `llm()` sub-episodes, and several episodes stepped concurrently.

mod common;

use std::sync::Arc;

use fathom_env::env::{AgentAction, EnvError, Environment, ReplEnv, ResetRequest, Services};
use fathom_env::policy::{Policy, PolicyError, run_episode};
use fathom_env::sublm::FixedSubLm;
use fathom_rewards::record::{Action, EndReason, Message, Role, Split};

fn custom(doc: &str) -> ResetRequest {
    ResetRequest::Custom {
        document: doc.into(),
        question: "What is the code?".into(),
        answer: Some("77".into()),
    }
}

fn env() -> ReplEnv {
    common::env(&common::pool(), Arc::new(FixedSubLm("sub".into())))
}

#[test]
fn a_full_episode_produces_the_record() {
    let mut env = env();
    let obs = env.reset(custom("The code is 77.")).unwrap();
    assert_eq!(obs.messages.len(), 2);
    assert_eq!(obs.messages[0].role, Role::System);
    assert!(
        obs.messages[1]
            .content
            .starts_with("Question: What is the code?")
    );
    assert!(!obs.done);
    let obs = env
        .step(AgentAction::Message(
            "Let me look.\n```repl\nprint(context[-3:-1])\n```".into(),
        ))
        .unwrap();
    assert_eq!(obs.messages.last().unwrap().content, "Output:\n77");
    let step = obs.step.unwrap();
    assert_eq!(
        step.action,
        Action::Code {
            code: "print(context[-3:-1])\n".into()
        }
    );
    assert_eq!(step.code_tokens, 6);
    assert_eq!(step.output_tokens, 3);
    assert!(step.completion_tokens > step.code_tokens);
    assert!(matches!(env.trajectory(), Err(EnvError::NotFinished(_))));
    let obs = env
        .step(AgentAction::Message("<answer>77</answer>".into()))
        .unwrap();
    assert!(obs.done);
    assert_eq!(obs.end_reason, Some(EndReason::Answered));
    let t = env.trajectory().unwrap();
    assert_eq!(t.task_id, "custom");
    assert_eq!(t.steps.len(), 2);
    assert_eq!(t.messages.len(), 5);
    assert_eq!(t.final_assistant(), Some("<answer>77</answer>"));
    assert!(matches!(
        env.step(AgentAction::Answer("x".into())),
        Err(EnvError::EpisodeOver(_))
    ));
}

#[test]
fn misuse_is_a_clear_error() {
    let mut env = env();
    assert!(matches!(
        env.step(AgentAction::Code("1".into())),
        Err(EnvError::NoEpisode)
    ));
    assert!(matches!(env.trajectory(), Err(EnvError::NoEpisode)));
    let err = env
        .reset(ResetRequest::Split {
            split: Split::Eval,
            index: 999,
        })
        .unwrap_err();
    assert!(
        err.to_string().contains("out of range for the eval split"),
        "{err}"
    );
}

#[test]
fn invalid_turns_and_mixed_turns_are_explained() {
    let mut env = env();
    env.reset(custom("doc")).unwrap();
    let obs = env
        .step(AgentAction::Message("I think it is 77.".into()))
        .unwrap();
    assert!(matches!(obs.step.unwrap().action, Action::Invalid { .. }));
    assert!(
        obs.messages
            .last()
            .unwrap()
            .content
            .starts_with("No action found")
    );
    let obs = env
        .step(AgentAction::Message(
            "```repl\nprint(1)\n```\n<answer>77</answer>".into(),
        ))
        .unwrap();
    assert!(!obs.done, "code wins over an answer in the same turn");
    let last = &obs.messages.last().unwrap().content;
    assert!(
        last.starts_with("Output:\n1\nNote: Your <answer> was ignored"),
        "{last}"
    );
}

#[test]
fn the_iteration_cap_ends_the_episode() {
    let pool = common::pool();
    let mut services = Services::new(pool, Arc::new(FixedSubLm("sub".into())));
    services.config.max_turns = 3;
    let mut env = ReplEnv::new(services);
    env.reset(custom("doc")).unwrap();
    let o1 = env.step(AgentAction::Code("x = 1".into())).unwrap();
    assert!(!o1.done && !o1.messages.last().unwrap().content.contains("last turn"));
    let o2 = env.step(AgentAction::Code("x = 2".into())).unwrap();
    assert!(
        o2.messages
            .last()
            .unwrap()
            .content
            .contains("this is your last turn")
    );
    let o3 = env.step(AgentAction::Code("x = 3".into())).unwrap();
    assert!(o3.done);
    assert_eq!(
        env.trajectory().unwrap().end_reason,
        EndReason::IterationCap
    );
}

#[test]
fn timeouts_become_observations_and_the_episode_goes_on() {
    let mut env = env();
    env.reset(custom("The code is 77.")).unwrap();
    env.step(AgentAction::Code("keep = 5".into())).unwrap();
    let obs = env
        .step(AgentAction::Code("while True:\n    pass".into()))
        .unwrap();
    let text = &obs.messages.last().unwrap().content;
    assert!(
        text.contains("TimeoutError") && text.contains("restarted"),
        "{text}"
    );
    let obs = env
        .step(AgentAction::Code(
            "print('keep' in globals(), context[-3:-1])".into(),
        ))
        .unwrap();
    assert_eq!(obs.messages.last().unwrap().content, "Output:\nFalse 77");
}

/// Answers the top-level question by delegating to `llm()`; inside a sub-episode (whose
/// question is the part of the prompt before the marker) it reads `context` and answers.
struct Delegator;

impl Policy for Delegator {
    fn respond(&self, messages: &[Message]) -> Result<String, PolicyError> {
        let question = &messages[1].content;
        let last = messages.last().unwrap();
        let turns = messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count();
        Ok(
            match (question.starts_with("Question: What is the code?"), turns) {
                (true, 0) => "```repl\nprint(llm('Which number? \\n---\\n' + context))\n```".into(),
                (false, 0) => {
                    "```repl\nimport re\nprint(re.findall(r'\\d+', context)[0])\n```".into()
                }
                (_, _) => format!(
                    "<answer>{}</answer>",
                    last.content.trim_start_matches("Output:\n")
                ),
            },
        )
    }
}

#[test]
fn llm_recurses_into_a_sub_episode_below_max_depth() {
    let pool = common::pool();
    let mut services = Services::new(pool, Arc::new(FixedSubLm("should not be asked".into())));
    services.config.llm.max_depth = 2;
    services.policy = Some(Arc::new(Delegator));
    let mut env = ReplEnv::new(services);
    let t = run_episode(&mut env, &Delegator, custom("The code is 77.")).unwrap();
    assert_eq!(t.end_reason, EndReason::Answered);
    assert_eq!(t.final_assistant(), Some("<answer>77</answer>"));
    let calls: Vec<_> = t.llm_calls().collect();
    assert_eq!(calls.len(), 1);
    assert_eq!((calls[0].depth, calls[0].response.as_str()), (1, "77"));
    assert!(calls[0].refused.is_none());
}

#[test]
fn at_max_depth_llm_goes_to_the_sub_lm() {
    let mut env = env();
    let t = run_episode(&mut env, &Delegator, custom("The code is 77.")).unwrap();
    assert_eq!(t.final_assistant(), Some("<answer>sub</answer>"));
}

#[test]
fn episodes_step_concurrently() {
    let pool = common::pool();
    let mut envs: Vec<ReplEnv> = (0..4)
        .map(|_| {
            ReplEnv::new(Services::new(
                pool.clone(),
                Arc::new(FixedSubLm("s".into())),
            ))
        })
        .collect();
    for (i, e) in envs.iter_mut().enumerate() {
        e.reset(custom(&format!("The code is {i}."))).unwrap();
    }
    std::thread::scope(|scope| {
        for e in envs.iter_mut() {
            scope.spawn(move || {
                e.step(AgentAction::Code(
                    "import re\nprint(re.findall(r'\\d', context)[0])".into(),
                ))
                .unwrap()
            });
        }
    });
    for (i, e) in envs.iter_mut().enumerate() {
        let obs = e.step(AgentAction::Answer(i.to_string())).unwrap();
        assert!(obs.done);
        let t = e.trajectory().unwrap();
        assert_eq!(t.steps[0].output.as_ref().unwrap().stdout, format!("{i}\n"));
    }
}

#[test]
fn a_binary_that_is_not_a_worker_is_a_clear_error() {
    let mut config = common::sandbox_config();
    config.worker = fathom_env::sandbox::WorkerCommand::Path("/bin/true".into());
    config.idle_workers = 0;
    let pool = fathom_env::sandbox::SandboxPool::new(config).unwrap();
    let err = pool
        .session("doc")
        .err()
        .expect("no session from /bin/true")
        .to_string();
    assert!(
        err.contains("/bin/true") && err.contains("run_worker_if_requested"),
        "{err}"
    );
    let missing = common::sandbox_config();
    let missing = fathom_env::sandbox::SandboxConfig {
        worker: fathom_env::sandbox::WorkerCommand::Path("/nonexistent/worker".into()),
        ..missing
    };
    let err = fathom_env::sandbox::SandboxPool::new(missing)
        .err()
        .expect("missing binary")
        .to_string();
    assert!(err.contains("/nonexistent/worker"), "{err}");
}
