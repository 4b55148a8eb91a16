//! The backend operations built from burn tensor operations, for every backend: the defaults of
//! [`ModelBackend`](super::ModelBackend), and the backward passes `Autodiff<B>` runs on the
//! inner backend.
//!
//! Attention works one sequence at a time and, within a sequence, one block of queries at a
//! time: a block's scores `[kv_heads, group, block, keys]` are the largest temporary, and a
//! block only reads the keys up to its last query (causality). The query heads that share a
//! key/value head are folded into one batched matmul (`[kv_heads, group · block, head_dim]`),
//! so keys and values are never repeated per query head.
//!
//! Log-probabilities work a chunk of positions at a time with the output head inside the chunk.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{
    DType, FloatDType, IndexingUpdateOp, Int, Tensor, TensorMetadata, TensorPrimitive,
};

use super::{Head, Heads, ModelBackend, SequenceKv, Span};

/// Scores one query block may hold (elements): blocks shrink as sequences grow, so a block's
/// `[kv_heads, group, block, keys]` scores stay around 16 MiB of f32.
const SCORE_BUDGET: usize = 1 << 22;

/// `silu(gate) · up` with burn's operations.
pub fn swiglu<B: Backend>(gate: FloatTensor<B>, up: FloatTensor<B>) -> FloatTensor<B> {
    let gate = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(gate));
    let up = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(up));
    (burn::tensor::activation::silu(gate) * up)
        .into_primitive()
        .tensor()
}

/// The gradients `(d_gate, d_up)` of [`swiglu`] for the output gradient `grad`, with burn's
/// operations: `s = sigmoid(gate)`, `d_gate = grad · up · s · (1 + gate · (1 − s))`,
/// `d_up = grad · gate · s`.
pub fn swiglu_backward<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let t = |x| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x));
    let (gate, up, grad) = (t(gate), t(up), t(grad));
    let s = burn::tensor::activation::sigmoid(gate.clone());
    let d_up = grad.clone() * gate.clone() * s.clone();
    let d_gate = grad * up * s.clone() * ((s.neg() + 1.0) * gate + 1.0);
    (
        d_gate.into_primitive().tensor(),
        d_up.into_primitive().tensor(),
    )
}

/// `x · Wᵀ` as `(W · xᵀ)ᵀ` with the backend's matmul.
pub fn matmul_linear<B: Backend>(x: FloatTensor<B>, w: FloatTensor<B>) -> FloatTensor<B> {
    B::float_transpose(B::float_matmul(w, B::float_transpose(x)))
}

/// Writes `values` `[a, n, b]` at `start` of the middle axis of `buffer` `[a, capacity, b]`
/// with `slice_assign`.
pub fn slice_write<B: Backend>(
    buffer: FloatTensor<B>,
    start: usize,
    values: FloatTensor<B>,
) -> FloatTensor<B> {
    let [a, n, b] = float::<B, 3>(values.clone()).dims();
    B::float_slice_assign(
        buffer,
        &[
            burn::tensor::Slice::from(0..a),
            burn::tensor::Slice::from(start..start + n),
            burn::tensor::Slice::from(0..b),
        ],
        values,
    )
}

/// A half-precision tensor widened to f32; any other tensor as it is.
pub fn widen<B: Backend>(w: FloatTensor<B>) -> FloatTensor<B> {
    match w.dtype() {
        DType::BF16 | DType::F16 => B::float_cast(w, FloatDType::F32),
        _ => w,
    }
}

fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// Queries of the block size the score budget allows, for `keys` keys.
fn block_size(budget: usize, heads: Heads, len: usize, keys: usize) -> usize {
    (budget / (heads.heads * keys.max(1)))
        .max(16)
        .min(len.max(1))
}

/// The causal mask of a block: `true` where query `i` (at position `first + i`) must not see
/// key `j` (`j > first + i`).
///
/// # Shapes
/// - output: `[1, 1, queries, keys]`
fn causal_mask<B: Backend>(
    first: usize,
    queries: usize,
    keys: usize,
    device: &B::Device,
) -> Tensor<B, 4, burn::tensor::Bool> {
    let key = Tensor::<B, 1, Int>::arange(0..keys as i64, device)
        .reshape([1, keys])
        .expand([queries, keys]);
    let query = Tensor::<B, 1, Int>::arange(first as i64..(first + queries) as i64, device)
        .reshape([queries, 1])
        .expand([queries, keys]);
    key.greater(query).reshape([1, 1, queries, keys])
}

