//! The backend extension the model needs beyond burn's own operations: projections by frozen
//! dense, bf16 and NF4 weights (and their transposes, for the backward pass), packed
//! grouped-query attention over ragged sequences, SwiGLU's activation, and token
//! log-probabilities computed a chunk of positions at a time with the output head inside the
//! chunk.
//!
//! Every operation has a default built from burn tensor operations ([`reference`]), so any
//! backend works. The CPU backend ([`crate::Cpu`], burn's Flex) replaces the projections with
//! host kernels; the GPU backends replace NF4 dequantization with a CubeCL kernel; and
//! `Autodiff<B>` makes the projections, attention and log-probabilities custom autodiff
//! operations whose backward passes recompute what they need instead of keeping it
//! ([`autodiff`]): an NF4 projection keeps only its packed weight, attention keeps its inputs
//! and one log-sum-exp per query, and the log-probabilities keep the hidden states (and, on the
//! CPU, their own hidden-state gradient, so that the backward pass need not recompute logits).
//!
//! Two process settings for binaries to apply at start-up sit beside them: [`host_allocator`]
//! keeps freed host memory for reuse (the CPU backend's activations), and `kernel_cache` (GPU
//! features) keeps CubeCL's compiled kernels on disk.

pub mod attention;
pub mod autodiff;
pub mod flex;
pub mod gemv;
pub mod host_allocator;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod kernel_cache;
pub mod logprobs;
pub mod reference;
pub mod vmath;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};

use crate::blocks::BlockFormat;

/// How queries, keys and values are laid out in a packed attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`heads` is a multiple of it).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl Heads {
    /// Query heads that share one key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// `1 / sqrt(head_dim)`.
    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }
}

/// The new tokens of one sequence in a packed call: rows `start .. start + len` of the packed
/// tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// First packed row of the sequence.
    pub start: usize,
    /// Number of new tokens.
    pub len: usize,
}

/// Keys or values of one sequence for attention: `[kv_heads, positions, head_dim]`.
pub type SequenceKv<B> = (FloatTensor<B>, FloatTensor<B>);

/// A frozen output head `[vocab, hidden]` for [`ModelBackend::token_logprobs`].
#[derive(Clone, Debug)]
pub enum Head<B: Backend> {
    /// A dense weight (f32, or bf16 on backends that keep it).
    Dense(FloatTensor<B>),
    /// A dense weight with its exact copy in 32-weight blocks ([`crate::blocks`]), which
    /// [`ModelBackend::dense_linear_blocks`] may read instead.
    DenseBlocks {
        /// The dense weight.
        weight: FloatTensor<B>,
        /// The copy's `u32` words.
        blocks: IntTensor<B>,
        /// The copy's format.
        format: BlockFormat,
    },
    /// A dense weight held as consecutive row blocks (vocabulary ranges, in order), for
    /// backends that bound the size of one buffer ([`ModelBackend::max_buffer_bytes`]).
    Blocks(Vec<FloatTensor<B>>),
    /// A packed NF4 weight.
    Nf4 {
        /// Packed codes (`u32` words).
        codes: IntTensor<B>,
        /// One f32 scale per 64-element block.
        absmax: FloatTensor<B>,
        /// The 16-entry code table.
        table: FloatTensor<B>,
        /// Vocabulary size (rows).
        rows: usize,
        /// Hidden size (columns).
        cols: usize,
    },
}

impl<B: ModelBackend> Head<B> {
    /// The vocabulary size (output rows).
    pub fn rows(&self) -> usize {
        match self {
            Head::Dense(w) | Head::DenseBlocks { weight: w, .. } => w.shape()[0],
            Head::Blocks(ws) => ws.iter().map(|w| w.shape()[0]).sum(),
            Head::Nf4 { rows, .. } => *rows,
        }
    }

    /// `x · Wᵀ` for `x` `[m, hidden]`; returns `[m, vocab]`.
    pub fn forward(&self, x: FloatTensor<B>) -> FloatTensor<B> {
        match self {
            Head::Dense(w) => B::dense_linear(x, w.clone()),
            Head::DenseBlocks {
                weight,
                blocks,
                format,
            } => B::dense_linear_blocks(x, weight.clone(), blocks.clone(), *format),
            Head::Blocks(ws) => B::float_cat(
                ws.iter()
                    .map(|w| B::dense_linear(x.clone(), w.clone()))
                    .collect(),
                1,
            ),
            Head::Nf4 {
                codes,
                absmax,
                table,
                rows,
                cols,
            } => B::nf4_linear(
                x,
                codes.clone(),
                absmax.clone(),
                table.clone(),
                *rows,
                *cols,
            ),
        }
    }

