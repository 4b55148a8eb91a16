//! The NF4 backend extension: dequantize packed codes and multiply by an NF4 weight, implemented
//! per backend — plain Rust on the CPU (`Flex`, the default CPU backend), a CubeCL kernel on wgpu and CUDA (see
//! `kernel.rs`), and for `Autodiff<B>` by delegating to `B` (the base is frozen, so only the
//! input receives a gradient, through an ordinary matmul).
//!
//! Packed codes live in a `u32` Int tensor (bitsandbytes' bytes, little-endian, eight codes per
//! word): every backend stores `u32` natively, so a 1.5B model's base takes half a byte per
//! weight on the host and on the device alike.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};

use super::cpu;

/// A backend that can compute with NF4 weights.
pub trait Nf4Backend: Backend {
    /// Dequantizes packed codes (`u32` words) with one f32 `absmax` per 64-element block and the
    /// 16-entry code `table` into a `[rows, cols]` float tensor (`table[code] * absmax`).
    fn nf4_dequantize(
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self>;

    /// `x · Wᵀ` for `x` `[m, cols]` and a dense weight `W` `[rows, cols]`; returns `[m, rows]`.
    /// The default is the backend's matmul as `(W · xᵀ)ᵀ`, so no backend copies a transposed
    /// weight.
    fn dense_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        matmul_linear::<Self>(x, w)
    }

    /// `x · Wᵀ` for `x` `[m, cols]` and the NF4 weight `W` `[rows, cols]`; returns `[m, rows]`.
    /// The default dequantizes into a temporary and uses the backend's matmul as `(W · xᵀ)ᵀ`,
    /// so the temporary is read in its row-major layout.
    fn nf4_linear(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        dequantize_then_matmul::<Self>(x, codes, absmax, table, rows, cols)
    }
}

/// `x · Wᵀ` as `(W · xᵀ)ᵀ` with the backend's matmul.
pub fn matmul_linear<B: Backend>(x: FloatTensor<B>, w: FloatTensor<B>) -> FloatTensor<B> {
    B::float_transpose(B::float_matmul(w, B::float_transpose(x)))
}

/// `x · Wᵀ` by dequantizing `W` into a temporary and computing `(W · xᵀ)ᵀ` with the backend's
/// matmul, so the temporary is read in its row-major layout.
pub fn dequantize_then_matmul<B: Nf4Backend>(
    x: FloatTensor<B>,
    codes: IntTensor<B>,
    absmax: FloatTensor<B>,
    table: FloatTensor<B>,
    rows: usize,
    cols: usize,
) -> FloatTensor<B> {
    matmul_linear::<B>(x, B::nf4_dequantize(codes, absmax, table, rows, cols))
}

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

/// Runs `f` on the `u32` words of a Flex code tensor, without copying when it is contiguous.
fn with_words<R>(codes: &FlexTensor, f: impl FnOnce(&[u32]) -> R) -> R {
    match codes.as_slice::<u32>() {
        Some(words) => f(words),
        None if codes.dtype() == DType::U32 => {
            f(codes.to_contiguous().as_slice::<u32>().expect("contiguous"))
        }
        None => {
            // Codes uploaded through a path that widened them: recover the bit patterns.
            let data = Tensor::<Flex, 1, Int>::from_primitive(codes.clone()).into_data();
            let words: Vec<u32> = data.iter::<i64>().map(|v| v as u32).collect();
            f(&words)
        }
    }
}

/// Runs `f` on the f32 values of a Flex float tensor, row-major.
fn with_f32<R>(tensor: &FlexTensor, f: impl FnOnce(&[f32]) -> R) -> R {
    match tensor.as_slice::<f32>() {
        Some(values) => f(values),
        None if tensor.dtype() == DType::F32 => f(tensor
            .to_contiguous()
            .as_slice::<f32>()
            .expect("contiguous")),
        None => {
            let data = Tensor::<Flex, 1>::from_primitive(TensorPrimitive::Float(tensor.clone()))
                .into_data();
            f(&data.iter::<f32>().collect::<Vec<f32>>())
        }
    }
}

