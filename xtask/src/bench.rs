//! `cargo xtask bench …`: measurements reported as ratios against peers run on the same machine
//! (see `docs/benchmarks.md`).
//!
//! - `bench model`: prefill and decode throughput of a checkpoint with the protocol of the
//!   peers' `hf_bench.py` / `candle-bench` (prefill of 1×512 ids with last-position logits;
//!   greedy decoding of 64 tokens after a 32-token prompt at batch 1 and 8, the prompt's prefill
//!   included; medians after one warm-up; ids `((b·len + i)·7919 + 13) mod vocab`), plus peak RSS.
//! - `bench forward`: one forward pass of a randomly initialised model of a named shape (the
//!   Qwen2.5-Coder-1.5B shape by default), time and peak RSS.
//! - `bench nf4`: NF4 projection throughput against dense f32 on the Qwen2.5-1.5B projection
//!   shapes, for decode-sized and prefill-sized inputs, fused and dequantize-then-matmul.
//!
//! Every timing reads the result back to the host before stopping the clock, so asynchronous
//! backends are synchronised, and inputs change between iterations.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use burn::tensor::{Distribution, Tensor, TensorData, TensorPrimitive};
use clap::{Args, Subcommand, ValueEnum};
use fathom_model::nf4::Nf4Backend;
use fathom_model::{GenerateConfig, Qwen2Config, Qwen2ForCausalLM};
use serde_json::json;

use crate::backend::{BackendKind, ModelArgs};

/// `xtask bench` subcommands.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Prefill and decode tokens/s of a checkpoint (the peers' protocol).
    Model(ModelBench),
    /// One forward pass of a random model of a named shape: time and memory.
    Forward(ForwardBench),
    /// NF4 projection throughput against dense f32.
    Nf4(Nf4Bench),
}

/// Arguments of `bench model`.
#[derive(Args, Debug)]
pub struct ModelBench {
    #[command(flatten)]
    model: ModelArgs,
    /// Prefill length.
    #[arg(long, default_value_t = 512)]
    prefill_len: usize,
    /// Prefill repetitions (after one warm-up).
    #[arg(long, default_value_t = 5)]
    prefill_iters: usize,
    /// Prompt length before decoding.
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// New tokens per decode run.
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Decode repetitions (after one warm-up).
    #[arg(long, default_value_t = 3)]
    decode_iters: usize,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batches: Vec<usize>,
}

/// A named model shape.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Shape {
    /// Qwen2.5-Coder-1.5B: 28 layers, hidden 1536, 12 heads, 2 KV heads, vocab 151936.
    Qwen1_5b,
    /// Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads, 2 KV heads, vocab 151936.
    Qwen0_5b,
    /// The peers' `small` preset: 4 layers, hidden 256, vocab 4096.
    Small,
}

impl Shape {
    /// The configuration of this shape.
    pub fn config(self) -> Qwen2Config {
        match self {
            Shape::Qwen1_5b => Qwen2Config::qwen2_5_1_5b(),
            Shape::Qwen0_5b => Qwen2Config::qwen2_5_0_5b(),
            Shape::Small => Qwen2Config::with_shape(4096, 256, 704, 4, 4, 2),
        }
    }
}

/// Arguments of `bench forward`.
#[derive(Args, Debug)]
pub struct ForwardBench {
    /// Model shape.
    #[arg(long, value_enum, default_value = "qwen1-5b")]
    shape: Shape,
    /// Tokens in the forward pass.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Quantize the projections to NF4.
    #[arg(long)]
    nf4: bool,
    /// Compute backend.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
}

/// Arguments of `bench nf4`.
#[derive(Args, Debug)]
pub struct Nf4Bench {
    /// Input rows to measure (decode-sized and prefill-sized).
    #[arg(long, value_delimiter = ',', default_value = "1,8,128")]
    rows: Vec<usize>,
    /// Repetitions per measurement (after one warm-up).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Compute backend.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
}

