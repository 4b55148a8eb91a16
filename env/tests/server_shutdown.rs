//! Graceful shutdown: WebSocket clients are told and disconnected, HTTP sessions end, and
//! every sandbox worker the server started is gone once it returns, including the worker of
//! a step that was still running. A test binary of its own, so that the only child processes
//! of this process are the server's workers.

mod common;
mod serving;

use std::sync::Arc;
use std::time::{Duration, Instant};

use fathom_env::expert::PassageReader;
use serde_json::json;
use serving::{TestServer, Ws, post};

/// Live (not reaped) child processes of this process.
fn children() -> Vec<u32> {
    let me = std::process::id();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid …": comm may hold spaces, so read after the last ')'.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        if fields.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(me) {
            found.push(pid);
        }
    }
    found
}

#[test]
fn shutdown_ends_sessions_and_kills_their_workers() {
    let mut sandbox = common::sandbox_config();
    sandbox.step_timeout = Duration::from_secs(2);
    let mut server = TestServer::start(serving::config(4), sandbox, Arc::new(PassageReader));
    let doc = json!({"context": "The code is 9.", "task_prompt": "Code?", "expected_answer": "9"});

    let mut idle = Ws::connect(server.addr, "");
    assert_eq!(
        idle.call(&json!({"type": "reset", "data": doc}))["type"],
        "observation"
    );
    let mut busy = Ws::connect(server.addr, "");
    assert_eq!(
        busy.call(&json!({"type": "reset", "data": doc}))["type"],
        "observation"
    );
    busy.send(&json!({"type": "step", "data": {"code": "while True:\n    pass"}}));
    let (status, _) = post(server.addr, "/reset", &doc);
    assert_eq!(status, 200);
    assert_eq!(server.sessions().0, 3);
    let workers = children();
    assert!(
        workers.len() >= 3,
        "one worker per session at least: {workers:?}"
    );

    let started = Instant::now();
    server.stop().expect("the server stops cleanly");
    let took = started.elapsed();
    // The running cell is bounded by the sandbox's 2 s limit; nothing else waits.
    assert!(took < Duration::from_secs(15), "shutdown took {took:?}");

    for ws in [&mut idle, &mut busy] {
        let msgs = ws.drain_until_closed();
        assert_eq!(msgs.len(), 1, "{msgs:?}");
        assert_eq!(msgs[0]["data"]["code"], "SESSION_ERROR");
        assert_eq!(msgs[0]["data"]["message"], "the server is shutting down");
    }
    let left = children();
    assert!(
        left.is_empty(),
        "workers left after shutdown: {left:?} (of {workers:?})"
    );
}
