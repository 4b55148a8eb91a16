//! `config.json` of a Hugging Face Qwen2 or Llama checkpoint, as a serde mirror with upstream
//! field names.
//!
//! Qwen2 is Llama with biases on the query, key and value projections, so both families load
//! into the same module: the config says which projections carry a bias (Qwen2: q/k/v always;
//! Llama: q/k/v/o when `attention_bias`, the MLP when `mlp_bias`) and how wide a head is
//! (`head_dim` when given, else `hidden_size / num_attention_heads`).
//!
//! Unknown fields are ignored (Hugging Face adds new ones every release); missing required
//! fields are reported by name. Both spellings of the RoPE base are accepted: the top-level
//! `rope_theta` of transformers 4 and `rope_parameters.rope_theta` of transformers 5.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// The Qwen2 / Llama architecture hyper-parameters, named as in `transformers`' `Qwen2Config`
/// and `LlamaConfig`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Qwen2Config {
    /// Size of the vocabulary (rows of `embed_tokens` and `lm_head`).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention); defaults to the query heads.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Width of one attention head (Llama); defaults to `hidden_size / num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Whether q/k/v/o carry a bias (Llama; Qwen2 has q/k/v biases whatever this says).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    /// Whether the MLP's projections carry a bias (Llama).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_bias: Option<bool>,
    /// Longest sequence the model was trained for.
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base (transformers 4 spelling).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE parameters (transformers 5 spelling).
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    /// Legacy RoPE scaling block; only `null` or the default type is supported.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Whether `lm_head` shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Activation of the MLP; Qwen2 uses `silu`.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Whether sliding-window attention is on (not supported).
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Beginning-of-sequence token id.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id(s).
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// The architecture family; absent means Qwen2 (the only family this crate read before).
    #[serde(default)]
    pub model_type: Option<ModelType>,
    /// bitsandbytes quantization settings of a 4-bit checkpoint.
    #[serde(default)]
    pub quantization_config: Option<QuantizationConfig>,
}

/// The `model_type` values this crate loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelType {
    /// Qwen2 and Qwen2.5: biases on q/k/v, none elsewhere.
    Qwen2,
    /// Llama (SmolLM2, TinyLlama, …): biases as `attention_bias` and `mlp_bias` say.
    Llama,
}

impl ModelType {
    /// The `model_type` string of `config.json`.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelType::Qwen2 => "qwen2",
            ModelType::Llama => "llama",
        }
    }

    /// The `architectures` entry `transformers` writes for the causal LM of this family.
    pub fn architecture(self) -> &'static str {
        match self {
            ModelType::Qwen2 => "Qwen2ForCausalLM",
            ModelType::Llama => "LlamaForCausalLM",
        }
    }
}

/// One token id or a list of them, as `eos_token_id` may be either.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// A single id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

impl TokenIds {
    /// The ids as a list.
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

/// transformers 5's `rope_parameters` block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeParameters {
    /// RoPE base.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// Scaling type; only `default` is supported.
    #[serde(default)]
    pub rope_type: Option<String>,
}

/// The `quantization_config` block `transformers` writes for bitsandbytes 4-bit checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QuantizationConfig {
    /// `bitsandbytes` for the checkpoints this crate reads.
    #[serde(default)]
    pub quant_method: Option<String>,
    /// Whether weights are 4-bit.
    #[serde(default)]
    pub load_in_4bit: bool,
    /// Whether weights are 8-bit (not supported).
    #[serde(default)]
    pub load_in_8bit: bool,
    /// `nf4` or `fp4`; only `nf4` is supported.
    #[serde(default)]
    pub bnb_4bit_quant_type: Option<String>,
    /// Whether absmax is itself quantized.
    #[serde(default)]
    pub bnb_4bit_use_double_quant: bool,
    /// Modules left unquantized.
    #[serde(default)]
    pub llm_int8_skip_modules: Option<Vec<String>>,
}

fn default_max_positions() -> usize {
    32768
}
fn default_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}

