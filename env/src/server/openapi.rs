//! The OpenAPI document (`/openapi.json`) and the JSON Schemas of `/schema`, both generated
//! from the wire types by `utoipa`, so what the server documents is what it parses and sends.
//!
//! `/schema` gives each of action, observation and state as a self-contained JSON Schema
//! (draft 2020-12, which OpenAPI 3.1's schema objects are): the schema itself with every
//! component it references under `$defs`.
//!
//! The record types (tasks, messages, steps, trajectories) are `fathom_rewards::record`'s own,
//! whose `schema` feature derives their schemas. The OpenEnv integration test validates every
//! observation and state the server sends against `/schema`, so the record schemas are closed
//! ([`CloseRecords`]) as the wire's request types are: a field serde writes that a schema does
//! not describe fails that test instead of passing unnoticed.
//!
//! What the derive cannot say, [`contract`] writes into the document: an action is exactly
//! one of its kinds (`oneOf`), an HTTP reset names its task one way with the index bounded
//! by its split's length, the bounds of `timeout_s` and `request_id`, that `POST /mcp` takes
//! any JSON and answers JSON-RPC errors with 200 (OpenEnv's convention), and, when the server
//! has a token, the bearer scheme and its 401 on every route but `/health`. Integers get the
//! bounds of their Rust types. The schemathesis test (`tests/fuzz.rs`) checks that the server
//! answers exactly what this document says.

use std::collections::BTreeMap;

use fathom_rewards::record;
use serde_json::{Value, json};
use utoipa::openapi::schema::{AdditionalProperties, Schema};
use utoipa::openapi::{OpenApi as Document, RefOr};
use utoipa::{Modify, OpenApi};

use super::ServerConfig;
use super::http::{
    CapacityBody, ErrorBody, HealthBody, MetadataBody, SchemaBody, ValidationErrorBody,
};
use crate::tasks;
use crate::wire::{self, MAX_EPISODE_ID_CHARS, MAX_REQUEST_ID_CHARS};

/// The server's OpenAPI document.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Fathom RLM environment (OpenEnv HTTP API)",
        version = "1.0.0",
        description = "OpenEnv-compatible server for Fathom's RLM environment: a sandboxed \
            Python REPL holding a long document as `context`. The WebSocket session at `/ws` \
            (OpenEnv's `reset`/`step`/`state`/`close` messages) is described in the README."
    ),
    paths(
        super::http::health,
        super::http::metadata,
        super::http::schema,
        super::http::sessions,
        super::http::reset,
        super::http::step,
        super::http::state,
        super::http::mcp,
    ),
    components(schemas(
        wire::ResetParams,
        wire::ActionParams,
        wire::StepParams,
        wire::StepResponse,
        wire::ObservationBody,
        wire::StateBody,
        wire::Score,
        wire::ComponentScore,
        wire::FieldError,
        wire::LlmMode,
        wire::WsError,
        wire::ErrorCode,
        wire::LlmRequest,
        wire::LlmResult,
        record::Split,
        record::Family,
        record::Span,
        record::Task,
        record::Role,
        record::Message,
        record::Action,
        record::ExecOutput,
        record::LlmCall,
        record::Access,
        record::AccessKind,
        record::Step,
        record::EndReason,
        record::Trajectory,
        HealthBody,
        MetadataBody,
        CapacityBody,
        SchemaBody,
        ErrorBody,
        ValidationErrorBody,
    )),
    modifiers(&CloseRecords)
)]
pub struct ApiDoc;

/// The record structs whose schemas [`CloseRecords`] closes. `Access` is not among them: it
/// flattens the tagged `AccessKind` (an `allOf` of the two), where closing either part would
/// reject the other's fields.
const CLOSED_RECORDS: [&str; 7] = [
    "Span",
    "Task",
    "Message",
    "ExecOutput",
    "LlmCall",
    "Step",
    "Trajectory",
];

/// Sets `additionalProperties: false` on the [`CLOSED_RECORDS`]. utoipa closes a schema only
/// for serde's `deny_unknown_fields`, which would also change how records parse (and does not
/// combine with `Access`'s `flatten`), so the record types leave it out and the document
/// closes their schemas here instead.
struct CloseRecords;

impl Modify for CloseRecords {
    fn modify(&self, doc: &mut Document) {
        let Some(components) = doc.components.as_mut() else {
            return;
        };
        for name in CLOSED_RECORDS {
            if let Some(RefOr::T(Schema::Object(object))) = components.schemas.get_mut(name) {
                object.additional_properties =
                    Some(Box::new(AdditionalProperties::FreeForm(false)));
            }
        }
    }
}

