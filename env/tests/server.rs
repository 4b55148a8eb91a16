//! The environment server over raw HTTP and WebSocket: discovery routes, HTTP sessions,
//! and robustness — malformed and oversized requests, unknown sessions, clients that vanish
//! mid-step, idle and slow sessions, more sessions than allowed. After every abuse the
//! server must answer the next good request.

mod common;
mod serving;

use std::sync::Arc;
use std::time::{Duration, Instant};

use fathom_env::sublm::FixedSubLm;
use serde_json::{Value, json};
use serving::{TestServer, Ws, get, post, request};

fn server(max_sessions: usize) -> TestServer {
    TestServer::start(
        serving::config(max_sessions),
        common::sandbox_config(),
        Arc::new(FixedSubLm("sub-LM says hi".into())),
    )
}

fn custom_reset() -> Value {
    json!({
        "context": "Ledger. The vault code is 4417. End.",
        "task_prompt": "What is the vault code?",
        "expected_answer": "4417",
    })
}

fn healthy(s: &TestServer) {
    let (status, body) = get(s.addr, "/health");
    assert_eq!((status, body), (200, json!({"status": "healthy"})));
}

/// The first entry of a 422 body: (loc, msg).
fn detail(body: &Value) -> (Vec<String>, String) {
    let d = &body["detail"][0];
    let loc = d["loc"]
        .as_array()
        .unwrap_or_else(|| panic!("no detail in {body}"))
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    (loc, d["msg"].as_str().unwrap().to_string())
}

#[test]
fn discovery_routes_answer() {
    let s = server(4);
    healthy(&s);
    let (status, meta) = get(s.addr, "/metadata");
    assert_eq!(status, 200);
    assert_eq!(meta["name"], "fathom");
    assert!(meta["description"].as_str().unwrap().contains("REPL"));
    let (status, schema) = get(s.addr, "/schema");
    assert_eq!(status, 200);
    for key in ["action", "observation", "state"] {
        assert!(schema[key].is_object(), "{key}");
    }
    let (status, doc) = get(s.addr, "/openapi.json");
    assert_eq!(status, 200);
    assert_eq!(doc["info"]["version"], "1.0.0");
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    assert_eq!(s.sessions(), (0, 4));
    let (status, body) = get(s.addr, "/nowhere");
    assert_eq!((status, body), (404, json!({"detail": "Not Found"})));
    // OpenEnv's validator posts an empty object to /mcp and wants a JSON-RPC answer.
    let (status, rpc) = post(s.addr, "/mcp", &json!({}));
    assert_eq!(status, 200);
    assert_eq!(rpc["jsonrpc"], "2.0");
    assert_eq!(rpc["error"]["code"], -32600);
    let (_, rpc) = post(
        s.addr,
        "/mcp",
        &json!({"jsonrpc": "2.0", "method": "tools/list", "id": 1}),
    );
    assert_eq!(
        (rpc["id"].clone(), rpc["error"]["code"].clone()),
        (json!(1), json!(-32603))
    );
    let (_, rpc) = request(s.addr, "POST", "/mcp", &[], b"{oops");
    assert_eq!(rpc["error"]["code"], -32700);
}

