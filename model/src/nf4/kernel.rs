//! The NF4 dequantization kernel for the GPU backends, written in CubeCL so the same source
//! compiles to WGSL/SPIR-V (wgpu) and PTX (CUDA).
//!
//! One invocation per `u32` word: it reads eight packed codes, looks each up in the code table
//! and scales it by its block's absmax. The matmul against the dequantized weight is burn's own
//! (autotuned) matmul; the temporary weight lives only for the duration of the projection.

use burn::tensor::Shape;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

use crate::backend::ModelBackend;

/// Dequantizes eight NF4 codes per invocation: `output[e] = table[code(e)] * absmax[e / 64]`.
#[cube(launch)]
pub fn nf4_dequantize_kernel<F: Float>(
    codes: &Tensor<u32>,
    absmax: &Tensor<F>,
    table: &Tensor<F>,
    output: &mut Tensor<F>,
) {
    let word_index = ABSOLUTE_POS;
    let n = output.len();
    let base = word_index * 8;
    if base >= n {
        terminate!();
    }
    let word = codes[word_index];
    #[unroll]
    for j in 0..8u32 {
        let e = base + j as usize;
        if e < n {
            let byte = (word >> (8 * (j / 2))) & 0xFF;
            let code = if j % 2 == 0 { byte >> 4 } else { byte & 0xF };
            output[e] = table[code as usize] * absmax[e / 64];
        }
    }
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> ModelBackend
    for CubeBackend<R, F, I, BT>
{
    /// CubeCL's largest page: the adapter's storage-buffer binding limit on wgpu, a quarter of
    /// the device memory on CUDA.
    fn max_buffer_bytes(device: &Self::Device) -> Option<usize> {
        let bytes = R::client(device).properties().memory.max_page_size;
        Some(usize::try_from(bytes).unwrap_or(usize::MAX))
    }

    fn nf4_dequantize(
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        let codes: CubeTensor<R> = into_contiguous(codes);
        let absmax: CubeTensor<R> = into_contiguous(absmax);
        let table: CubeTensor<R> = into_contiguous(table);
        let n = rows * cols;
        let client = absmax.client.clone();
        let buffer = client.empty(n * core::mem::size_of::<F>());
        let output = CubeTensor::new_contiguous(
            client.clone(),
            absmax.device.clone(),
            Shape::from([rows, cols]),
            buffer,
            F::dtype(),
        );
        let words = n.div_ceil(8);
        let cube_dim = CubeDim::new(&client, words);
        let cube_count = calculate_cube_count_elemwise(&client, words, cube_dim);
        nf4_dequantize_kernel::launch::<F, R>(
            &client,
            cube_count,
            cube_dim,
            codes.into_tensor_arg(),
            absmax.into_tensor_arg(),
            table.into_tensor_arg(),
            output.clone().into_tensor_arg(),
        );
        output
    }
}