/// The OpenAPI document of a server with `config`, as JSON.
pub(crate) fn document_json(config: &ServerConfig) -> String {
    document(config.token.is_some()).to_string()
}

/// The OpenAPI document, with the [`contract`] written in; `auth` declares the bearer token.
pub fn document(auth: bool) -> Value {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_else(
        |e| json!({"openapi": "3.1.0", "info": {"title": "fathom", "version": "1.0.0"}, "x-error": e.to_string()}),
    );
    contract(&mut doc, auth);
    doc
}

/// `{"action": …, "observation": …, "state": …}`: self-contained JSON Schemas.
pub fn json_schemas() -> Value {
    let doc = document(false);
    let components = doc
        .pointer("/components/schemas")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let standalone = |name: &str| -> Value {
        let mut defs = BTreeMap::new();
        collect_refs(&components, name, &mut defs);
        let mut root = rewrite_refs(components.get(name).cloned().unwrap_or(Value::Null));
        defs.remove(name);
        if let Value::Object(map) = &mut root {
            map.insert(
                "$schema".into(),
                json!("https://json-schema.org/draft/2020-12/schema"),
            );
            map.insert("title".into(), json!(name));
            if !defs.is_empty() {
                let defs: serde_json::Map<String, Value> = defs
                    .into_iter()
                    .map(|(k, v)| (k, rewrite_refs(v)))
                    .collect();
                map.insert("$defs".into(), Value::Object(defs));
            }
        }
        root
    };
    json!({
        "action": standalone("Action"),
        "observation": standalone("Observation"),
        "state": standalone("State"),
    })
}

const PREFIX: &str = "#/components/schemas/";

/// Adds `name` and every component it references, transitively, to `out`.
fn collect_refs(
    components: &serde_json::Map<String, Value>,
    name: &str,
    out: &mut BTreeMap<String, Value>,
) {
    if out.contains_key(name) {
        return;
    }
    let Some(schema) = components.get(name) else {
        return;
    };
    out.insert(name.to_string(), schema.clone());
    let mut refs = Vec::new();
    find_refs(schema, &mut refs);
    for r in refs {
        collect_refs(components, &r, out);
    }
}

fn find_refs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            for (k, v) in map {
                if k == "$ref"
                    && let Some(name) = v.as_str().and_then(|s| s.strip_prefix(PREFIX))
                {
                    out.push(name.to_string());
                } else {
                    find_refs(v, out);
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|i| find_refs(i, out)),
        _ => {}
    }
}

