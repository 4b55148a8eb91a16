//! Strict JSON parsing of requests: errors locate the offending field (`loc`) and name it in
//! the message, in the style of FastAPI's 422 `detail` items, and a struct is only ever read
//! from a JSON object (serde's derive would also take an array of its fields).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{ActionParams, LlmResult, ResetParams, StepParams};

/// A validation error, in the style of FastAPI's 422 `detail` items.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FieldError {
    /// Where: field names from the request's root (`["body", "action", "code"]`).
    pub loc: Vec<String>,
    /// What is wrong, naming the field.
    pub msg: String,
    /// The kind: `json_invalid`, `missing`, `extra_forbidden`, `type_error`, `value_error`.
    #[serde(rename = "type")]
    pub kind: String,
}

impl FieldError {
    fn new(loc: &[&str], kind: &str, msg: impl Into<String>) -> FieldError {
        FieldError {
            loc: loc.iter().map(|s| s.to_string()).collect(),
            msg: msg.into(),
            kind: kind.into(),
        }
    }

    /// A missing field.
    pub fn missing(loc: &[&str], msg: impl Into<String>) -> FieldError {
        FieldError::new(loc, "missing", msg)
    }

    /// A field with a bad value.
    pub fn value(loc: &[&str], msg: impl Into<String>) -> FieldError {
        FieldError::new(loc, "value_error", msg)
    }

    /// The same error located under `prefix` (e.g. `["body"]`); a message that starts with
    /// the field's path is rewritten to start with the new path.
    pub fn under(mut self, prefix: &[&str]) -> FieldError {
        let old = self.field();
        let mut loc: Vec<String> = prefix.iter().map(|s| s.to_string()).collect();
        loc.append(&mut self.loc);
        self.loc = loc;
        let new = self.field();
        let old_head = if old.is_empty() {
            "body: ".to_string()
        } else {
            format!("{old}: ")
        };
        if !new.is_empty()
            && let Some(rest) = self.msg.strip_prefix(&old_head)
        {
            self.msg = format!("{new}: {rest}");
        }
        self
    }

    /// `loc` joined with dots, without a leading `body`.
    pub fn field(&self) -> String {
        let skip = usize::from(self.loc.first().map(String::as_str) == Some("body"));
        self.loc[skip..].join(".")
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

/// Request types, with the places in their JSON that must be objects.
///
/// serde's derive also accepts a struct written as an array of its fields in order
/// (`[1, "id"]` for `{"seed": 1, "episode_id": "id"}`); requests must not be read that way,
/// so parsing first checks that every struct position holds an object.
pub trait Shape {
    /// Dotted paths of the struct-typed positions (`""` is the root; `*` is every element of
    /// an array).
    const OBJECTS: &'static [&'static str];

    /// An unknown field that serde passed over: types that embed record types (which do not
    /// deny unknown fields themselves) compare what was sent with what was read.
    fn unknown_field(&self, _sent: &serde_json::Value) -> Option<FieldError> {
        None
    }
}

impl Shape for ResetParams {
    const OBJECTS: &'static [&'static str] = &["", "task", "task.evidence.*"];

    /// A field of `task` (or of its evidence spans) that `Task` does not have.
    fn unknown_field(&self, sent: &serde_json::Value) -> Option<FieldError> {
        let task = self.task.as_ref()?;
        let read = serde_json::to_value(task).ok()?;
        first_unknown(sent.get("task")?, &read, &mut vec!["task".to_string()])
    }
}