#[test]
fn an_http_episode_runs_to_a_scored_end() {
    let s = server(4);
    let (status, first) = post(s.addr, "/reset", &custom_reset());
    assert_eq!(status, 200, "{first}");
    let id = first["metadata"]["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(first["done"], false);
    assert_eq!(first["reward"], Value::Null);
    assert!(
        first["observation"]["text"]
            .as_str()
            .unwrap()
            .starts_with("Question: What is the vault code?")
    );
    assert_eq!(
        first["observation"]["messages"].as_array().unwrap().len(),
        2
    );
    assert_eq!(s.sessions().0, 1);

    let (status, r) = post(
        s.addr,
        "/step",
        &json!({"session_id": id, "action": {"code": "print(context[26:30])"}}),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["observation"]["text"], "Output:\n4417");
    assert_eq!(r["observation"]["turn"], 1);
    assert_eq!(
        r["observation"]["step"]["action"],
        json!({"kind": "code", "code": "print(context[26:30])"})
    );

    let (_, st) = get(s.addr, &format!("/state?session_id={id}"));
    assert_eq!(
        (
            st["step_count"].clone(),
            st["done"].clone(),
            st["scored"].clone()
        ),
        (json!(1), json!(false), json!(true))
    );
    assert_eq!(st["task_id"], "custom");

    let (status, r) = post(
        s.addr,
        "/step",
        &json!({"session_id": id, "action": {"message": "<answer>4417</answer>"}, "request_id": "r-1"}),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["done"], true);
    let reward = r["reward"].as_f64().unwrap();
    assert!((reward - r["observation"]["score"]["total"].as_f64().unwrap()).abs() < 1e-12);
    assert!(reward > 0.9, "correct, cheap episode: {reward}");
    let names: Vec<&str> = r["observation"]["score"]["components"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "format_gate",
            "correctness",
            "token_budget",
            "recursion_efficiency"
        ]
    );
    assert_eq!(r["observation"]["score"]["correct"], true);
    assert_eq!(r["observation"]["end_reason"], json!({"kind": "answered"}));
    assert_eq!(
        r["observation"]["trajectory"]["steps"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_eq!(r["observation"]["text"], "");

    // The episode is over; a new reset in the same session starts another.
    let (status, r) = post(
        s.addr,
        "/step",
        &json!({"session_id": id, "action": {"answer": "x"}}),
    );
    assert_eq!(status, 409, "{r}");
    assert!(r["detail"].as_str().unwrap().contains("already ended"));
    let (status, r) = post(
        s.addr,
        "/reset",
        &json!({"session_id": id, "split": "eval", "index": 3, "episode_id": "mine"}),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        (
            r["observation"]["task_id"].clone(),
            r["observation"]["episode_id"].clone()
        ),
        (json!("eval-00003"), json!("mine"))
    );
    assert_eq!(s.sessions().0, 1);

    // Closing over MCP ends the session.
    let (_, rpc) = post(
        s.addr,
        "/mcp",
        &json!({"jsonrpc": "2.0", "id": "c", "method": "openenv/session/close", "params": {"session_id": id}}),
    );
    assert_eq!(rpc["result"], json!({"session_id": id, "closed": true}));
    assert_eq!(s.sessions().0, 0);
    let (status, _) = post(
        s.addr,
        "/step",
        &json!({"session_id": id, "action": {"answer": "x"}}),
    );
    assert_eq!(status, 404);
}

/// A request that must get a 422: path, what is wrong, body (`{id}` stands for an open
/// session), the expected `loc` and a piece of `msg`.
type Case<'a> = (&'a str, &'a str, &'a str, &'a [&'a str], &'a str);

#[test]
fn malformed_http_requests_get_4xx_naming_the_field() {
    let s = server(4);
    let (_, first) = post(s.addr, "/reset", &json!({"seed": 7}));
    let id = first["metadata"]["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    #[rustfmt::skip]
    let cases: &[Case] = &[
        ("/reset", "bad JSON", r#"{"seed": "#, &["body"], "EOF"),
        ("/reset", "unknown field", r#"{"sed": 1}"#, &["body", "sed"], "unknown field `sed`"),
        ("/reset", "wrong type", r#"{"seed": "seven"}"#, &["body", "seed"], "invalid type"),
        ("/reset", "negative seed", r#"{"seed": -1}"#, &["body", "seed"], "invalid value"),
        ("/reset", "split without index", r#"{"split": "eval"}"#,
            &["body", "index"], "index is required"),
        ("/reset", "unknown split", r#"{"split": "dev", "index": 0}"#,
            &["body", "split"], "unknown variant `dev`"),
        ("/reset", "index out of range", r#"{"split": "eval", "index": 200}"#,
            &["body", "index"], "out of range"),
        ("/reset", "two sources", r#"{"seed": 1, "context": "d", "task_prompt": "q"}"#,
            &["body", "context"], "exclusive"),
        ("/reset", "client llm over HTTP", r#"{"llm": "client"}"#, &["body", "llm"], "WebSocket"),
        ("/reset", "not an object", "[1, 2]", &["body"], "expected an object"),
        ("/step", "action as an array", r#"{"session_id": "{id}", "action": ["print(1)"]}"#,
            &["body", "action"], "action: invalid type: array"),
        ("/step", "no action", r#"{"session_id": "{id}"}"#,
            &["body", "action"], "missing field `action`"),
        ("/step", "empty action", r#"{"session_id": "{id}", "action": {}}"#,
            &["body", "action", "message"], "one of message, code, answer"),
        ("/step", "wrong type", r#"{"session_id": "{id}", "action": {"code": 5}}"#,
            &["body", "action", "code"], "action.code: invalid type"),
        ("/step", "unknown action field", r#"{"session_id": "{id}", "action": {"cod": "x"}}"#,
            &["body", "action", "cod"], "unknown field `cod`"),
        ("/step", "two actions", r#"{"session_id": "{id}", "action": {"code": "1", "answer": "2"}}"#,
            &["body", "action", "answer"], "exclusive"),
        ("/step", "no session", r#"{"action": {"code": "1"}}"#,
            &["body", "session_id"], "session_id is required"),
        ("/step", "bad timeout", r#"{"session_id": "{id}", "action": {"code": "1"}, "timeout_s": -1}"#,
            &["body", "timeout_s"], "positive"),
        ("/step", "empty body", "", &["body"], "EOF"),
    ];
    for &(path, what, body, loc, msg) in cases {
        let body = body.replace("{id}", &id);
        let (got, answer) = request(
            s.addr,
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.as_bytes(),
        );
        assert_eq!(got, 422, "{path} {what}: {answer}");
        let (got_loc, got_msg) = detail(&answer);
        assert_eq!(got_loc, loc, "{path} {what}: {answer}");
        assert!(
            got_msg.contains(msg),
            "{path} {what}: {got_msg:?} lacks {msg:?}"
        );
        healthy(&s);
    }
    let (status, answer) = get(s.addr, "/state?sessionid=x");
    assert_eq!(status, 422, "{answer}");
    assert_eq!(detail(&answer).0, ["query", "sessionid"]);
    let (status, _) = request(s.addr, "DELETE", "/reset", &[], b"");
    assert_eq!(status, 405);
    // The session survived every bad request.
    let (status, r) = post(
        s.addr,
        "/step",
        &json!({"session_id": id, "action": {"code": "print(1 + 1)"}}),
    );
    assert_eq!(
        (status, r["observation"]["text"].clone()),
        (200, json!("Output:\n2"))
    );
}

#[test]
fn oversized_requests_are_refused_and_the_server_carries_on() {
    let s = server(4);
    let big = json!({"context": "x".repeat(2 << 20), "task_prompt": "q"}).to_string();
    let (status, body) = request(
        s.addr,
        "POST",
        "/reset",
        &[("Content-Type", "application/json")],
        big.as_bytes(),
    );
    assert_eq!(status, 413, "{body}");
    assert!(body["detail"].as_str().unwrap().contains("1048576 bytes"));
    // Without a Content-Length the limit still holds.
    let (status, _) = request(
        s.addr,
        "POST",
        "/reset",
        &[("Transfer-Encoding", "chunked")],
        big.as_bytes(),
    );
    assert_eq!(status, 413);
    healthy(&s);
    assert_eq!(s.sessions().0, 0);

    let mut ws = Ws::connect(s.addr, "");
    ws.send_text_refusable(
        &json!({"type": "reset", "data": {"context": "x".repeat(2 << 20), "task_prompt": "q"}})
            .to_string(),
    );
    assert!(ws.drain_until_closed().is_empty());
    s.wait_sessions(0, Duration::from_secs(10));
    let mut ws = Ws::connect(s.addr, "");
    let r = ws.call(&json!({"type": "reset", "data": custom_reset()}));
    assert_eq!(r["type"], "observation", "{r}");
}

#[test]
fn unknown_sessions_are_named() {
    let s = server(4);
    let (status, body) = post(
        s.addr,
        "/step",
        &json!({"session_id": "nope", "action": {"code": "1"}}),
    );
    assert_eq!(
        (status, body["detail"].clone()),
        (404, json!("Unknown session_id: nope"))
    );
    let (status, _) = get(s.addr, "/state?session_id=nope");
    assert_eq!(status, 404);
    let (status, _) = post(s.addr, "/reset", &json!({"session_id": "nope"}));
    assert_eq!(status, 404);
    let (_, rpc) = post(
        s.addr,
        "/mcp",
        &json!({"jsonrpc": "2.0", "id": 2, "method": "openenv/session/close", "params": {"session_id": "nope"}}),
    );
    assert_eq!(rpc["error"]["code"], -32602);
    let mut ws = Ws::connect(s.addr, "?session_id=nope");
    let msgs = ws.drain_until_closed();
    assert_eq!(
        msgs,
        [
            json!({"type": "error", "data": {"message": "Unknown session_id: nope", "code": "SESSION_ERROR"}})
        ]
    );
    healthy(&s);
    assert_eq!(s.sessions().0, 0);
}

#[test]
fn websocket_errors_leave_the_session_usable() {
    let s = server(4);
    let mut ws = Ws::connect(s.addr, "");
    ws.send_text("{not json");
    assert_eq!(ws.recv().unwrap()["data"]["code"], "INVALID_JSON");
    let r = ws.call(&json!({"type": "dance"}));
    assert_eq!(
        r["data"],
        json!({"message": "Unknown message type: dance", "code": "UNKNOWN_TYPE"})
    );
    let r = ws.call(&json!({"type": "step", "data": {"code": 5}}));
    assert_eq!(r["data"]["code"], "VALIDATION_ERROR");
    assert!(
        r["data"]["message"]
            .as_str()
            .unwrap()
            .contains("data.code: invalid type"),
        "{r}"
    );
    assert_eq!(r["data"]["errors"][0]["loc"], json!(["data", "code"]));
    let r = ws.call(&json!({"type": "step", "data": {"code": "1"}}));
    assert_eq!(
        r["data"],
        json!({"message": "no episode: send reset first", "code": "EXECUTION_ERROR"})
    );
    let r = ws.call(&json!({"type": "reset", "data": {"split": "eval", "index": 999}}));
    assert_eq!(r["data"]["code"], "VALIDATION_ERROR");
    assert_eq!(r["data"]["errors"][0]["loc"], json!(["data", "index"]));
    let st = ws.call(&json!({"type": "state"}));
    assert_eq!(
        (st["type"].clone(), st["data"]["episode_id"].clone()),
        (json!("state"), Value::Null)
    );

    let r = ws.call(&json!({"type": "reset", "data": custom_reset()}));
    assert_eq!(r["type"], "observation", "{r}");
    let r = ws.call(&json!({"type": "step", "data": {"code": "x = 20 + 22\nx"}}));
    assert_eq!(r["data"]["observation"]["text"], "Output:\n42");
    let r = ws.call(&json!({"type": "llm_result", "data": {"id": 3, "response": "?"}}));
    assert_eq!(r["data"]["code"], "VALIDATION_ERROR");
    let r = ws.call(&json!({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 9, "method": "openenv/session/create"}}));
    assert_eq!(r["type"], "mcp");
    assert!(r["data"]["result"]["session_id"].is_string());
    let r = ws.call(&json!({"type": "step", "data": {"code": "print(llm('hi'))"}}));
    assert_eq!(r["data"]["observation"]["text"], "Output:\nsub-LM says hi");
    let r = ws.call(&json!({"type": "step", "data": {"answer": "4417"}}));
    assert_eq!(
        (
            r["data"]["done"].clone(),
            r["data"]["observation"]["score"]["correct"].clone()
        ),
        (json!(true), json!(true))
    );
    ws.send(&json!({"type": "close"}));
    assert!(ws.drain_until_closed().is_empty());
    s.wait_sessions(0, Duration::from_secs(10));
}

#[test]
fn a_full_server_refuses_at_once_and_recovers() {
    let s = server(2);
    let mut a = Ws::connect(s.addr, "");
    assert_eq!(
        a.call(&json!({"type": "reset", "data": {"seed": 1}}))["type"],
        "observation"
    );
    let (_, http) = post(s.addr, "/reset", &json!({"seed": 2}));
    let http_id = http["metadata"]["session_id"].as_str().unwrap().to_string();
    assert_eq!(s.sessions(), (2, 2));

    let started = Instant::now();
    let mut c = Ws::connect(s.addr, "");
    let refused = c.drain_until_closed();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0]["data"]["code"], "CAPACITY_REACHED");
    assert_eq!(
        (
            refused[0]["data"]["active_sessions"].clone(),
            refused[0]["data"]["max_sessions"].clone()
        ),
        (json!(2), json!(2))
    );
    assert_eq!(
        refused[0]["data"]["message"],
        "Server at capacity: 2/2 sessions active. Cannot accept new connections."
    );
    let (status, body) = post(s.addr, "/reset", &json!({}));
    assert_eq!(status, 503, "{body}");
    let (_, rpc) = post(
        s.addr,
        "/mcp",
        &json!({"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create"}),
    );
    assert_eq!(rpc["error"]["code"], -32000);
    healthy(&s);

    // The sessions that are in keep working; freeing one lets a newcomer in.
    assert_eq!(
        a.call(&json!({"type": "step", "data": {"code": "print(3)"}}))["data"]["observation"]["text"],
        "Output:\n3"
    );
    post(
        s.addr,
        "/mcp",
        &json!({"jsonrpc": "2.0", "id": 1, "method": "openenv/session/close", "params": {"session_id": http_id}}),
    );
    let mut d = Ws::connect(s.addr, "");
    assert_eq!(
        d.call(&json!({"type": "reset", "data": {"seed": 3}}))["type"],
        "observation"
    );
}

#[test]
fn a_client_that_vanishes_mid_step_frees_its_session() {
    let mut sandbox = common::sandbox_config();
    sandbox.step_timeout = Duration::from_secs(2);
    let s = TestServer::start(
        serving::config(1),
        sandbox,
        Arc::new(FixedSubLm("x".into())),
    );
    let mut ws = Ws::connect(s.addr, "");
    assert_eq!(
        ws.call(&json!({"type": "reset", "data": custom_reset()}))["type"],
        "observation"
    );
    ws.send(&json!({"type": "step", "data": {"code": "while True:\n    pass"}}));
    drop(ws);
    s.wait_sessions(0, Duration::from_secs(10));
    let mut ws = Ws::connect(s.addr, "");
    assert_eq!(
        ws.call(&json!({"type": "reset", "data": custom_reset()}))["type"],
        "observation"
    );
    let r = ws.call(&json!({"type": "step", "data": {"code": "print('still here')"}}));
    assert_eq!(r["data"]["observation"]["text"], "Output:\nstill here");
}

#[test]
fn idle_sessions_are_ended() {
    let config = fathom_env::server::ServerConfig {
        idle_timeout: Duration::from_millis(400),
        ..serving::config(4)
    };
    let s = TestServer::start(
        config,
        common::sandbox_config(),
        Arc::new(FixedSubLm("x".into())),
    );
    let mut ws = Ws::connect(s.addr, "");
    assert_eq!(
        ws.call(&json!({"type": "reset", "data": custom_reset()}))["type"],
        "observation"
    );
    let (_, r) = post(s.addr, "/reset", &custom_reset());
    let id = r["metadata"]["session_id"].as_str().unwrap().to_string();
    let started = Instant::now();
    let msgs = ws.drain_until_closed();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(msgs.len(), 1, "{msgs:?}");
    assert_eq!(msgs[0]["data"]["code"], "SESSION_ERROR");
    assert!(
        msgs[0]["data"]["message"]
            .as_str()
            .unwrap()
            .contains("idle")
    );
    s.wait_sessions(0, Duration::from_secs(5));
    let (status, _) = post(
        s.addr,
        "/step",
        &json!({"session_id": id, "action": {"code": "1"}}),
    );
    assert_eq!(status, 404);
}

#[test]
fn a_step_past_its_limit_ends_the_session() {
    let config = fathom_env::server::ServerConfig {
        step_timeout: Duration::from_millis(700),
        ..serving::config(4)
    };
    let mut sandbox = common::sandbox_config();
    sandbox.step_timeout = Duration::from_secs(3);
    let s = TestServer::start(config, sandbox, Arc::new(FixedSubLm("x".into())));
    let mut ws = Ws::connect(s.addr, "");
    assert_eq!(
        ws.call(&json!({"type": "reset", "data": custom_reset()}))["type"],
        "observation"
    );
    ws.send(&json!({"type": "step", "data": {"code": "while True:\n    pass"}}));
    let msgs = ws.drain_until_closed();
    assert_eq!(msgs.len(), 1, "{msgs:?}");
    assert_eq!(msgs[0]["data"]["code"], "SESSION_ERROR");
    assert!(
        msgs[0]["data"]["message"]
            .as_str()
            .unwrap()
            .contains("ran past its 0.7 s limit")
    );
    s.wait_sessions(0, Duration::from_secs(5));

    let (_, r) = post(s.addr, "/reset", &custom_reset());
    let id = r["metadata"]["session_id"].as_str().unwrap().to_string();
    let (status, body) = post(
        s.addr,
        "/step",
        &json!({"session_id": id, "action": {"code": "while True:\n    pass"}}),
    );
    assert_eq!(status, 504, "{body}");
    s.wait_sessions(0, Duration::from_secs(5));
    healthy(&s);
}

#[test]
fn a_websocket_attaches_to_an_http_session() {
    let s = server(4);
    let (_, r) = post(s.addr, "/reset", &custom_reset());
    let id = r["metadata"]["session_id"].as_str().unwrap().to_string();
    let mut ws = Ws::connect(s.addr, &format!("?session_id={id}"));
    let r = ws.call(&json!({"type": "step", "data": {"code": "print(len(context))"}}));
    assert_eq!(r["data"]["observation"]["text"], "Output:\n36");
    let mut second = Ws::connect(s.addr, &format!("?session_id={id}"));
    let refused = second.drain_until_closed();
    assert!(
        refused[0]["data"]["message"]
            .as_str()
            .unwrap()
            .contains("already has an attached WebSocket")
    );
    ws.send(&json!({"type": "close"}));
    ws.drain_until_closed();
    let (status, st) = get(s.addr, &format!("/state?session_id={id}"));
    assert_eq!((status, st["step_count"].clone()), (200, json!(1)));
    assert_eq!(s.sessions().0, 1);
}
