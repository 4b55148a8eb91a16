//! `cargo xtask quantize`: write a bitsandbytes-format NF4 checkpoint from a dense one.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use fathom_model::nf4::export::{QuantizeOptions, StorageDtype, quantize_checkpoint};

/// Arguments of `xtask quantize`.
#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Dense Hugging Face model directory.
    #[arg(long)]
    model: PathBuf,
    /// Output directory (created; files in it are replaced atomically).
    #[arg(long)]
    out: PathBuf,
    /// Quantize absmax to 8 bits too (bitsandbytes' `bnb_4bit_use_double_quant`).
    #[arg(long)]
    double_quant: bool,
    /// Store unquantized tensors (embeddings, norms, biases, lm_head) in this dtype; default: as
    /// stored. `f32` reproduces what `transformers` saves after loading with `dtype=torch.float32`.
    #[arg(long, value_enum)]
    dtype: Option<DtypeArg>,
    /// With `--double-quant`: the torch thread count of the bitsandbytes run to reproduce byte
    /// for byte (the mean of absmax, summed per thread for projections of 2M weights or more,
    /// can differ in its last bit; torch's default is the number of physical cores).
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    torch_threads: usize,
}

/// `--dtype` values.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum DtypeArg {
    F32,
    Bf16,
    F16,
}

/// Runs the command.
pub fn run(args: QuantizeArgs) -> Result<()> {
    let dtype = args.dtype.map(|d| match d {
        DtypeArg::F32 => StorageDtype::F32,
        DtypeArg::Bf16 => StorageDtype::Bf16,
        DtypeArg::F16 => StorageDtype::F16,
    });
    let report = quantize_checkpoint(
        &args.model,
        &args.out,
        QuantizeOptions {
            double_quant: args.double_quant,
            dtype,
            torch_threads: args.torch_threads,
        },
    )
    .with_context(|| format!("quantizing {}", args.model.display()))?;
    eprintln!(
        "quantized {} projections to NF4, copied {} tensors; wrote {} ({:.1} MiB)",
        report.quantized,
        report.copied,
        args.out.join("model.safetensors").display(),
        report.bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}
