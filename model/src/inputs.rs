//! Per-step model inputs built on the host: token ids, rotary tables from position ids derived
//! from the attention mask, and the additive attention mask for left-padded batches.
//!
//! Position ids follow `transformers`' `generate()`: the cumulative sum of the attention mask
//! minus one, with padding positions set to 1. RoPE is the non-interleaved ("rotate half") form
//! with `inv_freq[i] = 1 / base^(2i / head_dim)`, computed in f32 as `transformers` does.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};

/// The precision of RoPE's inverse frequencies.
///
/// `transformers` computes `inv_freq` in f32 when it builds a model, and keeps it in a buffer;
/// casting the model (`model.to(torch.bfloat16)`, `.half()`) rounds that buffer, and every later
/// forward pass — even after casting back to f32 — uses the rounded frequencies. `F32` matches a
/// model loaded with `from_pretrained(..., dtype=torch.float32)`; `Bf16` / `F16` match a model
/// that was cast to that dtype at some point (the `tiny-qwen2` fixture's reference was made so).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeFrequencies {
    /// f32 frequencies, as computed at model construction.
    #[default]
    F32,
    /// Frequencies rounded to bf16.
    Bf16,
    /// Frequencies rounded to f16.
    F16,
}

impl RopeFrequencies {
    /// Rounds one frequency to this precision.
    pub fn round(self, f: f32) -> f32 {
        match self {
            RopeFrequencies::F32 => f,
            RopeFrequencies::Bf16 => half::bf16::from_f32(f).to_f32(),
            RopeFrequencies::F16 => half::f16::from_f32(f).to_f32(),
        }
    }
}

/// Position ids for one row of an attention mask (1 = token, 0 = padding).
pub fn positions_from_mask(mask: &[u8]) -> Vec<i64> {
    let mut count = 0i64;
    mask.iter()
        .map(|&m| {
            count += m as i64;
            if m == 0 { 1 } else { count - 1 }
        })
        .collect()
}

/// Inputs of one forward call.
#[derive(Clone, Debug)]
pub struct StepInput<B: Backend> {
    /// Token ids of this step, `[batch, seq]`.
    pub input_ids: Tensor<B, 2, Int>,
    /// RoPE cosines for the query heads, `[batch, heads, seq, head_dim]`.
    pub cos_q: Tensor<B, 4>,
    /// RoPE sines for the query heads, `[batch, heads, seq, head_dim]`.
    pub sin_q: Tensor<B, 4>,
    /// RoPE cosines for the key heads, `[batch, kv_heads, seq, head_dim]`.
    pub cos_k: Tensor<B, 4>,
    /// RoPE sines for the key heads, `[batch, kv_heads, seq, head_dim]`.
    pub sin_k: Tensor<B, 4>,
    /// Additive attention bias, `[batch, heads, seq, cached + seq]`: 0 where a query may attend,
    /// the most negative f32 where it may not (a fully masked padding row stays finite).
    ///
    /// The tables are repeated per head on the host rather than broadcast on the device:
    /// broadcasting elementwise operations are an order of magnitude slower than same-shape
    /// ones on burn's CPU backends, and the repeated tables are no larger than the scores.
    pub mask: Tensor<B, 4>,
}

