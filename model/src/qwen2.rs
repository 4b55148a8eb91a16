//! The Qwen2 causal language model, with Hugging Face's module and field names
//! (`model.layers.N.self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, …) so checkpoint keys
//! map one to one. Llama-family checkpoints load into the same module (Qwen2 is Llama with
//! q/k/v biases). Loading lives in [`crate::load`]; projections are [`Linear`]s (dense or NF4
//! base, optional LoRA).
//!
//! Every sequence of a step is packed into one `[n, hidden]` tensor (no padding; see
//! [`StepInput`]): projections, norms and the MLP run on all tokens at once, and only attention
//! looks at sequences separately ([`ModelBackend::packed_attention`]). Everything is computed in f32;
//! the embedding table may stay bf16 (rows are widened as they are gathered).

use burn::module::Module;
use burn::tensor::activation::silu;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorPrimitive};

use crate::backend::{Head, Heads, ModelBackend, SequenceKv};
use crate::cache::KvCache;
use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};
use crate::inputs::{RotaryEmbedding, Segment, StepInput};
use crate::linear::{BaseWeight, Linear};

/// Token embeddings, `weight` `[vocab, hidden]`.
#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    /// The embedding matrix (frozen): f32, or bf16 on backends that keep it
    /// ([`ModelBackend::KEEPS_BF16`]) when the checkpoint stores it so.
    pub weight: Tensor<B, 2>,
}

impl<B: Backend> Embedding<B> {
    /// The rows of `ids`, widened to f32.
    ///
    /// # Shapes
    /// - `ids`: `[n]`; output: `[n, hidden]`
    pub fn forward(&self, ids: Tensor<B, 1, Int>) -> Tensor<B, 2> {
        let rows = self.weight.clone().select(0, ids);
        match rows.dtype() {
            DType::F32 => rows,
            _ => rows.cast(DType::F32),
        }
    }
}

/// RMSNorm computed in f32: `x / sqrt(mean(x²) + eps) · weight`.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// Per-channel gain (frozen).
    pub weight: Tensor<B, 1>,
    /// Epsilon inside the square root.
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    /// # Shapes
    /// - `x`, output: `[n, hidden]`
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let variance = x.clone().powi_scalar(2).mean_dim(1);
        let normed = x * (variance + self.eps).sqrt().recip();
        normed * self.weight.clone().unsqueeze::<2>()
    }
}

/// Grouped-query self-attention with q/k/v biases.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// Query projection, `[heads · head_dim, hidden]`.
    pub q_proj: Linear<B>,
    /// Key projection, `[kv_heads · head_dim, hidden]`.
    pub k_proj: Linear<B>,
    /// Value projection, `[kv_heads · head_dim, hidden]`.
    pub v_proj: Linear<B>,
    /// Output projection, `[hidden, heads · head_dim]`.
    pub o_proj: Linear<B>,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
}