    /// `g · W` for `g` `[m, vocab]`; returns `[m, hidden]`.
    pub fn backward(&self, g: FloatTensor<B>) -> FloatTensor<B> {
        match self {
            Head::Dense(w) | Head::DenseBlocks { weight: w, .. } => {
                B::dense_linear_transposed(g, w.clone())
            }
            Head::Blocks(ws) => {
                let g = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(g));
                let m = g.dims()[0];
                let mut start = 0;
                let mut sum: Option<Tensor<B, 2>> = None;
                for w in ws {
                    let rows = w.shape()[0];
                    let part = g.clone().slice([0..m, start..start + rows]);
                    let x = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(
                        B::dense_linear_transposed(part.into_primitive().tensor(), w.clone()),
                    ));
                    sum = Some(match sum {
                        Some(s) => s + x,
                        None => x,
                    });
                    start += rows;
                }
                sum.expect("a blocked head has at least one block")
                    .into_primitive()
                    .tensor()
            }
            Head::Nf4 {
                codes,
                absmax,
                table,
                rows,
                cols,
            } => B::nf4_linear_transposed(
                g,
                codes.clone(),
                absmax.clone(),
                table.clone(),
                *rows,
                *cols,
            ),
        }
    }
}

/// A burn backend the model can run on.
pub trait ModelBackend: Backend {
    /// Whether the backend computes on the host, so a tensor's values can be read without a
    /// device transfer (sampling then reads logits directly instead of reducing on the device).
    const HOST: bool = false;

    /// Whether the backend multiplies by bf16 weights without converting them whole (the
    /// embedding table then stays bf16 in memory; otherwise it is widened to f32 at load).
    const KEEPS_BF16: bool = false;

    /// The largest tensor, in bytes, one buffer on `device` may hold; `None` where the model
    /// need not care. wgpu adapters bound it (a storage buffer binding: 128 MiB on Mesa's
    /// lavapipe and on WebGPU's minimum), so the embedding table of a large vocabulary is held
    /// in row blocks below it ([`crate::qwen2::Embedding`]).
    fn max_buffer_bytes(_device: &Self::Device) -> Option<usize> {
        None
    }

    /// Dequantizes packed codes (`u32` words) with one f32 `absmax` per 64-element block and the
    /// 16-entry code `table` into a `[rows, cols]` float tensor (`table[code] * absmax`).
    fn nf4_dequantize(
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self>;

    /// Writes `values` `[a, n, b]` into `buffer` `[a, capacity, b]` at positions
    /// `start .. start + n` of its middle axis and returns the buffer. The default is
    /// `slice_assign`; a backend that can write a uniquely owned buffer in place does so (the
    /// KV cache relies on it to avoid copying every row on every step).
    fn kv_write(
        buffer: FloatTensor<Self>,
        start: usize,
        values: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::slice_write::<Self>(buffer, start, values)
    }

    /// `x · Wᵀ` for `x` `[m, cols]` and a dense weight `W` `[rows, cols]`; returns `[m, rows]`.
    /// The default is the backend's matmul as `(W · xᵀ)ᵀ`, so no backend copies a transposed
    /// weight; a bf16 weight is widened first.
    fn dense_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::matmul_linear::<Self>(x, reference::widen::<Self>(w))
    }

    /// Whether [`ModelBackend::dense_linear_blocks`] reads a dense weight's block copy (the
    /// loader then keeps one beside each dense weight it recovers one for, [`crate::blocks`]).
    const READS_BLOCKS: bool = false;

    /// `x · Wᵀ` for `x` `[m, cols]` and a dense weight `W` `[rows, cols]` whose exact copy in
    /// 32-weight blocks is `blocks` ([`crate::blocks`]); returns `[m, rows]`, equal to
    /// [`ModelBackend::dense_linear`]'s. A backend that reads the smaller copy faster where
    /// the weight's bytes bound the time (decoding) overrides it; the default multiplies by `W`.
    fn dense_linear_blocks(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        blocks: IntTensor<Self>,
        format: BlockFormat,
    ) -> FloatTensor<Self> {
        let _ = (blocks, format);
        Self::dense_linear(x, w)
    }

    /// `g · W` for `g` `[m, rows]` and a dense weight `W` `[rows, cols]`; returns `[m, cols]`
    /// (the input gradient of [`ModelBackend::dense_linear`]).
    fn dense_linear_transposed(g: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(g, reference::widen::<Self>(w))
    }

    /// `x · Wᵀ` for `x` `[m, cols]` and the NF4 weight `W` `[rows, cols]`; returns `[m, rows]`.
    /// The default dequantizes into a temporary and uses the backend's matmul.
    fn nf4_linear(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        let w = Self::nf4_dequantize(codes, absmax, table, rows, cols);
        reference::matmul_linear::<Self>(x, w)
    }

