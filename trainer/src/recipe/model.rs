//! A recipe's `model` section: which weights (a Hugging Face directory, the default base
//! `cargo xtask fetch-base` provides, or random weights of a given shape), their
//! quantization, and what is trained (a LoRA adapter or every weight).

use std::path::PathBuf;

use fathom_model::{LoraSettings, Qwen2Config};
use serde::{Deserialize, Serialize};

/// Where the weights come from. Paths are resolved when the model is loaded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum ModelSource {
    /// A Hugging Face model directory (`config.json`, safetensors, tokenizer files).
    HuggingFace {
        /// The directory.
        path: PathBuf,
    },
    /// The embedded default base (SmolLM2-135M-Instruct), fetched and converted by
    /// `cargo xtask fetch-base` into its cache directory.
    DefaultBase,
    /// Random weights (seeded by the recipe's `seeds.model`) with a tokenizer from a
    /// directory, for tests and CI.
    Random {
        /// The architecture's shape.
        shape: Shape,
        /// A directory with `tokenizer.json` and `tokenizer_config.json`.
        tokenizer: PathBuf,
        /// Standard deviation of the embedding table and output head (default 0.02, as the
        /// projections). LoRA leaves them and the norms frozen, which bounds the logits a
        /// small random model can reach; a larger value (e.g. 1.0) lets it learn.
        #[serde(default)]
        embedding_std: Option<f64>,
    },
}

/// The shape of a randomly initialised Qwen2.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Shape {
    /// Qwen2.5-1.5B (and -Coder): 28 layers, hidden 1536, 12 heads, 2 KV heads, vocab 151936.
    Qwen2_5_1_5B,
    /// Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads, 2 KV heads, vocab 151936.
    Qwen2_5_0_5B,
    /// Any shape; the vocabulary is the tokenizer's.
    Custom {
        /// Hidden width.
        hidden_size: usize,
        /// MLP width.
        intermediate_size: usize,
        /// Decoder layers.
        num_hidden_layers: usize,
        /// Query heads.
        num_attention_heads: usize,
        /// Key/value heads.
        num_key_value_heads: usize,
    },
}

impl Shape {
    /// The model configuration for a tokenizer of `vocab` tokens. Presets keep their own
    /// (padded) vocabulary, which must hold the tokenizer's.
    pub fn config(&self, vocab: usize) -> Result<Qwen2Config, String> {
        let config = match *self {
            Shape::Qwen2_5_1_5B => Qwen2Config::qwen2_5_1_5b(),
            Shape::Qwen2_5_0_5B => Qwen2Config::qwen2_5_0_5b(),
            Shape::Custom {
                hidden_size,
                intermediate_size,
                num_hidden_layers,
                num_attention_heads,
                num_key_value_heads,
            } => Qwen2Config::with_shape(
                vocab,
                hidden_size,
                intermediate_size,
                num_hidden_layers,
                num_attention_heads,
                num_key_value_heads,
            ),
        };
        if config.vocab_size < vocab {
            return Err(format!(
                "the shape's vocabulary ({}) is smaller than the tokenizer's ({vocab})",
                config.vocab_size
            ));
        }
        config.validate()?;
        Ok(config)
    }
}

/// How the frozen weights are stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Quantization {
    /// f32 weights.
    Dense,
    /// NF4 decoder projections, as bitsandbytes stores them.
    Nf4 {
        /// Quantize the absmax scales too (bitsandbytes' double quantization) where the
        /// weights are written out; on the device the scales are kept in f32 either way.
        double_quant: bool,
    },
}

/// What is trained.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Tuning {
    /// A LoRA adapter on the targeted projections; everything else is frozen.
    Lora(LoraSettings),
    /// Every weight (needs dense weights).
    Full,
}

/// The `model` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// The weights.
    pub source: ModelSource,
    /// Their storage.
    pub quantization: Quantization,
    /// What is trained.
    pub tuning: Tuning,
    /// Start from this PEFT adapter directory instead of a fresh adapter (with
    /// `tuning: Lora`, whose rank and targets it must have): for example GRPO from an earlier
    /// run's SFT adapter. Optional; a fresh adapter when absent.
    #[serde(default)]
    pub adapter: Option<std::path::PathBuf>,
}

impl ModelSection {
    /// Checks the section; the error is `(field path, message)`.
    pub fn validate(&self) -> Result<(), (String, String)> {
        match &self.source {
            ModelSource::HuggingFace { path } if path.as_os_str().is_empty() => {
                return Err(("model.source.path".into(), "is empty".into()));
            }
            ModelSource::Random { tokenizer, .. } if tokenizer.as_os_str().is_empty() => {
                return Err(("model.source.tokenizer".into(), "is empty".into()));
            }
            ModelSource::Random {
                embedding_std: Some(std),
                ..
            } if !(std.is_finite() && *std > 0.0) => {
                return Err((
                    "model.source.embedding_std".into(),
                    format!("must be a positive number, got {std}"),
                ));
            }
            ModelSource::Random { shape, .. } => {
                // The real vocabulary is the tokenizer's; any will do to check the rest.
                shape
                    .config(1)
                    .map_err(|m| ("model.source.shape".to_string(), m))?;
            }
            _ => {}
        }
        if let Some(dir) = &self.adapter {
            if !matches!(self.tuning, Tuning::Lora(_)) {
                return Err((
                    "model.adapter".into(),
                    "needs `tuning: Lora(...)`: an adapter is a LoRA adapter".into(),
                ));
            }
            if dir.as_os_str().is_empty() {
                return Err(("model.adapter".into(), "is empty".into()));
            }
        }
        match &self.tuning {
            Tuning::Lora(lora) => lora.validate().map_err(|message| {
                // LoraSettings names its fields `lora.<name> …`.
                let name = message
                    .strip_prefix("lora.")
                    .and_then(|m| m.split_whitespace().next())
                    .unwrap_or("");
                let field = if name.is_empty() {
                    "model.tuning".to_string()
                } else {
                    format!("model.tuning.{name}")
                };
                let text = message
                    .strip_prefix(&format!("lora.{name} "))
                    .unwrap_or(&message)
                    .to_string();
                (field, text)
            }),
            Tuning::Full => match self.quantization {
                Quantization::Dense => Ok(()),
                Quantization::Nf4 { .. } => Err((
                    "model.tuning".into(),
                    "full fine-tuning trains every weight, which NF4 weights cannot be: use \
                     `quantization: Dense` or a LoRA adapter"
                        .into(),
                )),
            },
        }
    }
}
