//! The inputs of one forward call: the new tokens of every sequence packed one after another
//! (no padding anywhere inside the model), with their positions and rotary tables.
//!
//! A step is a list of segments, each continuing one sequence after the positions it already
//! has (in a [`KvCache`](crate::KvCache) row, or none). Left-padded `[batch, seq]` inputs with
//! an attention mask, as `transformers` takes them, are packed by dropping the masked tokens;
//! their position ids follow `transformers`' `generate()` (the cumulative sum of the mask minus
//! one), and the outputs are scattered back to `[batch, seq, …]` with zeros where the mask is 0.
//!
//! Training batches whose sequences begin alike (a GRPO group's samples share their prompt) can
//! be packed with that beginning stored once ([`SharedPacking`], [`StepInput::shared`]): every
//! projection, norm and the output head then run on it once, and only attention, whose rows
//! are gathered per sequence, sees each sequence whole.
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

/// How packed rows map to the whole sequences attention sees, for an input whose sequences
/// share stored prefixes ([`StepInput::shared`]).
#[derive(Clone, Debug)]
pub struct Expansion<B: Backend> {
    /// For every row of the sequences laid whole one after another, its packed row, `[m]`.
    pub expand: Tensor<B, 1, Int>,
    /// For every packed row, one whole-sequence row that holds it, `[n]`.
    pub pick: Tensor<B, 1, Int>,
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
    /// Where each segment's tokens sit in the packed rows; with an [`Expansion`], where each
    /// sequence sits in the whole-sequence rows attention works on.
    pub spans: Vec<Span>,
    /// The cache row each segment continues (cached steps only).
    pub rows: Vec<usize>,
    /// Positions already cached for each segment.
    pub past: Vec<usize>,
    /// How to scatter outputs back to a padded input, when the step came from one.
    pub padding: Option<Padding>,
    /// For sequences packed with shared prefixes stored once, how attention gathers them whole.
    pub expansion: Option<Expansion<B>>,
}

/// A packing of sequences in which consecutive sequences that begin with the same tokens store
/// that beginning once: a group of sequences is laid out as their common prefix, then each
/// member's remaining tokens. Every member keeps at least one token of its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedPacking {
    /// Packed row of every token of every sequence, sequence after sequence (`Σ len_i`).
    rows: Vec<usize>,
    /// Where each sequence's tokens start in `rows`; one more entry than sequences.
    starts: Vec<usize>,
    /// Token id of every packed row.
    ids: Vec<u32>,
    /// Position of every packed row within its sequence.
    positions: Vec<usize>,
}

impl SharedPacking {
    /// Groups consecutive sequences greedily: a sequence joins the current group when it
    /// begins with at least `min_shared` of the group's first sequence's tokens and joining
    /// does not lower the tokens the group saves; the group's prefix is then the longest one
    /// every member begins with, leaving each member one token of its own at least. With
    /// `min_shared` 0 nothing is shared (every sequence is packed whole).
    pub fn new(seqs: &[&[u32]], min_shared: usize) -> Self {
        // (first sequence, members, prefix length)
        let mut groups: Vec<(usize, usize, usize)> = Vec::new();
        for (i, seq) in seqs.iter().enumerate() {
            if min_shared > 0
                && let Some((first, members, prefix)) = groups.last_mut()
            {
                let lead = seqs[*first];
                let common = lead
                    .iter()
                    .zip(seq.iter())
                    .take_while(|(a, b)| a == b)
                    .count();
                let limit = common.min(seq.len().saturating_sub(1));
                let shared = if *members == 1 {
                    limit.min(lead.len().saturating_sub(1))
                } else {
                    limit.min(*prefix)
                };
                // Saved tokens: prefix × (members - 1), before and after joining.
                if shared >= min_shared && shared * *members >= *prefix * (*members - 1) {
                    *members += 1;
                    *prefix = shared;
                    continue;
                }
            }
            groups.push((i, 1, 0));
        }
        let total: usize = seqs.iter().map(|s| s.len()).sum();
        let mut out = Self {
            rows: Vec::with_capacity(total),
            starts: Vec::with_capacity(seqs.len() + 1),
            ids: Vec::new(),
            positions: Vec::new(),
        };
        for (first, members, prefix) in groups {
            let base = out.ids.len();
            out.ids.extend_from_slice(&seqs[first][..prefix]);
            out.positions.extend(0..prefix);
            for seq in &seqs[first..first + members] {
                out.starts.push(out.rows.len());
                let own = out.ids.len();
                out.rows.extend(base..base + prefix);
                out.rows.extend(own..own + seq.len() - prefix);
                out.ids.extend_from_slice(&seq[prefix..]);
                out.positions.extend(prefix..seq.len());
            }
        }
        out.starts.push(out.rows.len());
        out
    }

    /// Number of packed rows (tokens computed by the projections).
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Number of sequences.
    pub fn num_sequences(&self) -> usize {
        self.starts.len() - 1
    }

    /// The packed row of every token of sequence `i`.
    pub fn sequence_rows(&self, i: usize) -> &[usize] {
        &self.rows[self.starts[i]..self.starts[i + 1]]
    }

    /// Whether any row is shared by two sequences.
    pub fn shares(&self) -> bool {
        self.rows.len() > self.ids.len()
    }

