//! LoRA adapters in PEFT's on-disk format, so PEFT loads ours and we load PEFT's:
//! `adapter_config.json` (a serde mirror of PEFT's `LoraConfig`, unknown fields tolerated) and
//! `adapter_model.safetensors` with keys `base_model.model.<module path>.lora_A.weight` (`[r, in]`)
//! and `.lora_B.weight` (`[out, r]`). Both files are written atomically.
//!
//! Which projections get an adapter on load is decided by the keys present in the file (that is
//! what PEFT saved); `target_modules` is checked against them. PEFT features that change the
//! computation and are not implemented (DoRA, trained biases, `modules_to_save`, regex rank or
//! alpha patterns, …) are refused with an error naming the field.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use crate::checkpoint::{Checkpoint, OutTensor, write_atomic, write_safetensors};
use crate::error::{ModelError, Result};
use crate::lora::{Lora, LoraSettings, Target};
use crate::qwen2::Qwen2ForCausalLM;

/// PEFT's `target_modules`: a list of module names, or one regular expression.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TargetModules {
    /// Module-name suffixes (`q_proj`, …).
    List(Vec<String>),
    /// A regular expression over full module paths.
    Pattern(String),
}

/// `adapter_config.json`, mirroring PEFT's `LoraConfig` field names.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdapterConfig {
    /// Always `LORA` here.
    pub peft_type: String,
    /// Rank.
    pub r: usize,
    /// `lora_alpha`.
    pub lora_alpha: f64,
    /// Targeted modules.
    pub target_modules: Option<TargetModules>,
    /// Dropout on the adapter input.
    #[serde(default)]
    pub lora_dropout: f64,
    /// `none` (bias training is not supported).
    #[serde(default = "default_bias")]
    pub bias: String,
    /// rsLoRA scaling.
    #[serde(default)]
    pub use_rslora: bool,
    /// Whether weights are stored transposed (Conv1D models); must be false.
    #[serde(default)]
    pub fan_in_fan_out: bool,
    /// `CAUSAL_LM`.
    #[serde(default)]
    pub task_type: Option<String>,
    /// The base model the adapter was trained on.
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    /// Extra fully-trained modules (not supported).
    #[serde(default)]
    pub modules_to_save: Option<Vec<String>>,
    /// DoRA (not supported).
    #[serde(default)]
    pub use_dora: bool,
    /// Trained LoRA biases (not supported).
    #[serde(default)]
    pub lora_bias: bool,
    /// Per-module ranks.
    #[serde(default)]
    pub rank_pattern: HashMap<String, usize>,
    /// Per-module alphas.
    #[serde(default)]
    pub alpha_pattern: HashMap<String, f64>,
    /// Whether the adapter was saved for inference.
    #[serde(default)]
    pub inference_mode: bool,
    /// PEFT's initialisation flag (recorded, not used when loading trained weights).
    #[serde(default = "default_init")]
    pub init_lora_weights: serde_json::Value,
    /// Layers the adapter is restricted to (informational: the file's keys decide).
    #[serde(default)]
    pub layers_to_transform: Option<serde_json::Value>,
    /// Parameter targets (not supported).
    #[serde(default)]
    pub target_parameters: Option<Vec<String>>,
}

fn default_bias() -> String {
    "none".into()
}
fn default_init() -> serde_json::Value {
    serde_json::Value::Bool(true)
}

