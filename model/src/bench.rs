//! Measurement routines shared by `cargo xtask bench` and the GPU report example: model
//! throughput with the peers' protocol, one forward pass of a large random model, and NF4
//! projection throughput against dense f32. Each returns its figures as JSON.
//!
//! Every timing reads a result back to the host before stopping the clock (which synchronises
//! asynchronous backends), and inputs change between iterations.

use std::time::Instant;

use burn::tensor::{
    DType, Distribution, ElementConversion, FloatDType, Tensor, TensorData, TensorPrimitive,
};
use serde_json::{Value, json};

use crate::backend::ModelBackend;
use crate::error::{ModelError, Result};
use crate::linear::{Linear, Nf4Weight};
use crate::{GenerateConfig, Qwen2Config, Qwen2ForCausalLM, generate};

/// The peers' throughput protocol (`hf_bench.py`, `candle-bench`).
#[derive(Clone, Debug)]
pub struct Protocol {
    /// Prefill length (batch 1, last-position logits).
    pub prefill_len: usize,
    /// Prefill repetitions after one warm-up.
    pub prefill_iters: usize,
    /// Prompt length before decoding.
    pub prompt_len: usize,
    /// New tokens per decode run.
    pub new_tokens: usize,
    /// Decode repetitions after one warm-up.
    pub decode_iters: usize,
    /// Decode batch sizes.
    pub batches: Vec<usize>,
}

impl Default for Protocol {
    fn default() -> Self {
        Self {
            prefill_len: 512,
            prefill_iters: 5,
            prompt_len: 32,
            new_tokens: 64,
            decode_iters: 3,
            batches: vec![1, 8],
        }
    }
}