    /// Checks that the packing was built from `seqs` (as many sequences, of the same lengths).
    pub(crate) fn check(&self, seqs: &[&[u32]]) -> Result<()> {
        if self.num_sequences() != seqs.len()
            || (0..seqs.len()).any(|i| self.sequence_rows(i).len() != seqs[i].len())
        {
            return Err(ModelError::Input(
                "the shared packing was built from other sequences".into(),
            ));
        }
        Ok(())
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

/// One sequence's new tokens for [`StepInput::packed`]: `ids` continue after `past` positions.
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a> {
    /// The new tokens.
    pub ids: &'a [u32],
    /// Positions the sequence already has (its first new token's position).
    pub past: usize,
}

impl Segment<'_> {
    /// Checks that segment `i` has tokens, all in the vocabulary, at positions the rotary
    /// table covers.
    fn check(&self, i: usize, config: &Qwen2Config, positions: usize) -> Result<()> {
        if self.ids.is_empty() {
            return Err(ModelError::Input(format!("sequence {i} has no new tokens")));
        }
        if let Some(&bad) = self.ids.iter().find(|&&t| t as usize >= config.vocab_size) {
            return Err(ModelError::Input(format!(
                "token id {bad} is outside the vocabulary ({})",
                config.vocab_size
            )));
        }
        let end = self.past + self.ids.len();
        if end > positions {
            return Err(ModelError::Input(format!(
                "sequence {i} reaches position {end}, beyond the {positions} positions this \
                 model supports"
            )));
        }
        Ok(())
    }
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
            seg.check(i, config, rotary.positions())?;
            let end = seg.past + seg.ids.len();
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

    /// Packs sequences (nothing cached) as `packing` lays them out, `packing` built from the
    /// same `seqs`: each packed row is computed once, and attention gathers every sequence
    /// whole through an [`Expansion`] when rows are shared.
    pub fn shared(
        config: &Qwen2Config,
        rotary: &RotaryEmbedding<B>,
        seqs: &[&[u32]],
        packing: &SharedPacking,
        device: &B::Device,
    ) -> Result<Self> {
        let segments: Vec<Segment<'_>> = seqs.iter().map(|ids| Segment { ids, past: 0 }).collect();
        packing.check(seqs)?;
        if !packing.shares() {
            return Self::packed(config, rotary, &segments, device);
        }
        if segments.is_empty() {
            return Err(ModelError::Input(
                "a step needs at least one sequence".into(),
            ));
        }
        let mut spans = Vec::with_capacity(seqs.len());
        for (i, seg) in segments.iter().enumerate() {
            seg.check(i, config, rotary.positions())?;
            let start = spans.last().map_or(0, |s: &Span| s.start + s.len);
            spans.push(Span {
                start,
                len: seg.ids.len(),
            });
        }
        let ids = packing.ids.iter().map(|&t| t as i64).collect();
        let positions = packing.positions.iter().map(|&p| p as i64).collect();
        let mut input = Self::build(
            config,
            rotary,
            ids,
            positions,
            spans,
            vec![0; seqs.len()],
            device,
        );
        let mut pick = vec![0i64; packing.len()];
        for (e, &r) in packing.rows.iter().enumerate().rev() {
            pick[r] = e as i64;
        }
        let index = |v: Vec<i64>| {
            let n = v.len();
            Tensor::<B, 1, Int>::from_data(TensorData::new(v, [n]), device)
        };
        input.expansion = Some(Expansion {
            expand: index(packing.rows.iter().map(|&r| r as i64).collect()),
            pick: index(pick),
        });
        Ok(input)
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
            expansion: None,
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
    fn shared_packing_groups_consecutive_sequences_that_begin_alike() {
        let rows = |p: &SharedPacking| -> Vec<Vec<usize>> {
            (0..p.num_sequences())
                .map(|i| p.sequence_rows(i).to_vec())
                .collect()
        };
        let seqs: [&[u32]; 4] = [&[1, 2, 3, 4], &[1, 2, 3, 5, 6], &[1, 2, 3, 4], &[9, 2]];
        // Nothing shared: every sequence whole, one after another.
        let whole = SharedPacking::new(&seqs, 0);
        assert!(!whole.shares());
        assert_eq!(whole.len(), 15);
        assert_eq!(rows(&whole)[3], vec![13, 14]);
        // [1, 2, 3] once, then 4 | 5, 6 | 4; [9, 2] alone.
        let p = SharedPacking::new(&seqs, 2);
        assert_eq!(
            rows(&p),
            vec![
                vec![0, 1, 2, 3],
                vec![0, 1, 2, 4, 5],
                vec![0, 1, 2, 6],
                vec![7, 8]
            ]
        );
        assert_eq!(p.ids, vec![1, 2, 3, 4, 5, 6, 4, 9, 2]);
        assert_eq!(p.positions, vec![0, 1, 2, 3, 3, 4, 3, 0, 1]);
        // A prefix shorter than `min_shared` is not shared.
        assert!(!SharedPacking::new(&seqs, 4).shares());
        // Equal sequences keep one token each.
        let same: [&[u32]; 3] = [&[4, 5, 6], &[4, 5, 6], &[4, 5, 6]];
        let p = SharedPacking::new(&same, 1);
        assert_eq!(rows(&p), vec![vec![0, 1, 2], vec![0, 1, 3], vec![0, 1, 4]]);
        // A member that would shorten the prefix more than it saves starts its own group.
        let long: [&[u32]; 3] = [&[1, 2, 3, 4, 5, 6, 7], &[1, 2, 3, 4, 5, 6, 8], &[1, 2, 9]];
        let p = SharedPacking::new(&long, 2);
        assert_eq!(rows(&p)[2], vec![8, 9, 10]);
        assert_eq!(p.len(), 11);
    }

    #[test]
    fn positions_follow_transformers() {
        assert_eq!(
            positions_from_mask(&[0, 0, 0, 1, 1, 1]),
            vec![1, 1, 1, 0, 1, 2]
        );
        assert_eq!(positions_from_mask(&[1, 1, 1]), vec![0, 1, 2]);
    }
}