/// One sequence's packed rows as `[kv_heads, group, len, head_dim]` queries.
fn split_queries<B: Backend>(q: &Tensor<B, 2>, span: Span, heads: Heads) -> Tensor<B, 4> {
    q.clone()
        .narrow(0, span.start, span.len)
        .reshape([span.len, heads.kv_heads, heads.group(), heads.head_dim])
        .permute([1, 2, 0, 3])
}

/// One sequence's packed rows as `[kv_heads, len, head_dim]` keys or values.
fn split_kv<B: Backend>(k: &Tensor<B, 2>, span: Span, heads: Heads) -> Tensor<B, 3> {
    k.clone()
        .narrow(0, span.start, span.len)
        .reshape([span.len, heads.kv_heads, heads.head_dim])
        .swap_dims(0, 1)
}

/// `[kv_heads, group, len, head_dim]` back to packed `[len, heads · head_dim]` rows.
fn join_queries<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 2> {
    let [kvh, group, len, d] = x.dims();
    x.permute([2, 0, 1, 3]).reshape([len, kvh * group * d])
}

/// `[kv_heads, len, head_dim]` back to packed `[len, kv_heads · head_dim]` rows.
fn join_kv<B: Backend>(x: Tensor<B, 3>) -> Tensor<B, 2> {
    let [kvh, len, d] = x.dims();
    x.swap_dims(0, 1).reshape([len, kvh * d])
}

/// The scaled, causally masked scores of queries `first .. first + n` of a sequence whose
/// first query sits at position `past`, against the keys up to the block's last query.
///
/// # Shapes
/// - `qb`: `[kv_heads, group, n, head_dim]`; `k`: `[kv_heads, keys, head_dim]`
/// - output: `[kv_heads, group, n, past + first + n]`
fn block_scores<B: Backend>(
    qb: Tensor<B, 4>,
    k: &Tensor<B, 3>,
    past: usize,
    first: usize,
    heads: Heads,
) -> Tensor<B, 4> {
    let [kvh, group, n, d] = qb.dims();
    let visible = past + first + n;
    let kb = k.clone().narrow(1, 0, visible);
    let scores = qb
        .reshape([kvh, group * n, d])
        .matmul(kb.swap_dims(1, 2))
        .mul_scalar(heads.scale())
        .reshape([kvh, group, n, visible]);
    if n == 1 {
        return scores; // the only query sees every visible key
    }
    let mask = causal_mask::<B>(past + first, n, visible, &scores.device());
    scores.mask_fill(mask.expand([kvh, group, n, visible]), f32::NEG_INFINITY)
}

/// Attention of one sequence's queries (the last `len` of its `past + len` positions).
///
/// # Shapes
/// - `q`: `[kv_heads, group, len, head_dim]`; `k`, `v`: `[kv_heads, past + len, head_dim]`
/// - output: `[kv_heads, group, len, head_dim]` and the log-sum-exp `[kv_heads, group, len]`
fn sequence_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    heads: Heads,
    budget: usize,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let [kvh, group, len, d] = q.dims();
    let keys = k.dims()[1];
    let past = keys - len;
    let block = block_size(budget, heads, len, keys);
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    let mut first = 0;
    while first < len {
        let n = block.min(len - first);
        let scores = block_scores(q.clone().narrow(2, first, n), &k, past, first, heads);
        let visible = scores.dims()[3];
        let max = scores.clone().max_dim(3);
        let e = (scores - max.clone()).exp();
        let sum = e.clone().sum_dim(3);
        let probs = e / sum.clone();
        let out = probs
            .reshape([kvh, group * n, visible])
            .matmul(v.clone().narrow(1, 0, visible))
            .reshape([kvh, group, n, d]);
        outs.push(out);
        lses.push((max + sum.log()).reshape([kvh, group, n]));
        first += n;
    }
    (Tensor::cat(outs, 2), Tensor::cat(lses, 2))
}

/// [`ModelBackend::packed_attention`](super::ModelBackend::packed_attention) from tensor
/// operations.
pub fn packed_attention<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    spans: &[Span],
    heads: Heads,
) -> (FloatTensor<B>, FloatTensor<B>) {
    packed_attention_with_budget::<B>(q, k, v, spans, heads, SCORE_BUDGET)
}

/// [`packed_attention`] with query blocks sized for `budget` score elements (for tests of the
/// blocking).
pub fn packed_attention_with_budget<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    spans: &[Span],
    heads: Heads,
    budget: usize,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (q, k, v) = (float::<B, 2>(q), float::<B, 2>(k), float::<B, 2>(v));
    let mut outs = Vec::with_capacity(spans.len());
    let mut lses = Vec::with_capacity(spans.len());
    for &span in spans {
        let (out, lse) = sequence_attention(
            split_queries(&q, span, heads),
            split_kv(&k, span, heads),
            split_kv(&v, span, heads),
            heads,
            budget,
        );
        outs.push(join_queries(out));
        lses.push(lse.permute([2, 0, 1]).reshape([span.len, heads.heads]));
    }
    (prim(Tensor::cat(outs, 0)), prim(Tensor::cat(lses, 0)))
}

