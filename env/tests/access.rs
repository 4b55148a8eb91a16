//! Who may use the server: the access token (HTTP routes, the WebSocket, MCP and the Rust
//! client: without the token every request but `GET /health` gets 401 and no session opens)
//! and per-client fairness (one address holds at most its share of the sessions, over HTTP,
//! the WebSocket and MCP, while other addresses still get theirs). Several clients are
//! played from different loopback addresses (127.0.0.x).

mod common;
mod serving;

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use fathom_env::client::{ClientConfig, RemoteEnv, ServerPool};
use fathom_env::env::{AgentAction, Environment, ResetRequest};
use fathom_env::server::{AccessToken, ServerConfig};
use fathom_env::sublm::FixedSubLm;
use serde_json::{Value, json};
use serving::{TestServer, Ws, request, request_from};

const TOKEN: &str = "fathom-test-token-7f3a";

fn server(config: ServerConfig) -> TestServer {
    TestServer::start(
        config,
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

fn local(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
}

fn post_json(
    s: &TestServer,
    from: IpAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> (u16, Value) {
    let mut h = vec![("Content-Type", "application/json")];
    h.extend_from_slice(headers);
    request_from(from, s.addr, "POST", path, &h, body.to_string().as_bytes())
}

/// The status of a WebSocket handshake that the server refused.
fn refused_status(e: tungstenite::Error) -> u16 {
    match e {
        tungstenite::Error::Http(response) => response.status().as_u16(),
        other => panic!("expected an HTTP refusal, got {other:?}"),
    }
}

#[test]
fn without_the_token_nothing_but_health_answers_and_no_session_opens() {
    let s = server(ServerConfig {
        token: Some(AccessToken::new(TOKEN).unwrap()),
        ..serving::config(4)
    });
    let me = local(1);
    let good = format!("Bearer {TOKEN}");
    let good = [("Authorization", good.as_str())];
    let longer = format!("Bearer {TOKEN}x");

    // Liveness stays open.
    let (status, body) = request(s.addr, "GET", "/health", &[], b"");
    assert_eq!((status, body), (200, json!({"status": "healthy"})));

    // HTTP: no token, a wrong token, another scheme: 401 naming the problem.
    for (headers, says) in [
        (vec![], "needs an access token"),
        (
            vec![("Authorization", "Bearer not-the-token")],
            "token is wrong",
        ),
        (
            vec![("Authorization", "Basic ZmF0aG9tOnRva2Vu")],
            "token is wrong",
        ),
        (vec![("Authorization", longer.as_str())], "token is wrong"),
    ] {
        for (method, path, body) in [
            ("POST", "/reset", custom_reset()),
            (
                "POST",
                "/step",
                json!({"action": {"code": "1"}, "session_id": "x"}),
            ),
            ("GET", "/state", Value::Null),
            ("GET", "/sessions", Value::Null),
            ("GET", "/openapi.json", Value::Null),
            ("GET", "/schema", Value::Null),
            (
                "POST",
                "/mcp",
                json!({"jsonrpc": "2.0", "method": "openenv/session/create", "id": 1}),
            ),
        ] {
            let bytes = if body.is_null() {
                Vec::new()
            } else {
                body.to_string().into_bytes()
            };
            let (status, answer) = request_from(me, s.addr, method, path, &headers, &bytes);
            assert_eq!(status, 401, "{method} {path} with {headers:?}: {answer}");
            let detail = answer["detail"].as_str().unwrap_or_default();
            assert!(detail.contains(says), "{method} {path}: {detail}");
        }
        // WebSocket: refused at the handshake, before any session.
        let err = Ws::connect_with(me, s.addr, &headers)
            .err()
            .expect("the handshake is refused");
        assert_eq!(refused_status(err), 401, "/ws with {headers:?}");
    }
    assert_eq!(s.sessions(), (0, 4), "a refused request opened a session");

    // With the token: the document declares the scheme, HTTP and WebSocket sessions work.
    let (status, doc) = request_from(me, s.addr, "GET", "/openapi.json", &good, b"");
    assert_eq!(status, 200);
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    assert!(doc["paths"]["/reset"]["post"]["responses"]["401"].is_object());
    assert!(doc["paths"]["/health"]["get"]["responses"]["401"].is_null());
    let (status, first) = post_json(&s, me, "/reset", &good, &custom_reset());
    assert_eq!(status, 200, "{first}");
    let id = first["metadata"]["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, _) = post_json(
        &s,
        me,
        "/step",
        &[],
        &json!({"action": {"answer": "4417"}, "session_id": id}),
    );
    assert_eq!(status, 401, "a session id is no substitute for the token");
    let (status, last) = post_json(
        &s,
        me,
        "/step",
        &good,
        &json!({"action": {"answer": "4417"}, "session_id": id}),
    );
    assert_eq!((status, last["done"].clone()), (200, json!(true)), "{last}");
    let mut ws = Ws::connect_with(me, s.addr, &good).expect("handshake with the token");
    let obs = ws.call(&json!({"type": "reset", "data": custom_reset()}));
    assert_eq!(obs["type"], "observation", "{obs}");
    ws.send(&json!({"type": "close"}));
    ws.drain_until_closed();
    let rpc = post_json(
        &s,
        me,
        "/mcp",
        &good,
        &json!({"jsonrpc": "2.0", "method": "openenv/session/close", "params": {"session_id": id}, "id": 2}),
    )
    .1;
    assert_eq!(rpc["result"]["closed"], true, "{rpc}");
    s.wait_sessions(0, Duration::from_secs(10));

    // The Rust client: sends the configured token; without it (or with a wrong one) the
    // reset fails naming the cause.
    let pool = |token: Option<&str>| {
        ServerPool::with_config(
            &[s.url()],
            ClientConfig {
                token: token.map(str::to_string),
                ..ClientConfig::default()
            },
        )
        .unwrap()
    };
    let mut env = RemoteEnv::new(pool(Some(TOKEN)));
    let obs = env
        .reset(ResetRequest::Custom {
            document: "The vault code is 4417.".into(),
            question: "What is the vault code?".into(),
            answer: Some("4417".into()),
        })
        .expect("a reset with the token");
    assert!(!obs.done);
    let obs = env.step(AgentAction::Answer("4417".into())).unwrap();
    assert!(obs.done);
    drop(env);
    for (token, says) in [
        (None, "needs an access token (401)"),
        (Some("wrong-token"), "refused the access token (401)"),
    ] {
        let mut env = RemoteEnv::new(pool(token));
        let err = env.reset(ResetRequest::Seed(1)).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    }
    assert!(matches!(
        ServerPool::with_config(
            &[s.url()],
            ClientConfig {
                token: Some("has space".into()),
                ..ClientConfig::default()
            }
        ),
        Err(fathom_env::client::ClientError::BadToken)
    ));
    s.wait_sessions(0, Duration::from_secs(10));
}

#[test]
fn one_address_holds_at_most_its_share_of_the_sessions() {
    // 6 sessions, half of them per address: 3.
    let s = server(ServerConfig {
        max_client_share: 0.5,
        ..serving::config(6)
    });
    let (a, b, c) = (local(1), local(2), local(3));

    // Address a: two HTTP sessions and a WebSocket fill its share.
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (status, body) = post_json(&s, a, "/reset", &[], &custom_reset());
        assert_eq!(status, 200, "{body}");
        ids.push(body["metadata"]["session_id"].as_str().unwrap().to_string());
    }
    let mut ws_a = Ws::connect_with(a, s.addr, &[]).unwrap();
    let obs = ws_a.call(&json!({"type": "reset", "data": custom_reset()}));
    assert_eq!(obs["type"], "observation", "{obs}");
    let (status, counts) = request_from(a, s.addr, "GET", "/sessions", &[], b"");
    assert_eq!(status, 200);
    assert_eq!(
        counts,
        json!({"active_sessions": 3, "max_sessions": 6, "client_sessions": 3, "max_sessions_per_client": 3})
    );

    // A fourth from a: 429 over HTTP, CAPACITY_REACHED on a socket, a JSON-RPC error over
    // MCP; each names the client's share.
    let (status, body) = post_json(&s, a, "/reset", &[], &custom_reset());
    assert_eq!(status, 429, "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains("Client 127.0.0.1 holds 3 of the 3 sessions"),
        "{detail}"
    );
    let mut refused = Ws::connect_with(a, s.addr, &[]).unwrap();
    refused.send(&json!({"type": "reset"}));
    let seen = refused.drain_until_closed();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0]["data"]["code"], "CAPACITY_REACHED", "{seen:?}");
    assert!(
        seen[0]["data"]["message"]
            .as_str()
            .unwrap()
            .contains("holds 3 of the 3 sessions"),
        "{seen:?}"
    );
    let rpc = post_json(
        &s,
        a,
        "/mcp",
        &[],
        &json!({"jsonrpc": "2.0", "method": "openenv/session/create", "id": 7}),
    )
    .1;
    assert_eq!(rpc["error"]["code"], -32000, "{rpc}");
    assert_eq!(
        (
            rpc["error"]["data"]["client_sessions"].clone(),
            rpc["error"]["data"]["max_sessions_per_client"].clone()
        ),
        (json!(3), json!(3)),
        "{rpc}"
    );
    assert_eq!(s.sessions(), (3, 6));

    // Address b still gets its share, over both transports.
    let (status, body) = post_json(&s, b, "/reset", &[], &custom_reset());
    assert_eq!(status, 200, "{body}");
    let mut ws_b = Ws::connect_with(b, s.addr, &[]).unwrap();
    let obs = ws_b.call(&json!({"type": "reset", "data": custom_reset()}));
    assert_eq!(obs["type"], "observation", "{obs}");
    let rpc = post_json(
        &s,
        b,
        "/mcp",
        &[],
        &json!({"jsonrpc": "2.0", "method": "openenv/session/create", "id": 8}),
    )
    .1;
    assert!(rpc["result"]["session_id"].is_string(), "{rpc}");
    assert_eq!(s.sessions(), (6, 6));

    // The server is full: address c, within its share, is refused for capacity (503).
    let (status, body) = post_json(&s, c, "/reset", &[], &custom_reset());
    assert_eq!(status, 503, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .starts_with("Server at capacity: 6/6"),
        "{body}"
    );
    let mut full = Ws::connect_with(c, s.addr, &[]).unwrap();
    full.send(&json!({"type": "reset"}));
    let seen = full.drain_until_closed();
    assert_eq!(seen[0]["data"]["code"], "CAPACITY_REACHED", "{seen:?}");

    // Once a frees a session (its socket closes, an HTTP session is closed over MCP), it may
    // open one again.
    ws_a.send(&json!({"type": "close"}));
    ws_a.drain_until_closed();
    let rpc = post_json(
        &s,
        a,
        "/mcp",
        &[],
        &json!({"jsonrpc": "2.0", "method": "openenv/session/close", "params": {"session_id": ids[0]}, "id": 9}),
    )
    .1;
    assert_eq!(rpc["result"]["closed"], true, "{rpc}");
    s.wait_sessions(4, Duration::from_secs(10));
    let (status, body) = post_json(&s, a, "/reset", &[], &custom_reset());
    assert_eq!(status, 200, "{body}");
    let mut again = Ws::connect_with(a, s.addr, &[]).unwrap();
    let obs = again.call(&json!({"type": "reset", "data": custom_reset()}));
    assert_eq!(obs["type"], "observation", "{obs}");
    assert_eq!(s.sessions(), (6, 6));
}

#[test]
fn the_share_is_validated_and_rounds_down_to_at_least_one() {
    let config = |share: f64, max: usize| ServerConfig {
        max_client_share: share,
        ..serving::config(max)
    };
    assert_eq!(config(1.0, 32).max_sessions_per_client(), 32);
    assert_eq!(config(0.5, 7).max_sessions_per_client(), 3);
    assert_eq!(config(0.01, 4).max_sessions_per_client(), 1);
    for bad in [0.0, -0.5, 1.5, f64::NAN] {
        let pool = common::pool();
        let err = fathom_env::server::EnvServer::new(
            fathom_env::env::Services::new(pool, Arc::new(FixedSubLm(String::new()))),
            fathom_rewards::Composite::default(),
            config(bad, 4),
        )
        .err()
        .expect("refused");
        assert!(err.to_string().contains("max_client_share"), "{err}");
    }
}
