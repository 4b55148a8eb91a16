//! The tokenizer (a Hugging Face `tokenizer.json` through the `tokenizers` crate) and the chat
//! template from `tokenizer_config.json`, rendered the way `transformers` renders it: a Jinja
//! engine (`minijinja`) with `trim_blocks` and `lstrip_blocks`, loop controls, Python string
//! methods, `raise_exception`, and a `tojson` filter that writes JSON as Python's `json.dumps`
//! does (`ensure_ascii=False`, `", "` and `": "` separators).

use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// Who wrote a chat message, as chat templates spell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChatRole {
    /// `system`
    System,
    /// `user`
    User,
    /// `assistant`
    Assistant,
    /// `tool`
    Tool,
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// The author.
    pub role: ChatRole,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and text.
    pub fn new(role: ChatRole, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
        }
    }
}

/// A special token as `tokenizer_config.json` may write it: a string or an AddedToken object.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenSpec {
    Text(String),
    Added { content: String },
}

impl TokenSpec {
    fn text(self) -> String {
        match self {
            TokenSpec::Text(t) | TokenSpec::Added { content: t } => t,
        }
    }
}

/// The chat template as `tokenizer_config.json` may hold it: one string, or named templates.
#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateSpec {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

#[derive(Deserialize, Default)]
struct TokenizerConfig {
    #[serde(default)]
    chat_template: Option<TemplateSpec>,
    #[serde(default)]
    eos_token: Option<TokenSpec>,
    #[serde(default)]
    bos_token: Option<TokenSpec>,
    #[serde(default)]
    pad_token: Option<TokenSpec>,
}

/// Token ids, and each token's byte range in the encoded text.
pub type IdsWithOffsets = (Vec<u32>, Vec<(usize, usize)>);

/// A tokenizer with its chat template and special tokens.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    template: Option<String>,
    eos_token: Option<String>,
    bos_token: Option<String>,
    pad_token: Option<String>,
    path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` and, when present, `tokenizer_config.json` from a directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(ModelError::Tokenizer {
                path,
                message: "file not found".into(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| ModelError::Tokenizer {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let config_path = dir.join("tokenizer_config.json");
        let config: TokenizerConfig = if config_path.exists() {
            let text = std::fs::read_to_string(&config_path)
                .map_err(|e| ModelError::io(&config_path, e))?;
            serde_json::from_str(&text).map_err(|e| ModelError::Json {
                path: config_path.clone(),
                message: e.to_string(),
            })?
        } else {
            TokenizerConfig::default()
        };
        let template = match config.chat_template {
            None => None,
            Some(TemplateSpec::One(t)) => Some(t),
            Some(TemplateSpec::Named(list)) => list
                .into_iter()
                .find(|t| t.name == "default")
                .map(|t| t.template),
        };
        let tokenizer = Self {
            inner,
            template,
            eos_token: config.eos_token.map(TokenSpec::text),
            bos_token: config.bos_token.map(TokenSpec::text),
            pad_token: config.pad_token.map(TokenSpec::text),
            path,
        };
        if let Some(t) = &tokenizer.template {
            tokenizer.environment(t)?;
        }
        Ok(tokenizer)
    }

    /// Number of tokens, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| ModelError::Tokenizer {
                path: self.path.clone(),
                message: e.to_string(),
            })
    }

    /// Token ids of `text` with each token's byte range in `text` (for masks over parts of a
    /// rendered conversation).
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<IdsWithOffsets> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| (e.get_ids().to_vec(), e.get_offsets().to_vec()))
            .map_err(|e| ModelError::Tokenizer {
                path: self.path.clone(),
                message: e.to_string(),
            })
    }

    /// Text of `ids`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenizer {
                path: self.path.clone(),
                message: e.to_string(),
            })
    }

    /// The id of a token, if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The end-of-sequence token id named by `tokenizer_config.json`.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_id(t))
    }

    /// The padding token id named by `tokenizer_config.json`.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad_token.as_deref().and_then(|t| self.token_id(t))
    }

    /// Whether a chat template is available.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Renders a conversation with the chat template, as `apply_chat_template(tokenize=False)`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.template.as_deref().ok_or_else(|| {
            ModelError::Template(format!("{} has no chat_template", self.path.display()))
        })?;
        let env = self.environment(template)?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| ModelError::Template(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            tools => Value::from(()),
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(|e| ModelError::Template(describe(&e)))
    }

    fn environment<'a>(&self, template: &'a str) -> Result<Environment<'a>> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<Value, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template("chat", template)
            .map_err(|e| ModelError::Template(describe(&e)))?;
        Ok(env)
    }
}

fn describe(e: &JinjaError) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    write_python_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Writes JSON with Python's `json.dumps` layout.
fn write_python_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::to_string(k).expect("string"));
                out.push_str(": ");
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&serde_json::to_string(other).expect("json")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_matches_python_layout() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"name": "f", "args": [1, "é", {"a": null}], "e": {}}"#)
                .unwrap();
        let mut out = String::new();
        write_python_json(&v, None, 0, &mut out);
        assert_eq!(
            out,
            r#"{"name": "f", "args": [1, "é", {"a": null}], "e": {}}"#
        );
        let mut out = String::new();
        write_python_json(&serde_json::json!({"a": [1, 2]}), Some(2), 0, &mut out);
        assert_eq!(out, "{\n  \"a\": [\n    1,\n    2\n  ]\n}");
    }
}
