//! A burn Qwen2 causal language model that loads Hugging Face checkpoints.

pub mod checkpoint;
pub mod config;
pub mod error;
pub mod nf4;

pub use error::{ModelError, Result};
