//! `cargo xtask generate`: greedy or sampled generation from token ids or a chat prompt.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use fathom_model::ModelBackend;
use fathom_model::{ChatMessage, ChatRole, GenerateConfig, Sampling, Tokenizer};
use serde::Serialize;

use crate::backend::{ModelArgs, read_json};
use crate::logits::IdsFile;

/// Arguments of `xtask generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSON file `{"input_ids": [[…]], "attention_mask": [[…]]}` with the prompts.
    #[arg(long, conflicts_with = "prompt", required_unless_present = "prompt")]
    input: Option<PathBuf>,
    /// A user message; the chat template is applied.
    #[arg(long)]
    prompt: Option<String>,
    /// A system message to put before `--prompt`.
    #[arg(long, requires = "prompt")]
    system: Option<String>,
    /// Directory with tokenizer.json (default: the model directory).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Maximum new tokens per sequence.
    #[arg(long)]
    max_new_tokens: usize,
    /// Greedy decoding (the default when no sampling option is given).
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k"])]
    greedy: bool,
    /// Sampling temperature.
    #[arg(long)]
    temperature: Option<f32>,
    /// Nucleus sampling mass.
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep only the k most likely tokens when sampling (0 = all).
    #[arg(long)]
    top_k: Option<usize>,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the generated text contains this string (repeatable).
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Do not stop at end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Write `{"ids": [[…]], "text": […]}` here (printed to stdout otherwise).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Serialize)]
struct Output {
    ids: Vec<Vec<u32>>,
    text: Vec<Option<String>>,
    logprobs: Vec<Vec<f32>>,
    finish: Vec<fathom_model::generate::FinishReason>,
}

/// Runs the command.
pub fn run(args: GenerateArgs) -> Result<()> {
    crate::infer::device::check(args.model.backend)?;
    crate::with_backend!(args.model.backend, |B, device| run_on::<B>(&args, &device))
}

fn load_tokenizer(dir: &Path, required: bool) -> Result<Option<Tokenizer>> {
    if !dir.join("tokenizer.json").exists() && !required {
        return Ok(None);
    }
    Tokenizer::from_dir(dir)
        .map(Some)
        .with_context(|| format!("loading the tokenizer from {}", dir.display()))
}

fn run_on<B: ModelBackend>(args: &GenerateArgs, device: &B::Device) -> Result<()> {
    let tok_dir = args
        .tokenizer
        .clone()
        .unwrap_or_else(|| args.model.model.clone());
    let tokenizer = load_tokenizer(&tok_dir, args.prompt.is_some() || !args.stop.is_empty())?;
    let prompts: Vec<Vec<u32>> = match (&args.input, &args.prompt) {
        (Some(path), _) => {
            let (ids, mask) = read_json::<IdsFile>(path)?.validated()?;
            ids.into_iter()
                .zip(mask)
                .map(|(row, m)| {
                    row.into_iter()
                        .zip(m)
                        .filter(|p| p.1 == 1)
                        .map(|p| p.0)
                        .collect()
                })
                .collect()
        }
        (None, Some(prompt)) => {
            let tok = tokenizer.as_ref().expect("required above");
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(ChatMessage::new(ChatRole::System, system.clone()));
            }
            messages.push(ChatMessage::new(ChatRole::User, prompt.clone()));
            let text = tok.apply_chat_template(&messages, true)?;
            vec![tok.encode(&text, false)?]
        }
        (None, None) => bail!("give --input or --prompt"),
    };
    let model = args.model.load::<B>(device)?;
    let sampling = if args.greedy
        || (args.temperature.is_none() && args.top_p.is_none() && args.top_k.is_none())
    {
        Sampling::Greedy
    } else {
        Sampling::Sample {
            temperature: args.temperature.unwrap_or(1.0),
            top_p: args.top_p.unwrap_or(1.0),
            top_k: args.top_k.unwrap_or(0),
        }
    };
    let mut eos_ids = Vec::new();
    if !args.ignore_eos {
        eos_ids.extend(model.config.eos_ids());
        if let Ok(generation) =
            read_json::<serde_json::Value>(&args.model.model.join("generation_config.json"))
            && let Some(v) = generation.get("eos_token_id")
        {
            let ids: Vec<u32> = match v {
                serde_json::Value::Array(a) => a
                    .iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| x as u32)
                    .collect(),
                other => other.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            };
            eos_ids.extend(ids);
        }
        if let Some(id) = tokenizer.as_ref().and_then(Tokenizer::eos_id) {
            eos_ids.push(id);
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
    }
    let config = GenerateConfig {
        max_new_tokens: args.max_new_tokens,
        sampling,
        eos_ids,
        stop_strings: args.stop.clone(),
        seed: args.seed,
        use_cache: true,
    };
    let out = fathom_model::generate(&model, &prompts, &config, tokenizer.as_ref(), device)?;
    let text = out
        .tokens
        .iter()
        .map(|t| {
            tokenizer
                .as_ref()
                .map(|tok| tok.decode(t, true))
                .transpose()
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let output = Output {
        ids: out.tokens,
        text,
        logprobs: out.logprobs,
        finish: out.finish,
    };
    let json = serde_json::to_string(&output)?;
    match &args.out {
        Some(path) => std::fs::write(path, json + "\n")
            .with_context(|| format!("writing {}", path.display()))?,
        None => println!("{json}"),
    }
    Ok(())
}
