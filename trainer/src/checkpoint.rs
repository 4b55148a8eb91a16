//! Checkpoints: everything a run needs to continue exactly where it stopped, written
//! atomically, every N steps, keeping the last K.
//!
//! A checkpoint is a directory `step-00000050/` under the run's `checkpoints/` holding:
//!
//! | file | what |
//! | --- | --- |
//! | `adapter/` | the LoRA adapter in PEFT's format (`fathom_model::peft`) |
//! | `model/` | instead of `adapter/` under full fine-tuning: the whole model (f32 safetensors) |
//! | `optimizer.mpk` | the AdamW state (burn's record, keyed by parameter id) |
//! | `optimizer_params.json` | each parameter's module path, id at save time and shape |
//! | `state.json` | step, stage, data cursor, RNG state, RAPO's state ([`TrainerState`]) |
//! | `recipe.ron` | the recipe text the run was started with |
//! | `manifest.json` | size and CRC-32 of every file above, written last |
//!
//! **Atomicity.** Everything is written into a temporary sibling (`.tmp-step-…`) in the same
//! parent, each file and directory is fsynced, then the directory is renamed to its final
//! name and the parent fsynced. A crash leaves either a complete checkpoint or a temporary
//! directory that nothing reads (the next save removes it). A directory named `step-*` whose
//! manifest does not verify (a damaged disk, a hand edit) is skipped by [`latest`], which
//! falls back to the newest one that does.
//!
//! **Optimiser state across processes.** burn keys optimiser state by `ParamId`, which is
//! fresh for every process and every adapter load. The save records the module path of each
//! id; the load maps saved ids to the ids of the freshly loaded model by path, after checking
//! that both have the same parameters with the same shapes.
//!
//! **RNG.** The trainer's generator is ChaCha12 ([`TrainRng`], the algorithm behind
//! `StdRng`), saved as its seed, stream and word position, so the restored generator continues
//! the same sequence exactly.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use burn::module::ParamId;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder};
use burn::tensor::backend::AutodiffBackend;
use fathom_model::{LoadOptions, ModelBackend, Qwen2ForCausalLM};
use rand::SeedableRng;
use rand_chacha::ChaCha12Rng;
use serde::{Deserialize, Serialize};

use crate::optim::trainable_params;
use crate::rapo::RapoState;

/// The trainer's random generator (ChaCha12, as `StdRng`), whose position can be saved.
pub type TrainRng = ChaCha12Rng;

/// A fresh generator from a seed.
pub fn train_rng(seed: u64) -> TrainRng {
    TrainRng::seed_from_u64(seed)
}

/// When to write checkpoints (a recipe's `checkpoints` section).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSettings {
    /// Write one every this many optimiser steps (≥ 1).
    pub every: usize,
    /// Keep this many of the newest (≥ 1).
    pub keep_last: usize,
}

/// The exact state of a [`TrainRng`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// The 32-byte key.
    pub seed: [u8; 32],
    /// The stream number.
    pub stream: u64,
    /// The position in the stream, in 32-bit words (decimal text: JSON numbers are not u128).
    pub word_pos: String,
}

impl RngState {
    /// The state of `rng`.
    pub fn capture(rng: &TrainRng) -> Self {
        Self {
            seed: rng.get_seed(),
            stream: rng.get_stream(),
            word_pos: rng.get_word_pos().to_string(),
        }
    }

    /// A generator in exactly this state.
    pub fn restore(&self) -> Result<TrainRng, String> {
        let pos: u128 = self
            .word_pos
            .parse()
            .map_err(|e| format!("rng.word_pos {:?}: {e}", self.word_pos))?;
        let mut rng = TrainRng::from_seed(self.seed);
        rng.set_stream(self.stream);
        rng.set_word_pos(pos);
        Ok(rng)
    }
}

/// Which stage of the run a checkpoint belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// The SFT warm-start.
    Sft,
    /// GRPO.
    Grpo,
}

/// Where the run is in its data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataCursor {
    /// Completed passes over the stage's data.
    pub epoch: u64,
    /// The next position in the current pass.
    pub position: u64,
}

