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

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Int, Tensor, TensorPrimitive};

use crate::backend::{Head, Heads, ModelBackend, SequenceKv};
use crate::cache::KvCache;
use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};
use crate::inputs::{RotaryEmbedding, Segment, SharedPacking, StepInput};
use crate::linear::{BaseWeight, BlockWeight, Linear, frozen};

/// Token embeddings `[vocab, hidden]`, held as consecutive row blocks.
///
/// One block, unless the backend bounds the size of one buffer
/// ([`ModelBackend::max_buffer_bytes`]: a wgpu adapter's storage-buffer limit, 128 MiB on
/// lavapipe) below the table's size, as for Qwen2.5-1.5B's 933 MB f32 table; then each block
/// holds as many whole rows as fit ([`Embedding::from_data`]).
#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    /// The row blocks, in vocabulary order ([`frozen`] unless fully fine-tuned): f32, or bf16
    /// on backends that keep it ([`ModelBackend::KEEPS_BF16`]) when the checkpoint stores it so.
    pub blocks: Vec<Param<Tensor<B, 2>>>,
    /// An exact block copy of a one-block table that is also the output head, for decoding
    /// ([`crate::blocks`]).
    pub block_copy: Option<BlockWeight<B>>,
}

impl<B: Backend> Embedding<B> {
    /// An embedding of one block.
    pub fn new(weight: Tensor<B, 2>) -> Self {
        Self {
            blocks: vec![frozen(weight)],
            block_copy: None,
        }
    }

    /// Uploads a `[rows, cols]` table from host `data` in blocks of at most `max_bytes`
    /// (whole rows, at least one per block); `None` for one block.
    pub fn from_data(
        data: burn::tensor::TensorData,
        max_bytes: Option<usize>,
        device: &B::Device,
    ) -> Self {
        let [rows, cols] = [data.shape[0], data.shape[1]];
        let row_bytes = cols * data.dtype.size();
        let per_block = match max_bytes {
            Some(max) if rows * row_bytes > max => (max / row_bytes.max(1)).max(1),
            _ => return Self::new(Tensor::from_data(data, device)),
        };
        let bytes = data.as_bytes();
        let blocks = (0..rows)
            .step_by(per_block)
            .map(|start| {
                let n = per_block.min(rows - start);
                let part = bytes[start * row_bytes..(start + n) * row_bytes].to_vec();
                frozen(Tensor::from_data(
                    burn::tensor::TensorData::from_bytes_vec(part, [n, cols], data.dtype),
                    device,
                ))
            })
            .collect();
        Self {
            blocks,
            block_copy: None,
        }
    }

    /// Vocabulary size (rows over all blocks).
    pub fn rows(&self) -> usize {
        self.blocks.iter().map(|b| b.val().dims()[0]).sum()
    }

    /// The whole table as one tensor (for saving; on a backend that bounds buffers below its
    /// size, this allocation fails as loading it whole would have).
    pub fn weight(&self) -> Tensor<B, 2> {
        match self.blocks.as_slice() {
            [one] => one.val(),
            blocks => Tensor::cat(blocks.iter().map(Param::val).collect(), 0),
        }
    }

    /// The rows of `ids`, widened to f32.
    ///
    /// # Shapes
    /// - `ids`: `[n]`; output: `[n, hidden]`
    pub fn forward(&self, ids: Tensor<B, 1, Int>) -> Tensor<B, 2> {
        let widen = |rows: Tensor<B, 2>| match rows.dtype() {
            DType::F32 => rows,
            _ => rows.cast(DType::F32),
        };
        if let [one] = self.blocks.as_slice() {
            return widen(one.val().select(0, ids));
        }
        // Each block gathers the ids in its range (others clamped into it, then zeroed).
        let mut start = 0i64;
        let mut sum: Option<Tensor<B, 2>> = None;
        for block in self.blocks.iter().map(Param::val) {
            let n = block.dims()[0] as i64;
            let inside = ids
                .clone()
                .greater_equal_elem(start)
                .bool_and(ids.clone().lower_elem(start + n));
            let local = (ids.clone() - start).clamp(0, n - 1);
            let rows = widen(block.select(0, local)) * inside.float().unsqueeze_dim::<2>(1);
            sum = Some(match sum {
                Some(s) => s + rows,
                None => rows,
            });
            start += n;
        }
        sum.expect("an embedding has at least one block")
    }
}

