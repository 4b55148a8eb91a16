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

use std::collections::BTreeMap;

use fathom_rewards::record;
use serde_json::{Value, json};
use utoipa::openapi::schema::{AdditionalProperties, Schema};
use utoipa::openapi::{OpenApi as Document, RefOr};
use utoipa::{Modify, OpenApi};

use super::http::{
    CapacityBody, ErrorBody, HealthBody, MetadataBody, SchemaBody, ValidationErrorBody,
};
use crate::wire;

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

/// The OpenAPI document as JSON.
pub(crate) fn document_json() -> String {
    ApiDoc::openapi()
        .to_json()
        .unwrap_or_else(|e| json!({"openapi": "3.1.0", "info": {"title": "fathom", "version": "1.0.0"}, "x-error": e.to_string()}).to_string())
}

/// `{"action": …, "observation": …, "state": …}`: self-contained JSON Schemas.
pub fn json_schemas() -> Value {
    let doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or(Value::Null);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openapi_has_the_simulation_routes_and_a_version() {
        let doc: Value = serde_json::from_str(&document_json()).unwrap();
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
    fn record_schemas_are_closed() {
        let doc: Value = serde_json::from_str(&document_json()).unwrap();
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
