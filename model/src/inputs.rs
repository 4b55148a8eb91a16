//! The inputs of one forward call: the new tokens of every sequence packed one after another
//! (no padding anywhere inside the model), with their positions and rotary tables.
//!
//! A step is a list of segments, each continuing one sequence after the positions it already
//! has (in a [`KvCache`](crate::KvCache) row, or none). Left-padded `[batch, seq]` inputs with
//! an attention mask, as `transformers` takes them, are packed by dropping the masked tokens;
//! their position ids follow `transformers`' `generate()` (the cumulative sum of the mask minus
//! one), and the outputs are scattered back to `[batch, seq, …]` with zeros where the mask is 0.
//!
//! RoPE is the non-interleaved ("rotate half") form with `inv_freq[i] = 1 / base^(2i / d)` in
//! f32, as `transformers` builds it; the cosine and sine tables are computed once per model
//! ([`RotaryEmbedding`]) and gathered on the device by position.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::backend::Span;
use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};

/// Cosine and sine of every position's rotary angles, `[positions, head_dim]`, with the sign of
/// `rotate_half` folded into the sine (its first half negated), so a rotation is
/// `x · cos + swap_halves(x) · sin`.
#[derive(Module, Debug)]
pub struct RotaryEmbedding<B: Backend> {
    /// Cosines, `[positions, head_dim]`.
    pub cos: Tensor<B, 2>,
    /// Signed sines, `[positions, head_dim]`.
    pub sin: Tensor<B, 2>,
}

/// Positions the rotary tables cover when the configuration allows more (a longer table costs
/// `8 · head_dim` bytes per position).
pub const MAX_ROTARY_POSITIONS: usize = 32_768;

impl<B: Backend> RotaryEmbedding<B> {
    /// The tables for a configuration, up to `min(max_position_embeddings, 32768)` positions.
    pub fn new(config: &Qwen2Config, device: &B::Device) -> Self {
        let d = config.head_dim();
        let half = d / 2;
        let positions = config
            .max_position_embeddings
            .clamp(1, MAX_ROTARY_POSITIONS);
        let base = config.rope_base() as f32;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
            .collect();
        let mut cos = Vec::with_capacity(positions * d);
        let mut sin = Vec::with_capacity(positions * d);
        for p in 0..positions {
            // The angle in f32 (as `transformers` multiplies), its cosine and sine in f64.
            let angles: Vec<f64> = inv_freq.iter().map(|f| (p as f32 * f) as f64).collect();
            for sign in [-1.0, 1.0] {
                cos.extend(angles.iter().map(|a| a.cos() as f32));
                sin.extend(angles.iter().map(|a| (sign * a.sin()) as f32));
            }
        }
        let table = |v: Vec<f32>| Tensor::from_data(TensorData::new(v, [positions, d]), device);
        Self {
            cos: table(cos),
            sin: table(sin),
        }
    }

    /// Number of positions covered.
    pub fn positions(&self) -> usize {
        self.cos.dims()[0]
    }
}

/// How a packed step maps back to a left-padded `[batch, seq]` input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Padding {
    /// Rows of the padded input.
    pub batch: usize,
    /// Columns of the padded input.
    pub seq: usize,
    /// For every padded position (row-major), its packed index, or the packed length (one past
    /// the end: a zero row) where the mask is 0.
    pub gather: Vec<i64>,
}