/// RMSNorm computed in f32: `x / sqrt(mean(x²) + eps) · weight`.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// Per-channel gain ([`frozen`] unless fully fine-tuned).
    pub weight: Param<Tensor<B, 1>>,
    /// Epsilon inside the square root.
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    /// # Shapes
    /// - `x`, output: `[n, hidden]`
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let variance = x.clone().powi_scalar(2).mean_dim(1);
        let normed = x * (variance + self.eps).sqrt().recip();
        normed * self.weight.val().unsqueeze::<2>()
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
            None => match &input.expansion {
                None => B::packed_attention(prim(q), prim(k), prim(v), &input.spans, heads).0,
                Some(e) => {
                    // Shared rows computed once: attention sees every sequence whole.
                    let whole = |t: Tensor<B, 2>| prim(t.select(0, e.expand.clone()));
                    let out =
                        B::packed_attention(whole(q), whole(k), whole(v), &input.spans, heads);
                    Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out.0))
                        .select(0, e.pick.clone())
                        .into_primitive()
                        .tensor()
                }
            },
            Some(cache) => {
                assert!(
                    input.expansion.is_none(),
                    "a cached step cannot share packed rows"
                );
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
        let gate = self.gate_proj.forward(x.clone()).into_primitive().tensor();
        let up = self.up_proj.forward(x).into_primitive().tensor();
        let act = B::swiglu(gate, up);
        self.down_proj
            .forward(Tensor::from_primitive(TensorPrimitive::Float(act)))
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

/// A dense output head, with its block copy when it has one.
fn dense_head<B: ModelBackend>(weight: FloatTensor<B>, copy: &Option<BlockWeight<B>>) -> Head<B> {
    match copy {
        Some(copy) => Head::DenseBlocks {
            weight,
            blocks: copy.words.clone().into_primitive(),
            format: copy.format,
        },
        None => Head::Dense(weight),
    }
}

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
        let prim = |t: &Param<Tensor<B, 2>>| t.val().into_primitive().tensor();
        match &self.lm_head {
            None => match self.model.embed_tokens.blocks.as_slice() {
                [one] => dense_head(prim(one), &self.model.embed_tokens.block_copy),
                blocks => Head::Blocks(blocks.iter().map(prim).collect()),
            },
            Some(head) => match &head.weight {
                BaseWeight::Dense(w) => dense_head(prim(w), &head.block_copy),
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

    /// Builds the inputs of a forward pass over sequences packed as `packing` (built from the
    /// same `seqs`) lays them out, shared prefixes once, nothing cached
    /// ([`StepInput::shared`]).
    pub fn shared_input(
        &self,
        seqs: &[&[u32]],
        packing: &SharedPacking,
        device: &B::Device,
    ) -> Result<StepInput<B>> {
        StepInput::shared(&self.config, &self.model.rotary_emb, seqs, packing, device)
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
    /// Drops every block copy ([`crate::blocks`]): the projections', the head's and the
    /// embedding's. The model then multiplies by its dense weights alone, as it must once
    /// they can change.
    pub fn drop_block_copies(&mut self) {
        for (_, p) in self.layer_projections_mut() {
            p.block_copy = None;
        }
        if let Some(head) = &mut self.lm_head {
            head.block_copy = None;
        }
        self.model.embed_tokens.block_copy = None;
    }

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
        let embed = &self.model.embed_tokens;
        let mut n = embed.rows() * embed.blocks[0].val().dims()[1];
        let width = |norm: &RmsNorm<B>| norm.weight.val().dims()[0];
        n += width(&self.model.norm);
        for l in &self.model.layers {
            n += width(&l.input_layernorm) + width(&l.post_attention_layernorm);
        }
        for (_, p) in self.projections() {
            let [o, i] = p.shape();
            n += o * i + p.bias.as_ref().map(|b| b.val().dims()[0]).unwrap_or(0);
            if let Some(l) = &p.lora {
                n += l.rank() * (o + i);
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Tensor, TensorData, TensorPrimitive};

    use super::*;
    use crate::Cpu;
    use crate::config::Qwen2Config;

    fn table(rows: usize, cols: usize) -> TensorData {
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1013) as f32 / 1013.0 - 0.5)
            .collect();
        TensorData::new(values, [rows, cols])
    }

    #[test]
    fn blocked_embedding_gathers_and_projects_as_one_block() {
        let device = Default::default();
        let (rows, cols) = (103, 8);
        let whole = Embedding::<Cpu>::from_data(table(rows, cols), None, &device);
        // 10 rows of 8 f32 per block: 11 blocks, the last of 3 rows.
        let blocked = Embedding::<Cpu>::from_data(table(rows, cols), Some(10 * 8 * 4 + 7), &device);
        assert_eq!(whole.blocks.len(), 1);
        assert_eq!(blocked.blocks.len(), 11);
        assert_eq!(blocked.blocks[10].val().dims(), [3, 8]);
        assert_eq!(blocked.rows(), rows);
        assert_eq!(blocked.weight().into_data(), whole.weight().into_data());

        let ids: Vec<i64> = vec![0, 9, 10, 11, 55, 99, 100, 102, 3, 102];
        let ids = Tensor::<Cpu, 1, Int>::from_data(TensorData::new(ids, [10]), &device);
        assert_eq!(
            blocked.forward(ids.clone()).into_data(),
            whole.forward(ids).into_data()
        );

        let prim = |t: &Tensor<Cpu, 2>| t.clone().into_primitive().tensor();
        let one = Head::<Cpu>::Dense(prim(&whole.blocks[0].val()));
        let many = Head::<Cpu>::Blocks(blocked.blocks.iter().map(|b| prim(&b.val())).collect());
        let x: Vec<f32> = (0..3 * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let x = Tensor::<Cpu, 2>::from_data(TensorData::new(x, [3, cols]), &device);
        let float = |t| Tensor::<Cpu, 2>::from_primitive(TensorPrimitive::Float(t)).into_data();
        float(many.forward(prim(&x)))
            .assert_approx_eq::<f32>(&float(one.forward(prim(&x))), Default::default());
        let g: Vec<f32> = (0..3 * rows).map(|i| (i as f32 * 0.11).cos()).collect();
        let g = Tensor::<Cpu, 2>::from_data(TensorData::new(g, [3, rows]), &device);
        float(many.backward(prim(&g)))
            .assert_approx_eq::<f32>(&float(one.backward(prim(&g))), Default::default());
    }

    #[test]
    fn a_model_with_a_blocked_embedding_gives_the_same_logits() {
        let device = Default::default();
        let config = Qwen2Config::with_shape(300, 16, 32, 1, 2, 1);
        let model = Qwen2ForCausalLM::<Cpu>::random(config.clone(), 5, false, &device);
        let mut blocked = Qwen2ForCausalLM::<Cpu>::random(config, 5, false, &device);
        let data = blocked.model.embed_tokens.weight().into_data();
        blocked.model.embed_tokens = Embedding::from_data(data, Some(64 * 16 * 4), &device);
        assert!(blocked.model.embed_tokens.blocks.len() > 1);
        assert!(matches!(blocked.head(), Head::Blocks(_)));
        let ids = vec![vec![1u32, 70, 140, 299, 64, 128]];
        let run = |m: &Qwen2ForCausalLM<Cpu>| {
            crate::sequence_logprobs(m, &ids, &[vec![1; 6]], 1.0, &device)
                .unwrap()
                .into_data()
        };
        run(&blocked).assert_approx_eq::<f32>(&run(&model), Default::default());
    }
}
