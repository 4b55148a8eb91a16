//! The server through OpenEnv's real Python client: the pinned `openenv` package (installed
//! from PyPI into a virtualenv on first run, see `python/mod.rs`) validates the running server
//! with `validate_running_environment` and drives full expert episodes with `GenericEnvClient`
//! over WebSocket; every action, observation and state must match the server's `/schema`, and
//! each episode must produce the conversation and reward the in-process environment does.

mod common;
mod python;
mod serving;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use fathom_env::env::ResetRequest;
use fathom_env::expert::{Expert, PassageReader};
use fathom_env::policy::run_episode;
use fathom_env::tasks::{self, TaskConfig};
use fathom_rewards::Composite;
use fathom_rewards::record::{Action, Split, Trajectory};
use serde_json::{Value, json};
use serving::TestServer;

const MAX_SESSIONS: usize = 3;

/// The actions of `t` as the OpenEnv client will send them: raw messages, except that odd
/// episodes send code and answers explicitly (both must give the same conversation).
fn actions(t: &Trajectory, explicit: bool) -> Vec<Value> {
    t.steps
        .iter()
        .map(|s| match (&s.action, explicit) {
            (Action::Code { code }, true) => json!({"code": code}),
            (Action::Answer { text }, true) => json!({"answer": text}),
            _ => json!({"message": s.assistant}),
        })
        .collect()
}

#[test]
fn openenv_python_client_drives_full_episodes() {
    let python = python::interpreter();
    let server = TestServer::start(
        serving::config(MAX_SESSIONS),
        common::sandbox_config(),
        Arc::new(PassageReader),
    );

    // The expert's episodes in-process: what the server must reproduce.
    let pool = common::pool();
    let mut local = common::env(&pool, Arc::new(PassageReader));
    let composite = Composite::default();
    let config = TaskConfig::default();
    let mut plan = Vec::new();
    let mut expected = Vec::new();
    for index in 0..5 {
        let task = tasks::split_task(Split::Eval, index, &config).unwrap();
        let t = run_episode(
            &mut local,
            &Expert,
            ResetRequest::Task(Box::new(task.clone())),
        )
        .unwrap();
        let score = composite.score(&task, &t).unwrap();
        assert!(score.correct, "the expert solves {}", task.id);
        plan.push(json!({"reset": {"split": "eval", "index": index}, "actions": actions(&t, index % 2 == 1)}));
        expected.push((task, t, score.total));
    }
    let plan_path =
        std::env::temp_dir().join(format!("fathom-openenv-plan-{}.json", std::process::id()));
    std::fs::write(&plan_path, json!({"episodes": plan}).to_string()).unwrap();

    let driver = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/drive.py");
    let stdout = python::output(
        Command::new(&python)
            .arg(driver)
            .arg(server.url())
            .arg(&plan_path)
            .arg(MAX_SESSIONS.to_string())
            .env("PYTHONUNBUFFERED", "1"),
        Duration::from_secs(600),
    )
    .unwrap_or_else(|e| panic!("the OpenEnv driver failed: {e}"));
    let _ = std::fs::remove_file(&plan_path);
    let out: Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("driver output is not JSON ({e}): {stdout}"));

    let report = &out["validation"];
    assert_eq!(
        report["passed"], true,
        "validate_running_environment: {report:#}"
    );
    assert_eq!(report["standard_profile"], "openenv-http/1.x");
    assert_eq!(report["mode"], "simulation");
    assert_eq!(out["problems"], json!([]), "schema violations");

    let episodes = out["episodes"].as_array().unwrap();
    assert_eq!(episodes.len(), expected.len());
    for (got, (task, t, total)) in episodes.iter().zip(&expected) {
        assert_eq!(got["done"], true, "{}", task.id);
        assert_eq!(got["reward"].as_f64(), Some(*total), "{}", task.id);
        assert_eq!(got["score"]["correct"], true, "{}", task.id);
        assert_eq!(
            got["messages"],
            serde_json::to_value(&t.messages).unwrap(),
            "{}",
            task.id
        );
        assert_eq!(got["trajectory_steps"], json!(t.steps.len()));
        assert!(
            got["first_text"]
                .as_str()
                .unwrap()
                .starts_with(&format!("Question: {}", task.question))
        );
        assert_eq!(got["state"]["task_id"], task.id);
        assert_eq!(
            (
                got["state"]["done"].clone(),
                got["state"]["step_count"].clone()
            ),
            (json!(true), json!(t.steps.len()))
        );
    }

    let custom = &out["custom"];
    assert_eq!(custom["episode_id"], "py-custom");
    assert_eq!(custom["output"], "Output:\n4417");
    assert_eq!(
        (custom["done"].clone(), custom["correct"].clone()),
        (json!(true), json!(true))
    );
    assert!(custom["reward"].as_f64().unwrap() > 0.9);

    let bad = out["bad_action"].as_str().unwrap();
    assert!(
        bad.contains("VALIDATION_ERROR") && bad.contains("data.code: invalid type"),
        "{bad}"
    );
    let bad = out["bad_reset"].as_str().unwrap();
    assert!(
        bad.contains("VALIDATION_ERROR") && bad.contains("index"),
        "{bad}"
    );
    assert_eq!(out["after_errors"], "Output:\nafter");

    let full = out["capacity"].as_str().unwrap();
    assert!(full.contains("CAPACITY_REACHED"), "{full}");
    assert_eq!(out["after_capacity"], "seed-3");
    server.wait_sessions(0, Duration::from_secs(10));
}