impl<B: ModelBackend> Attention<B> {
    /// The head layout.
    pub fn heads(&self) -> Heads {
        Heads {
            heads: self.num_heads,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Attention over the step's sequences; with a cache, each sequence's keys and values are
    /// appended to its row and it attends to everything the row holds.
    ///
    /// # Shapes
    /// - `x`, output: `[n, hidden]`
    pub fn forward(
        &self,
        x: Tensor<B, 2>,
        input: &StepInput<B>,
        layer: usize,
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 2> {
        let heads = self.heads();
        let d = self.head_dim;
        let q = input.rotate_q(self.q_proj.forward(x.clone()), d);
        let k = input.rotate_k(self.k_proj.forward(x.clone()), d);
        let v = self.v_proj.forward(x);
        let prim = |t: Tensor<B, 2>| t.into_primitive().tensor();
        let out = match cache {
            None => B::packed_attention(prim(q), prim(k), prim(v), &input.spans, heads).0,
            Some(cache) => {
                assert_eq!(
                    input.rows.len(),
                    input.spans.len(),
                    "a cached step needs an input built by `cached_input`"
                );
                let kvh = self.num_kv_heads;
                let mut kv: Vec<SequenceKv<B>> = Vec::with_capacity(input.spans.len());
                for (span, &row) in input.spans.iter().zip(&input.rows) {
                    // [len, kv_heads · d] -> [kv_heads, len, d]
                    let split = |t: &Tensor<B, 2>| {
                        t.clone()
                            .narrow(0, span.start, span.len)
                            .reshape([span.len, kvh, d])
                            .swap_dims(0, 1)
                    };
                    let (kr, vr) = cache.append(layer, row, split(&k), split(&v));
                    kv.push((kr.into_primitive().tensor(), vr.into_primitive().tensor()));
                }
                B::cached_attention(prim(q), kv, &input.spans, heads)
            }
        };
        self.o_proj
            .forward(Tensor::from_primitive(TensorPrimitive::Float(out)))
    }
}

/// The SwiGLU MLP: `down(silu(gate(x)) · up(x))`.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// `[intermediate, hidden]`.
    pub gate_proj: Linear<B>,
    /// `[intermediate, hidden]`.
    pub up_proj: Linear<B>,
    /// `[hidden, intermediate]`.
    pub down_proj: Linear<B>,
}

impl<B: ModelBackend> Mlp<B> {
    /// # Shapes
    /// - `x`, output: `[n, hidden]`
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let gate = silu(self.gate_proj.forward(x.clone()));
        self.down_proj.forward(gate * self.up_proj.forward(x))
    }
}

/// One pre-norm decoder layer.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    /// Self-attention.
    pub self_attn: Attention<B>,
    /// Feed-forward.
    pub mlp: Mlp<B>,
    /// Norm before attention.
    pub input_layernorm: RmsNorm<B>,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm<B>,
}