impl<B: Backend> StepInput<B> {
    /// Builds the inputs for tokens `ids` (`[batch][seq]`) appended after `past` cached
    /// positions, given the attention mask over all `past + seq` positions of each row.
    pub fn new(
        config: &Qwen2Config,
        rope: RopeFrequencies,
        ids: &[Vec<u32>],
        mask: &[Vec<u8>],
        past: usize,
        device: &B::Device,
    ) -> Result<Self> {
        let batch = ids.len();
        let seq = ids.first().map(Vec::len).unwrap_or(0);
        if batch == 0 || seq == 0 {
            return Err(ModelError::Input("empty batch or sequence".into()));
        }
        if mask.len() != batch {
            return Err(ModelError::Input(format!(
                "{} mask rows for {batch} sequences",
                mask.len()
            )));
        }
        let total = past + seq;
        for (b, (row, m)) in ids.iter().zip(mask).enumerate() {
            if row.len() != seq {
                return Err(ModelError::Input(format!(
                    "row {b} has {} tokens, row 0 has {seq}",
                    row.len()
                )));
            }
            if m.len() != total {
                return Err(ModelError::Input(format!(
                    "mask row {b} has {} entries, expected {total} (cached {past} + new {seq})",
                    m.len()
                )));
            }
            if let Some(&bad) = row.iter().find(|&&t| t as usize >= config.vocab_size) {
                return Err(ModelError::Input(format!(
                    "token id {bad} is outside the vocabulary ({})",
                    config.vocab_size
                )));
            }
        }
        let head_dim = config.head_dim();
        let half = head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                rope.round(1.0 / (config.rope_base() as f32).powf((2 * i) as f32 / head_dim as f32))
            })
            .collect();
        let (heads, kv_heads) = (config.num_attention_heads, config.num_kv_heads());
        // One row's tables, then repeated per head.
        let mut cos = Vec::with_capacity(batch * seq * head_dim);
        let mut sin = Vec::with_capacity(batch * seq * head_dim);
        let mut bias = Vec::with_capacity(batch * seq * total);
        for m in mask {
            let positions = positions_from_mask(m);
            for q in 0..seq {
                let pos = positions[past + q] as f32;
                let angles: Vec<f32> = inv_freq.iter().map(|f| pos * f).collect();
                for _ in 0..2 {
                    cos.extend(angles.iter().map(|a| (*a as f64).cos() as f32));
                    sin.extend(angles.iter().map(|a| (*a as f64).sin() as f32));
                }
                let query = past + q;
                bias.extend((0..total).map(|k| {
                    if k <= query && m[k] != 0 {
                        0.0
                    } else {
                        f32::MIN
                    }
                }));
            }
        }
        let per_head = |values: &[f32], n: usize, width: usize| -> Vec<f32> {
            let row = seq * width;
            let mut out = Vec::with_capacity(batch * n * row);
            for b in 0..batch {
                for _ in 0..n {
                    out.extend_from_slice(&values[b * row..(b + 1) * row]);
                }
            }
            out
        };
        let table = |values: Vec<f32>, n: usize, width: usize| {
            Tensor::from_data(TensorData::new(values, [batch, n, seq, width]), device)
        };
        let ids: Vec<i64> = ids.iter().flatten().map(|&t| t as i64).collect();
        Ok(Self {
            input_ids: Tensor::from_data(TensorData::new(ids, [batch, seq]), device),
            cos_q: table(per_head(&cos, heads, head_dim), heads, head_dim),
            sin_q: table(per_head(&sin, heads, head_dim), heads, head_dim),
            cos_k: table(per_head(&cos, kv_heads, head_dim), kv_heads, head_dim),
            sin_k: table(per_head(&sin, kv_heads, head_dim), kv_heads, head_dim),
            mask: table(per_head(&bias, heads, total), heads, total),
        })
    }

    /// Applies the rotary embedding to queries `[batch, heads, seq, head_dim]`.
    pub fn rotate_q(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        rotate(x, &self.cos_q, &self.sin_q)
    }

    /// Applies the rotary embedding to keys `[batch, kv_heads, seq, head_dim]`.
    pub fn rotate_k(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        rotate(x, &self.cos_k, &self.sin_k)
    }
}

/// `x · cos + rotate_half(x) · sin`, with `rotate_half(x) = [-x₂, x₁]`.
fn rotate<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 4>, sin: &Tensor<B, 4>) -> Tensor<B, 4> {
    let [b, h, s, d] = x.dims();
    let half = d / 2;
    let x1 = x.clone().slice([0..b, 0..h, 0..s, 0..half]);
    let x2 = x.clone().slice([0..b, 0..h, 0..s, half..d]);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos.clone() + rotated * sin.clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_follow_transformers() {
        assert_eq!(
            positions_from_mask(&[0, 0, 0, 1, 1, 1]),
            vec![1, 1, 1, 0, 1, 2]
        );
        assert_eq!(positions_from_mask(&[1, 1, 1]), vec![0, 1, 2]);
    }
}
