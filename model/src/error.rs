//! The model crate's error type: every failure names the file, tensor or field it is about.

use std::path::PathBuf;

/// Errors from loading, saving and running models, adapters and tokenizers.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error (shown in the message, not repeated as a cause).
        error: std::io::Error,
    },
    /// A JSON file did not parse, or lacked a required field.
    #[error("{path}: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What serde reported (it names missing or mistyped fields).
        message: String,
    },
    /// A configuration parsed but asks for something this crate does not do, or is inconsistent.
    #[error("{path}: {message}")]
    Config {
        /// The configuration file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A safetensors file is malformed.
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("tensor `{name}` is missing from the checkpoint in {dir}")]
    MissingTensor {
        /// The tensor's key.
        name: String,
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape {
        /// The tensor's key.
        name: String,
        /// Its shape in the file.
        found: Vec<usize>,
        /// The shape the configuration implies.
        expected: Vec<usize>,
    },
    /// A tensor is stored in a dtype this crate cannot read for that role.
    #[error("tensor `{name}` has unsupported dtype {dtype}")]
    Dtype {
        /// The tensor's key.
        name: String,
        /// The dtype found.
        dtype: String,
    },
    /// A 4-bit quantized weight is inconsistent.
    #[error("NF4 weight `{name}`: {message}")]
    Nf4 {
        /// The weight's key.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor is larger than the device lets one buffer be.
    #[error(
        "tensor `{name}` needs one buffer of {bytes} bytes, but this device allows at most {max} \
         per buffer (a wgpu adapter's storage-buffer limit); run it on the CPU (`--backend cpu`) \
         or on a GPU whose driver allows larger buffers"
    )]
    TooLarge {
        /// The tensor.
        name: String,
        /// Bytes it needs.
        bytes: usize,
        /// The device's limit.
        max: usize,
    },
    /// A LoRA adapter is malformed or does not fit the model.
    #[error("adapter {path}: {message}")]
    Adapter {
        /// The adapter directory or file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A tokenizer could not be loaded or used.
    #[error("tokenizer {path}: {message}")]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The chat template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
    /// Inputs given to the model or to generation are inconsistent.
    #[error("invalid input: {0}")]
    Input(String),
}

/// Result alias for this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            error: source,
        }
    }
}
