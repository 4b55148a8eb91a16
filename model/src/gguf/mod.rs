//! GGUF import: reading llama.cpp's container, dequantizing its tensor types, and converting a
//! Llama-architecture file into a Hugging Face directory this crate (and `transformers`) loads.
//!
//! - [`reader`]: the GGUF v2/v3 container (header, metadata of every value type, tensor infos,
//!   alignment), memory-mapped, every length checked against the file before it is trusted.
//! - [`dequant`]: ggml's block formats to f32 — F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
//!   the k-quants Q2_K … Q6_K — checked against the `gguf` Python package's dequantization.
//! - [`tokenizer`]: a `tokenizers` `tokenizer.json` and a `tokenizer_config.json` (with the chat
//!   template) rebuilt from the `tokenizer.ggml.*` metadata of a byte-level BPE vocabulary.
//! - [`convert`]: `config.json`, `model.safetensors` (f32, llama.cpp's Q/K row permutation undone),
//!   the tokenizer files and `generation_config.json`, written to a temporary directory that is
//!   renamed into place only when complete.
//!
//! The container is parsed here rather than through a crate: the only well-kept Rust reader is
//! candle-core's, which would bring a second tensor library into this crate for ~200 lines of
//! parsing and fails on the first tensor type it does not know, where this reader parses any
//! file and names the unsupported type only if a tensor of that type is converted.

pub mod convert;
pub mod dequant;
pub mod reader;
pub mod tokenizer;

use std::path::PathBuf;

pub use convert::{ConvertReport, convert_gguf};
pub use dequant::GgmlType;
pub use reader::{GgufFile, TensorInfo, Value};

/// Errors from reading or converting a GGUF file. Each names the file and the key or tensor.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file or an output path could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        error: std::io::Error,
    },
    /// The file is not a GGUF file, or its structure is broken (truncated, bad lengths).
    #[error("{path}: not a valid GGUF file: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the byte offset where it was found.
        message: String,
    },
    /// A metadata key the conversion needs is missing or has the wrong type.
    #[error("{path}: metadata `{key}`: {message}")]
    Metadata {
        /// The file.
        path: PathBuf,
        /// The metadata key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor is missing, has the wrong shape, or its data lies outside the file.
    #[error("{path}: tensor `{name}`: {message}")]
    Tensor {
        /// The file.
        path: PathBuf,
        /// The tensor's GGUF name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor is stored in a ggml type this crate does not dequantize.
    #[error(
        "{path}: tensor `{name}` is stored as {type_name} (ggml type {type_id}), which is not \
         supported; supported types: {supported}. Re-quantize the model to one of them \
         (llama.cpp's `llama-quantize`), or convert from the original Hugging Face checkpoint"
    )]
    UnsupportedType {
        /// The file.
        path: PathBuf,
        /// The tensor's GGUF name.
        name: String,
        /// ggml's name for the type (or `unknown`).
        type_name: String,
        /// ggml's numeric type id.
        type_id: u32,
        /// The types that are supported, comma-separated.
        supported: String,
    },
    /// The file describes a model or tokenizer this converter does not handle.
    #[error("{path}: {message}")]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What is not supported, and what is.
        message: String,
    },
    /// The rebuilt tokenizer or another output failed to serialise or to load back.
    #[error("{path}: {message}")]
    Output {
        /// The output file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

impl GgufError {
    pub(crate) fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            error,
        }
    }
}