/// Everything besides weights and optimiser state that a resumed run needs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerState {
    /// Optimiser steps completed in this stage.
    pub step: u64,
    /// The stage.
    pub stage: Stage,
    /// The data cursor.
    pub data: DataCursor,
    /// The trainer's generator.
    pub rng: RngState,
    /// RAPO's solve rates and replay buffer.
    pub rapo: RapoState,
}

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file-system operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The checkpoint is incomplete or damaged.
    #[error("checkpoint {dir}: {message}")]
    Invalid {
        /// The checkpoint directory.
        dir: PathBuf,
        /// What is wrong, naming the file or field.
        message: String,
    },
    /// The model or adapter could not be saved or loaded.
    #[error("checkpoint {dir}: weights (adapter or model): {source}")]
    Adapter {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The model crate's error.
        source: fathom_model::ModelError,
    },
    /// burn's recorder failed on the optimiser state.
    #[error("checkpoint {dir}: optimizer.mpk: {message}")]
    Optimizer {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The recorder's message.
        message: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The manifest's entry for one file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct FileEntry {
    path: String,
    bytes: u64,
    crc32: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Manifest {
    format: u32,
    step: u64,
    stage: Stage,
    files: Vec<FileEntry>,
}

const MANIFEST: &str = "manifest.json";
const FORMAT: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct SavedParam {
    path: String,
    id: u64,
    shape: Vec<usize>,
}

/// The directory name of a checkpoint.
pub fn dir_name(stage: Stage, step: u64) -> String {
    match stage {
        Stage::Sft => format!("sft-step-{step:08}"),
        Stage::Grpo => format!("step-{step:08}"),
    }
}

fn parse_dir_name(name: &str) -> Option<(Stage, u64)> {
    if let Some(n) = name.strip_prefix("sft-step-") {
        return n.parse().ok().map(|s| (Stage::Sft, s));
    }
    name.strip_prefix("step-")
        .and_then(|n| n.parse().ok())
        .map(|s| (Stage::Grpo, s))
}

/// The optimiser this module checkpoints.
pub type AdamWOptimizer<B> = OptimizerAdaptor<AdamW, Qwen2ForCausalLM<B>, B>;

/// Writes a checkpoint of `model`'s adapter (or, without one, of the whole fully fine-tuned
/// model), `optim`'s state, `state` and the recipe text under `root`, atomically, then deletes
/// all but the newest `keep_last` of that stage. Returns the checkpoint's directory.
pub fn save<B: AutodiffBackend + ModelBackend>(
    root: &Path,
    model: &Qwen2ForCausalLM<B>,
    optim: &AdamWOptimizer<B>,
    state: &TrainerState,
    recipe_text: &str,
    keep_last: usize,
) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(root).map_err(io(root))?;
    remove_stale_temporaries(root)?;
    let name = dir_name(state.stage, state.step);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io(&tmp))?;

    let full = model.projections().iter().all(|(_, p)| p.lora.is_none());
    let weights = tmp.join(if full { "model" } else { "adapter" });
    let written = if full {
        model.save_pretrained(&weights, fathom_model::save::SaveDtype::F32)
    } else {
        model.save_adapter(&weights, None)
    };
    written.map_err(|source| CheckpointError::Adapter {
        dir: tmp.clone(),
        source,
    })?;
    let params: Vec<SavedParam> = trainable_params(model)
        .into_iter()
        .map(|p| SavedParam {
            path: p.path,
            id: p.id.val(),
            shape: p.shape,
        })
        .collect();
    write_file(&tmp.join("optimizer_params.json"), &json(&params))?;
    NamedMpkFileRecorder::<FullPrecisionSettings>::new()
        .record(optim.to_record(), tmp.join("optimizer"))
        .map_err(|e| CheckpointError::Optimizer {
            dir: tmp.clone(),
            message: e.to_string(),
        })?;
    write_file(&tmp.join("state.json"), &json(state))?;
    write_file(&tmp.join("recipe.ron"), recipe_text.as_bytes())?;

    let mut files = Vec::new();
    collect_files(&tmp, &mut files)?;
    let mut entries = Vec::new();
    for path in files {
        let bytes = std::fs::read(&path).map_err(io(&path))?;
        File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(io(&path))?;
        entries.push(FileEntry {
            path: relative(&tmp, &path),
            bytes: bytes.len() as u64,
            crc32: crc32fast::hash(&bytes),
        });
    }
    let manifest = Manifest {
        format: FORMAT,
        step: state.step,
        stage: state.stage,
        files: entries,
    };
    write_file(&tmp.join(MANIFEST), &json(&manifest))?;
    sync_dir(&weights)?;
    sync_dir(&tmp)?;

    let fin = root.join(&name);
    if fin.exists() {
        // The same step saved again (a resumed run re-reaching it): move the old one aside
        // first, since a directory cannot be renamed over a non-empty one.
        let old = root.join(format!(".tmp-old-{name}-{}", std::process::id()));
        std::fs::rename(&fin, &old).map_err(io(&fin))?;
        std::fs::rename(&tmp, &fin).map_err(io(&fin))?;
        std::fs::remove_dir_all(&old).map_err(io(&old))?;
    } else {
        std::fs::rename(&tmp, &fin).map_err(io(&fin))?;
    }
    sync_dir(root)?;
    prune(root, state.stage, keep_last)?;
    Ok(fin)
}