impl Qwen2Config {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let de = &mut serde_json::Deserializer::from_str(&text);
        let config: Qwen2Config =
            serde_path_to_error::deserialize(de).map_err(|e| ModelError::Json {
                path: path.to_path_buf(),
                message: if e.path().iter().next().is_some() {
                    format!("`{}`: {}", e.path(), e.inner())
                } else {
                    e.inner().to_string()
                },
            })?;
        config.validate().map_err(|message| ModelError::Config {
            path: path.to_path_buf(),
            message,
        })?;
        Ok(config)
    }

    /// Checks the hyper-parameters are consistent and supported; returns what is wrong.
    pub fn validate(&self) -> std::result::Result<(), String> {
        for (name, value) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_kv_heads()),
        ] {
            if value == 0 {
                return Err(format!("`{name}` must be positive"));
            }
        }
        if self.head_dim == Some(0) {
            return Err("`head_dim` must be positive".into());
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "`hidden_size` {} is not a multiple of `num_attention_heads` {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if !self.num_attention_heads.is_multiple_of(self.num_kv_heads()) {
            return Err(format!(
                "`num_attention_heads` {} is not a multiple of `num_key_value_heads` {}",
                self.num_attention_heads,
                self.num_kv_heads()
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!(
                "head dimension {} must be even for RoPE",
                self.head_dim()
            ));
        }
        if self.hidden_act != "silu" {
            return Err(format!(
                "`hidden_act` is `{}`, only `silu` is supported",
                self.hidden_act
            ));
        }
        if self.use_sliding_window {
            return Err(
                "`use_sliding_window` is true; sliding-window attention is not supported".into(),
            );
        }
        if let Some(scaling) = &self.rope_scaling {
            let default = scaling.is_null()
                || scaling.get("rope_type").and_then(|t| t.as_str()) == Some("default")
                || scaling.get("type").and_then(|t| t.as_str()) == Some("default");
            if !default {
                return Err(format!("`rope_scaling` {scaling} is not supported"));
            }
        }
        if let Some(kind) = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.rope_type.as_deref())
            && kind != "default"
        {
            return Err(format!(
                "`rope_parameters.rope_type` `{kind}` is not supported"
            ));
        }
        // Written so that NaN fails too.
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        if !(self.rope_base() > 0.0) {
            return Err(format!("RoPE base {} must be positive", self.rope_base()));
        }
        if let Some(q) = &self.quantization_config {
            if q.load_in_8bit {
                return Err("8-bit bitsandbytes checkpoints are not supported (only NF4)".into());
            }
            if let Some(kind) = &q.bnb_4bit_quant_type
                && kind != "nf4"
            {
                return Err(format!(
                    "`bnb_4bit_quant_type` `{kind}` is not supported (only nf4)"
                ));
            }
        }
        Ok(())
    }

    /// Number of key/value heads.
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Width of one attention head: `head_dim` when the config gives it, else
    /// `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// The architecture family (Qwen2 when `model_type` is absent).
    pub fn family(&self) -> ModelType {
        self.model_type.unwrap_or(ModelType::Qwen2)
    }

    /// Whether `q_proj`, `k_proj` and `v_proj` carry a bias.
    pub fn qkv_bias(&self) -> bool {
        match self.family() {
            ModelType::Qwen2 => true,
            ModelType::Llama => self.attention_bias.unwrap_or(false),
        }
    }

    /// Whether `o_proj` carries a bias (Llama with `attention_bias` only).
    pub fn o_bias(&self) -> bool {
        match self.family() {
            ModelType::Qwen2 => false,
            ModelType::Llama => self.attention_bias.unwrap_or(false),
        }
    }

    /// Whether the MLP's projections carry a bias (Llama with `mlp_bias` only).
    pub fn mlp_bias(&self) -> bool {
        match self.family() {
            ModelType::Qwen2 => false,
            ModelType::Llama => self.mlp_bias.unwrap_or(false),
        }
    }

    /// The RoPE base, from whichever spelling the file used (10000 when absent).
    pub fn rope_base(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|p| p.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10000.0)
    }

    /// End-of-sequence ids named by the config.
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(TokenIds::to_vec)
            .unwrap_or_default()
    }

    /// A config with the given shape and Qwen2 defaults, for randomly initialised models.
    pub fn with_shape(
        vocab_size: usize,
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        num_key_value_heads: usize,
    ) -> Self {
        Self {
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: Some(num_key_value_heads),
            head_dim: None,
            attention_bias: None,
            mlp_bias: None,
            max_position_embeddings: 32768,
            rms_norm_eps: 1e-6,
            rope_theta: Some(1_000_000.0),
            rope_parameters: None,
            rope_scaling: None,
            tie_word_embeddings: true,
            hidden_act: "silu".into(),
            use_sliding_window: false,
            bos_token_id: None,
            eos_token_id: None,
            model_type: Some(ModelType::Qwen2),
            quantization_config: None,
        }
    }

    /// The shape of Qwen2.5-Coder-1.5B (and Qwen2.5-1.5B): 28 layers, hidden 1536, 12 heads,
    /// 2 KV heads, intermediate 8960, vocab 151936, tied embeddings.
    pub fn qwen2_5_1_5b() -> Self {
        Self::with_shape(151_936, 1536, 8960, 28, 12, 2)
    }

    /// The shape of Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads, 2 KV heads,
    /// intermediate 4864, vocab 151936, tied embeddings.
    pub fn qwen2_5_0_5b() -> Self {
        Self::with_shape(151_936, 896, 4864, 24, 14, 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> std::result::Result<Qwen2Config, String> {
        let c: Qwen2Config = serde_json::from_str(json).map_err(|e| e.to_string())?;
        c.validate()?;
        Ok(c)
    }

    const BASE: &str = r#""vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2"#;

    #[test]
    fn missing_field_is_named() {
        let err = parse(r#"{"vocab_size": 10}"#).unwrap_err();
        assert!(err.contains("hidden_size"), "{err}");
    }

    #[test]
    fn rope_theta_in_either_place() {
        let a = parse(&format!("{{{BASE}, \"rope_theta\": 5.0}}")).unwrap();
        assert_eq!(a.rope_base(), 5.0);
        let b = parse(&format!(
            "{{{BASE}, \"rope_parameters\": {{\"rope_theta\": 7.0, \"rope_type\": \"default\"}}}}"
        ))
        .unwrap();
        assert_eq!(b.rope_base(), 7.0);
    }

    #[test]
    fn unknown_fields_tolerated_unsupported_rejected() {
        assert!(parse(&format!("{{{BASE}, \"some_new_field\": [1, 2]}}")).is_ok());
        let err = parse(&format!(
            "{{{BASE}, \"rope_scaling\": {{\"type\": \"yarn\", \"factor\": 4.0}}}}"
        ))
        .unwrap_err();
        assert!(err.contains("rope_scaling"), "{err}");
        let err = parse(&format!("{{{BASE}, \"num_key_value_heads\": 3}}")).unwrap_err();
        assert!(err.contains("num_key_value_heads"), "{err}");
    }

    #[test]
    fn llama_configs_load_with_their_biases_and_head_dim() {
        let plain = parse(&format!("{{{BASE}, \"model_type\": \"llama\"}}")).unwrap();
        assert_eq!(plain.family(), ModelType::Llama);
        assert!(!plain.qkv_bias() && !plain.o_bias() && !plain.mlp_bias());
        let biased = parse(&format!(
            "{{{BASE}, \"model_type\": \"llama\", \"attention_bias\": true, \"mlp_bias\": true, \"head_dim\": 6}}"
        ))
        .unwrap();
        assert!(biased.qkv_bias() && biased.o_bias() && biased.mlp_bias());
        assert_eq!(biased.head_dim(), 6);
        // Qwen2 has q/k/v biases whatever `attention_bias` says, and none elsewhere.
        let qwen = parse(&format!("{{{BASE}, \"model_type\": \"qwen2\"}}")).unwrap();
        assert!(qwen.qkv_bias() && !qwen.o_bias() && !qwen.mlp_bias());
        assert_eq!(qwen.head_dim(), 4);
    }

    #[test]
    fn unsupported_model_type_is_named() {
        let err = parse(&format!("{{{BASE}, \"model_type\": \"mistral\"}}")).unwrap_err();
        assert!(err.contains("mistral"), "{err}");
        let err = parse(&format!("{{{BASE}, \"head_dim\": 0}}")).unwrap_err();
        assert!(err.contains("head_dim"), "{err}");
    }

    #[test]
    fn eos_as_int_or_list() {
        let a = parse(&format!("{{{BASE}, \"eos_token_id\": 3}}")).unwrap();
        assert_eq!(a.eos_ids(), vec![3]);
        let b = parse(&format!("{{{BASE}, \"eos_token_id\": [3, 4]}}")).unwrap();
        assert_eq!(b.eos_ids(), vec![3, 4]);
    }
}