/// Arguments of `xtask make-model`.
#[derive(Args, Debug)]
pub struct MakeModelArgs {
    /// Model shape.
    #[arg(long, value_enum)]
    shape: Shape,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// Writes a random-weight checkpoint (bf16, weights N(0, 0.02), biases N(0, 0.02), norms
/// 1 + N(0, 0.02)) that `transformers` and candle load, for benchmarks against them.
pub fn make_model(args: MakeModelArgs) -> Result<()> {
    let device = Default::default();
    let model = Qwen2ForCausalLM::<fathom_model::Cpu>::random(args.shape.config(), args.seed, false, &device);
    model.save_pretrained(&args.out, fathom_model::save::SaveDtype::Bf16)?;
    eprintln!("wrote a random {:?} checkpoint ({} weights) to {}", args.shape, model.num_weights(), args.out.display());
    Ok(())
}

/// Runs the command.
pub fn run(command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Model(args) => crate::with_backend!(args.model.backend, |B, device| model_bench::<B>(&args, &device)),
        BenchCommand::Forward(args) => crate::with_backend!(args.backend, |B, device| forward_bench::<B>(&args, &device)),
        BenchCommand::Nf4(args) => crate::with_backend!(args.backend, |B, device| nf4_bench::<B>(&args, &device)),
    }
}

fn ids(batch: usize, seq: usize, vocab: usize, salt: usize) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| (0..seq).map(|i| ((((b * seq + i) * 7919 + 13) + salt * 104_729) % vocab) as u32).collect())
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Peak resident set size of this process in MiB (VmHWM).
pub fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).map(str::to_string))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse::<f64>().ok()))
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

fn model_bench<B: Nf4Backend>(args: &ModelBench, device: &B::Device) -> Result<()> {
    if args.prefill_iters == 0 || args.decode_iters == 0 {
        bail!("--prefill-iters and --decode-iters must be positive");
    }
    let t0 = Instant::now();
    let model = args.model.load::<B>(device)?;
    let load_s = t0.elapsed().as_secs_f64();
    let vocab = model.config.vocab_size;
    // Prefill: logits of the last position only, as generation needs.
    let prefill = |salt: usize| -> Result<f64> {
        let x = ids(1, args.prefill_len, vocab, salt);
        let mask = vec![vec![1u8; args.prefill_len]];
        let t = Instant::now();
        let input = model.step_input(&x, &mask, 0, device)?;
        let hidden = model.forward_hidden(&input, None);
        let [b, s, h] = hidden.dims();
        let logits = model.logits(hidden.slice([0..b, s - 1..s, 0..h]));
        let _ = logits.sum().into_scalar();
        Ok(t.elapsed().as_secs_f64())
    };
    prefill(0)?;
    let ts: Vec<f64> = (1..=args.prefill_iters).map(prefill).collect::<Result<_>>()?;
    let mut out = json!({
        "system": "fathom",
        "backend": format!("{:?}", args.model.backend).to_lowercase(),
        "ckpt": args.model.model.display().to_string(),
        "params": model.num_weights(),
        "load_s": load_s,
        "prefill_len": args.prefill_len,
        "prefill_s": ts,
        "prefill_tok_s": args.prefill_len as f64 / median(ts.clone()),
        "prefill_best_tok_s": args.prefill_len as f64 / ts.iter().copied().fold(f64::INFINITY, f64::min),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
    });
    for &b in &args.batches {
        let config = GenerateConfig::greedy(args.new_tokens);
        let run = |salt: usize| -> Result<f64> {
            let prompts = ids(b, args.prompt_len, vocab, salt);
            let t = Instant::now();
            let g = fathom_model::generate(&model, &prompts, &config, None, device)?;
            let dt = t.elapsed().as_secs_f64();
            if g.tokens.iter().any(|t| t.len() != args.new_tokens) {
                bail!("a row stopped early");
            }
            Ok(dt)
        };
        run(0)?;
        let ts: Vec<f64> = (1..=args.decode_iters).map(run).collect::<Result<_>>()?;
        out[format!("decode_b{b}_s")] = json!(ts);
        out[format!("decode_b{b}_tok_s")] = json!((b * args.new_tokens) as f64 / median(ts.clone()));
        out[format!("decode_b{b}_best_tok_s")] = json!((b * args.new_tokens) as f64 / ts.iter().copied().fold(f64::INFINITY, f64::min));
    }
    out["peak_rss_mb"] = json!(peak_rss_mb());
    println!("{out}");
    Ok(())
}

