//! Teacher-forced log-probabilities of given sequences, the quantity a trainer's loss is built
//! on: packed (no padding), computed a chunk of positions at a time with the output head inside
//! the chunk, with the entropy of each position's distribution alongside. Differentiable under
//! autodiff; see [`crate::train`] for the backward pass with per-layer checkpointing.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::backend::ModelBackend;
use crate::error::{ModelError, Result};
use crate::inputs::SharedPacking;
use crate::qwen2::Qwen2ForCausalLM;

/// Per-token log-probabilities and entropies of packed sequences.
///
/// Entry `offsets[i] + t` (for `t < len_i - 1`) belongs to sequence `i`'s token `t + 1`:
/// `log p(seq_i[t + 1] | seq_i[..=t])` and the entropy of that distribution.
#[derive(Clone, Debug)]
pub struct SequenceLogprobs<B: Backend> {
    /// Log-probabilities, `[Σ (len_i - 1)]`.
    pub logprobs: Tensor<B, 1>,
    /// Entropies, `[Σ (len_i - 1)]`.
    pub entropy: Tensor<B, 1>,
    /// Where each sequence's entries start; one more entry than sequences (the total last).
    pub offsets: Vec<usize>,
}

/// Which packed hidden rows predict a next token, and those tokens, for [`packed_logprobs`].
pub(crate) struct Targets {
    /// Packed row of every position whose next token is computed.
    pub rows: Vec<i64>,
    /// The next token of each of those positions.
    pub tokens: Vec<i64>,
    /// As in [`SequenceLogprobs::offsets`].
    pub offsets: Vec<usize>,
    /// When only some tokens are scored or some are computed once for several entries
    /// ([`targets_packed`]): for every entry of the full layout, its index among the computed
    /// ones, or `rows.len()` for an entry left at 0.
    pub spread: Option<Vec<i64>>,
}

/// Checks `seqs` and lists their prediction rows and targets.
pub(crate) fn targets(seqs: &[&[u32]]) -> Result<Targets> {
    if seqs.is_empty() {
        return Err(ModelError::Input("no sequences".into()));
    }
    let mut out = Targets {
        rows: Vec::new(),
        tokens: Vec::new(),
        offsets: vec![0],
        spread: None,
    };
    let mut start = 0;
    for (i, seq) in seqs.iter().enumerate() {
        if seq.len() < 2 {
            return Err(ModelError::Input(format!(
                "sequence {i} has {} token(s); log-probabilities need at least two",
                seq.len()
            )));
        }
        out.rows
            .extend((start..start + seq.len() - 1).map(|r| r as i64));
        out.tokens.extend(seq[1..].iter().map(|&t| t as i64));
        out.offsets.push(out.rows.len());
        start += seq.len();
    }
    Ok(out)
}

/// [`targets`] for sequences packed as `packing` lays them out: an entry reads its position's
/// packed row, and entries with the same row and next token (a shared prefix's) are computed
/// once. With `scored` (`scored[i][t]`: token `t` of sequence `i`, as long as the sequence;
/// token 0 has no prediction), only the marked tokens are computed and the others' entries are
/// 0; with no token marked at all, every token is computed (a loss then weights them all by 0,
/// and its backward pass still has a graph to run).
pub(crate) fn targets_packed(
    seqs: &[&[u32]],
    packing: &SharedPacking,
    scored: Option<&[&[bool]]>,
) -> Result<Targets> {
    let mut all = targets(seqs)?;
    packing.check(seqs)?;
    // Entry e of the full layout predicts token t + 1 of its sequence.
    let keep: Vec<bool> = match scored {
        None => vec![true; all.rows.len()],
        Some(scored) => {
            if scored.len() != seqs.len() {
                return Err(ModelError::Input(format!(
                    "{} scored masks for {} sequences",
                    scored.len(),
                    seqs.len()
                )));
            }
            if let Some(i) = (0..seqs.len()).find(|&i| scored[i].len() != seqs[i].len()) {
                return Err(ModelError::Input(format!(
                    "sequence {i} has {} tokens but {} scored flags",
                    seqs[i].len(),
                    scored[i].len()
                )));
            }
            scored.iter().flat_map(|m| m[1..].iter().copied()).collect()
        }
    };
    let any_kept = keep.iter().any(|k| *k);
    if !packing.shares() && (!any_kept || scored.is_none()) {
        return Ok(all);
    }
    let keep = |e: usize| keep[e] || !any_kept;
    let rows_of: Vec<i64> = (0..seqs.len())
        .flat_map(|i| {
            let rows = packing.sequence_rows(i);
            rows[..rows.len() - 1].iter().map(|&r| r as i64)
        })
        .collect();
    let mut index = std::collections::HashMap::new();
    let (mut rows, mut tokens) = (Vec::new(), Vec::new());
    let mut spread: Vec<i64> = (0..all.rows.len())
        .map(|e| {
            if !keep(e) {
                return -1;
            }
            let key = (rows_of[e], all.tokens[e]);
            *index.entry(key).or_insert_with(|| {
                rows.push(key.0);
                tokens.push(key.1);
                rows.len() as i64 - 1
            })
        })
        .collect();
    let zero = rows.len() as i64;
    spread
        .iter_mut()
        .filter(|s| **s < 0)
        .for_each(|s| *s = zero);
    all.rows = rows;
    all.tokens = tokens;
    all.spread = Some(spread);
    Ok(all)
}