/// The first key of an object in `sent` (recursively, through arrays) that `read`, the same
/// value parsed and written back, lacks.
fn first_unknown(
    sent: &serde_json::Value,
    read: &serde_json::Value,
    loc: &mut Vec<String>,
) -> Option<FieldError> {
    use serde_json::Value;
    match (sent, read) {
        (Value::Object(sent), Value::Object(read)) => {
            for (key, value) in sent {
                loc.push(key.clone());
                let found = match read.get(key) {
                    None => {
                        let field = loc.join(".");
                        Some(FieldError {
                            loc: loc.clone(),
                            msg: format!("{field}: unknown field `{key}`"),
                            kind: "extra_forbidden".into(),
                        })
                    }
                    Some(back) => first_unknown(value, back, loc),
                };
                loc.pop();
                if found.is_some() {
                    return found;
                }
            }
            None
        }
        (Value::Array(sent), Value::Array(read)) => {
            sent.iter().zip(read).enumerate().find_map(|(i, (s, r))| {
                loc.push(i.to_string());
                let found = first_unknown(s, r, loc);
                loc.pop();
                found
            })
        }
        _ => None,
    }
}

impl Shape for ActionParams {
    const OBJECTS: &'static [&'static str] = &[""];
}

impl Shape for StepParams {
    const OBJECTS: &'static [&'static str] = &["", "action"];
}

impl Shape for LlmResult {
    const OBJECTS: &'static [&'static str] = &[""];
}

/// Parses `bytes` as JSON into `T`, locating any error at the offending field.
///
/// Errors name the field in `msg` (`"action.code: invalid type: integer `5`, expected a
/// string"`), and `loc` holds its path.
pub fn parse_json<T: DeserializeOwned + Shape>(bytes: &[u8]) -> Result<T, FieldError> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| FieldError {
        loc: Vec::new(),
        msg: format!("body: {e}"),
        kind: "json_invalid".into(),
    })?;
    from_value(value)
}

/// Converts an already-parsed JSON value into `T`, locating errors as [`parse_json`] does.
///
/// Numbers written with a fraction of zero (`61.0`) are integers, as JSON Schema (and so the
/// OpenAPI document) counts them and as pydantic reads them; no request field is a float that
/// an integer could not also fill.
pub fn from_value<T: DeserializeOwned + Shape>(
    mut value: serde_json::Value,
) -> Result<T, FieldError> {
    integral_floats_to_integers(&mut value);
    check_objects(&value, T::OBJECTS)?;
    let parsed = serde_path_to_error::deserialize::<_, T>(&value).map_err(|err| {
        let text = err.inner().to_string();
        located(err.path(), kind_of(&text), &text)
    })?;
    match parsed.unknown_field(&value) {
        Some(e) => Err(e),
        None => Ok(parsed),
    }
}

