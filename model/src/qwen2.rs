//! The Qwen2 causal language model, with Hugging Face's module and field names
//! (`model.layers.N.self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, …) so checkpoint keys
//! map one to one. Loading lives in [`crate::load`]; projections are [`Linear`]s (dense or NF4
//! base, optional LoRA).
//!
//! Everything is computed in f32. Attention is grouped-query without materialising repeated
//! keys and values: the query heads that share a key/value head are folded into the sequence
//! axis of one batched matmul.

use burn::module::Module;
use burn::tensor::activation::{silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::cache::KvCache;
use crate::config::Qwen2Config;
use crate::error::Result;
use crate::inputs::{RopeFrequencies, StepInput};
use crate::linear::Linear;
use crate::nf4::Nf4Backend;

/// Token embeddings, `weight` `[vocab, hidden]`.
#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    /// The embedding matrix (frozen).
    pub weight: Tensor<B, 2>,
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
    /// - `x`, output: `[batch, seq, hidden]`
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let variance = x.clone().powi_scalar(2).mean_dim(2);
        let normed = x * (variance + self.eps).sqrt().recip();
        normed * self.weight.clone().unsqueeze::<3>()
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

impl<B: Nf4Backend> Attention<B> {
    /// # Shapes
    /// - `x`, output: `[batch, seq, hidden]`
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        input: &StepInput<B>,
        layer: usize,
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let (h, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let rep = h / kvh;
        let heads = |t: Tensor<B, 3>, n: usize| t.reshape([batch, seq, n, d]).swap_dims(1, 2);
        let q = input.rotate_q(heads(self.q_proj.forward(x.clone()), h));
        let k = input.rotate_k(heads(self.k_proj.forward(x.clone()), kvh));
        let v = heads(self.v_proj.forward(x), kvh);
        let (k, v) = match cache {
            Some(cache) => cache.append(layer, k, v),
            None => (k, v),
        };
        let total = k.dims()[2];
        // [batch, kv_heads, rep · seq, d]: query heads sharing a key/value head, side by side.
        let q = q.reshape([batch, kvh, rep * seq, d]);
        let scores = q
            .matmul(k.swap_dims(2, 3))
            .mul_scalar(1.0 / (d as f64).sqrt());
        // [batch, kv_heads, rep · seq, total] is [batch, heads, seq, total] in memory.
        let scores = scores.reshape([batch, h, seq, total]) + input.mask.clone();
        let probs = softmax(scores, 3).reshape([batch, kvh, rep * seq, total]);
        let out = probs
            .matmul(v)
            .reshape([batch, h, seq, d])
            .swap_dims(1, 2)
            .reshape([batch, seq, h * d]);
        self.o_proj.forward(out)
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

impl<B: Nf4Backend> Mlp<B> {
    /// # Shapes
    /// - `x`, output: `[batch, seq, hidden]`
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
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

impl<B: Nf4Backend> DecoderLayer<B> {
    /// # Shapes
    /// - `x`, output: `[batch, seq, hidden]`
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        input: &StepInput<B>,
        layer: usize,
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
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
    /// Precision of RoPE's inverse frequencies (see [`RopeFrequencies`]).
    #[module(skip)]
    pub rope_frequencies: RopeFrequencies,
}

impl<B: Nf4Backend> Qwen2ForCausalLM<B> {
    /// Runs the decoder and returns the final hidden states (after the last norm). With a cache,
    /// `input` holds only the new tokens and the cache grows by their number.
    ///
    /// # Shapes
    /// - output: `[batch, seq, hidden]`
    pub fn forward_hidden(
        &self,
        input: &StepInput<B>,
        mut cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        let mut x = burn::tensor::module::embedding(
            self.model.embed_tokens.weight.clone(),
            input.input_ids.clone(),
        );
        for (i, layer) in self.model.layers.iter().enumerate() {
            x = layer.forward(x, input, i, cache.as_deref_mut());
        }
        self.model.norm.forward(x)
    }

    /// Projects hidden states to vocabulary logits.
    ///
    /// # Shapes
    /// - `hidden`: `[batch, seq, hidden]`
    /// - output: `[batch, seq, vocab]`
    pub fn logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        match &self.lm_head {
            Some(head) => head.forward(hidden),
            None => {
                let [batch, seq, width] = hidden.dims();
                let vocab = self.config.vocab_size;
                // The [vocab, hidden] embedding is used in its stored layout, like any weight.
                let flat = hidden.reshape([batch * seq, width]);
                let logits = B::dense_linear(
                    flat.into_primitive().tensor(),
                    self.model
                        .embed_tokens
                        .weight
                        .clone()
                        .into_primitive()
                        .tensor(),
                );
                Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(logits))
                    .reshape([batch, seq, vocab])
            }
        }
    }

    /// Hidden states then logits for every position.
    ///
    /// # Shapes
    /// - output: `[batch, seq, vocab]`
    pub fn forward(&self, input: &StepInput<B>, cache: Option<&mut KvCache<B>>) -> Tensor<B, 3> {
        self.logits(self.forward_hidden(input, cache))
    }

    /// Builds the inputs of one forward call for this model (see [`StepInput::new`]).
    pub fn step_input(
        &self,
        ids: &[Vec<u32>],
        mask: &[Vec<u8>],
        past: usize,
        device: &B::Device,
    ) -> Result<StepInput<B>> {
        StepInput::new(&self.config, self.rope_frequencies, ids, mask, past, device)
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
