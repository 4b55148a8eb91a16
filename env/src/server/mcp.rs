//! The MCP endpoint, to the extent OpenEnv's clients and validator use it: JSON-RPC 2.0 over
//! `POST /mcp` and WebSocket `mcp` messages, with OpenEnv's session methods
//! (`openenv/session/create`, `openenv/session/close`). The environment exposes no MCP
//! tools, so `tools/list` and `tools/call` answer OpenEnv's own error for such environments.
//! Every failure is a JSON-RPC error object, never an HTTP error.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde::Deserialize;
use serde_json::{Value, json};

use super::episode::EnvSession;
use super::sessions::{Kind, Refusal};
use super::{App, fresh_id};
use crate::wire;

/// JSON-RPC error codes.
const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const METHOD_NOT_FOUND: i64 = -32601;
const INVALID_PARAMS: i64 = -32602;
const INTERNAL_ERROR: i64 = -32603;
const SERVER_ERROR: i64 = -32000;

/// A JSON-RPC 2.0 request.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RpcRequest {
    jsonrpc: String,
    method: String,
    #[serde(default)]
    params: serde_json::Map<String, Value>,
    #[serde(default)]
    id: Option<Value>,
}

impl wire::Shape for RpcRequest {
    const OBJECTS: &'static [&'static str] = &[""];
}

fn error(id: Option<&Value>, code: i64, message: impl Into<String>, data: Option<Value>) -> Value {
    let mut err = json!({"code": code, "message": message.into()});
    if let Some(data) = data {
        err["data"] = data;
    }
    json!({"jsonrpc": "2.0", "id": id.cloned().unwrap_or(Value::Null), "error": err})
}

fn success(id: Option<&Value>, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id.cloned().unwrap_or(Value::Null), "result": result})
}

/// Answers a JSON-RPC request given as bytes (`POST /mcp`) from `client`.
pub(crate) fn handle_bytes(
    app: &App,
    bytes: &[u8],
    current: Option<&str>,
    client: IpAddr,
) -> Value {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(v) => handle(app, v, current, client),
        Err(e) => error(None, PARSE_ERROR, format!("Parse error: {e}"), None),
    }
}

/// Answers a JSON-RPC request from `client`; `current` is the WebSocket session it came
/// through, if any.
pub(crate) fn handle(app: &App, request: Value, current: Option<&str>, client: IpAddr) -> Value {
    let id = request.get("id").cloned();
    let req: RpcRequest = match wire::from_value(request) {
        Ok(r) => r,
        Err(e) => {
            return error(
                id.as_ref(),
                INVALID_REQUEST,
                format!("Invalid request: {}", e.msg),
                None,
            );
        }
    };
    let id = req.id.as_ref();
    if req.jsonrpc != "2.0" {
        return error(
            id,
            INVALID_REQUEST,
            "Invalid request: jsonrpc must be \"2.0\"",
            None,
        );
    }
    if !matches!(
        id,
        None | Some(Value::Null | Value::String(_) | Value::Number(_))
    ) {
        return error(
            id,
            INVALID_REQUEST,
            "Invalid request: id must be a string or a number",
            None,
        );
    }
    match req.method.as_str() {
        "openenv/session/create" => {
            if let Some(current) = current {
                return success(id, json!({"session_id": current}));
            }
            let env = EnvSession::new(app.services.clone(), Arc::clone(&app.composite));
            let session_id = match fresh_id() {
                Ok(s) => s,
                Err(e) => return error(id, INTERNAL_ERROR, e.to_string(), None),
            };
            match app.registry.open(session_id, Kind::Http, env, client) {
                Ok(cell) => {
                    tracing::info!(session = %cell.id, "HTTP session opened over MCP");
                    success(id, json!({"session_id": cell.id}))
                }
                Err(refusal) => {
                    let data = match refusal {
                        Refusal::Full { active, max } => {
                            json!({"active_sessions": active, "max_sessions": max})
                        }
                        Refusal::ClientShare {
                            held,
                            max,
                            active,
                            total,
                            ..
                        } => json!({
                            "active_sessions": active,
                            "max_sessions": total,
                            "client_sessions": held,
                            "max_sessions_per_client": max,
                        }),
                    };
                    error(id, SERVER_ERROR, refusal.to_string(), Some(data))
                }
            }
        }
        "openenv/session/close" => {
            let Some(Value::String(target)) = req.params.get("session_id") else {
                return error(
                    id,
                    INVALID_PARAMS,
                    "Invalid params - 'session_id' is required",
                    None,
                );
            };
            if current == Some(target.as_str()) {
                return error(
                    id,
                    INVALID_REQUEST,
                    "Cannot close active WebSocket-managed session via MCP method",
                    None,
                );
            }
            let Some(cell) = app.registry.http(target) else {
                return error(
                    id,
                    INVALID_PARAMS,
                    format!("Unknown session_id: {target}"),
                    None,
                );
            };
            if cell.attached.load(Ordering::SeqCst) {
                cell.pending_close.store(true, Ordering::SeqCst);
                return success(
                    id,
                    json!({"session_id": target, "closed": false, "closing": true}),
                );
            }
            if let Some(cell) = app.registry.close(target) {
                tokio::task::spawn_blocking(move || drop(cell));
            }
            success(id, json!({"session_id": target, "closed": true}))
        }
        "tools/list" | "tools/call" => {
            error(id, INTERNAL_ERROR, "Environment does not support MCP", None)
        }
        other => error(
            id,
            METHOD_NOT_FOUND,
            format!("Method not found: {other}"),
            None,
        ),
    }
}
