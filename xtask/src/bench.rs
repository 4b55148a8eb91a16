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
//!   shapes, for decode-sized and prefill-sized inputs: the backend's kernel, dequantize-then-
//!   matmul, dense bf16; with `--cpu-kernels`, the fused and tiled host kernels side by side.
//! - `bench train-step`: one LoRA training step (r = 16, α = 32, all seven projections; forward,
//!   backward, AdamW) on a random model of a named shape, optionally NF4 and with per-layer
//!   checkpointing, with the protocol of the peer `peft_qlora_step.py`: median step time after
//!   one warm-up, and peak RSS.
//!
//! The measurements themselves live in `fathom_model::bench` (the model crate's `bench`
//! feature).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::{Args, Subcommand, ValueEnum};
use fathom_model::ModelBackend;
use fathom_model::bench::{
    Protocol, TrainStepBench, forward_pass, nf4_cpu_kernels, nf4_matmul, throughput, train_step,
};
use fathom_model::{Qwen2Config, Qwen2ForCausalLM};

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
    /// One LoRA training step (r = 16, all seven projections) on a random model: time, memory.
    TrainStep(TrainStepArgs),
    /// GRPO steps of a recipe's policy, split into generation, environment and learning.
    GrpoStep(crate::grpo_bench::GrpoStepArgs),
}

/// Arguments of `bench train-step`.
#[derive(Args, Debug)]
pub struct TrainStepArgs {
    /// Model shape.
    #[arg(long, value_enum, default_value = "qwen1-5b")]
    shape: Shape,
    /// Tokens in the step.
    #[arg(long, default_value_t = 1024)]
    tokens: usize,
    /// NF4 base projections.
    #[arg(long)]
    nf4: bool,
    /// Per-layer activation checkpointing.
    #[arg(long)]
    checkpointing: bool,
    /// Measured steps after one warm-up (the peer's default is 2).
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Positions of logits computed at a time.
    #[arg(long, default_value_t = 256)]
    chunk: usize,
    /// Compute backend.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
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
    /// SmolLM2-135M's shape (the embedded default's base): 30 layers, hidden 576, 9 heads, 3 KV
    /// heads, vocab 49152.
    Smollm2,
}

impl Shape {
    /// The configuration of this shape.
    pub fn config(self) -> Qwen2Config {
        match self {
            Shape::Qwen1_5b => Qwen2Config::qwen2_5_1_5b(),
            Shape::Qwen0_5b => Qwen2Config::qwen2_5_0_5b(),
            Shape::Small => Qwen2Config::with_shape(4096, 256, 704, 4, 4, 2),
            Shape::Smollm2 => Qwen2Config::with_shape(49_152, 576, 1536, 30, 9, 3),
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
    /// Also compare the two host NF4 kernels (fused and tiled) directly, the measurement behind
    /// the CPU backend's choice between them.
    #[arg(long)]
    cpu_kernels: bool,
    /// Input rows for `--cpu-kernels`.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    kernel_rows: Vec<usize>,
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
    let model = Qwen2ForCausalLM::<fathom_model::Cpu>::random(
        args.shape.config(),
        args.seed,
        false,
        &device,
    );
    model.save_pretrained(&args.out, fathom_model::save::SaveDtype::Bf16)?;
    eprintln!(
        "wrote a random {:?} checkpoint ({} weights) to {}",
        args.shape,
        model.num_weights(),
        args.out.display()
    );
    Ok(())
}

/// Runs the command.
pub fn run(command: BenchCommand) -> Result<()> {
    let backend = match &command {
        BenchCommand::Model(args) => Some(args.model.backend),
        BenchCommand::Forward(args) => Some(args.backend),
        BenchCommand::TrainStep(args) => Some(args.backend),
        BenchCommand::Nf4(args) => Some(args.backend),
        BenchCommand::GrpoStep(_) => None,
    };
    if let Some(kind) = backend {
        crate::infer::device::check(kind)?;
    }
    match command {
        BenchCommand::Model(args) => {
            crate::with_backend!(args.model.backend, |B, device| model_bench::<B>(
                &args, &device
            ))
        }
        BenchCommand::Forward(args) => crate::with_backend!(args.backend, |B, device| {
            let mut out = forward_pass::<B>(args.shape.config(), args.seq, args.nf4, &device)?;
            out["shape"] = format!("{:?}", args.shape).into();
            println!("{out}");
            Ok(())
        }),
        BenchCommand::GrpoStep(args) => crate::grpo_bench::run(args),
        BenchCommand::TrainStep(args) => crate::with_backend!(args.backend, |B, device| {
            let bench = TrainStepBench {
                tokens: args.tokens,
                nf4: args.nf4,
                checkpointing: args.checkpointing,
                steps: args.steps,
                chunk: args.chunk,
            };
            let mut out = train_step::<B>(args.shape.config(), &bench, &device)?;
            out["shape"] = format!("{:?}", args.shape).into();
            out["backend"] = format!("{:?}", args.backend).to_lowercase().into();
            println!("{out}");
            Ok(())
        }),
        BenchCommand::Nf4(args) => crate::with_backend!(args.backend, |B, device| {
            let mut out = nf4_matmul::<B>(&args.rows, args.iters, &device);
            out["backend"] = format!("{:?}", args.backend).to_lowercase().into();
            if args.cpu_kernels {
                out["cpu_kernels"] = nf4_cpu_kernels(&args.kernel_rows, args.iters);
            }
            println!("{out}");
            Ok(())
        }),
    }
}

fn model_bench<B: ModelBackend>(args: &ModelBench, device: &B::Device) -> Result<()> {
    let t0 = Instant::now();
    let model = args.model.load::<B>(device)?;
    let load_s = t0.elapsed().as_secs_f64();
    let protocol = Protocol {
        prefill_len: args.prefill_len,
        prefill_iters: args.prefill_iters,
        prompt_len: args.prompt_len,
        new_tokens: args.new_tokens,
        decode_iters: args.decode_iters,
        batches: args.batches.clone(),
    };
    let mut out = throughput(&model, &protocol, device)?;
    out["system"] = "fathom".into();
    out["backend"] = format!("{:?}", args.model.backend).to_lowercase().into();
    out["ckpt"] = args.model.model.display().to_string().into();
    out["load_s"] = load_s.into();
    println!("{out}");
    Ok(())
}