impl<B: ModelBackend> DecoderLayer<B> {
    /// # Shapes
    /// - `x`, output: `[n, hidden]`
    pub fn forward(
        &self,
        x: Tensor<B, 2>,
        input: &StepInput<B>,
        layer: usize,
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 2> {
        let h = x.clone()
            + self
                .self_attn
                .forward(self.input_layernorm.forward(x), input, layer, cache);
        h.clone() + self.mlp.forward(self.post_attention_layernorm.forward(h))
    }
}

/// The decoder stack (`model.` in checkpoint keys).
#[derive(Module, Debug)]
pub struct Qwen2Model<B: Backend> {
    /// Token embeddings.
    pub embed_tokens: Embedding<B>,
    /// Decoder layers.
    pub layers: Vec<DecoderLayer<B>>,
    /// Final norm.
    pub norm: RmsNorm<B>,
    /// Rotary tables (computed from the configuration, not loaded).
    pub rotary_emb: RotaryEmbedding<B>,
}

/// Qwen2 with its language-model head.
#[derive(Module, Debug)]
pub struct Qwen2ForCausalLM<B: Backend> {
    /// The decoder stack.
    pub model: Qwen2Model<B>,
    /// The output projection; `None` when tied to the embeddings.
    pub lm_head: Option<Linear<B>>,
    /// The configuration the model was built from.
    #[module(skip)]
    pub config: Qwen2Config,
}

/// Positions of logits computed per chunk by [`Qwen2ForCausalLM::token_logprobs`] callers that
/// do not choose: `[256, vocab]` f32 is 155 MB at Qwen2's 151,936-entry vocabulary.
pub const DEFAULT_LOGPROB_CHUNK: usize = 256;

impl<B: ModelBackend> Qwen2ForCausalLM<B> {
    /// Runs the decoder on a packed step and returns the final hidden states (after the last
    /// norm). With a cache, each segment is appended to its row.
    ///
    /// # Shapes
    /// - output: `[n, hidden]`
    pub fn forward_hidden(
        &self,
        input: &StepInput<B>,
        mut cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 2> {
        let mut x = self.model.embed_tokens.forward(input.input_ids.clone());
        for (i, layer) in self.model.layers.iter().enumerate() {
            x = layer.forward(x, input, i, cache.as_deref_mut());
        }
        self.model.norm.forward(x)
    }

    /// The output head: `lm_head`, or the embedding matrix when they are tied.
    pub fn head(&self) -> Head<B> {
        let prim = |t: &Tensor<B, 2>| t.clone().into_primitive().tensor();
        match &self.lm_head {
            None => Head::Dense(prim(&self.model.embed_tokens.weight)),
            Some(head) => match &head.weight {
                BaseWeight::Dense(w) => Head::Dense(prim(w)),
                BaseWeight::Nf4(w) => Head::Nf4 {
                    codes: w.codes.clone().into_primitive(),
                    absmax: w.absmax.clone().into_primitive().tensor(),
                    table: w.table.clone().into_primitive().tensor(),
                    rows: w.rows,
                    cols: w.cols,
                },
            },
        }
    }

    /// Projects hidden states to vocabulary logits.
    ///
    /// # Shapes
    /// - `hidden`: `[n, hidden]`
    /// - output: `[n, vocab]`
    pub fn logits(&self, hidden: Tensor<B, 2>) -> Tensor<B, 2> {
        let out = self.head().forward(hidden.into_primitive().tensor());
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }

    /// Log-probability of each position's target under `log_softmax(logits / temperature)`,
    /// and the entropy of that distribution, computed `chunk` positions at a time with the head
    /// inside the chunk (no `[n, vocab]` tensor). Differentiable; under autodiff the backward
    /// pass recomputes each chunk's logits.
    ///
    /// # Shapes
    /// - `hidden`: `[n, hidden]`; `targets`: `[n]`
    /// - output: log-probabilities `[n]` and entropies `[n]`
    pub fn token_logprobs(
        &self,
        hidden: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
        temperature: f64,
        chunk: usize,
    ) -> (Tensor<B, 1>, Tensor<B, 1>) {
        let n = hidden.dims()[0];
        let out = B::token_logprobs(
            hidden.into_primitive().tensor(),
            &self.head(),
            targets.into_primitive(),
            temperature,
            chunk,
        );
        let out = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out));
        (
            out.clone().narrow(1, 0, 1).reshape([n]),
            out.narrow(1, 1, 1).reshape([n]),
        )
    }

    /// Hidden states then logits, scattered back to the padded layout of an input built by
    /// [`Qwen2ForCausalLM::step_input`] (zeros where the mask is 0); `[1, n, vocab]` for a
    /// packed input.
    ///
    /// # Shapes
    /// - output: `[batch, seq, vocab]`
    pub fn forward(&self, input: &StepInput<B>, cache: Option<&mut KvCache<B>>) -> Tensor<B, 3> {
        input.unpack(self.logits(self.forward_hidden(input, cache)))
    }

    /// Builds the inputs of a forward pass over a left-padded batch (`ids` and `mask`
    /// `[batch][seq]`, 1 = token), nothing cached (see [`StepInput::padded`]).
    pub fn step_input(
        &self,
        ids: &[Vec<u32>],
        mask: &[Vec<u8>],
        device: &B::Device,
    ) -> Result<StepInput<B>> {
        StepInput::padded(&self.config, &self.model.rotary_emb, ids, mask, device)
    }

    /// Builds the inputs of a forward pass over packed sequences, nothing cached.
    pub fn packed_input(&self, seqs: &[&[u32]], device: &B::Device) -> Result<StepInput<B>> {
        let segments: Vec<Segment<'_>> = seqs.iter().map(|ids| Segment { ids, past: 0 }).collect();
        StepInput::packed(&self.config, &self.model.rotary_emb, &segments, device)
    }

