//! `cargo xtask logits`: f32 logits `[B, T, V]` of given token ids, written to a safetensors file,
//! for comparing against `transformers` (`logits = model(input_ids, attention_mask).logits`).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use fathom_model::ModelBackend;
use fathom_model::checkpoint::{OutTensor, write_safetensors};
use serde::Deserialize;

use crate::backend::{ModelArgs, read_json};

/// Arguments of `xtask logits`.
#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSON file `{"input_ids": [[…]], "attention_mask": [[…]]}` (mask optional: all ones).
    #[arg(long)]
    input: PathBuf,
    /// Output safetensors file; holds `logits`, f32 `[B, T, V]`.
    #[arg(long)]
    out: PathBuf,
}

/// The input file of `logits` and `generate --input`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdsFile {
    /// Token ids, one row per sequence (equal lengths; left-pad with any id and mask it).
    pub input_ids: Vec<Vec<u32>>,
    /// 1 for tokens, 0 for padding.
    #[serde(default)]
    pub attention_mask: Option<Vec<Vec<u8>>>,
}

/// Token ids, one row per sequence.
pub type Ids = Vec<Vec<u32>>;
/// Attention mask rows (1 = token, 0 = padding).
pub type Mask = Vec<Vec<u8>>;

impl IdsFile {
    /// Checks shapes and returns the ids with a full mask.
    pub fn validated(self) -> Result<(Ids, Mask)> {
        let ids = self.input_ids;
        if ids.is_empty() || ids[0].is_empty() {
            bail!("input_ids is empty");
        }
        let width = ids[0].len();
        if let Some(i) = ids.iter().position(|r| r.len() != width) {
            bail!(
                "input_ids row {i} has {} tokens, row 0 has {width}",
                ids[i].len()
            );
        }
        let mask = self
            .attention_mask
            .unwrap_or_else(|| vec![vec![1; width]; ids.len()]);
        if mask.len() != ids.len() || mask.iter().any(|r| r.len() != width) {
            bail!("attention_mask must have the same shape as input_ids");
        }
        if let Some(v) = mask.iter().flatten().find(|&&m| m > 1) {
            bail!("attention_mask holds {v}; only 0 and 1 are allowed");
        }
        if let Some(i) = mask.iter().position(|r| r.iter().all(|&m| m == 0)) {
            bail!("attention_mask row {i} masks every token");
        }
        Ok((ids, mask))
    }
}

/// Runs the command.
pub fn run(args: LogitsArgs) -> Result<()> {
    crate::infer::device::check(args.model.backend)?;
    crate::with_backend!(args.model.backend, |B, device| run_on::<B>(&args, &device))
}

fn run_on<B: ModelBackend>(args: &LogitsArgs, device: &B::Device) -> Result<()> {
    let (ids, mask) = read_json::<IdsFile>(&args.input)?.validated()?;
    let model = args.model.load::<B>(device)?;
    let input = model.step_input(&ids, &mask, device)?;
    let logits = model.forward(&input, None);
    let dims = logits.dims();
    let values = logits
        .into_data()
        .to_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("reading logits: {e:?}"))?;
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    write_safetensors(
        &args.out,
        &[OutTensor::f32("logits", dims.to_vec(), &values)],
        Some(meta),
    )
    .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!("wrote logits {:?} to {}", dims, args.out.display());
    Ok(())
}
