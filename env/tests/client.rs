//! `RemoteEnv` against real servers: the same episodes as the in-process environment, a
//! pool of URLs that spreads sessions and skips servers that are down or full, `llm()` calls
//! answered by the client, abort, and a lost session.

mod common;
mod serving;

use std::sync::Arc;
use std::time::Duration;

use fathom_env::client::{RemoteEnv, ServerPool};
use fathom_env::env::{AgentAction, EnvError, Environment, ResetRequest};
use fathom_env::expert::{Expert, PassageReader};
use fathom_env::policy::run_episode;
use fathom_env::server::ServerConfig;
use fathom_env::sublm::FixedSubLm;
use fathom_env::tasks::{self, TaskConfig};
use fathom_rewards::Composite;
use fathom_rewards::record::{Action, EndReason, Family, Split, Step, Trajectory};
use serving::TestServer;

fn server(max_sessions: usize, sub_lm: Arc<dyn fathom_env::sublm::SubLm>) -> TestServer {
    TestServer::start(
        serving::config(max_sessions),
        common::sandbox_config(),
        sub_lm,
    )
}

/// A step without its timings (which differ from run to run).
fn untimed(step: &Step) -> Step {
    let mut s = step.clone();
    if let Some(o) = &mut s.output {
        o.elapsed_ms = 0.0;
    }
    s
}

fn same_episode(remote: &Trajectory, local: &Trajectory) {
    assert_eq!(remote.task_id, local.task_id);
    assert_eq!(remote.messages, local.messages, "{}", local.task_id);
    assert_eq!(remote.end_reason, local.end_reason);
    let r: Vec<Step> = remote.steps.iter().map(untimed).collect();
    let l: Vec<Step> = local.steps.iter().map(untimed).collect();
    assert_eq!(r, l, "{}", local.task_id);
}

#[test]
fn remote_episodes_match_in_process_ones() {
    let s = server(4, Arc::new(PassageReader));
    let pool = ServerPool::new(&[s.url()]).unwrap();
    let mut remote = RemoteEnv::new(pool);
    let local_pool = common::pool();
    let mut local = common::env(&local_pool, Arc::new(PassageReader));
    let composite = Composite::default();
    let config = TaskConfig::default();
    // One task of each family, so the passage family's llm() calls are covered too.
    for index in 0..5 {
        let task = tasks::split_task(Split::Eval, index, &config).unwrap();
        let request = ResetRequest::Split {
            split: Split::Eval,
            index,
        };
        let r = run_episode(&mut remote, &Expert, request.clone()).unwrap();
        let l = run_episode(&mut local, &Expert, request).unwrap();
        same_episode(&r, &l);
        assert_eq!(r.end_reason, EndReason::Answered);
        let last = remote.last_response().unwrap();
        let expected = composite.score(&task, &l).unwrap();
        assert_eq!(last.reward, Some(expected.total), "{}", task.id);
        let score = last.observation.score.as_ref().unwrap();
        assert!(score.correct, "{}", task.id);
        let components: Vec<(String, f64)> = score
            .components
            .iter()
            .map(|c| (c.name.clone(), c.value))
            .collect();
        let want: Vec<(String, f64)> = expected
            .components
            .iter()
            .map(|c| (c.name.to_string(), c.value))
            .collect();
        assert_eq!(components, want);
        if task.family == Family::Passage {
            assert!(r.llm_call_count() >= 1);
        }
    }
    // The session is reused across episodes.
    assert_eq!(s.sessions().0, 1);
    let state = remote.state().unwrap();
    assert_eq!(
        (state.task_id.as_deref(), state.done),
        (Some("eval-00004"), true)
    );
}

