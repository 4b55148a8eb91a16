//! NF4 4-bit weights: the bitsandbytes format on the host, and the backend operations that
//! dequantize and multiply by them on every backend.

pub mod cpu;
pub mod export;
pub mod format;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod kernel;
pub mod ops;
#[cfg(any(feature = "ndarray", feature = "candle"))]
mod other_cpu;

pub use ops::{Nf4Backend, codes_bytes, codes_tensor};