    /// Builds the inputs of a cached step: each `(row, ids)` appends `ids` to that cache row.
    /// A row may appear once per step.
    pub fn cached_input(
        &self,
        cache: &KvCache<B>,
        segments: &[(usize, &[u32])],
        device: &B::Device,
    ) -> Result<StepInput<B>> {
        let mut seen = std::collections::HashSet::new();
        let mut segs = Vec::with_capacity(segments.len());
        for &(row, ids) in segments {
            if !seen.insert(row) {
                return Err(ModelError::Input(format!(
                    "cache row {row} appears twice in one step"
                )));
            }
            segs.push(Segment {
                ids,
                past: cache.row_len(row)?,
            });
        }
        let mut input = StepInput::packed(&self.config, &self.model.rotary_emb, &segs, device)?;
        input.rows = segments.iter().map(|&(row, _)| row).collect();
        Ok(input)
    }

    /// An empty cache sized for this model.
    pub fn new_cache(&self) -> KvCache<B> {
        KvCache::new(self.model.layers.len())
    }
}

impl<B: Backend> Qwen2ForCausalLM<B> {
    /// Every projection with its Hugging Face module path (`model.layers.3.mlp.up_proj`),
    /// in layer order; `lm_head` last when untied.
    pub fn projections(&self) -> Vec<(String, &Linear<B>)> {
        let mut out = Vec::new();
        for (i, l) in self.model.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            out.push((format!("{p}.self_attn.q_proj"), &l.self_attn.q_proj));
            out.push((format!("{p}.self_attn.k_proj"), &l.self_attn.k_proj));
            out.push((format!("{p}.self_attn.v_proj"), &l.self_attn.v_proj));
            out.push((format!("{p}.self_attn.o_proj"), &l.self_attn.o_proj));
            out.push((format!("{p}.mlp.gate_proj"), &l.mlp.gate_proj));
            out.push((format!("{p}.mlp.up_proj"), &l.mlp.up_proj));
            out.push((format!("{p}.mlp.down_proj"), &l.mlp.down_proj));
        }
        if let Some(head) = &self.lm_head {
            out.push(("lm_head".into(), head));
        }
        out
    }

    /// Mutable access to every decoder-layer projection with its module path.
    pub fn layer_projections_mut(&mut self) -> Vec<(String, &mut Linear<B>)> {
        let mut out = Vec::new();
        for (i, l) in self.model.layers.iter_mut().enumerate() {
            let p = format!("model.layers.{i}");
            out.push((format!("{p}.self_attn.q_proj"), &mut l.self_attn.q_proj));
            out.push((format!("{p}.self_attn.k_proj"), &mut l.self_attn.k_proj));
            out.push((format!("{p}.self_attn.v_proj"), &mut l.self_attn.v_proj));
            out.push((format!("{p}.self_attn.o_proj"), &mut l.self_attn.o_proj));
            out.push((format!("{p}.mlp.gate_proj"), &mut l.mlp.gate_proj));
            out.push((format!("{p}.mlp.up_proj"), &mut l.mlp.up_proj));
            out.push((format!("{p}.mlp.down_proj"), &mut l.mlp.down_proj));
        }
        out
    }

    /// Number of weights in the model (NF4 weights counted by their logical size).
    pub fn num_weights(&self) -> usize {
        let mut n = self
            .model
            .embed_tokens
            .weight
            .dims()
            .iter()
            .product::<usize>();
        n += self.model.norm.weight.dims()[0];
        for l in &self.model.layers {
            n += l.input_layernorm.weight.dims()[0] + l.post_attention_layernorm.weight.dims()[0];
        }
        for (_, p) in self.projections() {
            let [o, i] = p.shape();
            n += o * i + p.bias.as_ref().map(|b| b.dims()[0]).unwrap_or(0);
            if let Some(l) = &p.lora {
                n += l.rank() * (o + i);
            }
        }
        n
    }
}