/// Points OpenAPI component references at `$defs`.
fn rewrite_refs(v: Value) -> Value {
    match v {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| {
                    let v = match (&*k, v) {
                        ("$ref", Value::String(s)) if s.starts_with(PREFIX) => {
                            Value::String(format!("#/$defs/{}", &s[PREFIX.len()..]))
                        }
                        (_, v) => rewrite_refs(v),
                    };
                    (k, v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(rewrite_refs).collect()),
        other => other,
    }
}

/// Writes into `doc` what the derived schemas cannot say (see the module docs).
fn contract(doc: &mut Value, auth: bool) {
    if let Some(schemas) = doc
        .pointer_mut("/components/schemas")
        .and_then(Value::as_object_mut)
    {
        for schema in schemas.values_mut() {
            bound_integers(schema);
        }
        schemas.insert("Action".into(), action_schema());
        schemas.insert("ResetRequest".into(), http_reset_schema());
        if let Some(step) = schemas.get_mut("StepRequest") {
            step_request(step);
        }
    }
    // As OpenEnv's, `POST /reset` takes an empty body (a random task).
    if let Some(body) = doc.pointer_mut("/paths/~1reset/post/requestBody") {
        body["required"] = json!(false);
    }
    session_links(doc);
    if let Some(mcp) = doc.pointer_mut("/paths/~1mcp/post") {
        mcp["requestBody"] = json!({
            "description": "A JSON-RPC 2.0 request: `{\"jsonrpc\": \"2.0\", \"method\", \"params\"?, \"id\"?}`. \
                As in OpenEnv (whose validator posts `{}` and expects 200), the route takes any body, \
                and every JSON-RPC failure (parse error, invalid request, unknown method, capacity) \
                is a JSON-RPC error object with status 200.",
            "required": false,
            "content": {"application/json": {"schema": {}}},
        });
    }
    if auth {
        declare_bearer(doc);
    }
}

/// Links from a reset's or step's session to the operations that use it (`metadata.session_id`
/// into `/step`, `/state` and `/reset`), so clients and fuzzers can follow a session.
fn session_links(doc: &mut Value) {
    let id = "$response.body#/metadata/session_id";
    let links = json!({
        "step": {
            "operationId": "step",
            "requestBody": {"session_id": id},
            "description": "A turn in the session: `session_id` is `metadata.session_id`.",
        },
        "state": {
            "operationId": "state",
            "parameters": {"session_id": id},
            "description": "The session's state.",
        },
        "reset": {
            "operationId": "reset",
            "requestBody": {"session_id": id},
            "description": "A new episode in the same session.",
        },
    });
    for path in [
        "/paths/~1reset/post/responses/200",
        "/paths/~1step/post/responses/200",
    ] {
        if let Some(response) = doc.pointer_mut(path) {
            response["links"] = links.clone();
        }
    }
}

/// The largest integer each Rust integer type holds, by the `format` utoipa writes.
fn bound_integers(v: &mut Value) {
    match v {
        Value::Object(map) => {
            let is_integer = match map.get("type") {
                Some(Value::String(t)) => t == "integer",
                Some(Value::Array(ts)) => ts.iter().any(|t| t == "integer"),
                _ => false,
            };
            if is_integer && !map.contains_key("maximum") {
                let unsigned = map
                    .get("minimum")
                    .and_then(Value::as_i64)
                    .is_some_and(|m| m >= 0);
                let max = match (map.get("format").and_then(Value::as_str), unsigned) {
                    (Some("int32"), true) => json!(u32::MAX),
                    (Some("int32"), false) => json!(i32::MAX),
                    (_, true) => json!(u64::MAX),
                    (_, false) => json!(i64::MAX),
                };
                if !unsigned && !map.contains_key("minimum") {
                    let min = match map.get("format").and_then(Value::as_str) {
                        Some("int32") => json!(i32::MIN),
                        _ => json!(i64::MIN),
                    };
                    map.insert("minimum".into(), min);
                }
                map.insert("maximum".into(), max);
            }
            for value in map.values_mut() {
                bound_integers(value);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(bound_integers),
        _ => {}
    }
}

/// The action kinds; exactly one is given (as a string), the others absent or null.
const ACTION_KINDS: [(&str, &str); 4] = [
    (
        "message",
        "The model's raw message, parsed as the in-process environment parses it.",
    ),
    ("code", "Code to run, as if written in a `repl` block."),
    ("answer", "A final answer, as if written in answer tags."),
    ("abort", "End the episode with this error message."),
];

/// `Action`: exactly one of `message`, `code`, `answer`, `abort` is a string; the others are
/// absent or null; `metadata` is accepted and ignored.
fn action_schema() -> Value {
    let mut properties = serde_json::Map::new();
    for (name, description) in ACTION_KINDS {
        properties.insert(
            name.into(),
            json!({"type": ["string", "null"], "description": description}),
        );
    }
    properties.insert(
        "metadata".into(),
        json!({"type": ["object", "null"], "description": "OpenEnv's action metadata; accepted and ignored."}),
    );
    let variants: Vec<Value> = ACTION_KINDS
        .iter()
        .map(|(given, _)| {
            let props: serde_json::Map<String, Value> = ACTION_KINDS
                .iter()
                .map(|(name, _)| {
                    let t = if name == given { "string" } else { "null" };
                    (name.to_string(), json!({"type": t}))
                })
                .collect();
            json!({"title": given, "required": [given], "properties": props})
        })
        .collect();
    json!({
        "type": "object",
        "description": "One assistant turn: exactly one of `message`, `code`, `answer` or `abort` \
            (a string; the others absent or null).",
        "properties": properties,
        "additionalProperties": false,
        "oneOf": variants,
    })
}

/// The fields that choose the task of a reset.
const TASK_FIELDS: [&str; 7] = [
    "seed",
    "split",
    "index",
    "task",
    "context",
    "task_prompt",
    "expected_answer",
];

/// One way to choose the task: `given` fields with their schemas, `required` among them;
/// every other task field absent or null.
fn reset_variant(title: &str, given: Value, required: &[&str]) -> Value {
    let mut props = given.as_object().cloned().unwrap_or_default();
    for field in TASK_FIELDS {
        props
            .entry(field.to_string())
            .or_insert_with(|| json!({"type": "null"}));
    }
    json!({"title": title, "required": required, "properties": props})
}

/// `ResetRequest` as `POST /reset` takes it: at most one way to choose the task (none: a
/// random seed); a split's index is below its length; `llm` is `server` (client-answered
/// `llm()` needs a WebSocket).
fn http_reset_schema() -> Value {
    let seed = json!({"type": "integer", "minimum": 0, "maximum": u64::MAX});
    let mut variants = vec![
        reset_variant("random", json!({}), &[]),
        reset_variant("seed", json!({"seed": seed}), &["seed"]),
    ];
    for split in [
        fathom_rewards::record::Split::Train,
        fathom_rewards::record::Split::Eval,
        fathom_rewards::record::Split::Heldout,
    ] {
        let name = tasks::split_name(split);
        variants.push(reset_variant(
            &format!("split {name}"),
            json!({
                "split": {"const": name},
                "index": {"type": "integer", "minimum": 0, "maximum": tasks::split_len(split) - 1},
            }),
            &["split", "index"],
        ));
    }
    variants.push(reset_variant(
        "task",
        json!({"task": {"$ref": format!("{PREFIX}Task")}}),
        &["task"],
    ));
    variants.push(reset_variant(
        "context",
        json!({
            "context": {"type": "string"},
            "task_prompt": {"type": "string"},
            "expected_answer": {"type": ["string", "null"]},
        }),
        &["context", "task_prompt"],
    ));
    let splits: Vec<Value> = [
        fathom_rewards::record::Split::Train,
        fathom_rewards::record::Split::Eval,
        fathom_rewards::record::Split::Heldout,
    ]
    .into_iter()
    .map(|s| {
        json!(format!(
            "{} ({} tasks)",
            tasks::split_name(s),
            tasks::split_len(s)
        ))
    })
    .collect();
    json!({
        "type": "object",
        "description": format!(
            "How to start an episode. Choose the task at most one way: `seed`; `split` with \
             `index` (below the split's length: {}); a whole `task`; or `context` with \
             `task_prompt` (and optionally `expected_answer`). With none, the task is generated \
             from a random seed. Null is the same as absent.",
            splits.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(", ")
        ),
        "properties": {
            "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": u64::MAX,
                "description": "Generate the task from this seed (outside the fixed splits)."},
            "split": {"oneOf": [{"$ref": format!("{PREFIX}Split")}, {"type": "null"}],
                "description": "A fixed split; needs `index`."},
            "index": {"type": ["integer", "null"], "minimum": 0,
                "maximum": tasks::split_len(fathom_rewards::record::Split::Train) - 1,
                "description": "Position in `split`, below its length."},
            "task": {"oneOf": [{"$ref": format!("{PREFIX}Task")}, {"type": "null"}],
                "description": "A whole task (one line of `xtask data`'s JSONL)."},
            "context": {"type": ["string", "null"],
                "description": "A document of your own, loaded as `context`; needs `task_prompt`."},
            "task_prompt": {"type": ["string", "null"], "description": "The question about `context`."},
            "expected_answer": {"type": ["string", "null"],
                "description": "The expected answer for `context`; when given, the final step is scored."},
            "episode_id": {"type": ["string", "null"], "minLength": 1,
                "maxLength": MAX_EPISODE_ID_CHARS,
                "description": "Your identifier for the episode; generated when absent."},
            "llm": {"enum": ["server", null],
                "description": "Who answers `llm()` calls: the server's sub-LM. (`client` exists \
                    only for WebSocket sessions, which can carry the calls back.)"},
            "session_id": {"type": ["string", "null"],
                "description": "Start the episode in this existing HTTP session instead of a new one."},
        },
        "additionalProperties": false,
        "oneOf": variants,
    })
}

/// `StepRequest`: `session_id` is required; `timeout_s` is positive; `request_id` is at most
/// 255 characters.
fn step_request(step: &mut Value) {
    step["required"] = json!(["action", "session_id"]);
    let props = &mut step["properties"];
    props["session_id"] = json!({
        "type": "string",
        "description": "The session `POST /reset` returned in `metadata.session_id`.",
    });
    props["timeout_s"] = json!({
        "type": ["number", "null"],
        "exclusiveMinimum": 0,
        "description": "Give up on the step after this many seconds (at most the server's step \
            limit); the session is then ended (504).",
    });
    props["request_id"] = json!({
        "type": ["string", "null"],
        "maxLength": MAX_REQUEST_ID_CHARS,
        "description": "Your identifier for the request (logged).",
    });
}

/// Declares the bearer token: the scheme, a security requirement and a 401 response on every
/// operation but `GET /health`.
fn declare_bearer(doc: &mut Value) {
    doc["components"]["securitySchemes"] = json!({
        "bearer": {
            "type": "http",
            "scheme": "bearer",
            "description": "The server's access token (`xtask serve --token-file`).",
        }
    });
    let Some(paths) = doc.get_mut("paths").and_then(Value::as_object_mut) else {
        return;
    };
    for (path, item) in paths.iter_mut() {
        if path == super::auth::OPEN_ROUTE {
            continue;
        }
        let Some(item) = item.as_object_mut() else {
            continue;
        };
        for operation in item.values_mut() {
            operation["security"] = json!([{"bearer": []}]);
            operation["responses"]["401"] = json!({
                "description": "No access token, or a wrong one",
                "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
                "content": {"application/json": {"schema": {"$ref": format!("{PREFIX}ErrorBody")}}},
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openapi_has_the_simulation_routes_and_a_version() {
        let doc = document(false);
        assert_eq!(doc["info"]["version"], "1.0.0");
        for path in [
            "/reset",
            "/step",
            "/state",
            "/health",
            "/metadata",
            "/schema",
            "/mcp",
        ] {
            assert!(doc["paths"].get(path).is_some(), "{path} missing");
        }
    }

    #[test]
    fn schemas_are_self_contained() {
        let s = json_schemas();
        for key in ["action", "observation", "state"] {
            let mut refs = Vec::new();
            let text = s[key].to_string();
            assert!(!text.contains(PREFIX), "{key} still points at components");
            find_refs(&s[key], &mut refs);
            for r in text.split("\"#/$defs/").skip(1) {
                let name = r.split('"').next().unwrap();
                assert!(
                    s[key]["$defs"].get(name).is_some(),
                    "{key}: $defs lacks {name}"
                );
            }
        }
        let props = &s["observation"]["properties"];
        for field in [
            "messages",
            "text",
            "score",
            "trajectory",
            "step",
            "end_reason",
        ] {
            assert!(props.get(field).is_some(), "observation lacks {field}");
        }
        assert!(s["action"]["properties"].get("code").is_some());
        assert_eq!(s["action"]["additionalProperties"], json!(false));
    }

    #[test]
    fn the_contract_is_written_in() {
        let doc = document(false);
        let action = &doc["components"]["schemas"]["Action"];
        assert_eq!(action["oneOf"].as_array().unwrap().len(), 4);
        let reset = &doc["components"]["schemas"]["ResetRequest"];
        let titles: Vec<&str> = reset["oneOf"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["title"].as_str().unwrap())
            .collect();
        assert_eq!(
            titles,
            [
                "random",
                "seed",
                "split train",
                "split eval",
                "split heldout",
                "task",
                "context"
            ]
        );
        assert_eq!(
            reset["oneOf"][3]["properties"]["index"]["maximum"],
            json!(199)
        );
        assert_eq!(reset["properties"]["llm"]["enum"], json!(["server", null]));
        let step = &doc["components"]["schemas"]["StepRequest"];
        assert_eq!(step["required"], json!(["action", "session_id"]));
        assert_eq!(
            step["properties"]["timeout_s"]["exclusiveMinimum"],
            json!(0)
        );
        assert_eq!(
            doc["paths"]["/reset"]["post"]["requestBody"]["required"],
            json!(false)
        );
        assert_eq!(
            doc["paths"]["/mcp"]["post"]["requestBody"]["content"]["application/json"]["schema"],
            json!({})
        );
        assert!(doc["paths"]["/reset"]["post"]["responses"]["200"]["links"]["step"].is_object());
        assert!(doc["components"].get("securitySchemes").is_none());
        assert!(doc["paths"]["/reset"]["post"]["responses"]["401"].is_null());
        // Every integer has both bounds.
        fn unbounded(v: &Value) -> usize {
            match v {
                Value::Object(m) => {
                    let t = m.get("type");
                    let integer = t.is_some_and(|t| {
                        t == "integer"
                            || t.as_array().is_some_and(|t| t.contains(&json!("integer")))
                    });
                    let own = integer && !(m.contains_key("minimum") && m.contains_key("maximum"));
                    usize::from(own) + m.values().map(unbounded).sum::<usize>()
                }
                Value::Array(items) => items.iter().map(unbounded).sum(),
                _ => 0,
            }
        }
        assert_eq!(unbounded(&doc), 0);

        let doc = document(true);
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["type"],
            "http"
        );
        for (path, item) in doc["paths"].as_object().unwrap() {
            for op in item.as_object().unwrap().values() {
                let guarded = op["responses"].get("401").is_some();
                assert_eq!(guarded, path != "/health", "{path}");
                assert_eq!(op.get("security").is_some(), path != "/health", "{path}");
            }
        }
    }

    #[test]
    fn record_schemas_are_closed() {
        let doc = document(false);
        for name in CLOSED_RECORDS {
            let schema = &doc["components"]["schemas"][name];
            assert!(
                schema["properties"].is_object(),
                "{name} is not an object schema"
            );
            assert_eq!(schema["additionalProperties"], json!(false), "{name}");
        }
    }
}