#[test]
fn llm_calls_can_be_answered_by_the_client() {
    // The server's own sub-LM knows nothing; the client's reader finds the answer.
    let s = server(4, Arc::new(FixedSubLm("unknown".into())));
    let pool = ServerPool::new(&[s.url()]).unwrap();
    let passage = ResetRequest::Split {
        split: Split::Eval,
        index: 4,
    };
    let gold = tasks::split_task(Split::Eval, 4, &TaskConfig::default()).unwrap();
    assert_eq!(gold.family, Family::Passage);
    let answer_of = |t: &Trajectory| match t.steps.last().map(|s| &s.action) {
        Some(Action::Answer { text }) => text.clone(),
        other => panic!("no answer: {other:?}"),
    };

    let mut via_client = RemoteEnv::with_sub_lm(pool.clone(), Arc::new(PassageReader));
    let t = run_episode(&mut via_client, &Expert, passage.clone()).unwrap();
    assert_eq!(answer_of(&t), gold.answer);
    assert!(t.llm_calls().all(|c| c.refused.is_none()));
    assert_eq!(
        via_client.state().unwrap().llm,
        fathom_env::wire::LlmMode::Client
    );

    let mut via_server = RemoteEnv::new(pool);
    let t = run_episode(&mut via_server, &Expert, passage).unwrap();
    assert_ne!(answer_of(&t), gold.answer);
    assert!(t.llm_calls().all(|c| c.response == "unknown"));
}

#[test]
fn the_pool_spreads_sessions_and_skips_servers_that_refuse() {
    let a = server(1, Arc::new(PassageReader));
    let b = server(4, Arc::new(PassageReader));
    // Nothing listens on port 9 of loopback.
    let pool = ServerPool::new(&["ws://127.0.0.1:9".to_string(), a.url(), b.url()]).unwrap();
    let mut envs: Vec<RemoteEnv> = (0..4).map(|_| RemoteEnv::new(pool.clone())).collect();
    let mut served_by = Vec::new();
    for (i, env) in envs.iter_mut().enumerate() {
        env.reset(ResetRequest::Seed(i as u64)).unwrap();
        served_by.push(env.server().unwrap().to_string());
    }
    // a holds one session (it is full after the first), b the rest; the dead URL none.
    assert_eq!(a.sessions(), (1, 1));
    assert_eq!(b.sessions().0, 3);
    assert_eq!(served_by.iter().filter(|u| **u == a.url()).count(), 1);
    for env in &mut envs {
        let obs = env.step(AgentAction::Code("print('ok')".into())).unwrap();
        assert_eq!(obs.messages.last().unwrap().content, "Output:\nok");
    }
    drop(envs);
    a.wait_sessions(0, Duration::from_secs(10));
    b.wait_sessions(0, Duration::from_secs(10));
}

#[test]
fn abort_ends_the_remote_episode() {
    let s = server(2, Arc::new(PassageReader));
    let mut env = RemoteEnv::new(ServerPool::new(&[s.url()]).unwrap());
    env.reset(ResetRequest::Custom {
        document: "doc".into(),
        question: "q?".into(),
        answer: Some("a".into()),
    })
    .unwrap();
    assert!(matches!(env.trajectory(), Err(EnvError::NotFinished(_))));
    env.abort("generation failed").unwrap();
    let t = env.trajectory().unwrap();
    assert_eq!(
        t.end_reason,
        EndReason::Error {
            message: "generation failed".into()
        }
    );
    assert!(matches!(
        env.step(AgentAction::Answer("a".into())),
        Err(EnvError::EpisodeOver(_))
    ));
    // Scored all the same: no answer, so only the (zero) format and correctness credit.
    assert_eq!(env.last_response().unwrap().reward, Some(0.0));
}

#[test]
fn a_lost_session_is_an_error_and_the_next_reset_reconnects() {
    let config = ServerConfig {
        idle_timeout: Duration::from_millis(300),
        ..serving::config(2)
    };
    let s = TestServer::start(config, common::sandbox_config(), Arc::new(PassageReader));
    let mut env = RemoteEnv::new(ServerPool::new(&[s.url()]).unwrap());
    env.reset(ResetRequest::Seed(5)).unwrap();
    std::thread::sleep(Duration::from_millis(900));
    let err = env.step(AgentAction::Code("1".into())).unwrap_err();
    assert!(matches!(err, EnvError::Remote(_)), "{err}");
    assert!(matches!(
        env.step(AgentAction::Code("1".into())),
        Err(EnvError::NoEpisode)
    ));
    env.reset(ResetRequest::Seed(5)).unwrap();
    let obs = env.step(AgentAction::Code("print(2 * 21)".into())).unwrap();
    assert_eq!(obs.messages.last().unwrap().content, "Output:\n42");
}