/// Inputs of one forward call.
#[derive(Clone, Debug)]
pub struct StepInput<B: Backend> {
    /// Token ids of this step, packed, `[n]`.
    pub input_ids: Tensor<B, 1, Int>,
    /// Rotary cosines per query head, `[n, heads · head_dim]`.
    pub cos_q: Tensor<B, 2>,
    /// Signed rotary sines per query head, `[n, heads · head_dim]`.
    pub sin_q: Tensor<B, 2>,
    /// Rotary cosines per key head, `[n, kv_heads · head_dim]`.
    pub cos_k: Tensor<B, 2>,
    /// Signed rotary sines per key head, `[n, kv_heads · head_dim]`.
    pub sin_k: Tensor<B, 2>,
    /// Where each segment's tokens sit in the packed rows.
    pub spans: Vec<Span>,
    /// The cache row each segment continues (cached steps only).
    pub rows: Vec<usize>,
    /// Positions already cached for each segment.
    pub past: Vec<usize>,
    /// How to scatter outputs back to a padded input, when the step came from one.
    pub padding: Option<Padding>,
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

/// One sequence's new tokens for [`StepInput::packed`]: `ids` continue after `past` positions.
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a> {
    /// The new tokens.
    pub ids: &'a [u32],
    /// Positions the sequence already has (its first new token's position).
    pub past: usize,
}

impl<B: Backend> StepInput<B> {
    /// Packs `segments` into one step. Every segment must have at least one token, every token
    /// must be in the vocabulary, and every position must be inside the rotary table.
    pub fn packed(
        config: &Qwen2Config,
        rotary: &RotaryEmbedding<B>,
        segments: &[Segment<'_>],
        device: &B::Device,
    ) -> Result<Self> {
        if segments.is_empty() {
            return Err(ModelError::Input(
                "a step needs at least one sequence".into(),
            ));
        }
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::with_capacity(segments.len());
        for (i, seg) in segments.iter().enumerate() {
            if seg.ids.is_empty() {
                return Err(ModelError::Input(format!("sequence {i} has no new tokens")));
            }
            if let Some(&bad) = seg.ids.iter().find(|&&t| t as usize >= config.vocab_size) {
                return Err(ModelError::Input(format!(
                    "token id {bad} is outside the vocabulary ({})",
                    config.vocab_size
                )));
            }
            let end = seg.past + seg.ids.len();
            if end > rotary.positions() {
                return Err(ModelError::Input(format!(
                    "sequence {i} reaches position {end}, beyond the {} positions this model \
                     supports",
                    rotary.positions()
                )));
            }
            spans.push(Span {
                start: ids.len(),
                len: seg.ids.len(),
            });
            ids.extend(seg.ids.iter().map(|&t| t as i64));
            positions.extend((seg.past..end).map(|p| p as i64));
        }
        let past = segments.iter().map(|s| s.past).collect();
        Ok(Self::build(
            config, rotary, ids, positions, spans, past, device,
        ))
    }

    /// Packs a left-padded batch: `ids` `[batch][seq]` with `mask` `[batch][seq]` (1 = token),
    /// nothing cached. Masked tokens are dropped; outputs can be scattered back with
    /// [`StepInput::padding`].
    pub fn padded(
        config: &Qwen2Config,
        rotary: &RotaryEmbedding<B>,
        ids: &[Vec<u32>],
        mask: &[Vec<u8>],
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
        let mut rows = Vec::with_capacity(batch);
        let mut packed_of = vec![-1i64; batch * seq];
        let mut n = 0i64;
        for (b, (row, m)) in ids.iter().zip(mask).enumerate() {
            if row.len() != seq {
                return Err(ModelError::Input(format!(
                    "row {b} has {} tokens, row 0 has {seq}",
                    row.len()
                )));
            }
            if m.len() != seq {
                return Err(ModelError::Input(format!(
                    "mask row {b} has {} entries, expected {seq}",
                    m.len()
                )));
            }
            let kept: Vec<u32> = row
                .iter()
                .zip(m)
                .enumerate()
                .filter(|(_, (_, m))| **m != 0)
                .map(|(t, (&id, _))| {
                    packed_of[b * seq + t] = n;
                    n += 1;
                    id
                })
                .collect();
            if kept.is_empty() {
                return Err(ModelError::Input(format!("row {b} is all padding")));
            }
            rows.push(kept);
        }
        let segments: Vec<Segment<'_>> = rows.iter().map(|r| Segment { ids: r, past: 0 }).collect();
        let mut input = Self::packed(config, rotary, &segments, device)?;
        input.padding = Some(Padding {
            batch,
            seq,
            gather: packed_of
                .into_iter()
                .map(|i| if i < 0 { n } else { i })
                .collect(),
        });
        Ok(input)
    }

    fn build(
        config: &Qwen2Config,
        rotary: &RotaryEmbedding<B>,
        ids: Vec<i64>,
        positions: Vec<i64>,
        spans: Vec<Span>,
        past: Vec<usize>,
        device: &B::Device,
    ) -> Self {
        let n = ids.len();
        let d = config.head_dim();
        let (heads, kv_heads) = (config.num_attention_heads, config.num_kv_heads());
        let positions = Tensor::<B, 1, Int>::from_data(TensorData::new(positions, [n]), device);
        let cos = rotary.cos.clone().select(0, positions.clone());
        let sin = rotary.sin.clone().select(0, positions);
        // Repeated per head once per step (every layer reuses them): same-shape element-wise
        // products are much faster than broadcasting ones on burn's CPU backend.
        let per_head = |t: &Tensor<B, 2>, h: usize| {
            t.clone()
                .reshape([n, 1, d])
                .repeat_dim(1, h)
                .reshape([n, h * d])
        };
        Self {
            input_ids: Tensor::from_data(TensorData::new(ids, [n]), device),
            cos_q: per_head(&cos, heads),
            sin_q: per_head(&sin, heads),
            cos_k: per_head(&cos, kv_heads),
            sin_k: per_head(&sin, kv_heads),
            spans,
            rows: Vec::new(),
            past,
            padding: None,
        }
    }

    /// Number of packed tokens.
    pub fn len(&self) -> usize {
        self.input_ids.dims()[0]
    }

    /// Whether the step has no tokens (never true for a built input).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Applies the rotary embedding to packed queries `[n, heads · head_dim]`.
    pub fn rotate_q(&self, x: Tensor<B, 2>, head_dim: usize) -> Tensor<B, 2> {
        rotate(x, &self.cos_q, &self.sin_q, head_dim)
    }

    /// Applies the rotary embedding to packed keys `[n, kv_heads · head_dim]`.
    pub fn rotate_k(&self, x: Tensor<B, 2>, head_dim: usize) -> Tensor<B, 2> {
        rotate(x, &self.cos_k, &self.sin_k, head_dim)
    }

    /// Scatters packed rows `[n, width]` back to the padded layout `[batch, seq, width]`, with
    /// zeros where the mask was 0. Without padding information, returns `[1, n, width]`.
    pub fn unpack(&self, x: Tensor<B, 2>) -> Tensor<B, 3> {
        let [n, width] = x.dims();
        let Some(padding) = &self.padding else {
            return x.reshape([1, n, width]);
        };
        let device = x.device();
        let extended = Tensor::cat(vec![x, Tensor::zeros([1, width], &device)], 0);
        let index = Tensor::<B, 1, Int>::from_data(
            TensorData::new(padding.gather.clone(), [padding.gather.len()]),
            &device,
        );
        extended
            .select(0, index)
            .reshape([padding.batch, padding.seq, width])
    }
}

/// `x · cos + swap_halves(x) · sin` per head, with the sign of `rotate_half` folded into `sin`.
fn rotate<B: Backend>(
    x: Tensor<B, 2>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    head_dim: usize,
) -> Tensor<B, 2> {
    let [n, width] = x.dims();
    let half = head_dim / 2;
    let heads = x.clone().reshape([n, width / head_dim, 2, half]);
    let swapped = Tensor::cat(
        vec![heads.clone().narrow(2, 1, 1), heads.narrow(2, 0, 1)],
        2,
    )
    .reshape([n, width]);
    x * cos.clone() + swapped * sin.clone()
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
