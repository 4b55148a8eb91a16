//! Building a [`Qwen2ForCausalLM`]: from a Hugging Face checkpoint directory (dense f32, f16 or
//! bf16 safetensors, single or sharded, or a bitsandbytes NF4 checkpoint kept packed), optionally
//! quantizing dense projections to NF4 on the way in, or with random weights of a given shape.
//! Qwen2 and Llama checkpoints load alike; the config says which projections carry a bias.

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;

use crate::backend::ModelBackend;
use crate::checkpoint::Checkpoint;
use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};
use crate::inputs::RotaryEmbedding;
use crate::linear::{BaseWeight, BlockWeight, Linear, Nf4Weight, frozen};
use crate::nf4::format::{BLOCK, NF4_CODE, dequantize_absmax};
use crate::qwen2::{
    Attention, DecoderLayer, Embedding, Mlp, Qwen2ForCausalLM, Qwen2Model, RmsNorm,
};

/// Options for loading a checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Quantize dense decoder-layer projections to NF4 while loading (`--quantize nf4`).
    pub quantize_nf4: bool,
}

/// `weight.quant_state.bitsandbytes__nf4`: the JSON bitsandbytes stores beside each weight.
#[derive(Deserialize)]
struct QuantState {
    quant_type: String,
    blocksize: usize,
    shape: Vec<usize>,
    #[serde(default)]
    nested_offset: Option<f32>,
    #[serde(default)]
    nested_blocksize: Option<usize>,
}

