//! Writing a bitsandbytes-format 4-bit checkpoint from a dense one, with the keys, bytes and
//! `quantization_config` that `transformers` + bitsandbytes write, so they load it unchanged.
//!
//! Every decoder-layer projection (`q/k/v/o_proj`, `gate/up/down_proj`) is quantized to NF4 in
//! blocks of 64; embeddings, norms, biases and `lm_head` are copied in their stored dtype
//! (bitsandbytes leaves `lm_head` unquantized by default). Per weight `W` the output holds
//! `W` (packed `u8` `[n/2, 1]`), `W.absmax`, `W.quant_map` and
//! `W.quant_state.bitsandbytes__nf4` (the JSON state as bytes), plus `W.nested_absmax` and
//! `W.nested_quant_map` with double quantization.

use std::collections::HashMap;
use std::path::Path;

use safetensors::Dtype;

use crate::checkpoint::{Checkpoint, OutTensor, to_f32, write_atomic, write_safetensors};
use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};
use crate::nf4::format::{NESTED_BLOCK, NF4_CODE, quantize_absmax, quantize_nf4};

const PROJECTIONS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// Summary of a quantization run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizeReport {
    /// Number of projections quantized.
    pub quantized: usize,
    /// Number of tensors copied unchanged.
    pub copied: usize,
    /// Size of the written weights file in bytes.
    pub bytes: u64,
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F32 | Dtype::BF16 | Dtype::F16)
}

fn torch_dtype(d: Dtype) -> &'static str {
    match d {
        Dtype::BF16 => "bfloat16",
        Dtype::F16 => "float16",
        _ => "float32",
    }
}

/// bitsandbytes' quant-state JSON, laid out as Python's `json.dumps` writes it.
fn quant_state_json(shape: [usize; 2], dtype: &str, nested_offset: Option<f32>) -> String {
    let mut s = format!(
        "{{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"{dtype}\", \"shape\": [{}, {}]",
        shape[0], shape[1]
    );
    if let Some(offset) = nested_offset {
        // Python prints the float repr of the f32 offset widened to f64; Rust's `{}` for f64 is
        // the same shortest round-trip form.
        let mut repr = format!("{}", offset as f64);
        if !repr.contains(['.', 'e', 'E']) {
            repr.push_str(".0");
        }
        s.push_str(&format!(
            ", \"nested_blocksize\": {NESTED_BLOCK}, \"nested_dtype\": \"float32\", \"nested_offset\": {repr}"
        ));
    }
    s.push('}');
    s
}

/// The dtype unquantized tensors are written in (and the `dtype` of each quant state, which is
/// what bitsandbytes dequantizes to).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageDtype {
    /// float32 (what `transformers` writes after loading with `dtype=torch.float32`).
    F32,
    /// bfloat16.
    Bf16,
    /// float16.
    F16,
}

impl StorageDtype {
    fn safetensors(self) -> Dtype {
        match self {
            StorageDtype::F32 => Dtype::F32,
            StorageDtype::Bf16 => Dtype::BF16,
            StorageDtype::F16 => Dtype::F16,
        }
    }
}

/// How to quantize a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantizeOptions {
    /// Quantize absmax to 8 bits as well.
    pub double_quant: bool,
    /// Convert unquantized tensors to this dtype (`None` keeps each as stored).
    pub dtype: Option<StorageDtype>,
    /// The torch intra-op thread count to reproduce under double quantization: bitsandbytes
    /// centres absmax on `absmax.mean()`, and torch sums a projection of two million weights or
    /// more (32768 absmax values) in one chunk per thread, so the offset's last bit — and with
    /// it an occasional 8-bit code — depends on it (`nf4::format::torch_sum`). torch's default
    /// is the number of physical cores.
    pub torch_threads: usize,
}

fn convert(name: &str, values: &[u8], from: Dtype, to: Dtype) -> Result<Vec<u8>> {
    if from == to || !matches!(from, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
        return Ok(values.to_vec());
    }
    let f = to_f32(name, from, values)?;
    Ok(match to {
        Dtype::BF16 => f
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        Dtype::F16 => f
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => f.iter().flat_map(|v| v.to_le_bytes()).collect(),
    })
}

