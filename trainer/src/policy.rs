//! The policy a run trains: the model a recipe names (a Hugging Face directory, the default
//! base, or random weights of a shape), quantized as asked, with a fresh LoRA adapter, and the
//! tokenizer and chat template it speaks.

use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;
use fathom_model::{LoadOptions, ModelBackend, Qwen2ForCausalLM, RandomInit, Tokenizer};

use crate::recipe::{ModelSource, Plan, Quantization, Tuning};

/// Why the policy could not be built.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The model directory does not exist.
    #[error(
        "model directory {0} not found. Download it first (for Qwen2.5-Coder-1.5B-Instruct: \
         `huggingface-cli download Qwen/Qwen2.5-Coder-1.5B-Instruct --local-dir {0}` on a \
         machine with access to the Hugging Face hub), or point the recipe's model.source.path \
         at an existing directory"
    )]
    MissingModel(PathBuf),
    /// The recipe uses the default base and none was provided.
    #[error(
        "the recipe uses the default base, which has not been fetched: run \
         `cargo xtask fetch-base` (it downloads and converts SmolLM2-135M-Instruct)"
    )]
    NoDefaultBase,
    /// The model or tokenizer failed to load.
    #[error(transparent)]
    Model(#[from] fathom_model::ModelError),
    /// The recipe asks for something this build cannot do.
    #[error("{0}")]
    Unsupported(String),
}

/// The loaded policy.
pub struct Policy<B: AutodiffBackend> {
    /// The model with its trainable adapter.
    pub model: Qwen2ForCausalLM<B>,
    /// Its tokenizer (with the chat template).
    pub tokenizer: Tokenizer,
    /// The token that ends an assistant turn.
    pub end_of_turn: u32,
    /// Where the base came from (a directory, or a description of the random shape).
    pub base: String,
}

/// The directory the tokenizer of `source` lives in, resolved against `default_base`.
pub fn tokenizer_dir(
    source: &ModelSource,
    default_base: Option<&Path>,
) -> Result<PathBuf, PolicyError> {
    match source {
        ModelSource::HuggingFace { path } => Ok(path.clone()),
        ModelSource::DefaultBase => default_base
            .map(Path::to_path_buf)
            .ok_or(PolicyError::NoDefaultBase),
        ModelSource::Random { tokenizer, .. } => Ok(tokenizer.clone()),
    }
}

/// The token that ends an assistant turn: ChatML's `<|im_end|>` when the tokenizer has it,
/// its end-of-sequence token otherwise.
pub fn end_of_turn(tokenizer: &Tokenizer) -> Result<u32, PolicyError> {
    tokenizer
        .token_id("<|im_end|>")
        .or_else(|| tokenizer.eos_id())
        .ok_or_else(|| {
            PolicyError::Unsupported(
                "the tokenizer has neither <|im_end|> nor an end-of-sequence token".into(),
            )
        })
}

/// The base model of a plan without an adapter, and its tokenizer.
pub fn load_base<B: ModelBackend>(
    plan: &Plan,
    default_base: Option<&Path>,
    device: &B::Device,
) -> Result<(Qwen2ForCausalLM<B>, Tokenizer, String), PolicyError> {
    let nf4 = match plan.model.quantization {
        Quantization::Dense => false,
        Quantization::Nf4 { .. } => true,
    };
    let dir = tokenizer_dir(&plan.model.source, default_base)?;
    if !dir.is_dir() {
        return Err(PolicyError::MissingModel(dir));
    }
    let tokenizer = Tokenizer::from_dir(&dir)?;
    let (model, base) = match &plan.model.source {
        ModelSource::Random {
            shape,
            embedding_std,
            ..
        } => {
            let config = shape
                .config(tokenizer.vocab_size())
                .map_err(PolicyError::Unsupported)?;
            let mut init = RandomInit::default();
            if let Some(std) = embedding_std {
                init.embedding_std = *std as f32;
            }
            let model = Qwen2ForCausalLM::random_init(config, plan.seeds.model, nf4, init, device);
            (
                model,
                format!("random {shape:?} (seed {})", plan.seeds.model),
            )
        }
        _ => {
            let options = LoadOptions { quantize_nf4: nf4 };
            (
                Qwen2ForCausalLM::load(&dir, device, options)?,
                dir.display().to_string(),
            )
        }
    };
    Ok((model, tokenizer, base))
}

/// The policy of a plan: the base with a fresh adapter (seeded by `seeds.model`), the base
/// with `model.adapter`, or, under `tuning: Full`, the base with every weight trainable.
pub fn load_policy<B>(
    plan: &Plan,
    default_base: Option<&Path>,
    device: &B::Device,
) -> Result<Policy<B>, PolicyError>
where
    B: AutodiffBackend + ModelBackend,
{
    let (base, tokenizer, name) = load_base::<B>(plan, default_base, device)?;
    let model = match &plan.model.tuning {
        Tuning::Lora(settings) => match &plan.model.adapter {
            None => {
                let mut rng = fathom_model::lora::init_rng(plan.seeds.model);
                base.attach_lora(settings, &mut rng, device)
            }
            Some(dir) => {
                let model = base.load_adapter(dir, device)?;
                let wanted: std::collections::BTreeSet<_> =
                    settings.targets.iter().copied().collect();
                let found = model.lora_targets();
                let ranks: std::collections::BTreeSet<usize> = model
                    .projections()
                    .into_iter()
                    .filter_map(|(_, p)| p.lora.as_ref().map(|l| l.rank()))
                    .collect();
                if found != wanted || ranks.iter().any(|&r| r != settings.rank) {
                    return Err(PolicyError::Unsupported(format!(
                        "model.adapter {}: it adapts {found:?} with rank {ranks:?}, but the \
                         recipe's model.tuning asks for {wanted:?} with rank {}",
                        dir.display(),
                        settings.rank
                    )));
                }
                model
            }
        },
        Tuning::Full => base.into_full_tuning()?,
    };
    let end_of_turn = end_of_turn(&tokenizer)?;
    Ok(Policy {
        model,
        tokenizer,
        end_of_turn,
        base: name,
    })
}