/// Rewrites every number with a zero fraction that fits an `i64` or a `u64` as that integer.
fn integral_floats_to_integers(value: &mut serde_json::Value) {
    use serde_json::Value;
    match value {
        Value::Number(n) if !n.is_i64() && !n.is_u64() => {
            if let Some(f) = n.as_f64()
                && f.fract() == 0.0
            {
                // Casts saturate: only values that survive the round trip are exact.
                if (0.0..18_446_744_073_709_551_616.0).contains(&f) {
                    *value = Value::from(f as u64);
                } else if (-9_223_372_036_854_775_808.0..0.0).contains(&f) {
                    *value = Value::from(f as i64);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(integral_floats_to_integers),
        Value::Object(map) => map.values_mut().for_each(integral_floats_to_integers),
        _ => {}
    }
}

/// Fails at the first struct position of `value` that holds neither an object nor null
/// (the root must be an object).
fn check_objects(value: &serde_json::Value, objects: &[&str]) -> Result<(), FieldError> {
    use serde_json::Value;
    for path in objects {
        let mut found: Vec<(Vec<String>, &Value)> = vec![(Vec::new(), value)];
        for seg in path.split('.').filter(|s| !s.is_empty()) {
            found = found
                .into_iter()
                .flat_map(|(loc, v)| -> Vec<(Vec<String>, &Value)> {
                    let at = |name: String| {
                        let mut loc = loc.clone();
                        loc.push(name);
                        loc
                    };
                    match (seg, v) {
                        ("*", Value::Array(items)) => items
                            .iter()
                            .enumerate()
                            .map(|(i, x)| (at(i.to_string()), x))
                            .collect(),
                        (name, Value::Object(m)) => m
                            .get(name)
                            .map(|x| vec![(at(name.to_string()), x)])
                            .unwrap_or_default(),
                        _ => Vec::new(),
                    }
                })
                .collect();
        }
        for (loc, v) in found {
            let root = loc.is_empty();
            if v.is_object() || (v.is_null() && !root) {
                continue;
            }
            let what = match v {
                Value::Null => "null",
                Value::Bool(_) => "boolean",
                Value::Number(_) => "number",
                Value::String(_) => "string",
                Value::Array(_) => "array",
                Value::Object(_) => "object",
            };
            let field = if root {
                "body".to_string()
            } else {
                loc.join(".")
            };
            return Err(FieldError {
                loc,
                msg: format!("{field}: invalid type: {what}, expected an object"),
                kind: "type_error".into(),
            });
        }
    }
    Ok(())
}

/// The FastAPI-style kind of a serde data error, from its message.
fn kind_of(text: &str) -> &'static str {
    if text.starts_with("unknown field") {
        "extra_forbidden"
    } else if text.starts_with("missing field") {
        "missing"
    } else if text.starts_with("invalid type") {
        "type_error"
    } else {
        "value_error"
    }
}

/// A [`FieldError`] at `path`: unknown and missing fields are located at the field itself.
fn located(path: &serde_path_to_error::Path, kind: &str, text: &str) -> FieldError {
    let mut loc: Vec<String> = path
        .iter()
        .filter_map(|seg| match seg {
            serde_path_to_error::Segment::Seq { index } => Some(index.to_string()),
            serde_path_to_error::Segment::Map { key } => Some(key.clone()),
            serde_path_to_error::Segment::Enum { variant } => Some(variant.clone()),
            serde_path_to_error::Segment::Unknown => None,
        })
        .collect();
    // serde reports "unknown field `x`" / "missing field `x`" at the enclosing object.
    if matches!(kind, "extra_forbidden" | "missing")
        && let Some(name) = text.split('`').nth(1)
        && loc.last().map(String::as_str) != Some(name)
    {
        loc.push(name.to_string());
    }
    let field = loc.join(".");
    let msg = if field.is_empty() {
        format!("body: {text}")
    } else {
        format!("{field}: {text}")
    };
    FieldError {
        loc,
        msg,
        kind: kind.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_errors_name_the_field() {
        let err = parse_json::<StepParams>(br#"{"action": {"code": 5}}"#).unwrap_err();
        assert_eq!(err.loc, ["action", "code"]);
        assert_eq!(err.kind, "type_error");
        assert!(
            err.msg
                .starts_with("action.code: invalid type: integer `5`"),
            "{}",
            err.msg
        );
    }

    #[test]
    fn unknown_fields_are_located_at_the_field() {
        let err = parse_json::<StepParams>(br#"{"action": {"cod": "x"}}"#).unwrap_err();
        assert_eq!(err.loc, ["action", "cod"]);
        assert_eq!(err.kind, "extra_forbidden");
        let err = parse_json::<ResetParams>(br#"{"sed": 1}"#).unwrap_err();
        assert_eq!(err.loc, ["sed"]);
        assert!(
            err.msg.starts_with("sed: unknown field `sed`"),
            "{}",
            err.msg
        );
    }

    #[test]
    fn missing_and_bad_json_are_reported() {
        let err = parse_json::<StepParams>(br#"{}"#).unwrap_err();
        assert_eq!(
            (err.loc.as_slice(), err.kind.as_str()),
            (&["action".to_string()][..], "missing")
        );
        let err = parse_json::<StepParams>(br#"{"action": "#).unwrap_err();
        assert_eq!(err.kind, "json_invalid");
        assert!(
            err.msg.starts_with("body: EOF while parsing"),
            "{}",
            err.msg
        );
        let err = parse_json::<StepParams>(b"nope").unwrap_err();
        assert_eq!((err.kind.as_str(), err.loc.len()), ("json_invalid", 0));
        assert!(err.msg.starts_with("body: expected"), "{}", err.msg);
        let err = err.under(&["body"]);
        assert_eq!(err.loc, ["body"]);
        let located = parse_json::<StepParams>(br#"{"action": {"code": 5}}"#)
            .unwrap_err()
            .under(&["data"]);
        assert!(
            located.msg.starts_with("data.action.code: "),
            "{}",
            located.msg
        );
        let located = parse_json::<StepParams>(br#"{"action": {"code": 5}}"#)
            .unwrap_err()
            .under(&["body"]);
        assert_eq!(located.loc, ["body", "action", "code"]);
        assert!(located.msg.starts_with("action.code: "), "{}", located.msg);
    }

    #[test]
    fn integral_floats_are_integers() {
        let p = parse_json::<ResetParams>(br#"{"split": "eval", "index": 61.0, "seed": -0.0}"#)
            .unwrap();
        assert_eq!((p.index, p.seed), (Some(61), Some(0)));
        let err = parse_json::<ResetParams>(br#"{"index": 61.5}"#).unwrap_err();
        assert_eq!(
            (err.loc.as_slice(), err.kind.as_str()),
            (&["index".to_string()][..], "type_error")
        );
        let err = parse_json::<ResetParams>(br#"{"seed": 1e20}"#).unwrap_err();
        assert_eq!(err.loc, ["seed"]);
        let err = parse_json::<ResetParams>(br#"{"index": -2.0}"#).unwrap_err();
        assert!(err.msg.contains("integer `-2`"), "{}", err.msg);
        let s = parse_json::<StepParams>(br#"{"action": {"code": "1"}, "timeout_s": 2}"#).unwrap();
        assert_eq!(s.timeout_s, Some(2.0));
    }

    #[test]
    fn structs_written_as_arrays_are_refused() {
        let err = parse_json::<ResetParams>(b"[1, 2]").unwrap_err();
        assert_eq!(
            (err.loc.len(), err.msg.as_str()),
            (0, "body: invalid type: array, expected an object")
        );
        let err = parse_json::<StepParams>(br#"{"action": ["x"], "session_id": "s"}"#).unwrap_err();
        assert_eq!(err.loc, ["action"]);
        let err = parse_json::<ResetParams>(
            br#"{"task": {"id": "t", "split": "eval", "index": 0, "seed": 1, "family": "needle", "document": "d", "question": "q", "answer": "a", "doc_tokens": 1, "evidence": [[0, 1]]}}"#,
        )
        .unwrap_err();
        assert_eq!(err.loc, ["task", "evidence", "0"]);
        assert!(parse_json::<ResetParams>(br#"{"task": null}"#).is_ok());
    }

    #[test]
    fn unknown_fields_inside_a_task_are_refused() {
        let task = r#"{"id": "t", "split": "eval", "index": 0, "seed": 1, "family": "needle", "document": "d", "question": "q", "answer": "a", "doc_tokens": 1, "evidence": [{"start": 0, "end": 1}]}"#;
        assert!(parse_json::<ResetParams>(format!(r#"{{"task": {task}}}"#).as_bytes()).is_ok());
        let extra = task.replace(r#""end": 1}"#, r#""end": 1, "width": 2}"#);
        let err =
            parse_json::<ResetParams>(format!(r#"{{"task": {extra}}}"#).as_bytes()).unwrap_err();
        assert_eq!(err.loc, ["task", "evidence", "0", "width"]);
        assert_eq!(err.kind, "extra_forbidden");
        assert_eq!(err.msg, "task.evidence.0.width: unknown field `width`");
        let extra = task.replace(r#""id": "t""#, r#""id": "t", "ID": "u""#);
        let err =
            parse_json::<ResetParams>(format!(r#"{{"task": {extra}}}"#).as_bytes()).unwrap_err();
        assert_eq!(err.loc, ["task", "ID"]);
    }
}