/// Quantizes the dense checkpoint in `src` into `out` (created if needed).
pub fn quantize_checkpoint(
    src: &Path,
    out: &Path,
    options: QuantizeOptions,
) -> Result<QuantizeReport> {
    let double_quant = options.double_quant;
    let config_path = src.join("config.json");
    let config = Qwen2Config::from_file(&config_path)?;
    if config.quantization_config.is_some() {
        return Err(ModelError::Config {
            path: config_path,
            message: "the checkpoint is already quantized".into(),
        });
    }
    let ck = Checkpoint::open_dir(src)?;
    let mut tensors = Vec::new();
    let mut quantized = 0;
    let mut targets = HashMap::new();
    for i in 0..config.num_hidden_layers {
        for p in PROJECTIONS {
            targets.insert(format!("model.layers.{i}.{p}.weight"), ());
        }
    }
    for name in ck.names() {
        let raw = ck.raw(&name)?;
        if !targets.contains_key(&name) {
            let dtype = options
                .dtype
                .map(StorageDtype::safetensors)
                .filter(|_| is_float(raw.dtype))
                .unwrap_or(raw.dtype);
            let data = convert(&name, raw.data, raw.dtype, dtype)?;
            tensors.push(OutTensor {
                name: name.clone(),
                dtype,
                shape: raw.shape.clone(),
                data,
            });
            continue;
        }
        if raw.shape.len() != 2 {
            return Err(ModelError::Shape {
                name,
                found: raw.shape,
                expected: vec![0, 0],
            });
        }
        let shape = [raw.shape[0], raw.shape[1]];
        let values = to_f32(&name, raw.dtype, raw.data)?;
        let q = quantize_nf4(&values);
        let n = shape[0] * shape[1];
        tensors.push(OutTensor::u8(
            name.clone(),
            vec![n.div_ceil(2), 1],
            q.packed,
        ));
        tensors.push(OutTensor::f32(
            format!("{name}.quant_map"),
            vec![16],
            &NF4_CODE,
        ));
        let offset = if double_quant {
            let nested = quantize_absmax(&q.absmax, options.torch_threads);
            tensors.push(OutTensor::u8(
                format!("{name}.absmax"),
                vec![q.absmax.len()],
                nested.quantized,
            ));
            tensors.push(OutTensor::f32(
                format!("{name}.nested_absmax"),
                vec![nested.nested_absmax.len()],
                &nested.nested_absmax,
            ));
            tensors.push(OutTensor::f32(
                format!("{name}.nested_quant_map"),
                vec![256],
                &nested.nested_code,
            ));
            Some(nested.offset)
        } else {
            tensors.push(OutTensor::f32(
                format!("{name}.absmax"),
                vec![q.absmax.len()],
                &q.absmax,
            ));
            None
        };
        let state_dtype = options
            .dtype
            .map(StorageDtype::safetensors)
            .unwrap_or(raw.dtype);
        let state = quant_state_json(shape, torch_dtype(state_dtype), offset).into_bytes();
        let len = state.len();
        tensors.push(OutTensor::u8(
            format!("{name}.quant_state.bitsandbytes__nf4"),
            vec![len],
            state,
        ));
        quantized += 1;
    }
    if quantized != targets.len() {
        let missing = targets
            .keys()
            .find(|k| !ck.contains(k))
            .cloned()
            .unwrap_or_default();
        return Err(ModelError::MissingTensor {
            name: missing,
            dir: src.to_path_buf(),
        });
    }
    std::fs::create_dir_all(out).map_err(|e| ModelError::io(out, e))?;
    let copied = tensors.len() - quantized * if double_quant { 6 } else { 4 };
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    let weights = out.join("model.safetensors");
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    write_safetensors(&weights, &tensors, Some(meta))?;

    // config.json with the quantization_config transformers writes.
    let text =
        std::fs::read_to_string(&config_path).map_err(|e| ModelError::io(&config_path, e))?;
    let mut json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| ModelError::Json {
            path: config_path.clone(),
            message: e.to_string(),
        })?;
    let compute_dtype = options
        .dtype
        .map(|d| torch_dtype(d.safetensors()))
        .unwrap_or("float32");
    if let Some(d) = options.dtype {
        json["dtype"] = serde_json::Value::from(torch_dtype(d.safetensors()));
    }
    json["quantization_config"] = serde_json::json!({
        "_load_in_4bit": true,
        "_load_in_8bit": false,
        "bnb_4bit_compute_dtype": compute_dtype,
        "bnb_4bit_quant_storage": "uint8",
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": double_quant,
        "llm_int8_enable_fp32_cpu_offload": false,
        "llm_int8_has_fp16_weight": false,
        "llm_int8_skip_modules": null,
        "llm_int8_threshold": 6.0,
        "load_in_4bit": true,
        "load_in_8bit": false,
        "quant_method": "bitsandbytes"
    });
    let pretty = serde_json::to_string_pretty(&json).map_err(|e| ModelError::Json {
        path: config_path,
        message: e.to_string(),
    })?;
    write_atomic(&out.join("config.json"), pretty.as_bytes())?;
    for extra in [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        let from = src.join(extra);
        if from.exists() {
            let bytes = std::fs::read(&from).map_err(|e| ModelError::io(&from, e))?;
            write_atomic(&out.join(extra), &bytes)?;
        }
    }
    let bytes = std::fs::metadata(&weights)
        .map_err(|e| ModelError::io(&weights, e))?
        .len();
    Ok(QuantizeReport {
        quantized,
        copied,
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quant_state_json_matches_bitsandbytes_text() {
        assert_eq!(
            quant_state_json([64, 64], "float32", Some(0.521_759_03)),
            "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float32\", \"shape\": [64, 64], \"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": 0.521759033203125}"
        );
        assert_eq!(
            quant_state_json([64, 64], "float32", None),
            "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float32\", \"shape\": [64, 64]}"
        );
    }
}