impl AdapterConfig {
    /// Refuses settings that would change the computation in ways this crate does not implement.
    fn check_supported(&self) -> std::result::Result<(), String> {
        if self.peft_type != "LORA" {
            return Err(format!(
                "peft_type is `{}`, only LORA is supported",
                self.peft_type
            ));
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return Err(format!(
                "lora_dropout {} is outside [0, 1)",
                self.lora_dropout
            ));
        }
        if self.r == 0 {
            return Err("r must be positive".into());
        }
        if self.use_dora {
            return Err("use_dora: DoRA adapters are not supported".into());
        }
        if self.bias != "none" {
            return Err(format!("bias is `{}`: only `none` is supported", self.bias));
        }
        if self.lora_bias {
            return Err("lora_bias: adapters with a bias are not supported".into());
        }
        if self.fan_in_fan_out {
            return Err("fan_in_fan_out is true; Qwen2 projections are not Conv1D".into());
        }
        if self.modules_to_save.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err("modules_to_save: fully trained extra modules are not supported".into());
        }
        if self
            .target_parameters
            .as_ref()
            .is_some_and(|m| !m.is_empty())
        {
            return Err("target_parameters are not supported".into());
        }
        for key in self.alpha_pattern.keys().chain(self.rank_pattern.keys()) {
            if key.chars().any(|c| "\\^$*+?()[]{}|".contains(c)) {
                return Err(format!(
                    "pattern `{key}` in rank_pattern/alpha_pattern: only plain module names are supported"
                ));
            }
        }
        Ok(())
    }

    /// PEFT's alpha for a module path: `alpha_pattern` entries match the path or its suffix
    /// after a dot, as PEFT's `(.*\.)?<key>$` does for plain keys.
    fn alpha_for(&self, path: &str) -> f64 {
        self.alpha_pattern
            .iter()
            .find(|(k, _)| path == k.as_str() || path.ends_with(&format!(".{k}")))
            .map(|(_, v)| *v)
            .unwrap_or(self.lora_alpha)
    }
}

/// The key of an adapter weight.
fn key(path: &str, which: &str) -> String {
    format!("base_model.model.{path}.{which}.weight")
}

impl<B: Backend> Qwen2ForCausalLM<B> {
    /// Attaches fresh adapters (A random, B zero) to the targeted projections of every layer.
    pub fn attach_lora(
        mut self,
        settings: &LoraSettings,
        rng: &mut StdRng,
        device: &B::Device,
    ) -> Self {
        let targets: BTreeSet<&str> = settings.targets.iter().map(|t| t.module_name()).collect();
        for (path, linear) in self.layer_projections_mut() {
            let name = path.rsplit('.').next().unwrap_or_default();
            if targets.contains(name) {
                let [out, inp] = linear.shape();
                linear.lora = Some(Lora::init(inp, out, settings, rng, device));
            }
        }
        self
    }

