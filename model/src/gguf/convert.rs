//! Converting a Llama-architecture GGUF into a Hugging Face directory: `config.json`,
//! `model.safetensors` (f32), `tokenizer.json`, `tokenizer_config.json` (with the chat
//! template) and `generation_config.json`.
//!
//! Tensor names map from llama.cpp's (`blk.N.attn_q.weight`) to Hugging Face's
//! (`model.layers.N.self_attn.q_proj.weight`); every tensor of the file must map, and every
//! tensor the config implies must be there with its shape. llama.cpp's converter reorders the
//! rows of the query and key projections (it interleaves the two rotary halves of each head, for
//! its GPT-J-style RoPE kernel); [`unpermute_rows`] puts them back in the rotate-half order the
//! model expects.
//!
//! Weights are written in f32: a dequantized Q4_1 weight `d·q + m` is generally not exact in a
//! 16-bit format, and f32 keeps the converted model's logits equal to `transformers`' own GGUF
//! loader's. Everything is written to a temporary sibling directory that is renamed onto the
//! destination only once complete, so a failure never leaves a half-written directory.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::json;

use super::GgufError;
use super::reader::{GgufFile, TensorInfo};
use super::tokenizer;

/// What a conversion did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvertReport {
    /// `general.architecture`.
    pub architecture: String,
    /// Number of weights written.
    pub parameters: u64,
    /// How many tensors of each ggml type were dequantized (`"Q4_1" → 210`).
    pub tensor_types: BTreeMap<String, usize>,
}

/// Undoes llama.cpp's Q/K row permutation (`permute` in `convert_hf_to_gguf.py`).
///
/// llama.cpp stores each head's rows as `[d0, d_half, d1, d_half+1, …]` — the two rotary halves
/// interleaved; Hugging Face's order is `[d0, d1, …, d_half, d_half+1, …]`. `values` is a
/// row-major `[heads · head_dim, cols]` matrix (or a bias, with `cols` 1).
pub fn unpermute_rows(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = values.len() / cols;
    let half = rows / heads / 2;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..2 {
            for j in 0..half {
                let hf = h * 2 * half + i * half + j;
                let gg = h * 2 * half + 2 * j + i;
                out[hf * cols..(hf + 1) * cols]
                    .copy_from_slice(&values[gg * cols..(gg + 1) * cols]);
            }
        }
    }
    out
}

/// The Hugging Face name of a llama.cpp tensor name, if it is one a Llama model has.
fn hf_name(gguf: &str) -> Option<String> {
    let top = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(t.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    if hf.ends_with("layernorm") && kind == "bias" {
        return None;
    }
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// The model's shape, read from `llama.*` metadata.
struct Shape {
    vocab: usize,
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Shape {
    fn read(file: &GgufFile, arch: &str, vocab: usize) -> Result<Self, GgufError> {
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| file.u64(&key(k)).map(|v| v as usize);
        let hidden = u("embedding_length")?;
        let heads = u("attention.head_count")?;
        let kv_heads = file
            .opt_u64(&key("attention.head_count_kv"))?
            .map_or(heads, |v| v as usize);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(GgufError::Metadata {
                path: file.path().to_path_buf(),
                key: key("attention.head_count_kv"),
                message: format!("{kv_heads} key/value heads for {heads} heads"),
            });
        }
        let head_dim = file
            .opt_u64(&key("attention.key_length"))?
            .map_or(hidden / heads, |v| v as usize);
        if let Some(rope) = file.opt_u64(&key("rope.dimension_count"))?
            && rope as usize != head_dim
        {
            return Err(GgufError::Unsupported {
                path: file.path().to_path_buf(),
                message: format!(
                    "`{}` is {rope} but heads are {head_dim} wide: partial rotary embeddings \
                     are not supported",
                    key("rope.dimension_count")
                ),
            });
        }
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(GgufError::Metadata {
                path: file.path().to_path_buf(),
                key: key("attention.key_length"),
                message: format!("head dimension {head_dim} must be even and positive"),
            });
        }
        Ok(Self {
            vocab: file
                .opt_u64(&key("vocab_size"))?
                .map_or(vocab, |v| v as usize),
            hidden,
            inter: u("feed_forward_length")?,
            layers: u("block_count")?,
            heads,
            kv_heads,
            head_dim,
        })
    }

    /// The PyTorch shape a Hugging Face tensor must have.
    fn expected(&self, hf: &str) -> Option<Vec<usize>> {
        let (h, q, kv) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        );
        let bias = hf.ends_with(".bias");
        let rows = match hf.rsplit('.').nth(1)? {
            "embed_tokens" | "lm_head" => return Some(vec![self.vocab, h]),
            "norm" | "input_layernorm" | "post_attention_layernorm" => return Some(vec![h]),
            "q_proj" => (q, h),
            "k_proj" | "v_proj" => (kv, h),
            "o_proj" => (h, q),
            "gate_proj" | "up_proj" => (self.inter, h),
            "down_proj" => (h, self.inter),
            _ => return None,
        };
        Some(if bias {
            vec![rows.0]
        } else {
            vec![rows.0, rows.1]
        })
    }
}