impl<B: ModelBackend> Qwen2ForCausalLM<B> {
    /// Loads `config.json` and the weights from a Hugging Face model directory.
    pub fn load(dir: &Path, device: &B::Device, options: LoadOptions) -> Result<Self> {
        if !dir.is_dir() {
            return Err(ModelError::io(
                dir,
                std::io::Error::new(std::io::ErrorKind::NotFound, "model directory not found"),
            ));
        }
        let config = Qwen2Config::from_file(&dir.join("config.json"))?;
        let ck = Checkpoint::open_dir(dir)?;
        let (hidden, inter) = (config.hidden_size, config.intermediate_size);
        let (heads, kv, d) = (
            config.num_attention_heads,
            config.num_kv_heads(),
            config.head_dim(),
        );
        let vector = |name: &str, len: usize| -> Result<Tensor<B, 1>> {
            Ok(Tensor::from_data(
                TensorData::new(ck.f32(name, &[len])?, [len]),
                device,
            ))
        };
        let projection = |path: &str,
                          rows: usize,
                          cols: usize,
                          bias: bool,
                          quantize: bool|
         -> Result<Linear<B>> {
            let (weight, block_copy) = load_base::<B>(&ck, path, rows, cols, quantize, device)?;
            let bias = if bias {
                Some(frozen(vector(&format!("{path}.bias"), rows)?))
            } else {
                None
            };
            Ok(Linear {
                weight,
                bias,
                lora: None,
                block_copy,
            })
        };
        let q = options.quantize_nf4;
        let (qkv_bias, o_bias, mlp_bias) = (config.qkv_bias(), config.o_bias(), config.mlp_bias());
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attn = |name: &str, rows: usize, cols: usize, bias: bool| {
                projection(&format!("{p}.self_attn.{name}"), rows, cols, bias, q)
            };
            let mlp = |name: &str, rows: usize, cols: usize| {
                projection(&format!("{p}.mlp.{name}"), rows, cols, mlp_bias, q)
            };
            layers.push(DecoderLayer {
                self_attn: Attention {
                    q_proj: attn("q_proj", heads * d, hidden, qkv_bias)?,
                    k_proj: attn("k_proj", kv * d, hidden, qkv_bias)?,
                    v_proj: attn("v_proj", kv * d, hidden, qkv_bias)?,
                    o_proj: attn("o_proj", hidden, heads * d, o_bias)?,
                    num_heads: heads,
                    num_kv_heads: kv,
                    head_dim: d,
                },
                mlp: Mlp {
                    gate_proj: mlp("gate_proj", inter, hidden)?,
                    up_proj: mlp("up_proj", inter, hidden)?,
                    down_proj: mlp("down_proj", hidden, inter)?,
                },
                input_layernorm: RmsNorm {
                    weight: frozen(vector(&format!("{p}.input_layernorm.weight"), hidden)?),
                    eps: config.rms_norm_eps,
                },
                post_attention_layernorm: RmsNorm {
                    weight: frozen(vector(
                        &format!("{p}.post_attention_layernorm.weight"),
                        hidden,
                    )?),
                    eps: config.rms_norm_eps,
                },
            });
        }
        let has_head = ck.contains("lm_head.weight");
        let lm_head = if config.tie_word_embeddings || !has_head {
            if !config.tie_word_embeddings {
                tracing::warn!(
                    "{}: no lm_head.weight; tying the output to the embeddings",
                    dir.display()
                );
            }
            None
        } else {
            let bytes = config.vocab_size * hidden * 4;
            if let Some(max) = B::max_buffer_bytes(device)
                && bytes > max
                && !ck.contains("lm_head.weight.quant_state.bitsandbytes__nf4")
            {
                return Err(ModelError::TooLarge {
                    name: "lm_head.weight".into(),
                    bytes,
                    max,
                });
            }
            // bitsandbytes leaves lm_head unquantized unless asked; read it as it is stored.
            Some(projection(
                "lm_head",
                config.vocab_size,
                hidden,
                false,
                false,
            )?)
        };
        let model = Qwen2Model {
            embed_tokens: embedding_table::<B>(
                &ck,
                "model.embed_tokens.weight",
                [config.vocab_size, hidden],
                lm_head.is_none(),
                device,
            )?,
            layers,
            norm: RmsNorm {
                weight: frozen(vector("model.norm.weight", hidden)?),
                eps: config.rms_norm_eps,
            },
            rotary_emb: RotaryEmbedding::new(&config, device),
        };
        Ok(Self {
            model,
            lm_head,
            config,
        })
    }

    /// A model with the given shape and random weights (weights, biases, the embedding and the
    /// output head N(0, 0.02), norm gains 1 + N(0, 0.02)), seeded; with `quantize_nf4` the
    /// projections are NF4. For tests and benchmarks.
    pub fn random(config: Qwen2Config, seed: u64, quantize_nf4: bool, device: &B::Device) -> Self {
        Self::random_init(config, seed, quantize_nf4, RandomInit::default(), device)
    }

    /// As [`Self::random`], with the standard deviations of `init`. The values are drawn in the
    /// same order whatever the deviations, so only their scale changes.
    pub fn random_init(
        config: Qwen2Config,
        seed: u64,
        quantize_nf4: bool,
        init: RandomInit,
        device: &B::Device,
    ) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        build(
            config,
            device,
            |len, kind| match kind {
                Init::Norm => normal(&mut rng, len, init.std)
                    .into_iter()
                    .map(|v| 1.0 + v)
                    .collect(),
                Init::Weight | Init::Bias => normal(&mut rng, len, init.std),
                Init::Embedding => normal(&mut rng, len, init.embedding_std),
            },
            quantize_nf4,
        )
    }

    /// A model with the given shape and all-zero weights; allocation is lazy on the host, so this
    /// builds even the largest shapes instantly (for shape checks).
    pub fn zeros(config: Qwen2Config, device: &B::Device) -> Self {
        build(config, device, |len, _| vec![0.0; len], false)
    }
}

/// Standard deviations of a random model's weights ([`Qwen2ForCausalLM::random_init`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RandomInit {
    /// Projections and biases (and the spread of norm gains around 1).
    pub std: f32,
    /// The embedding table and the output head. With frozen norms and head (LoRA training),
    /// logits are bounded by `‖head row‖ · √hidden`; a larger value lets an adapter on a
    /// small random model express confident predictions.
    pub embedding_std: f32,
}