    /// `g · W` for `g` `[m, rows]` and the NF4 weight `W` `[rows, cols]`; returns `[m, cols]`.
    /// The default dequantizes into a temporary.
    fn nf4_linear_transposed(
        g: FloatTensor<Self>,
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        let w = Self::nf4_dequantize(codes, absmax, table, rows, cols);
        Self::float_matmul(g, w)
    }

    /// Causal grouped-query attention over packed sequences with nothing cached: `q` is
    /// `[n, heads · head_dim]`, `k` and `v` are `[n, kv_heads · head_dim]` (after RoPE), all
    /// sequences' tokens one after another as `spans` says; each token attends to its own
    /// sequence up to itself. Returns the output `[n, heads · head_dim]` and the log-sum-exp of
    /// each query's scaled scores `[n, heads]` (what a memory-lean backward pass needs).
    fn packed_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spans: &[Span],
        heads: Heads,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::packed_attention::<Self>(q, k, v, spans, heads)
    }

    /// Causal grouped-query attention of packed new tokens over cached sequences: `q` is
    /// `[n, heads · head_dim]` and `kv[i]` holds sequence `i`'s keys and values
    /// `[kv_heads, positions, head_dim]` after RoPE, its `spans[i].len` new tokens last. New
    /// token `t` attends to every key up to its own position. Returns `[n, heads · head_dim]`.
    fn cached_attention(
        q: FloatTensor<Self>,
        kv: Vec<SequenceKv<Self>>,
        spans: &[Span],
        heads: Heads,
    ) -> FloatTensor<Self> {
        reference::cached_attention::<Self>(q, kv, spans, heads)
    }

    /// The input gradients `(dq, dk, dv)` of [`ModelBackend::packed_attention`] for the output
    /// gradient `grad`, from its inputs, output and log-sum-exp (what `Autodiff<B>` keeps). The
    /// default recomputes each query block's probabilities with tensor operations
    /// ([`reference::attention_backward`]).
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        spans: &[Span],
        heads: Heads,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        reference::attention_backward::<Self>(q, k, v, out, lse, grad, spans, heads)
    }

    /// SwiGLU's activation `silu(gate) · up` (`[n, intermediate]` each). The default uses
    /// burn's operations; under autodiff it is one operation that keeps its two inputs.
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::swiglu::<Self>(gate, up)
    }

    /// The gradients `(d_gate, d_up)` of [`ModelBackend::swiglu`] for the output gradient
    /// `grad`. The default uses burn's operations.
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::swiglu_backward::<Self>(gate, up, grad)
    }

    /// Log-probability and entropy of the temperature-scaled next-token distribution at each
    /// position: `logits = hidden · headᵀ / temperature`, computed `chunk` positions at a time
    /// so no `[n, vocab]` tensor is ever whole. Returns `[n, 2]`: column 0 is
    /// `log_softmax(logits)[target]`, column 1 the entropy.
    fn token_logprobs(
        hidden: FloatTensor<Self>,
        head: &Head<Self>,
        targets: IntTensor<Self>,
        temperature: f64,
        chunk: usize,
    ) -> FloatTensor<Self> {
        reference::token_logprobs::<Self>(hidden, head, targets, temperature, chunk)
    }

    /// [`ModelBackend::token_logprobs`] for a pass that will be differentiated, with — where
    /// the backend gives it cheaply — the log-probabilities' own hidden-state gradient
    /// `[n, width]`, taken from each chunk's probabilities while they exist (one more head
    /// product now, none in the backward pass; see
    /// [`ModelBackend::token_logprobs_backward_kept`]). The default gives `None`.
    fn token_logprobs_tracked(
        hidden: FloatTensor<Self>,
        head: &Head<Self>,
        targets: IntTensor<Self>,
        temperature: f64,
        chunk: usize,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        (
            Self::token_logprobs(hidden, head, targets, temperature, chunk),
            None,
        )
    }

    /// The hidden-state gradient for the output gradient `grad` `[n, 2]` from the `dlogp` that
    /// [`ModelBackend::token_logprobs_tracked`] kept: each row scaled by its position's
    /// log-probability gradient. `None` when an entropy has a gradient (which `dlogp` does not
    /// cover) or the backend cannot tell; the caller then recomputes with
    /// [`ModelBackend::token_logprobs_backward`]. The default gives `None`.
    fn token_logprobs_backward_kept(
        dlogp: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        let _ = (dlogp, grad);
        None
    }

    /// The hidden-state gradient of [`ModelBackend::token_logprobs`] for the output gradient
    /// `grad` `[n, 2]`, recomputing each chunk's logits. The default uses tensor operations
    /// ([`reference::token_logprobs_backward`]).
    fn token_logprobs_backward(
        hidden: FloatTensor<Self>,
        head: &Head<Self>,
        targets: IntTensor<Self>,
        temperature: f64,
        chunk: usize,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::token_logprobs_backward::<Self>(hidden, head, targets, temperature, chunk, grad)
    }
}