/// Removes a directory on drop unless disarmed: the temporary output of a failed conversion.
struct TempDir(Option<PathBuf>);

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// A fresh temporary directory beside `dest` (same file system, so it can be renamed onto it).
pub(crate) fn temp_sibling(dest: &Path) -> Result<PathBuf, GgufError> {
    let parent = dest
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| GgufError::io(parent, e))?;
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let tmp = parent.join(format!(".{name}.tmp-{}-{nanos}", std::process::id()));
    std::fs::create_dir(&tmp).map_err(|e| GgufError::io(&tmp, e))?;
    Ok(tmp)
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), GgufError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| GgufError::Output {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    std::fs::write(path, text).map_err(|e| GgufError::io(path, e))
}

/// Converts the GGUF file `gguf` into a Hugging Face directory at `out`, which must not exist.
/// Nothing is left at `out` (or beside it) if the conversion fails.
pub fn convert_gguf(gguf: &Path, out: &Path) -> Result<ConvertReport, GgufError> {
    if out.exists() {
        return Err(GgufError::io(
            out,
            std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "the output directory already exists (remove it, or choose another)",
            ),
        ));
    }
    let file = GgufFile::open(gguf)?;
    let tmp = TempDir(Some(temp_sibling(out)?));
    let dir = tmp.0.clone().expect("set above");
    let report = write_hf(&file, &dir)?;
    std::fs::rename(&dir, out).map_err(|e| GgufError::io(out, e))?;
    std::mem::forget(tmp);
    Ok(report)
}

