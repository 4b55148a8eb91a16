//! Choosing the compute backend at the command line, and loading a model (with its optional
//! adapter and on-load quantization) onto it.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use fathom_model::ModelBackend;
use fathom_model::{LoadOptions, Qwen2ForCausalLM};

/// A compute backend compiled into this binary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// The CPU (default; burn's Flex backend).
    Cpu,
    /// wgpu (Vulkan, Metal, DX12; built with `--features wgpu`).
    #[cfg(feature = "wgpu")]
    Wgpu,
    /// CUDA (built with `--features cuda`).
    #[cfg(feature = "cuda")]
    Cuda,
    /// burn's ndarray CPU backend (built with `--features ndarray`; for benchmarks).
    #[cfg(feature = "ndarray")]
    Ndarray,
    /// burn's Candle CPU backend (built with `--features candle`; for benchmarks).
    #[cfg(feature = "candle")]
    Candle,
}

/// Quantization applied to dense weights while loading.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum QuantizeOnLoad {
    /// bitsandbytes NF4 (blocks of 64) for every decoder-layer projection.
    Nf4,
}

/// Arguments shared by the commands that run a model.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Hugging Face model directory (config.json + safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// PEFT LoRA adapter directory to apply.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Quantize dense projections while loading.
    #[arg(long, value_enum)]
    pub quantize: Option<QuantizeOnLoad>,
    /// Compute backend.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendKind,
}

impl ModelArgs {
    /// Loads the model described by these arguments onto `device`.
    pub fn load<B: ModelBackend>(&self, device: &B::Device) -> Result<Qwen2ForCausalLM<B>> {
        let options = LoadOptions {
            quantize_nf4: self.quantize == Some(QuantizeOnLoad::Nf4),
        };
        let mut model = Qwen2ForCausalLM::<B>::load(&self.model, device, options)
            .with_context(|| format!("loading the model from {}", self.model.display()))?;
        if let Some(adapter) = &self.adapter {
            model = model
                .load_adapter(adapter, device)
                .with_context(|| format!("loading the adapter from {}", adapter.display()))?;
        }
        Ok(model)
    }
}

/// Reads a JSON file into `T`, naming the file on failure.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Runs `$body` with `B` bound to the chosen backend type and `device` to its default device.
#[macro_export]
macro_rules! with_backend {
    ($kind:expr, |$b:ident, $device:ident| $body:expr) => {{
        match $kind {
            $crate::backend::BackendKind::Cpu => {
                type $b = fathom_model::Cpu;
                let $device: burn::tensor::Device<$b> = Default::default();
                $body
            }
            #[cfg(feature = "wgpu")]
            $crate::backend::BackendKind::Wgpu => {
                type $b = fathom_model::Wgpu;
                let $device: burn::tensor::Device<$b> = Default::default();
                $body
            }
            #[cfg(feature = "cuda")]
            $crate::backend::BackendKind::Cuda => {
                type $b = fathom_model::Cuda;
                let $device: burn::tensor::Device<$b> = Default::default();
                $body
            }
            #[cfg(feature = "ndarray")]
            $crate::backend::BackendKind::Ndarray => {
                type $b = fathom_model::NdArray;
                let $device: burn::tensor::Device<$b> = Default::default();
                $body
            }
            #[cfg(feature = "candle")]
            $crate::backend::BackendKind::Candle => {
                type $b = fathom_model::Candle;
                let $device: burn::tensor::Device<$b> = Default::default();
                $body
            }
        }
    }};
}