/// [`ModelBackend::cached_attention`](super::ModelBackend::cached_attention) from tensor
/// operations.
pub fn cached_attention<B: Backend>(
    q: FloatTensor<B>,
    kv: Vec<SequenceKv<B>>,
    spans: &[Span],
    heads: Heads,
) -> FloatTensor<B> {
    let q = float::<B, 2>(q);
    let mut outs = Vec::with_capacity(spans.len());
    for (&span, (k, v)) in spans.iter().zip(kv) {
        let (out, _) = sequence_attention(
            split_queries(&q, span, heads),
            float::<B, 3>(k),
            float::<B, 3>(v),
            heads,
            SCORE_BUDGET,
        );
        outs.push(join_queries(out));
    }
    prim(Tensor::cat(outs, 0))
}

/// The input gradients of [`packed_attention`], recomputing each block's probabilities from the saved
/// log-sum-exp (the flash-attention backward pass, one query block at a time).
///
/// Returns `(dq, dk, dv)` in the packed layouts of `q`, `k` and `v`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    spans: &[Span],
    heads: Heads,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    attention_backward_with_budget::<B>(q, k, v, out, lse, grad, spans, heads, SCORE_BUDGET)
}

/// [`attention_backward`] with query blocks sized for `budget` score elements.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_with_budget<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    spans: &[Span],
    heads: Heads,
    budget: usize,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (q, k, v) = (float::<B, 2>(q), float::<B, 2>(k), float::<B, 2>(v));
    let (out, grad, lse) = (float::<B, 2>(out), float::<B, 2>(grad), float::<B, 2>(lse));
    let (kvh, group, d) = (heads.kv_heads, heads.group(), heads.head_dim);
    let (mut dqs, mut dks, mut dvs) = (Vec::new(), Vec::new(), Vec::new());
    for &span in spans {
        let len = span.len;
        let q4 = split_queries(&q, span, heads);
        let k3 = split_kv(&k, span, heads);
        let v3 = split_kv(&v, span, heads);
        let do4 = split_queries(&grad, span, heads);
        let o4 = split_queries(&out, span, heads);
        // [len, heads] -> [kv_heads, group, len, 1]
        let lse4 = lse
            .clone()
            .narrow(0, span.start, len)
            .reshape([len, kvh, group])
            .permute([1, 2, 0])
            .reshape([kvh, group, len, 1]);
        let delta = (do4.clone() * o4).sum_dim(3);
        let device = q4.device();
        let mut dk = Tensor::<B, 3>::zeros([kvh, len, d], &device);
        let mut dv = Tensor::<B, 3>::zeros([kvh, len, d], &device);
        let mut dq = Vec::new();
        let block = block_size(budget, heads, len, len);
        let mut first = 0;
        while first < len {
            let n = block.min(len - first);
            let visible = first + n;
            let qb = q4.clone().narrow(2, first, n);
            let dob = do4.clone().narrow(2, first, n).reshape([kvh, group * n, d]);
            let scores = block_scores(qb.clone(), &k3, 0, first, heads);
            let probs = (scores - lse4.clone().narrow(2, first, n)).exp();
            let kb = k3.clone().narrow(1, 0, visible);
            let vb = v3.clone().narrow(1, 0, visible);
            let p3 = probs.clone().reshape([kvh, group * n, visible]);
            let dv_part = p3.swap_dims(1, 2).matmul(dob.clone());
            let dp = dob
                .matmul(vb.swap_dims(1, 2))
                .reshape([kvh, group, n, visible]);
            let ds = (probs * (dp - delta.clone().narrow(2, first, n)))
                .mul_scalar(heads.scale())
                .reshape([kvh, group * n, visible]);
            dq.push(ds.clone().matmul(kb).reshape([kvh, group, n, d]));
            let dk_part = ds.swap_dims(1, 2).matmul(qb.reshape([kvh, group * n, d]));
            let range = [0..kvh, 0..visible, 0..d];
            dk = dk
                .clone()
                .slice_assign(range.clone(), dk.slice(range.clone()) + dk_part);
            dv = dv
                .clone()
                .slice_assign(range.clone(), dv.slice(range) + dv_part);
            first += n;
        }
        dqs.push(join_queries(Tensor::cat(dq, 2)));
        dks.push(join_kv(dk));
        dvs.push(join_kv(dv));
    }
    (
        prim(Tensor::cat(dqs, 0)),
        prim(Tensor::cat(dks, 0)),
        prim(Tensor::cat(dvs, 0)),
    )
}