/// Checkpoint directories of `stage` under `root` (by name; not verified), oldest first.
pub fn list(root: &Path, stage: Stage) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let mut out = Vec::new();
    if !root.exists() {
        return Ok(out);
    }
    for entry in std::fs::read_dir(root).map_err(io(root))? {
        let entry = entry.map_err(io(root))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some((s, step)) = parse_dir_name(&name)
            && s == stage
            && entry.path().is_dir()
        {
            out.push((step, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// The newest checkpoint of `stage` under `root` whose manifest verifies; damaged ones are
/// skipped (with a warning), temporary directories are never considered.
pub fn latest(root: &Path, stage: Stage) -> Result<Option<PathBuf>, CheckpointError> {
    for (_, dir) in list(root, stage)?.into_iter().rev() {
        match verify(&dir) {
            Ok(()) => return Ok(Some(dir)),
            Err(e) => tracing::warn!("skipping checkpoint: {e}"),
        }
    }
    Ok(None)
}

/// Checks that every file of the checkpoint's manifest is present with its size and CRC.
pub fn verify(dir: &Path) -> Result<(), CheckpointError> {
    let invalid = |message: String| CheckpointError::Invalid {
        dir: dir.to_path_buf(),
        message,
    };
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| invalid(format!("{MANIFEST}: {e} (the checkpoint is incomplete)")))?;
    let manifest: Manifest =
        serde_json::from_str(&text).map_err(|e| invalid(format!("{MANIFEST}: {e}")))?;
    if manifest.format != FORMAT {
        return Err(invalid(format!(
            "{MANIFEST}: format {} (this build reads format {FORMAT})",
            manifest.format
        )));
    }
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    if name.as_deref().and_then(parse_dir_name) != Some((manifest.stage, manifest.step)) {
        return Err(invalid(format!(
            "{MANIFEST}: step {} of stage {:?} does not match the directory name",
            manifest.step, manifest.stage
        )));
    }
    for f in &manifest.files {
        let p = dir.join(&f.path);
        let bytes = std::fs::read(&p).map_err(|e| invalid(format!("{}: {e}", f.path)))?;
        if bytes.len() as u64 != f.bytes {
            return Err(invalid(format!(
                "{}: {} bytes, the manifest says {}",
                f.path,
                bytes.len(),
                f.bytes
            )));
        }
        if crc32fast::hash(&bytes) != f.crc32 {
            return Err(invalid(format!("{}: checksum mismatch", f.path)));
        }
    }
    for required in [
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "optimizer.mpk",
        "optimizer_params.json",
        "state.json",
        "recipe.ron",
    ] {
        if !manifest.files.iter().any(|f| f.path == required) {
            return Err(invalid(format!("{required} is missing from the manifest")));
        }
    }
    Ok(())
}

/// A loaded checkpoint.
pub struct Loaded<B: AutodiffBackend> {
    /// The model with the checkpoint's adapter attached.
    pub model: Qwen2ForCausalLM<B>,
    /// The optimiser with its state restored.
    pub optim: AdamWOptimizer<B>,
    /// Step, stage, cursor, RNG and RAPO state.
    pub state: TrainerState,
    /// The recipe text the run was started with.
    pub recipe_text: String,
}

/// Loads the checkpoint in `dir` onto `base` (the model without an adapter), restoring the
/// optimiser state into `optim` (a fresh optimiser with the run's settings). A checkpoint of a
/// fully fine-tuned model replaces `base` with its own weights, all trainable. Everything is
/// verified first; errors name the file or field at fault.
pub fn load<B: AutodiffBackend + ModelBackend>(
    dir: &Path,
    base: Qwen2ForCausalLM<B>,
    optim: AdamWOptimizer<B>,
    device: &B::Device,
) -> Result<Loaded<B>, CheckpointError> {
    verify(dir)?;
    let invalid = |message: String| CheckpointError::Invalid {
        dir: dir.to_path_buf(),
        message,
    };
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name)).map_err(|e| invalid(format!("{name}: {e}")))
    };
    let state: TrainerState = serde_json::from_str(&read("state.json")?)
        .map_err(|e| invalid(format!("state.json: {e}")))?;
    state
        .rng
        .restore()
        .map_err(|e| invalid(format!("state.json: {e}")))?;
    let recipe_text = read("recipe.ron")?;
    let full = dir.join("model");
    let model = if full.is_dir() {
        drop(base);
        Qwen2ForCausalLM::load(
            &full,
            device,
            LoadOptions {
                quantize_nf4: false,
            },
        )
        .and_then(Qwen2ForCausalLM::into_full_tuning)
    } else {
        base.load_adapter(&dir.join("adapter"), device)
    }
    .map_err(|source| CheckpointError::Adapter {
        dir: dir.to_path_buf(),
        source,
    })?;

    let saved: Vec<SavedParam> = serde_json::from_str(&read("optimizer_params.json")?)
        .map_err(|e| invalid(format!("optimizer_params.json: {e}")))?;
    let current: BTreeMap<String, (ParamId, Vec<usize>)> = trainable_params(&model)
        .into_iter()
        .map(|p| (p.path, (p.id, p.shape)))
        .collect();
    let mut remap: HashMap<u64, ParamId> = HashMap::new();
    for s in &saved {
        let Some((id, shape)) = current.get(&s.path) else {
            return Err(invalid(format!(
                "optimizer_params.json: parameter `{}` is not in the loaded model",
                s.path
            )));
        };
        if *shape != s.shape {
            return Err(invalid(format!(
                "optimizer_params.json: `{}` has shape {:?}, the loaded model's is {shape:?}",
                s.path, s.shape
            )));
        }
        remap.insert(s.id, *id);
    }
    if let Some(path) = current
        .keys()
        .find(|p| !saved.iter().any(|s| &s.path == *p))
    {
        return Err(invalid(format!(
            "optimizer_params.json: the loaded model's parameter `{path}` has no saved state entry"
        )));
    }
    let record: <AdamWOptimizer<B> as Optimizer<Qwen2ForCausalLM<B>, B>>::Record =
        NamedMpkFileRecorder::<FullPrecisionSettings>::new()
            .load(dir.join("optimizer"), device)
            .map_err(|e| CheckpointError::Optimizer {
                dir: dir.to_path_buf(),
                message: e.to_string(),
            })?;
    let rekeyed = record
        .into_iter()
        .map(|(id, entry)| {
            remap.get(&id.val()).map(|new| (*new, entry)).ok_or_else(|| {
                invalid(format!(
                    "optimizer.mpk: state for parameter id {id} which optimizer_params.json does not list"
                ))
            })
        })
        .collect::<Result<_, _>>()?;
    let optim = optim.load_record(rekeyed);
    Ok(Loaded {
        model,
        optim,
        state,
        recipe_text,
    })
}