    /// Loads a PEFT adapter directory onto this model.
    pub fn load_adapter(mut self, dir: &Path, device: &B::Device) -> Result<Self> {
        let err = |message: String| ModelError::Adapter {
            path: dir.to_path_buf(),
            message,
        };
        let config_path = dir.join("adapter_config.json");
        let text =
            std::fs::read_to_string(&config_path).map_err(|e| ModelError::io(&config_path, e))?;
        let config: AdapterConfig = serde_json::from_str(&text).map_err(|e| ModelError::Json {
            path: config_path.clone(),
            message: e.to_string(),
        })?;
        config.check_supported().map_err(err)?;
        let weights = dir.join("adapter_model.safetensors");
        if !weights.exists() {
            let hint = if dir.join("adapter_model.bin").exists() {
                " (adapter_model.bin is not read: save with safe_serialization)"
            } else {
                ""
            };
            return Err(err(format!("adapter_model.safetensors not found{hint}")));
        }
        let ck = Checkpoint::open_files(dir, &[weights])?;
        let mut unused: BTreeSet<String> = ck.names().into_iter().collect();
        let mut attached = 0;
        let mut modules = BTreeSet::new();
        for (path, linear) in self.layer_projections_mut() {
            let (ka, kb) = (key(&path, "lora_A"), key(&path, "lora_B"));
            match (ck.contains(&ka), ck.contains(&kb)) {
                (false, false) => continue,
                (true, false) => return Err(err(format!("`{ka}` has no matching `{kb}`"))),
                (false, true) => return Err(err(format!("`{kb}` has no matching `{ka}`"))),
                (true, true) => {}
            }
            let [out, inp] = linear.shape();
            let a_shape = ck.shape(&ka)?;
            let b_shape = ck.shape(&kb)?;
            let rank = a_shape.first().copied().unwrap_or(0);
            if a_shape.len() != 2 || a_shape[1] != inp || rank == 0 || b_shape != [out, rank] {
                return Err(err(format!(
                    "made for a different base shape: `{path}` is {out}×{inp} in this model \
                     ({}), so `lora_A` must be [r, {inp}] and `lora_B` [{out}, r], but the \
                     adapter's are {a_shape:?} and {b_shape:?}{}",
                    shape_summary(&self.config),
                    named_base(&config)
                )));
            }
            let a = ck.f32(&ka, &[rank, inp])?;
            let b = ck.f32(&kb, &[out, rank])?;
            if linear.lora.is_some() {
                return Err(err(format!("`{path}` already has an adapter")));
            }
            linear.lora = Some(Lora::from_weights(
                Tensor::from_data(TensorData::new(a, [rank, inp]), device),
                Tensor::from_data(TensorData::new(b, [out, rank]), device),
                config.alpha_for(&path),
                config.use_rslora,
                config.lora_dropout,
            ));
            unused.remove(&ka);
            unused.remove(&kb);
            modules.insert(path.rsplit('.').next().unwrap_or_default().to_string());
            attached += 1;
        }
        if let Some(k) = unused.into_iter().next() {
            return Err(err(format!(
                "made for a different base shape: tensor `{k}` does not belong to any \
                 projection of this model ({}){}",
                shape_summary(&self.config),
                named_base(&config)
            )));
        }
        if attached == 0 {
            return Err(err("the adapter holds no LoRA weights".into()));
        }
        if let Some(TargetModules::List(list)) = &config.target_modules
            && let Some(m) = modules.iter().find(|m| !list.iter().any(|t| t == *m))
        {
            return Err(err(format!(
                "weights for `{m}` but target_modules is {list:?}"
            )));
        }
        Ok(self)
    }

    /// Writes the attached adapters in PEFT's format.
    pub fn save_adapter(&self, dir: &Path, base_model_name_or_path: Option<&str>) -> Result<()> {
        let err = |message: String| ModelError::Adapter {
            path: dir.to_path_buf(),
            message,
        };
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let mut tensors = Vec::new();
        let mut ranks: BTreeMap<String, usize> = BTreeMap::new();
        let mut alphas: BTreeMap<String, f64> = BTreeMap::new();
        let mut modules = BTreeSet::new();
        let mut rslora = None;
        let mut dropout = 0.0;
        for (path, linear) in self.projections() {
            let Some(lora) = &linear.lora else { continue };
            let a = lora.lora_a.val();
            let b = lora.lora_b.val();
            let (ad, bd) = (a.dims(), b.dims());
            let values = |t: Tensor<B, 2>| {
                t.into_data()
                    .to_vec::<f32>()
                    .map_err(|e| err(format!("{e:?}")))
            };
            tensors.push(OutTensor::f32(
                key(&path, "lora_A"),
                ad.to_vec(),
                &values(a)?,
            ));
            tensors.push(OutTensor::f32(
                key(&path, "lora_B"),
                bd.to_vec(),
                &values(b)?,
            ));
            if *rslora.get_or_insert(lora.rslora) != lora.rslora {
                return Err(err(
                    "adapters mix rsLoRA and plain scaling, which PEFT cannot express".into(),
                ));
            }
            dropout = lora.dropout.prob;
            ranks.insert(path.clone(), lora.rank());
            alphas.insert(path.clone(), lora.alpha);
            modules.insert(path.rsplit('.').next().unwrap_or_default().to_string());
        }
        if tensors.is_empty() {
            return Err(err("the model has no adapter to save".into()));
        }
        let r = most_common(ranks.values().copied());
        let alpha = most_common_f64(alphas.values().copied());
        let config = AdapterConfig {
            peft_type: "LORA".into(),
            r,
            lora_alpha: alpha,
            target_modules: Some(TargetModules::List(modules.into_iter().collect())),
            lora_dropout: dropout,
            bias: "none".into(),
            use_rslora: rslora.unwrap_or(false),
            fan_in_fan_out: false,
            task_type: Some("CAUSAL_LM".into()),
            base_model_name_or_path: base_model_name_or_path.map(str::to_string),
            modules_to_save: None,
            use_dora: false,
            lora_bias: false,
            rank_pattern: ranks.into_iter().filter(|(_, v)| *v != r).collect(),
            alpha_pattern: alphas.into_iter().filter(|(_, v)| *v != alpha).collect(),
            inference_mode: true,
            init_lora_weights: default_init(),
            layers_to_transform: None,
            target_parameters: None,
        };
        let mut meta = HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        write_safetensors(&dir.join("adapter_model.safetensors"), &tensors, Some(meta))?;
        let json = serde_json::to_string_pretty(&config).map_err(|e| err(e.to_string()))?;
        write_atomic(&dir.join("adapter_config.json"), json.as_bytes())
    }