fn forward_bench<B: Nf4Backend>(args: &ForwardBench, device: &B::Device) -> Result<()> {
    let config = args.shape.config();
    let t0 = Instant::now();
    let model = Qwen2ForCausalLM::<B>::random(config.clone(), 0, args.nf4, device);
    let build_s = t0.elapsed().as_secs_f64();
    let rss_built = peak_rss_mb();
    let mut times = Vec::new();
    for salt in 0..3 {
        let x = ids(1, args.seq, config.vocab_size, salt);
        let mask = vec![vec![1u8; args.seq]];
        let t = Instant::now();
        let input = model.step_input(&x, &mask, 0, device)?;
        let logits = model.forward(&input, None);
        let _ = logits.sum().into_scalar();
        times.push(t.elapsed().as_secs_f64());
    }
    println!(
        "{}",
        json!({
            "shape": format!("{:?}", args.shape),
            "nf4": args.nf4,
            "params": model.num_weights(),
            "seq": args.seq,
            "build_s": build_s,
            "forward_s": times,
            "forward_median_s": median(times.clone()),
            "rss_after_build_mb": rss_built,
            "peak_rss_mb": peak_rss_mb(),
        })
    );
    Ok(())
}

fn nf4_bench<B: Nf4Backend>(args: &Nf4Bench, device: &B::Device) -> Result<()> {
    // (rows, cols) of Qwen2.5-1.5B's projections.
    let shapes = [("q_proj/o_proj", 1536, 1536), ("k_proj/v_proj", 256, 1536), ("gate/up_proj", 8960, 1536), ("down_proj", 1536, 8960)];
    let mut results = Vec::new();
    for (name, rows, cols) in shapes {
        let weight: Vec<f32> = {
            let t = Tensor::<B, 2>::random([rows, cols], Distribution::Normal(0.0, 0.02), device);
            t.into_data().to_vec().expect("f32")
        };
        let nf4 = fathom_model::linear::Nf4Weight::<B>::quantize(&weight, rows, cols, device);
        let dense = fathom_model::Linear::dense(Tensor::<B, 2>::from_data(TensorData::new(weight, [rows, cols]), device), None);
        for &m in &args.rows {
            let inputs: Vec<Tensor<B, 2>> =
                (0..=args.iters).map(|_| Tensor::random([m, cols], Distribution::Default, device)).collect();
            let time = |f: &dyn Fn(Tensor<B, 2>) -> Tensor<B, 2>| -> f64 {
                let _ = f(inputs[0].clone()).sum().into_scalar();
                let ts: Vec<f64> = inputs[1..]
                    .iter()
                    .map(|x| {
                        let t = Instant::now();
                        let _ = f(x.clone()).sum().into_scalar();
                        t.elapsed().as_secs_f64()
                    })
                    .collect();
                median(ts)
            };
            let dense_s = time(&|x| dense.base_forward(x));
            let nf4_s = time(&|x| {
                Tensor::from_primitive(TensorPrimitive::Float(B::nf4_linear(
                    x.into_primitive().tensor(),
                    nf4.codes.clone().into_primitive(),
                    nf4.absmax.clone().into_primitive().tensor(),
                    nf4.table.clone().into_primitive().tensor(),
                    rows,
                    cols,
                )))
            });
            let dequant_s = time(&|x| nf4.dequantize().matmul(x.transpose()).transpose());
            let flops = 2.0 * (m * rows * cols) as f64;
            results.push(json!({
                "projection": name, "rows": rows, "cols": cols, "m": m,
                "dense_f32_s": dense_s, "nf4_s": nf4_s, "nf4_dequant_matmul_s": dequant_s,
                "dense_gflops": flops / dense_s / 1e9, "nf4_gflops": flops / nf4_s / 1e9,
                "nf4_vs_dense": dense_s / nf4_s,
                "weight_bytes_f32": rows * cols * 4, "weight_bytes_bf16": rows * cols * 2,
                "weight_bytes_nf4": (rows * cols).div_ceil(2) + (rows * cols).div_ceil(64) * 4,
            }));
        }
    }
    println!("{}", json!({ "backend": format!("{:?}", args.backend).to_lowercase(), "results": results }));
    Ok(())
}