fn json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec_pretty(value).expect("checkpoint metadata serialises")
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), CheckpointError> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .collect::<Result<_, _>>()
        .map_err(io(dir))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let p = e.path();
        if p.is_dir() {
            collect_files(&p, out)?;
        } else if e.file_name().to_string_lossy().starts_with('.') {
            // A leftover temporary of an atomic write: not part of the checkpoint.
            std::fs::remove_file(&p).map_err(io(&p))?;
        } else {
            out.push(p);
        }
    }
    Ok(())
}

fn relative(base: &Path, path: &Path) -> String {
    path.strip_prefix(base)
        .unwrap_or(path)
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// Removes temporary directories left by interrupted saves.
fn remove_stale_temporaries(root: &Path) -> Result<(), CheckpointError> {
    for entry in std::fs::read_dir(root).map_err(io(root))? {
        let entry = entry.map_err(io(root))?;
        if entry.file_name().to_string_lossy().starts_with(".tmp-") && entry.path().is_dir() {
            std::fs::remove_dir_all(entry.path()).map_err(io(&entry.path()))?;
        }
    }
    Ok(())
}

fn prune(root: &Path, stage: Stage, keep_last: usize) -> Result<(), CheckpointError> {
    let all = list(root, stage)?;
    let excess = all.len().saturating_sub(keep_last.max(1));
    for (_, dir) in all.into_iter().take(excess) {
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
