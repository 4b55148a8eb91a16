//! LoRA adapters: the trainable low-rank update `scale · B(A(dropout(x)))` added to a frozen
//! projection, its initialisation (A kaiming-uniform, B zero, as PEFT does) and the settings that
//! choose which projections get one.
//!
//! burn 0.21 has no LoRA module of its own (its `nn` crate offers `Linear` and quantization of
//! whole modules, not adapters over a frozen, separately quantized base), so this one is ours.

use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// A projection a LoRA adapter can target, named as in Hugging Face's Qwen2.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// `self_attn.q_proj`
    QProj,
    /// `self_attn.k_proj`
    KProj,
    /// `self_attn.v_proj`
    VProj,
    /// `self_attn.o_proj`
    OProj,
    /// `mlp.gate_proj`
    GateProj,
    /// `mlp.up_proj`
    UpProj,
    /// `mlp.down_proj`
    DownProj,
}

impl Target {
    /// All seven projections of a decoder layer.
    pub const ALL: [Target; 7] = [
        Target::QProj,
        Target::KProj,
        Target::VProj,
        Target::OProj,
        Target::GateProj,
        Target::UpProj,
        Target::DownProj,
    ];

    /// The module name (`q_proj`, …), as PEFT's `target_modules` spells it.
    pub fn module_name(self) -> &'static str {
        match self {
            Target::QProj => "q_proj",
            Target::KProj => "k_proj",
            Target::VProj => "v_proj",
            Target::OProj => "o_proj",
            Target::GateProj => "gate_proj",
            Target::UpProj => "up_proj",
            Target::DownProj => "down_proj",
        }
    }

    /// The target with this module name.
    pub fn from_module_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.module_name() == name)
    }
}

/// How to build new adapters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraSettings {
    /// Rank `r`.
    pub rank: usize,
    /// `lora_alpha`.
    pub alpha: f64,
    /// Dropout applied to the adapter's input while training.
    #[serde(default)]
    pub dropout: f64,
    /// rsLoRA scaling `alpha / sqrt(r)` instead of `alpha / r`.
    #[serde(default)]
    pub rslora: bool,
    /// Projections that get an adapter, in every layer.
    pub targets: Vec<Target>,
}

impl LoraSettings {
    /// The reference system's adapter: r = 16, alpha = 32, all seven projections.
    pub fn reference() -> Self {
        Self {
            rank: 16,
            alpha: 32.0,
            dropout: 0.0,
            rslora: false,
            targets: Target::ALL.to_vec(),
        }
    }

    /// The factor the adapter's output is multiplied by.
    pub fn scale(&self) -> f64 {
        lora_scale(self.alpha, self.rank, self.rslora)
    }

    /// Checks the settings; returns what is wrong, naming the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.rank == 0 {
            return Err("lora.rank must be positive".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(format!("lora.alpha must be positive, got {}", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!(
                "lora.dropout must be in [0, 1), got {}",
                self.dropout
            ));
        }
        if self.targets.is_empty() {
            return Err("lora.targets is empty".into());
        }
        Ok(())
    }
}

/// `alpha / r`, or `alpha / sqrt(r)` with rsLoRA.
pub fn lora_scale(alpha: f64, rank: usize, rslora: bool) -> f64 {
    if rslora {
        alpha / (rank as f64).sqrt()
    } else {
        alpha / rank as f64
    }
}

/// A LoRA adapter on one projection.
#[derive(Module, Debug)]
pub struct Lora<B: Backend> {
    /// `lora_A.weight`, `[r, in_features]`.
    pub lora_a: Param<Tensor<B, 2>>,
    /// `lora_B.weight`, `[out_features, r]`.
    pub lora_b: Param<Tensor<B, 2>>,
    /// `lora_alpha`.
    pub alpha: f64,
    /// Whether the scale is `alpha / sqrt(r)` (rsLoRA) rather than `alpha / r`.
    pub rslora: bool,
    /// Dropout on the adapter's input (active only under autodiff).
    pub dropout: Dropout,
}

impl<B: Backend> Lora<B> {
    /// A fresh adapter: A drawn uniformly from ±1/sqrt(in_features) (PyTorch's kaiming-uniform
    /// with a = sqrt(5), PEFT's default), B zero, so the adapter starts as a no-op.
    pub fn init(
        in_features: usize,
        out_features: usize,
        settings: &LoraSettings,
        rng: &mut StdRng,
        device: &B::Device,
    ) -> Self {
        let rank = settings.rank;
        let bound = 1.0 / (in_features as f64).sqrt();
        let a: Vec<f32> = (0..rank * in_features)
            .map(|_| rng.random_range(-bound..bound) as f32)
            .collect();
        let a = Tensor::from_data(TensorData::new(a, [rank, in_features]), device);
        let b = Tensor::zeros([out_features, rank], device);
        Self::from_weights(a, b, settings.alpha, settings.rslora, settings.dropout)
    }

    /// An adapter from given weights (`a` `[r, in]`, `b` `[out, r]`).
    pub fn from_weights(
        a: Tensor<B, 2>,
        b: Tensor<B, 2>,
        alpha: f64,
        rslora: bool,
        dropout: f64,
    ) -> Self {
        Self {
            lora_a: Param::from_tensor(a),
            lora_b: Param::from_tensor(b),
            alpha,
            rslora,
            dropout: DropoutConfig::new(dropout).init(),
        }
    }

    /// The factor the adapter's output is multiplied by.
    pub fn scale(&self) -> f64 {
        lora_scale(self.alpha, self.rank(), self.rslora)
    }

    /// The rank.
    pub fn rank(&self) -> usize {
        self.lora_a.dims()[0]
    }

    /// The adapter's contribution for `x` `[m, in_features]`; returns `[m, out_features]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let x = self.dropout.forward(x);
        x.matmul(self.lora_a.val().transpose())
            .matmul(self.lora_b.val().transpose())
            .mul_scalar(self.scale())
    }

    /// The dense update `scale · B · A`, `[out, in]`.
    pub fn delta_weight(&self) -> Tensor<B, 2> {
        self.lora_b
            .val()
            .matmul(self.lora_a.val())
            .mul_scalar(self.scale())
    }
}

/// A seeded generator for adapter initialisation (explicit, never global).
pub fn init_rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}