fn flex_float(values: Vec<f32>, shape: [usize; 2]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// The 16 values of a code-table tensor.
fn table_values(table: &FlexTensor) -> [f32; 16] {
    with_f32(table, |t| {
        let mut out = [0f32; 16];
        out.copy_from_slice(&t[..16]);
        out
    })
}

impl Nf4Backend for Flex {
    fn nf4_dequantize(
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        let table = table_values(&table);
        let out = with_words(&codes, |words| {
            with_f32(&absmax, |absmax| {
                cpu::dequantize(words, absmax, &table, rows, cols)
            })
        });
        flex_float(out, [rows, cols])
    }

    fn dense_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        use burn::tensor::TensorMetadata;
        // f32 only: another dtype keeps its own matmul (and its dtype).
        if x.dtype() != DType::F32 || w.dtype() != DType::F32 {
            return matmul_linear::<Self>(x, w);
        }
        let (m, shape) = (x.shape()[0], w.shape());
        let (rows, cols) = (shape[0], shape[1]);
        // Row tiles in parallel, each through a single-threaded gemm: measured faster on this
        // model than Flex's one multi-threaded gemm per projection (docs/benchmarks.md).
        let out = with_f32(&w, |ws| {
            with_f32(&x, |xs| cpu::dense_linear(xs, m, ws, rows, cols))
        });
        flex_float(out, [m, rows])
    }

    fn nf4_linear(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        // The tiled kernel at every size: measured faster than the fused one in total over a
        // layer's projections from one input row up (`cargo xtask bench nf4 --cpu-kernels`).
        let m = burn::tensor::TensorMetadata::shape(&x)[0];
        let table = table_values(&table);
        let out = with_words(&codes, |words| {
            with_f32(&absmax, |absmax| {
                with_f32(&x, |xs| {
                    cpu::linear_tiled(xs, m, words, absmax, &table, rows, cols)
                })
            })
        });
        flex_float(out, [m, rows])
    }
}

impl<B: Nf4Backend, C: CheckpointStrategy> Nf4Backend for Autodiff<B, C> {
    fn nf4_dequantize(
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        let absmax = <Self as AutodiffBackend>::inner(absmax);
        let table = <Self as AutodiffBackend>::inner(table);
        <Self as AutodiffBackend>::from_inner(B::nf4_dequantize(codes, absmax, table, rows, cols))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nf4::format::{dequantize_nf4, quantize_nf4};

    #[test]
    fn cpu_ops_match_the_format() {
        let (rows, cols) = (24, 96);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 70.0)
            .collect();
        let q = quantize_nf4(&w);
        let device = Default::default();
        let codes = codes_tensor::<Flex>(&q.packed, &device);
        assert_eq!(codes_bytes(&codes, q.packed.len()), q.packed);
        let absmax = Tensor::<Flex, 1>::from_floats(q.absmax.as_slice(), &device);
        let table = Tensor::<Flex, 1>::from_floats(crate::nf4::format::NF4_CODE, &device);
        let dense = dequantize_nf4(&q.packed, &q.absmax, rows * cols);
        let got = Flex::nf4_dequantize(
            codes.clone().into_primitive(),
            absmax.clone().into_primitive().tensor(),
            table.clone().into_primitive().tensor(),
            rows,
            cols,
        );
        let got = Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(got))
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(got, dense);
        let wt = Tensor::<Flex, 2>::from_data(TensorData::new(dense, [rows, cols]), &device);
        for m in [1, 3, 13, 40] {
            let x =
                Tensor::<Flex, 2>::random([m, cols], burn::tensor::Distribution::Default, &device);
            let want = x.clone().matmul(wt.clone().transpose());
            let got = Flex::nf4_linear(
                x.into_primitive().tensor(),
                codes.clone().into_primitive(),
                absmax.clone().into_primitive().tensor(),
                table.clone().into_primitive().tensor(),
                rows,
                cols,
            );
            let got = Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(got));
            let diff = (got - want).abs().max().into_scalar();
            assert!(diff < 1e-4, "m={m}: max diff {diff}");
        }
    }
}
