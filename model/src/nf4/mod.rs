//! NF4 4-bit weights: the bitsandbytes format on the host ([`format`], [`export`]), the CPU
//! projection kernels ([`cpu`]), the CubeCL dequantization kernel for the GPU backends
//! (`kernel`), and the packed code tensors the model keeps on the device.
//!
//! Packed codes live in a `u32` Int tensor (bitsandbytes' bytes, little-endian, eight codes per
//! word): every backend stores `u32` natively, so a 1.5B model's base takes half a byte per
//! weight on the host and on the device alike.

pub mod cpu;
pub mod export;
pub mod format;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod kernel;
#[cfg(any(feature = "ndarray", feature = "candle"))]
mod other_cpu;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};

/// Uploads bitsandbytes' packed bytes as a `u32` code tensor.
pub fn codes_tensor<B: Backend>(packed: &[u8], device: &B::Device) -> Tensor<B, 1, Int> {
    let words = cpu::pack_words(packed);
    let len = words.len();
    Tensor::from_data(TensorData::new(words, [len]), (device, DType::U32))
}

/// Reads a code tensor back into bitsandbytes' bytes (`len` of them).
pub fn codes_bytes<B: Backend>(codes: &Tensor<B, 1, Int>, len: usize) -> Vec<u8> {
    let data = codes.to_data();
    let words: Vec<u32> = match data.as_slice::<u32>() {
        Ok(words) => words.to_vec(),
        // A backend may widen the stored dtype on read; the bit patterns are what matter.
        Err(_) => data.iter::<i64>().map(|v| v as u32).collect(),
    };
    cpu::unpack_words(&words, len)
}