    /// Folds every adapter into its base (NF4 bases become dense) and removes the adapters.
    pub fn merge_adapters(mut self) -> Self
    where
        B: crate::backend::ModelBackend,
    {
        for layer in self.model.layers.iter_mut() {
            let a = &mut layer.self_attn;
            for p in [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj] {
                let taken = std::mem::replace(p, placeholder(p));
                *p = taken.merge();
            }
            let m = &mut layer.mlp;
            for p in [&mut m.gate_proj, &mut m.up_proj, &mut m.down_proj] {
                let taken = std::mem::replace(p, placeholder(p));
                *p = taken.merge();
            }
        }
        self
    }

    /// Settings-level view of the attached adapters: which targets carry one.
    pub fn lora_targets(&self) -> BTreeSet<Target> {
        self.projections()
            .into_iter()
            .filter(|(_, l)| l.lora.is_some())
            .filter_map(|(p, _)| Target::from_module_name(p.rsplit('.').next().unwrap_or_default()))
            .collect()
    }
}

/// A cheap stand-in used while a projection is moved out and merged.
fn placeholder<B: Backend>(p: &crate::linear::Linear<B>) -> crate::linear::Linear<B> {
    let device = match &p.weight {
        crate::linear::BaseWeight::Dense(w) => w.val().device(),
        crate::linear::BaseWeight::Nf4(w) => w.absmax.device(),
    };
    crate::linear::Linear::dense(Tensor::zeros([1, 1], &device), None)
}

fn most_common(values: impl Iterator<Item = usize>) -> usize {
    let mut counts: BTreeMap<usize, usize> = BTreeMap::new();
    for v in values {
        *counts.entry(v).or_default() += 1;
    }
    counts
        .into_iter()
        .max_by_key(|(v, c)| (*c, *v))
        .map(|(v, _)| v)
        .unwrap_or(0)
}

fn most_common_f64(values: impl Iterator<Item = f64>) -> f64 {
    let mut counts: Vec<(f64, usize)> = Vec::new();
    for v in values {
        match counts.iter_mut().find(|(x, _)| *x == v) {
            Some((_, c)) => *c += 1,
            None => counts.push((v, 1)),
        }
    }
    counts
        .into_iter()
        .max_by_key(|(_, c)| *c)
        .map(|(v, _)| v)
        .unwrap_or(0.0)
}

/// The shape of a model, as adapter errors describe it.
fn shape_summary(config: &crate::Qwen2Config) -> String {
    format!(
        "{} layers, hidden size {}, intermediate size {}",
        config.num_hidden_layers, config.hidden_size, config.intermediate_size
    )
}

/// The base an adapter says it was made for, as a clause of an error message.
fn named_base(config: &AdapterConfig) -> String {
    match &config.base_model_name_or_path {
        Some(base) => format!("; the adapter names its base `{base}`"),
        None => String::new(),
    }
}