impl Default for RandomInit {
    fn default() -> Self {
        Self {
            std: 0.02,
            embedding_std: 0.02,
        }
    }
}

#[derive(Clone, Copy)]
enum Init {
    Weight,
    Bias,
    Norm,
    Embedding,
}

fn normal(rng: &mut StdRng, len: usize, std: f32) -> Vec<f32> {
    // Box-Muller, two values per draw.
    let mut out = Vec::with_capacity(len + 1);
    while out.len() < len {
        let u1: f32 = rng.random_range(f32::EPSILON..1.0);
        let u2: f32 = rng.random::<f32>();
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let t = std::f32::consts::TAU * u2;
        out.push(r * t.cos());
        out.push(r * t.sin());
    }
    out.truncate(len);
    out
}

/// The embedding matrix: kept bf16 when the checkpoint stores it so and the backend multiplies
/// by bf16 weights directly ([`ModelBackend::KEEPS_BF16`]; lossless either way), f32 otherwise.
/// An f32 table that is also the output head (`head`) comes with its exact block copy where
/// the backend reads one and the values are one ([`crate::blocks`]).
fn embedding_table<B: ModelBackend>(
    ck: &Checkpoint,
    name: &str,
    shape: [usize; 2],
    head: bool,
    device: &B::Device,
) -> Result<Embedding<B>> {
    let raw = ck.raw(name)?;
    if raw.shape != shape {
        return Err(ModelError::Shape {
            name: name.into(),
            found: raw.shape,
            expected: shape.to_vec(),
        });
    }
    if B::KEEPS_BF16 && raw.dtype == safetensors::Dtype::BF16 {
        let values: Vec<half::bf16> = raw
            .data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]))
            .collect();
        let data = TensorData::new(values, shape);
        return Ok(Embedding::from_data(
            data,
            B::max_buffer_bytes(device),
            device,
        ));
    }
    let values = crate::checkpoint::to_f32(name, raw.dtype, raw.data)?;
    let copy = (head && B::READS_BLOCKS)
        .then(|| BlockWeight::recover(&values, shape[0], shape[1], device))
        .flatten();
    let data = TensorData::new(values, shape);
    let mut table = Embedding::from_data(data, B::max_buffer_bytes(device), device);
    if table.blocks.len() == 1 {
        table.block_copy = copy;
    }
    Ok(table)
}

