//! NF4 operations for the other CPU backends burn 0.21 offers, compiled only when their feature
//! is on (they exist to measure which CPU backend is fastest; see `docs/benchmarks.md`). Both
//! dequantize through `TensorData`, copying codes on every call, and multiply with the default
//! dequantize-then-matmul — fine for a comparison of dense models.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};

use super::cpu;
use crate::backend::ModelBackend;

/// Host copies of a code tensor's words, absmax, table and (optionally) an input.
fn host<B: burn::tensor::backend::Backend>(
    codes: IntTensor<B>,
    absmax: FloatTensor<B>,
    table: FloatTensor<B>,
) -> (Vec<u32>, Vec<f32>, [f32; 16]) {
    let words = Tensor::<B, 1, Int>::from_primitive(codes).into_data();
    let words: Vec<u32> = match words.as_slice::<u32>() {
        Ok(w) => w.to_vec(),
        Err(_) => words.iter::<i64>().map(|v| v as u32).collect(),
    };
    let absmax: Vec<f32> = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(absmax))
        .into_data()
        .iter::<f32>()
        .collect();
    let t: Vec<f32> = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(table))
        .into_data()
        .iter::<f32>()
        .collect();
    let mut table = [0f32; 16];
    table.copy_from_slice(&t[..16]);
    (words, absmax, table)
}

fn float<B: burn::tensor::backend::Backend>(
    values: Vec<f32>,
    shape: [usize; 2],
    device: &B::Device,
) -> FloatTensor<B> {
    Tensor::<B, 2>::from_data(TensorData::new(values, shape), device)
        .into_primitive()
        .tensor()
}

/// Implements [`ModelBackend`] for a backend through host copies.
macro_rules! host_nf4 {
    ($backend:ty) => {
        impl ModelBackend for $backend {
            fn nf4_dequantize(
                codes: IntTensor<Self>,
                absmax: FloatTensor<Self>,
                table: FloatTensor<Self>,
                rows: usize,
                cols: usize,
            ) -> FloatTensor<Self> {
                let (words, absmax, table) = host::<Self>(codes, absmax, table);
                float::<Self>(
                    cpu::dequantize(&words, &absmax, &table, rows, cols),
                    [rows, cols],
                    &Default::default(),
                )
            }
        }
    };
}

#[cfg(feature = "ndarray")]
host_nf4!(burn::backend::NdArray);
#[cfg(feature = "candle")]
host_nf4!(burn::backend::Candle);
