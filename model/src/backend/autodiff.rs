//! [`ModelBackend`] for `Autodiff<B>`: the model's heavy operations as custom autodiff
//! operations whose backward passes recompute instead of keeping.
//!
//! - **NF4 projection**: the forward pass runs `B`'s kernel; the backward pass computes
//!   `grad_x = grad_y · W` by dequantizing again (tile by tile on the CPU), so the only thing
//!   kept is the packed weight the model holds anyway. Left to burn's matmul, the dequantized
//!   f32 weight of every projection would stay alive until the backward pass.
//! - **Dense projection**: the same for a frozen dense (f32 or bf16) weight; when the weight is
//!   trainable (full fine-tuning) its gradient `grad_yᵀ · x` is computed too.
//! - **SwiGLU**: `silu(gate) · up` as one operation that keeps its two inputs (burn's `silu`
//!   and product keep the sigmoid and the activation as well).
//! - **Attention**: keeps queries, keys, values, the output and one log-sum-exp per query, and
//!   recomputes each query block's probabilities in the backward pass
//!   ([`ModelBackend::attention_backward`]); no `[heads, T, T]` tensor outlives its block.
//! - **Log-probabilities**: no `[T, vocab]` tensor outlives its chunk. Where the backend gives
//!   it ([`ModelBackend::token_logprobs_tracked`]), the forward pass keeps the
//!   log-probabilities' own hidden-state gradient, taken from each chunk's probabilities, and
//!   the backward pass scales it; an entropy gradient (which no trainer loss has) or a backend
//!   without it falls back to keeping the hidden states and recomputing each chunk's logits
//!   ([`ModelBackend::token_logprobs_backward`]).
//!
//! Cached attention (inference) and a trainable output head fall back to burn's own operations,
//! which are differentiable but keep their intermediates.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary, unary};
use burn::tensor::ops::{FloatTensor, IntTensor};

use super::{Head, Heads, ModelBackend, Span, reference};

type Ad<B, C> = Autodiff<B, C>;

/// The head's weights on the inner backend, when none of them is trainable.
fn frozen_head<B: ModelBackend, C: CheckpointStrategy>(head: &Head<Ad<B, C>>) -> Option<Head<B>> {
    match head {
        Head::Dense(w) if !w.is_tracked() => Some(Head::Dense(w.primitive.clone())),
        Head::Dense(_) => None,
        Head::DenseBlocks {
            weight,
            blocks,
            format,
        } if !weight.is_tracked() => Some(Head::DenseBlocks {
            weight: weight.primitive.clone(),
            blocks: blocks.clone(),
            format: *format,
        }),
        Head::DenseBlocks { .. } => None,
        Head::Blocks(ws) if ws.iter().all(|w| !w.is_tracked()) => Some(Head::Blocks(
            ws.iter().map(|w| w.primitive.clone()).collect(),
        )),
        Head::Blocks(_) => None,
        Head::Nf4 {
            codes,
            absmax,
            table,
            rows,
            cols,
        } => Some(Head::Nf4 {
            codes: codes.clone(),
            absmax: absmax.primitive.clone(),
            table: table.primitive.clone(),
            rows: *rows,
            cols: *cols,
        }),
    }
}

#[derive(Debug)]
struct Nf4Linear;

impl<B: ModelBackend> Backward<B, 1> for Nf4Linear {
    type State = (IntTensor<B>, FloatTensor<B>, FloatTensor<B>, usize, usize);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (codes, absmax, table, rows, cols) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| {
            B::nf4_linear_transposed(g, codes, absmax, table, rows, cols)
        });
    }
}

#[derive(Debug)]
struct DenseLinear;

impl<B: ModelBackend> Backward<B, 2> for DenseLinear {
    /// The input (kept only when the weight is trainable) and the weight.
    type State = (Option<FloatTensor<B>>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (x, w) = ops.state;
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            |g| B::dense_linear_transposed(g, w),
            |g| {
                let x = x.expect("the input is kept when the weight is trainable");
                B::float_matmul(B::float_transpose(g), x)
            },
        );
    }
}

#[derive(Debug)]
struct Attention;

/// What attention's backward pass needs: queries, keys, values, output, log-sum-exp, layout.
type AttentionState<B> = ([FloatTensor<B>; 5], Vec<Span>, Heads);