fn build<B: ModelBackend>(
    config: Qwen2Config,
    device: &B::Device,
    values: impl FnMut(usize, Init) -> Vec<f32>,
    quantize: bool,
) -> Qwen2ForCausalLM<B> {
    let (hidden, inter) = (config.hidden_size, config.intermediate_size);
    let (heads, kv, d) = (
        config.num_attention_heads,
        config.num_kv_heads(),
        config.head_dim(),
    );
    let values = std::cell::RefCell::new(values);
    let draw = |len: usize, kind: Init| (values.borrow_mut())(len, kind);
    let tensor2 = |rows: usize, cols: usize| {
        Tensor::<B, 2>::from_data(
            TensorData::new(draw(rows * cols, Init::Weight), [rows, cols]),
            device,
        )
    };
    // Each projection is quantized as soon as it is drawn, so an NF4 model never holds more
    // than one projection in f32.
    let base = |rows: usize, cols: usize| {
        if quantize {
            let host = draw(rows * cols, Init::Weight);
            BaseWeight::Nf4(Nf4Weight::quantize(&host, rows, cols, device))
        } else {
            BaseWeight::Dense(frozen(tensor2(rows, cols)))
        }
    };
    let mut layers_raw = Vec::new();
    for _ in 0..config.num_hidden_layers {
        layers_raw.push([
            base(heads * d, hidden),
            base(kv * d, hidden),
            base(kv * d, hidden),
            base(hidden, heads * d),
            base(inter, hidden),
            base(inter, hidden),
            base(hidden, inter),
        ]);
    }
    // The embedding is rounded to bf16 (as checkpoints store it) on every backend, and kept
    // bf16 where the backend multiplies by it directly, so random models agree across
    // backends. Drawn a block of rows at a time, so no f32 copy of it ever exists.
    let embed = {
        let (vocab, mut rows) = (
            config.vocab_size,
            Vec::with_capacity(config.vocab_size * hidden),
        );
        let mut done = 0;
        while done < vocab {
            let n = 4096.min(vocab - done);
            rows.extend(
                draw(n * hidden, Init::Embedding)
                    .into_iter()
                    .map(half::bf16::from_f32),
            );
            done += n;
        }
        let data = TensorData::new(rows, [vocab, hidden]);
        let data = if B::KEEPS_BF16 {
            data
        } else {
            data.convert::<f32>()
        };
        Embedding::from_data(data, B::max_buffer_bytes(device), device)
    };
    let head = (!config.tie_word_embeddings).then(|| {
        let (rows, cols) = (config.vocab_size, hidden);
        Tensor::<B, 2>::from_data(
            TensorData::new(draw(rows * cols, Init::Embedding), [rows, cols]),
            device,
        )
    });
    let vector = |len: usize, kind: Init| {
        Tensor::<B, 1>::from_data(TensorData::new(draw(len, kind), [len]), device)
    };
    let eps = config.rms_norm_eps;
    let (qkv_bias, o_bias, mlp_bias) = (config.qkv_bias(), config.o_bias(), config.mlp_bias());
    let linear = |weight: BaseWeight<B>, bias: Option<Tensor<B, 1>>| Linear {
        weight,
        bias: bias.map(frozen),
        lora: None,
        block_copy: None,
    };
    let layers = layers_raw
        .into_iter()
        .map(|[q, k, v, o, g, u, dn]| DecoderLayer {
            self_attn: Attention {
                q_proj: linear(q, qkv_bias.then(|| vector(heads * d, Init::Bias))),
                k_proj: linear(k, qkv_bias.then(|| vector(kv * d, Init::Bias))),
                v_proj: linear(v, qkv_bias.then(|| vector(kv * d, Init::Bias))),
                o_proj: linear(o, o_bias.then(|| vector(hidden, Init::Bias))),
                num_heads: heads,
                num_kv_heads: kv,
                head_dim: d,
            },
            mlp: Mlp {
                gate_proj: linear(g, mlp_bias.then(|| vector(inter, Init::Bias))),
                up_proj: linear(u, mlp_bias.then(|| vector(inter, Init::Bias))),
                down_proj: linear(dn, mlp_bias.then(|| vector(hidden, Init::Bias))),
            },
            input_layernorm: RmsNorm {
                weight: frozen(vector(hidden, Init::Norm)),
                eps,
            },
            post_attention_layernorm: RmsNorm {
                weight: frozen(vector(hidden, Init::Norm)),
                eps,
            },
        })
        .collect();
    let norm = RmsNorm {
        weight: frozen(vector(hidden, Init::Norm)),
        eps,
    };
    Qwen2ForCausalLM {
        model: Qwen2Model {
            embed_tokens: embed,
            layers,
            norm,
            rotary_emb: RotaryEmbedding::new(&config, device),
        },
        lm_head: head.map(|w| Linear::dense(w, None)),
        config,
    }
}