/// Token ids `((b·len + i)·7919 + 13) mod vocab` (the peers' formula), shifted by `salt` so
/// repetitions see different inputs.
pub fn ids(batch: usize, seq: usize, vocab: usize, salt: usize) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| {
            (0..seq)
                .map(|i| ((((b * seq + i) * 7919 + 13) + salt * 104_729) % vocab) as u32)
                .collect()
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// Peak resident set size of this process in MiB (VmHWM; NaN where /proc is unavailable).
pub fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .map(str::to_string)
        })
        .and_then(|l| {
            l.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

fn read_scalar<B: ModelBackend, const D: usize>(t: Tensor<B, D>) -> f32 {
    t.sum().into_scalar().elem::<f32>()
}

/// Prefill and decode throughput of `model` with the peers' protocol.
pub fn throughput<B: ModelBackend>(
    model: &Qwen2ForCausalLM<B>,
    protocol: &Protocol,
    device: &B::Device,
) -> Result<Value> {
    if protocol.prefill_iters == 0 || protocol.decode_iters == 0 {
        return Err(ModelError::Input("iterations must be positive".into()));
    }
    let vocab = model.config.vocab_size;
    let prefill = |salt: usize| -> Result<f64> {
        let x = ids(1, protocol.prefill_len, vocab, salt);
        let mask = vec![vec![1u8; protocol.prefill_len]];
        let t = Instant::now();
        let input = model.step_input(&x, &mask, device)?;
        let hidden = model.forward_hidden(&input, None);
        let n = hidden.dims()[0];
        let _ = read_scalar(model.logits(hidden.narrow(0, n - 1, 1)));
        Ok(t.elapsed().as_secs_f64())
    };
    prefill(0)?;
    let ts: Vec<f64> = (1..=protocol.prefill_iters)
        .map(prefill)
        .collect::<Result<_>>()?;
    let mut out = json!({
        "params": model.num_weights(),
        "prefill_len": protocol.prefill_len,
        "prefill_s": ts,
        "prefill_tok_s": protocol.prefill_len as f64 / median(ts.clone()),
        "prefill_best_tok_s": protocol.prefill_len as f64 / best(&ts),
        "prompt_len": protocol.prompt_len,
        "new_tokens": protocol.new_tokens,
    });
    for &b in &protocol.batches {
        let config = GenerateConfig::greedy(protocol.new_tokens);
        let run = |salt: usize| -> Result<f64> {
            let prompts = ids(b, protocol.prompt_len, vocab, salt);
            let t = Instant::now();
            let g = generate(model, &prompts, &config, None, device)?;
            let dt = t.elapsed().as_secs_f64();
            if g.tokens.iter().any(|t| t.len() != protocol.new_tokens) {
                return Err(ModelError::Input("a row stopped early".into()));
            }
            Ok(dt)
        };
        run(0)?;
        let ts: Vec<f64> = (1..=protocol.decode_iters)
            .map(run)
            .collect::<Result<_>>()?;
        let tokens = (b * protocol.new_tokens) as f64;
        out[format!("decode_b{b}_s")] = json!(ts);
        out[format!("decode_b{b}_tok_s")] = json!(tokens / median(ts.clone()));
        out[format!("decode_b{b}_best_tok_s")] = json!(tokens / best(&ts));
    }
    out["peak_rss_mb"] = json!(peak_rss_mb());
    Ok(out)
}

/// Builds a random model of `config` (NF4 projections if asked) and times three forward passes
/// of `seq` tokens.
pub fn forward_pass<B: ModelBackend>(
    config: Qwen2Config,
    seq: usize,
    nf4: bool,
    device: &B::Device,
) -> Result<Value> {
    let t0 = Instant::now();
    let model = Qwen2ForCausalLM::<B>::random(config.clone(), 0, nf4, device);
    let build_s = t0.elapsed().as_secs_f64();
    let rss_built = peak_rss_mb();
    let mut times = Vec::new();
    for salt in 0..3 {
        let x = ids(1, seq, config.vocab_size, salt);
        let mask = vec![vec![1u8; seq]];
        let t = Instant::now();
        let input = model.step_input(&x, &mask, device)?;
        let _ = read_scalar(model.forward(&input, None));
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(json!({
        "nf4": nf4,
        "params": model.num_weights(),
        "seq": seq,
        "build_s": build_s,
        "forward_s": times,
        "forward_median_s": median(times.clone()),
        "rss_after_build_mb": rss_built,
        "peak_rss_mb": peak_rss_mb(),
    }))
}

/// Settings of [`train_step`].
#[derive(Clone, Debug)]
pub struct TrainStepBench {
    /// Tokens in the step's one sequence.
    pub tokens: usize,
    /// NF4 base projections.
    pub nf4: bool,
    /// Per-layer activation checkpointing.
    pub checkpointing: bool,
    /// Measured steps after one warm-up.
    pub steps: usize,
    /// Positions of logits per chunk.
    pub chunk: usize,
}

/// The model [`train_step`] trains, under autodiff: a random model of `config` (NF4 base if
/// `nf4`), LoRA r = 16, α = 32 on all seven projections.
pub type TrainStepModel<B> = Qwen2ForCausalLM<burn::backend::Autodiff<B>>;

/// One LoRA training step as the peer `peft_qlora_step.py` runs it: a random model of `config`
/// (NF4 base if asked), LoRA r = 16, α = 32 on all seven projections, one sequence of random
/// token ids, the mean next-token cross-entropy, backward, and an AdamW update of the adapter.
/// Reports the median step time of `steps` steps after one warm-up, the warm-up's time, the
/// time to build the model, and peak RSS.
pub fn train_step<B: ModelBackend>(
    config: Qwen2Config,
    bench: &TrainStepBench,
    device: &B::Device,
) -> Result<Value> {
    check_train_step(bench)?;
    let t0 = Instant::now();
    let model = train_step_model::<B>(config, bench.nf4, device);
    let build_s = t0.elapsed().as_secs_f64();
    let rss_built = peak_rss_mb();
    let (_, mut out) = train_steps(model, bench, device, |_, _| {})?;
    out["build_s"] = build_s.into();
    out["rss_after_build_mb"] = rss_built.into();
    Ok(out)
}

/// [`train_step`]'s model, built once so that several settings can be timed on it
/// ([`train_steps`]).
pub fn train_step_model<B: ModelBackend>(
    config: Qwen2Config,
    nf4: bool,
    device: &B::Device,
) -> TrainStepModel<B> {
    let settings = crate::LoraSettings::reference();
    Qwen2ForCausalLM::random(config, 0, nf4, device).attach_lora(
        &settings,
        &mut crate::lora::init_rng(1),
        device,
    )
}

/// [`train_step`]'s steps on a model built by [`train_step_model`] (`bench.nf4` is not read),
/// with a fresh AdamW state: one warm-up step, then `bench.steps` timed ones. `progress` hears
/// each step's index (0 is the warm-up) and time as it ends. Returns the trained model with the
/// figures.
pub fn train_steps<B: ModelBackend>(
    mut model: TrainStepModel<B>,
    bench: &TrainStepBench,
    device: &B::Device,
    mut progress: impl FnMut(usize, f64),
) -> Result<(TrainStepModel<B>, Value)> {
    use burn::optim::{AdamWConfig, Optimizer};

    check_train_step(bench)?;
    let config = model.config.clone();
    let mut optim = AdamWConfig::new().init::<burn::backend::Autodiff<B>, TrainStepModel<B>>();
    let pass = crate::TrainPass {
        checkpointing: bench.checkpointing,
        chunk: bench.chunk,
        temperature: 1.0,
        share_prefix: 0,
    };
    let mut times = Vec::new();
    let mut warmup_s = 0.0;
    for salt in 0..=bench.steps {
        let seq = &ids(1, bench.tokens, config.vocab_size, salt)[0];
        let t = Instant::now();
        let out = crate::forward_backward(&model, &[seq.as_slice()], pass, device, |lp| {
            (lp.logprobs.clone().mean().neg(), ())
        })?;
        model = optim.step(1e-5, model, out.grads);
        // The update is lazy on some backends: read a value back before stopping the clock.
        let lora = model.model.layers[0]
            .self_attn
            .q_proj
            .lora
            .as_ref()
            .expect("adapter");
        let _ = read_scalar(lora.lora_b.val().inner().sum());
        let elapsed = t.elapsed().as_secs_f64();
        progress(salt, elapsed);
        if salt == 0 {
            warmup_s = elapsed;
        } else {
            times.push(elapsed);
        }
    }
    let nf4 = model.model.layers[0].self_attn.q_proj.is_nf4();
    let figures = json!({
        "system": "fathom", "tokens": bench.tokens, "nf4": nf4,
        "checkpointing": bench.checkpointing, "chunk": bench.chunk,
        "params": model.num_weights(),
        "lora_params": model.num_trainable(),
        "step_s": median(times.clone()), "steps_s": times, "warmup_s": warmup_s,
        "peak_rss_mb": peak_rss_mb(),
    });
    Ok((model, figures))
}

fn check_train_step(bench: &TrainStepBench) -> Result<()> {
    if bench.tokens < 2 || bench.steps == 0 {
        return Err(ModelError::Input(
            "need at least two tokens and one step".into(),
        ));
    }
    Ok(())
}

/// Qwen2.5-1.5B's projection shapes: name, output features, input features.
const PROJECTIONS: [(&str, usize, usize); 4] = [
    ("q_proj/o_proj", 1536, 1536),
    ("k_proj/v_proj", 256, 1536),
    ("gate/up_proj", 8960, 1536),
    ("down_proj", 1536, 8960),
];

/// NF4 projection throughput against dense f32 on Qwen2.5-1.5B's projection shapes, for each
/// number of input rows in `rows`: the backend's `nf4_linear` (the tiled kernel on the CPU)
/// and dequantize-then-matmul, a dense bf16 weight where the backend supports bf16 (`null`
/// otherwise), with weight sizes for f32, bf16 and NF4.
pub fn nf4_matmul<B: ModelBackend>(rows: &[usize], iters: usize, device: &B::Device) -> Value {
    let iters = iters.max(1);
    let mut results = Vec::new();
    for (name, out_f, in_f) in PROJECTIONS {
        let weight: Vec<f32> =
            Tensor::<B, 2>::random([out_f, in_f], Distribution::Normal(0.0, 0.02), device)
                .into_data()
                .to_vec()
                .expect("f32 weights");
        let nf4 = Nf4Weight::<B>::quantize(&weight, out_f, in_f, device);
        let dense_weight =
            Tensor::<B, 2>::from_data(TensorData::new(weight, [out_f, in_f]), device);
        // bf16 storage where the backend has it: the weight stays bf16, the input is cast per
        // call and the product cast back to f32, as a bf16 base would be used.
        let bf16_weight = B::supports_dtype(device, DType::BF16)
            .then(|| dense_weight.clone().cast(FloatDType::BF16));
        let dense = Linear::dense(dense_weight, None);
        for &m in rows {
            let inputs: Vec<Tensor<B, 2>> = (0..=iters)
                .map(|_| Tensor::random([m, in_f], Distribution::Default, device))
                .collect();
            let time = |f: &dyn Fn(Tensor<B, 2>) -> Tensor<B, 2>| -> f64 {
                let _ = read_scalar(f(inputs[0].clone()));
                median(
                    inputs[1..]
                        .iter()
                        .map(|x| {
                            let t = Instant::now();
                            let _ = read_scalar(f(x.clone()));
                            t.elapsed().as_secs_f64()
                        })
                        .collect(),
                )
            };
            let dense_s = time(&|x| dense.base_forward(x));
            let nf4_s = time(&|x| {
                Tensor::from_primitive(TensorPrimitive::Float(B::nf4_linear(
                    x.into_primitive().tensor(),
                    nf4.codes.clone().into_primitive(),
                    nf4.absmax.clone().into_primitive().tensor(),
                    nf4.table.clone().into_primitive().tensor(),
                    out_f,
                    in_f,
                )))
            });
            let dequant_s = time(&|x| nf4.dequantize().matmul(x.transpose()).transpose());
            let bf16_s = bf16_weight.as_ref().map(|w| {
                time(&|x| {
                    w.clone()
                        .matmul(x.cast(FloatDType::BF16).transpose())
                        .transpose()
                        .cast(FloatDType::F32)
                })
            });
            let flops = 2.0 * (m * out_f * in_f) as f64;
            results.push(json!({
                "projection": name, "rows": out_f, "cols": in_f, "m": m,
                "dense_f32_s": dense_s, "dense_bf16_s": bf16_s, "nf4_s": nf4_s,
                "nf4_dequant_matmul_s": dequant_s,
                "dense_gflops": flops / dense_s / 1e9, "nf4_gflops": flops / nf4_s / 1e9,
                "nf4_vs_dense": dense_s / nf4_s,
                "weight_bytes_f32": out_f * in_f * 4, "weight_bytes_bf16": out_f * in_f * 2,
                "weight_bytes_nf4": (out_f * in_f).div_ceil(2) + (out_f * in_f).div_ceil(64) * 4,
            }));
        }
    }
    json!({ "results": results })
}

/// A host NF4 kernel: `(x, m, words, absmax, table, rows, cols) -> y`.
type HostKernel = fn(&[f32], usize, &[u32], &[f32], &[f32; 16], usize, usize) -> Vec<f32>;

/// The two host NF4 kernels side by side on Qwen2.5-1.5B's projection shapes, for each number of
/// input rows in `rows`: the fused kernel (`nf4::cpu::linear`, decode a block, dot it with every
/// row) and the tiled one (`nf4::cpu::linear_tiled`, decode a tile of rows into reused scratch,
/// multiply with `gemm`). Medians of `iters` runs on fresh inputs. The measurement behind the
/// CPU backend's choice of the tiled kernel.
pub fn nf4_cpu_kernels(rows: &[usize], iters: usize) -> Value {
    use crate::nf4::{cpu, format};
    let iters = iters.max(1);
    let mut results = Vec::new();
    for (name, out_f, in_f) in PROJECTIONS {
        let weight: Vec<f32> = (0..out_f * in_f)
            .map(|i: usize| ((i.wrapping_mul(2654435761) % 10007) as f32 / 10007.0 - 0.5) * 0.04)
            .collect();
        let q = format::quantize_nf4(&weight);
        let words = cpu::pack_words(&q.packed);
        drop(weight);
        for &m in rows {
            let inputs: Vec<Vec<f32>> = (0..=iters)
                .map(|salt| {
                    (0..m * in_f)
                        .map(|i| ((i * 31 + salt * 7) % 97) as f32 / 97.0 - 0.5)
                        .collect()
                })
                .collect();
            let time = |kernel: HostKernel| {
                let run = |x: &[f32]| {
                    let y = kernel(x, m, &words, &q.absmax, &format::NF4_CODE, out_f, in_f);
                    std::hint::black_box(y[0]);
                };
                run(&inputs[0]);
                median(
                    inputs[1..]
                        .iter()
                        .map(|x| {
                            let t = Instant::now();
                            run(x);
                            t.elapsed().as_secs_f64()
                        })
                        .collect(),
                )
            };
            let fused = time(cpu::linear);
            let tiled = time(cpu::linear_tiled);
            results.push(json!({
                "projection": name, "rows": out_f, "cols": in_f, "m": m,
                "fused_s": fused, "tiled_s": tiled, "tiled_vs_fused": fused / tiled,
            }));
        }
    }
    json!({ "results": results })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Cpu;

    #[test]
    fn train_steps_reports_every_step_and_trains_the_adapter() {
        let device = Default::default();
        let config = Qwen2Config::with_shape(512, 64, 128, 2, 4, 2);
        let model = train_step_model::<Cpu>(config, true, &device);
        let lora_b = |m: &TrainStepModel<Cpu>| {
            let lora = m.model.layers[0].self_attn.q_proj.lora.as_ref().unwrap();
            lora.lora_b
                .val()
                .inner()
                .into_data()
                .to_vec::<f32>()
                .unwrap()
        };
        let before = lora_b(&model);
        let bench = TrainStepBench {
            tokens: 12,
            nf4: true,
            checkpointing: true,
            steps: 2,
            chunk: 5,
        };
        let mut heard = Vec::new();
        let (model, figures) =
            train_steps(model, &bench, &device, |step, s| heard.push((step, s))).unwrap();
        assert_eq!(heard.iter().map(|h| h.0).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(figures["warmup_s"].as_f64(), Some(heard[0].1));
        assert_eq!(figures["steps_s"].as_array().unwrap().len(), 2);
        assert_eq!(figures["nf4"], true);
        // LoRA's B starts at zero; three AdamW steps move it.
        assert!(before.iter().all(|&v| v == 0.0));
        assert!(lora_b(&model).iter().any(|&v| v != 0.0));
        let none = TrainStepBench { steps: 0, ..bench };
        assert!(train_steps(model, &none, &device, |_, _| {}).is_err());
    }
}