impl Targets {
    /// Computed entries `values` (`[rows.len()]`) in the full layout, 0 where not scored.
    pub fn spread<B: Backend>(&self, values: Tensor<B, 1>) -> Tensor<B, 1> {
        let Some(spread) = &self.spread else {
            return values;
        };
        let device = values.device();
        let padded = Tensor::cat(vec![values, Tensor::zeros([1], &device)], 0);
        let index = Tensor::<B, 1, Int>::from_data(
            TensorData::new(spread.clone(), [spread.len()]),
            &device,
        );
        padded.select(0, index)
    }

    /// The hidden rows that predict a token, and the tokens, on `device`.
    pub fn select<B: Backend>(&self, hidden: Tensor<B, 2>) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
        let device = hidden.device();
        let n = self.rows.len();
        let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(self.rows.clone(), [n]), &device);
        let tokens =
            Tensor::<B, 1, Int>::from_data(TensorData::new(self.tokens.clone(), [n]), &device);
        (hidden.select(0, rows), tokens)
    }
}

/// Log-probabilities and entropies of every next token of `seqs` under
/// `log_softmax(logits / temperature)`, `chunk` positions of logits at a time.
pub fn packed_logprobs<B: ModelBackend>(
    model: &Qwen2ForCausalLM<B>,
    seqs: &[&[u32]],
    temperature: f64,
    chunk: usize,
    device: &B::Device,
) -> Result<SequenceLogprobs<B>> {
    let targets = targets(seqs)?;
    let input = model.packed_input(seqs, device)?;
    let hidden = model.forward_hidden(&input, None);
    Ok(head_logprobs(model, hidden, &targets, temperature, chunk))
}

/// The head stage: selects the predicting rows of the final hidden states and computes their
/// log-probabilities and entropies.
pub(crate) fn head_logprobs<B: ModelBackend>(
    model: &Qwen2ForCausalLM<B>,
    hidden: Tensor<B, 2>,
    targets: &Targets,
    temperature: f64,
    chunk: usize,
) -> SequenceLogprobs<B> {
    let (rows, tokens) = targets.select(hidden);
    let (logprobs, entropy) = model.token_logprobs(rows, tokens, temperature, chunk);
    SequenceLogprobs {
        logprobs: targets.spread(logprobs),
        entropy: targets.spread(entropy),
        offsets: targets.offsets.clone(),
    }
}

/// Teacher-forced log-probabilities of a left-padded batch: entry `[b, t]` is
/// `log p(ids[b][t + 1] | ids[b][..=t])` where the mask is 1 at `t` and `t + 1`, and 0
/// elsewhere. Rows must have equal length; `mask` marks real tokens.
///
/// # Shapes
/// - output: `[batch, seq - 1]`
pub fn sequence_logprobs<B: ModelBackend>(
    model: &Qwen2ForCausalLM<B>,
    ids: &[Vec<u32>],
    mask: &[Vec<u8>],
    temperature: f32,
    device: &B::Device,
) -> Result<Tensor<B, 2>> {
    let seq = ids.first().map(Vec::len).unwrap_or(0);
    if seq < 2 {
        return Err(ModelError::Input(
            "sequences need at least two tokens".into(),
        ));
    }
    if mask.len() != ids.len() || mask.iter().any(|m| m.len() != seq) {
        return Err(ModelError::Input(
            "the mask must match the ids' shape".into(),
        ));
    }
    // The real tokens of each row, and where each of their predictions goes in the output.
    let rows: Vec<Vec<u32>> = ids
        .iter()
        .zip(mask)
        .map(|(r, m)| {
            r.iter()
                .zip(m)
                .filter(|(_, m)| **m != 0)
                .map(|(&t, _)| t)
                .collect()
        })
        .collect();
    let kept: Vec<&[u32]> = rows
        .iter()
        .filter(|r| r.len() >= 2)
        .map(Vec::as_slice)
        .collect();
    let batch = ids.len();
    let mut gather = vec![-1i64; batch * (seq - 1)];
    let mut next = 0i64;
    for (b, m) in mask.iter().enumerate() {
        let real: Vec<usize> = (0..seq).filter(|&t| m[t] != 0).collect();
        if real.len() < 2 {
            continue;
        }
        for pair in real.windows(2) {
            // The prediction made at `pair[0]` is of the next real token; transformers' layout
            // puts it at column `pair[0]` when that token is the next column.
            if pair[1] == pair[0] + 1 {
                gather[b * (seq - 1) + pair[0]] = next;
            }
            next += 1;
        }
    }
    let total = next;
    let values = if kept.is_empty() {
        Tensor::<B, 1>::zeros([1], device)
    } else {
        let out = packed_logprobs(
            model,
            &kept,
            temperature as f64,
            crate::qwen2::DEFAULT_LOGPROB_CHUNK,
            device,
        )?;
        Tensor::cat(vec![out.logprobs, Tensor::zeros([1], device)], 0)
    };
    let index: Vec<i64> = gather
        .into_iter()
        .map(|i| if i < 0 { total } else { i })
        .collect();
    let index = Tensor::<B, 1, Int>::from_data(TensorData::new(index, [batch * (seq - 1)]), device);
    Ok(values.select(0, index).reshape([batch, seq - 1]))
}