/// Loads one projection's base weight: bitsandbytes NF4 when the checkpoint holds its
/// quantization state, dense otherwise (quantized here when asked). A dense weight comes with
/// its exact block copy where the backend reads one and the values are one
/// ([`crate::blocks`]).
fn load_base<B: ModelBackend>(
    ck: &Checkpoint,
    path: &str,
    rows: usize,
    cols: usize,
    quantize: bool,
    device: &B::Device,
) -> Result<(BaseWeight<B>, Option<BlockWeight<B>>)> {
    let name = format!("{path}.weight");
    let state_key = format!("{name}.quant_state.bitsandbytes__nf4");
    if ck.contains(&state_key) {
        let nf4 = load_nf4(ck, &name, &state_key, rows, cols, device)?;
        return Ok((BaseWeight::Nf4(nf4), None));
    }
    for suffix in ["quant_state.bitsandbytes__fp4", "SCB"] {
        if ck.contains(&format!("{name}.{suffix}")) {
            return Err(ModelError::Nf4 {
                name,
                message: format!(
                    "`{suffix}` found: only NF4 bitsandbytes checkpoints are supported"
                ),
            });
        }
    }
    let values = ck.f32(&name, &[rows, cols])?;
    if quantize {
        let nf4 = Nf4Weight::quantize(&values, rows, cols, device);
        return Ok((BaseWeight::Nf4(nf4), None));
    }
    let copy = B::READS_BLOCKS
        .then(|| BlockWeight::recover(&values, rows, cols, device))
        .flatten();
    let dense = frozen(Tensor::from_data(
        TensorData::new(values, [rows, cols]),
        device,
    ));
    Ok((BaseWeight::Dense(dense), copy))
}

fn load_nf4<B: Backend>(
    ck: &Checkpoint,
    name: &str,
    state_key: &str,
    rows: usize,
    cols: usize,
    device: &B::Device,
) -> Result<Nf4Weight<B>> {
    let err = |message: String| ModelError::Nf4 {
        name: name.to_string(),
        message,
    };
    let (_, state_bytes) = ck.u8(state_key)?;
    let state: QuantState = serde_json::from_slice(state_bytes)
        .map_err(|e| err(format!("unreadable quant_state: {e}")))?;
    if state.quant_type != "nf4" {
        return Err(err(format!(
            "quant_type is `{}`, only nf4 is supported",
            state.quant_type
        )));
    }
    if state.blocksize != BLOCK {
        return Err(err(format!(
            "blocksize {} is not supported (only {BLOCK})",
            state.blocksize
        )));
    }
    if state.shape != [rows, cols] {
        return Err(ModelError::Shape {
            name: name.to_string(),
            found: state.shape,
            expected: vec![rows, cols],
        });
    }
    let n = rows * cols;
    let (_, packed) = ck.u8(name)?;
    if packed.len() != n.div_ceil(2) {
        return Err(err(format!(
            "{} packed bytes for {n} weights (expected {})",
            packed.len(),
            n.div_ceil(2)
        )));
    }
    let quant_map = ck.f32(&format!("{name}.quant_map"), &[16])?;
    if quant_map != NF4_CODE {
        return Err(err("quant_map is not the NF4 code table".into()));
    }
    let blocks = n.div_ceil(BLOCK);
    let absmax_key = format!("{name}.absmax");
    let raw = ck.raw(&absmax_key)?;
    let absmax = if raw.dtype == safetensors::Dtype::U8 {
        let offset = state
            .nested_offset
            .ok_or_else(|| err("double-quantized absmax without nested_offset".into()))?;
        if let Some(nb) = state.nested_blocksize
            && nb != crate::nf4::format::NESTED_BLOCK
        {
            return Err(err(format!(
                "nested blocksize {nb} is not supported (only 256)"
            )));
        }
        if raw.data.len() != blocks {
            return Err(err(format!(
                "{} absmax codes for {blocks} blocks",
                raw.data.len()
            )));
        }
        let nested_blocks = blocks.div_ceil(crate::nf4::format::NESTED_BLOCK);
        let nested = ck.f32(&format!("{name}.nested_absmax"), &[nested_blocks])?;
        let nested_code = ck.f32(&format!("{name}.nested_quant_map"), &[256])?;
        dequantize_absmax(raw.data, &nested, &nested_code, offset)
    } else {
        ck.f32(&absmax_key, &[blocks])?
    };
    if absmax.iter().any(|a| !a.is_finite()) {
        return Err(err("absmax holds a non-finite value".into()));
    }
    Ok(Nf4Weight::from_parts(packed, &absmax, rows, cols, device))
}