impl<B: ModelBackend> Backward<B, 3> for Attention {
    type State = AttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let ([q, k, v, out, lse], spans, heads) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let (dq, dk, dv) = B::attention_backward(q, k, v, out, lse, grad, &spans, heads);
        let [pq, pk, pv] = ops.parents;
        for (parent, g) in [(pq, dq), (pk, dk), (pv, dv)] {
            if let Some(node) = parent {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

#[derive(Debug)]
struct SwiGlu;

impl<B: ModelBackend> Backward<B, 2> for SwiGlu {
    /// Gate and up projections' outputs.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (gate, up) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let (d_gate, d_up) = B::swiglu_backward(gate, up, grad);
        let [pg, pu] = ops.parents;
        for (parent, g) in [(pg, d_gate), (pu, d_up)] {
            if let Some(node) = parent {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

#[derive(Debug)]
struct TokenLogprobs;

/// What the log-probabilities' backward pass needs: hidden states, head, targets,
/// temperature, chunk, and the log-probabilities' own gradient when the forward pass gave it.
type TokenLogprobsState<B> = (
    FloatTensor<B>,
    Head<B>,
    IntTensor<B>,
    f64,
    usize,
    Option<FloatTensor<B>>,
);

impl<B: ModelBackend> Backward<B, 1> for TokenLogprobs {
    type State = TokenLogprobsState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (hidden, head, targets, temperature, chunk, dlogp) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| {
            match dlogp.and_then(|d| B::token_logprobs_backward_kept(d, g.clone())) {
                Some(dh) => dh,
                None => B::token_logprobs_backward(hidden, &head, targets, temperature, chunk, g),
            }
        });
    }
}

impl<B: ModelBackend, C: CheckpointStrategy> ModelBackend for Autodiff<B, C> {
    const HOST: bool = B::HOST;
    const KEEPS_BF16: bool = B::KEEPS_BF16;

    // The loader keeps block copies for the inner backend (the model used for generation is
    // `valid()`'s); under autodiff the dense weight is multiplied as a tracked operation.
    const READS_BLOCKS: bool = B::READS_BLOCKS;

    fn max_buffer_bytes(device: &Self::Device) -> Option<usize> {
        B::max_buffer_bytes(device)
    }

    fn nf4_dequantize(
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        // The base is frozen: the dequantized weight is a constant.
        let out = B::nf4_dequantize(codes, absmax.primitive, table.primitive, rows, cols);
        <Self as burn::tensor::backend::AutodiffBackend>::from_inner(out)
    }

    fn dense_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        let w_tracked = w.is_tracked();
        match DenseLinear
            .prepare::<C>([x.node.clone(), w.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let kept = w_tracked.then(|| x.primitive.clone());
                let out = B::dense_linear(x.primitive, w.primitive.clone());
                prep.finish((kept, w.primitive), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::dense_linear(x.primitive, w.primitive)),
        }
    }

    fn nf4_linear(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        let (absmax, table) = (absmax.primitive, table.primitive);
        match Nf4Linear
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::nf4_linear(
                    x.primitive,
                    codes.clone(),
                    absmax.clone(),
                    table.clone(),
                    rows,
                    cols,
                );
                prep.finish((codes, absmax, table, rows, cols), out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::nf4_linear(x.primitive, codes, absmax, table, rows, cols))
            }
        }
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let nodes = [gate.node.clone(), up.node.clone()];
        match SwiGlu.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::swiglu(gate.primitive.clone(), up.primitive.clone());
                prep.finish((gate.primitive, up.primitive), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::swiglu(gate.primitive, up.primitive)),
        }
    }

    fn packed_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spans: &[Span],
        heads: Heads,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let nodes = [q.node.clone(), k.node.clone(), v.node.clone()];
        let (qp, kp, vp) = (q.primitive, k.primitive, v.primitive);
        let (out, lse) = B::packed_attention(qp.clone(), kp.clone(), vp.clone(), spans, heads);
        let lse_out = <Self as burn::tensor::backend::AutodiffBackend>::from_inner(lse.clone());
        let out = match Attention.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                prep.finish(([qp, kp, vp, out.clone(), lse], spans.to_vec(), heads), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        (out, lse_out)
    }

    fn token_logprobs(
        hidden: FloatTensor<Self>,
        head: &Head<Self>,
        targets: IntTensor<Self>,
        temperature: f64,
        chunk: usize,
    ) -> FloatTensor<Self> {
        let Some(inner_head) = frozen_head(head) else {
            // A trainable head: burn's own operations carry its gradient.
            return reference::token_logprobs::<Self>(hidden, head, targets, temperature, chunk);
        };
        match TokenLogprobs
            .prepare::<C>([hidden.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (out, dlogp) = B::token_logprobs_tracked(
                    hidden.primitive.clone(),
                    &inner_head,
                    targets.clone(),
                    temperature,
                    chunk,
                );
                prep.finish(
                    (
                        hidden.primitive,
                        inner_head,
                        targets,
                        temperature,
                        chunk,
                        dlogp,
                    ),
                    out,
                )
            }
            OpsKind::UnTracked(prep) => prep.finish(B::token_logprobs(
                hidden.primitive,
                &inner_head,
                targets,
                temperature,
                chunk,
            )),
        }
    }
}