fn write_hf(file: &GgufFile, dir: &Path) -> Result<ConvertReport, GgufError> {
    let path = file.path().to_path_buf();
    let arch = file.str("general.architecture")?.to_string();
    if arch != "llama" {
        return Err(GgufError::Unsupported {
            path,
            message: format!(
                "general.architecture is `{arch}`; only `llama` (Llama, SmolLM, Mistral-style \
                 checkpoints) is converted"
            ),
        });
    }
    if let Some(v) = file.get(&format!("{arch}.rope.scaling.type")) {
        let kind = v.as_str().unwrap_or("?");
        if kind != "none" {
            return Err(GgufError::Unsupported {
                path,
                message: format!("RoPE scaling `{kind}` is not supported"),
            });
        }
    }
    let tok = tokenizer::rebuild(file)?;
    let n_tokens = file.strings("tokenizer.ggml.tokens")?.len();
    let shape = Shape::read(file, &arch, n_tokens)?;
    let tensor_err = |name: &str, message: String| GgufError::Tensor {
        path: file.path().to_path_buf(),
        name: name.to_string(),
        message,
    };

    // Map and check every tensor before dequantizing anything.
    let mut mapped: Vec<(&TensorInfo, String)> = Vec::with_capacity(file.tensors.len());
    for t in &file.tensors {
        let hf = hf_name(&t.name)
            .ok_or_else(|| tensor_err(&t.name, "is not a tensor of a Llama model".into()))?;
        let expected = shape
            .expected(&hf)
            .ok_or_else(|| tensor_err(&t.name, "is not a tensor of a Llama model".into()))?;
        if let Some(layer) = hf
            .strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|l| l.parse::<usize>().ok())
            && layer >= shape.layers
        {
            return Err(tensor_err(
                &t.name,
                format!("layer {layer} is beyond block_count {}", shape.layers),
            ));
        }
        if t.torch_shape() != expected {
            return Err(tensor_err(
                &t.name,
                format!("shape {:?}, expected {expected:?}", t.torch_shape()),
            ));
        }
        mapped.push((t, hf));
    }
    let names: HashMap<&str, &TensorInfo> =
        mapped.iter().map(|(t, hf)| (hf.as_str(), *t)).collect();
    let mut required = vec![
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".to_string(),
    ];
    for i in 0..shape.layers {
        for m in [
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ] {
            required.push(format!("model.layers.{i}.{m}.weight"));
        }
    }
    if let Some(missing) = required.iter().find(|r| !names.contains_key(r.as_str())) {
        return Err(tensor_err(missing, "is missing from the file".into()));
    }
    let has = |n: &str| names.contains_key(n);
    let attention_bias = has("model.layers.0.self_attn.q_proj.bias");
    let mlp_bias = has("model.layers.0.mlp.gate_proj.bias");
    for i in 0..shape.layers {
        let p = format!("model.layers.{i}");
        for (m, on) in [
            ("self_attn.q_proj", attention_bias),
            ("self_attn.k_proj", attention_bias),
            ("self_attn.v_proj", attention_bias),
            ("self_attn.o_proj", attention_bias),
            ("mlp.gate_proj", mlp_bias),
            ("mlp.up_proj", mlp_bias),
            ("mlp.down_proj", mlp_bias),
        ] {
            let n = format!("{p}.{m}.bias");
            if has(&n) != on {
                return Err(tensor_err(
                    &n,
                    format!(
                        "is {} while layer 0 {} it",
                        if on { "missing" } else { "present" },
                        if on { "has" } else { "lacks" }
                    ),
                ));
            }
        }
    }
    let tied = !has("lm_head.weight");

    // Dequantize (and unpermute) every tensor to f32 bytes.
    let mut report = ConvertReport {
        architecture: arch.clone(),
        parameters: 0,
        tensor_types: BTreeMap::new(),
    };
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(mapped.len());
    for (t, hf) in &mapped {
        let mut values = file.dequantize(t)?;
        let shape_t = t.torch_shape();
        let cols = if shape_t.len() == 2 { shape_t[1] } else { 1 };
        if hf.contains(".q_proj.") {
            values = unpermute_rows(&values, shape.heads, cols);
        } else if hf.contains(".k_proj.") {
            values = unpermute_rows(&values, shape.kv_heads, cols);
        }
        if let Some(bad) = values.iter().position(|v| !v.is_finite()) {
            return Err(tensor_err(
                &t.name,
                format!("element {bad} dequantizes to {}", values[bad]),
            ));
        }
        let ty = super::dequant::GgmlType::from_id(t.type_id).expect("dequantized above");
        *report
            .tensor_types
            .entry(ty.name().to_string())
            .or_default() += 1;
        report.parameters += values.len() as u64;
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        out.push((hf.clone(), shape_t, bytes));
    }
    let st_path = dir.join("model.safetensors");
    let views = out
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(Dtype::F32, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| GgufError::Output {
                    path: st_path.clone(),
                    message: format!("`{name}`: {e}"),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize_to_file(views, Some(meta), &st_path).map_err(|e| {
        GgufError::Output {
            path: st_path.clone(),
            message: e.to_string(),
        }
    })?;
    drop(out);

    let rope_theta = file
        .get(&format!("{arch}.rope.freq_base"))
        .map(|_| file.f64(&format!("{arch}.rope.freq_base")))
        .transpose()?
        .unwrap_or(10000.0);
    let eps = file.f64(&format!("{arch}.attention.layer_norm_rms_epsilon"))?;
    let max_pos = file
        .opt_u64(&format!("{arch}.context_length"))?
        .unwrap_or(2048);
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.inter,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": eps,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "hidden_act": "silu",
        "attention_bias": attention_bias,
        "mlp_bias": mlp_bias,
        "tie_word_embeddings": tied,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
        "torch_dtype": "float32",
        "converted_from": {
            "gguf": file.path().file_name().map(|n| n.to_string_lossy().into_owned()),
            "general.name": file.get("general.name").and_then(|v| v.as_str()),
        },
    });
    write_json(&dir.join("config.json"), &config)?;
    write_json(
        &dir.join("generation_config.json"),
        &json!({"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
                "pad_token_id": tok.pad_id}),
    )?;
    let tok_path = dir.join("tokenizer.json");
    write_json(&tok_path, &tok.tokenizer)?;
    // The rebuilt tokenizer must load, or the directory is not usable.
    tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| GgufError::Output {
        path: tok_path.clone(),
        message: format!("the rebuilt tokenizer does not load: {e}"),
    })?;
    write_json(&dir.join("tokenizer_config.json"), &tok.config)?;
    // The config must be one this crate loads.
    crate::config::Qwen2Config::from_file(&dir.join("config.json")).map_err(|e| {
        GgufError::Output {
            path: dir.join("config.json"),
            message: e.to_string(),
        }
    })?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's `permute`, transcribed: reshape to `[heads, 2, half, cols]`, swap axes 1 and 2.
    fn permute(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
        let rows = values.len() / cols;
        let half = rows / heads / 2;
        let mut out = vec![0f32; values.len()];
        for h in 0..heads {
            for j in 0..half {
                for i in 0..2 {
                    let src = (h * 2 + i) * half + j; // [h, i, j]
                    let dst = (h * half + j) * 2 + i; // [h, j, i]
                    out[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&values[src * cols..(src + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        let (heads, head_dim, cols) = (3, 8, 5);
        let w: Vec<f32> = (0..heads * head_dim * cols).map(|v| v as f32).collect();
        let p = permute(&w, heads, cols);
        assert_ne!(p, w);
        assert_eq!(unpermute_rows(&p, heads, cols), w);
        // Row 1 of the stored head 0 is row `half` (= 4) of the original.
        assert_eq!(p[cols], w[4 * cols]);
    }

    #[test]
    fn names_map_to_hugging_face() {
        assert_eq!(
            hf_name("blk.12.attn_q.weight").as_deref(),
            Some("model.layers.12.self_attn.q_proj.weight")
        );
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.post_attention_layernorm.weight")
        );
        assert_eq!(
            hf_name("token_embd.weight").as_deref(),
            Some("model.embed_tokens.weight")
        );
        assert_eq!(hf_name("rope_freqs.weight"), None);
        assert_eq!(hf_name("blk.0.attn_norm.bias"), None);
    }
}