/// The logits of positions `start .. start + len`, scaled by `1 / temperature`.
fn chunk_logits<B: ModelBackend>(
    hidden: &Tensor<B, 2>,
    head: &Head<B>,
    start: usize,
    len: usize,
    temperature: f64,
) -> Tensor<B, 2> {
    let h = hidden.clone().narrow(0, start, len);
    let z = float::<B, 2>(head.forward(prim(h))).div_scalar(temperature);
    // Padded to a multiple of 4 columns with a logit no reduction can pick and whose
    // probability is 0 (finite, so `p · z` stays 0): burn 0.21's row reductions on wgpu drop
    // elements of rows longer than 65,535 that are not a multiple of 4 (see
    // `crate::sample`'s `pad_row`). Callers slice gradients back to the vocabulary.
    let [rows, vocab] = z.dims();
    let pad = vocab.next_multiple_of(4) - vocab;
    if pad == 0 {
        return z;
    }
    let fill = Tensor::<B, 2>::full([rows, pad], PAD_LOGIT, &z.device());
    Tensor::cat(vec![z, fill], 1)
}

/// The logit of [`chunk_logits`]' padding columns: `exp(PAD_LOGIT − max)` is 0 in f32.
const PAD_LOGIT: f32 = -1e30;

/// [`ModelBackend::token_logprobs`](super::ModelBackend::token_logprobs) from tensor operations.
pub fn token_logprobs<B: ModelBackend>(
    hidden: FloatTensor<B>,
    head: &Head<B>,
    targets: IntTensor<B>,
    temperature: f64,
    chunk: usize,
) -> FloatTensor<B> {
    let hidden = float::<B, 2>(hidden);
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let n = hidden.dims()[0];
    let chunk = chunk.max(1);
    let mut parts = Vec::with_capacity(n.div_ceil(chunk));
    let mut start = 0;
    while start < n {
        let len = chunk.min(n - start);
        let z = chunk_logits(&hidden, head, start, len, temperature);
        let t = targets.clone().narrow(0, start, len).reshape([len, 1]);
        let max = z.clone().max_dim(1);
        let e = (z.clone() - max.clone()).exp();
        let sum = e.clone().sum_dim(1);
        let lse = max + sum.clone().log();
        let logp = z.clone().gather(1, t) - lse.clone();
        let entropy = lse - (e * z).sum_dim(1) / sum;
        parts.push(Tensor::cat(vec![logp, entropy], 1));
        start += len;
    }
    prim(Tensor::cat(parts, 0))
}

/// The hidden-state gradient of [`token_logprobs`] for the output gradient `grad` `[n, 2]`,
/// recomputing each chunk's logits.
pub fn token_logprobs_backward<B: ModelBackend>(
    hidden: FloatTensor<B>,
    head: &Head<B>,
    targets: IntTensor<B>,
    temperature: f64,
    chunk: usize,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let hidden = float::<B, 2>(hidden);
    let grad = float::<B, 2>(grad);
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let n = hidden.dims()[0];
    let chunk = chunk.max(1);
    let mut parts = Vec::with_capacity(n.div_ceil(chunk));
    let mut start = 0;
    while start < n {
        let len = chunk.min(n - start);
        let z = chunk_logits(&hidden, head, start, len, temperature);
        let t = targets.clone().narrow(0, start, len).reshape([len, 1]);
        let g = grad.clone().narrow(0, start, len);
        let (g_logp, g_entropy) = (g.clone().narrow(1, 0, 1), g.narrow(1, 1, 1));
        let max = z.clone().max_dim(1);
        let e = (z.clone() - max).exp();
        let probs = e.clone() / e.sum_dim(1);
        let mean = (probs.clone() * z.clone()).sum_dim(1);
        // d logp / dz = onehot - p;  d entropy / dz = -p (z - E_p[z])
        let dz = probs.clone() * g_logp.clone().neg() - probs * (z - mean) * g_entropy;
        let dz = dz.scatter(1, t, g_logp, IndexingUpdateOp::Add);
        let vocab = head.rows();
        let dz = if dz.dims()[1] == vocab {
            dz
        } else {
            dz.narrow(1, 0, vocab)
        };
        parts.push(float::<B, 2>(
            head.backward(prim(dz.div_scalar(temperature))),
        ));
        start += len;
    }
    prim(Tensor::cat(parts, 0))
}
