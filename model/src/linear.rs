//! The one linear abstraction every projection uses: a base (dense or NF4), an optional bias,
//! and an optional trainable LoRA adapter — `y = base(x) + bias + lora(x)`.
//!
//! A dense base and the bias are [`frozen`] parameters: `Param`s whose tensors do not require
//! gradients, so they receive none and an optimiser leaves them as they are, until
//! [`crate::Qwen2ForCausalLM::into_full_tuning`] marks them trainable (full fine-tuning). An NF4
//! base is packed constants and is never trained. With a LoRA adapter, the adapter's `lora_a` /
//! `lora_b` are the only parameters that require gradients.
//!
//! A frozen dense base may also carry an exact copy of itself in 32-weight blocks
//! ([`BlockWeight`], [`crate::blocks`]) for backends whose decoding kernels read it instead; the
//! copy is dropped whenever the base could change (full fine-tuning, merging an adapter).

use burn::module::{Module, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};

use crate::backend::ModelBackend;
use crate::blocks::{self, BlockFormat};
use crate::lora::Lora;
use crate::nf4::format::{BLOCK, NF4_CODE, quantize_nf4};
use crate::nf4::{codes_bytes, codes_tensor};

/// An NF4-quantized `[rows, cols]` weight kept packed on the device.
#[derive(Module, Debug)]
pub struct Nf4Weight<B: Backend> {
    /// bitsandbytes' packed bytes as `u32` words (eight codes per word).
    pub codes: Tensor<B, 1, Int>,
    /// One f32 scale per 64-element block of the flattened weight (double-quantized absmax is
    /// expanded to f32 at load time: 4 bytes per 64 weights).
    pub absmax: Tensor<B, 1>,
    /// The 16-entry code table (`quant_map`; the NF4 values).
    pub table: Tensor<B, 1>,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
}

impl<B: Backend> Nf4Weight<B> {
    /// Quantizes a dense row-major `[rows, cols]` weight on the host and uploads it packed.
    pub fn quantize(weight: &[f32], rows: usize, cols: usize, device: &B::Device) -> Self {
        let q = quantize_nf4(weight);
        Self::from_parts(&q.packed, &q.absmax, rows, cols, device)
    }

    /// Uploads packed bytes and f32 absmax.
    pub fn from_parts(
        packed: &[u8],
        absmax: &[f32],
        rows: usize,
        cols: usize,
        device: &B::Device,
    ) -> Self {
        debug_assert_eq!(packed.len(), (rows * cols).div_ceil(2));
        debug_assert_eq!(absmax.len(), (rows * cols).div_ceil(BLOCK));
        Self {
            codes: codes_tensor::<B>(packed, device),
            absmax: Tensor::from_floats(absmax, device),
            table: Tensor::from_floats(NF4_CODE, device),
            rows,
            cols,
        }
    }

    /// bitsandbytes' packed bytes, read back from the device.
    pub fn packed_bytes(&self) -> Vec<u8> {
        codes_bytes(&self.codes, (self.rows * self.cols).div_ceil(2))
    }
}

impl<B: ModelBackend> Nf4Weight<B> {
    /// The dequantized `[rows, cols]` weight.
    pub fn dequantize(&self) -> Tensor<B, 2> {
        let out = B::nf4_dequantize(
            self.codes.clone().into_primitive(),
            self.absmax.clone().into_primitive().tensor(),
            self.table.clone().into_primitive().tensor(),
            self.rows,
            self.cols,
        );
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }
}

/// An exact copy of a dense `[rows, cols]` base weight in 32-weight blocks ([`crate::blocks`]).
#[derive(Module, Debug)]
pub struct BlockWeight<B: Backend> {
    /// The blocks' `u32` words.
    pub words: Tensor<B, 1, Int>,
    /// The block format.
    #[module(skip)]
    pub format: BlockFormat,
}

impl<B: Backend> BlockWeight<B> {
    /// Recovers the copy of a host `[rows, cols]` weight and uploads it; `None` when the weight
    /// is not exactly one in any block format ([`crate::blocks::recover`]).
    pub fn recover(values: &[f32], rows: usize, cols: usize, device: &B::Device) -> Option<Self> {
        let (format, words) = blocks::recover(values, rows, cols)?;
        let len = words.len();
        Some(Self {
            words: Tensor::from_data(TensorData::new(words, [len]), (device, DType::U32)),
            format,
        })
    }
}

/// `tensor` as a parameter that does not require gradients (a frozen base weight).
pub fn frozen<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Param<Tensor<B, D>> {
    Param::initialized(ParamId::new(), tensor.set_require_grad(false))
}

/// The base weight of a projection, `[out_features, in_features]` as in PyTorch.
#[derive(Module, Debug)]
pub enum BaseWeight<B: Backend> {
    /// A dense f32 (or bf16) weight: frozen, or trainable under full fine-tuning.
    Dense(Param<Tensor<B, 2>>),
    /// A packed NF4 weight.
    Nf4(Nf4Weight<B>),
}

/// A projection: frozen base, optional frozen bias, optional LoRA adapter.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// The base weight.
    pub weight: BaseWeight<B>,
    /// The bias (`q_proj`, `k_proj` and `v_proj` have one in Qwen2); frozen like the base.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// The adapter, when one is attached.
    pub lora: Option<Lora<B>>,
    /// An exact block copy of a dense base, for decoding ([`ModelBackend::dense_linear_blocks`]).
    pub block_copy: Option<BlockWeight<B>>,
}

impl<B: Backend> Linear<B> {
    /// A projection with a dense base.
    pub fn dense(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Self {
        Self {
            weight: BaseWeight::Dense(frozen(weight)),
            bias: bias.map(frozen),
            lora: None,
            block_copy: None,
        }
    }

    /// `[out_features, in_features]`.
    pub fn shape(&self) -> [usize; 2] {
        match &self.weight {
            BaseWeight::Dense(w) => w.val().dims(),
            BaseWeight::Nf4(w) => [w.rows, w.cols],
        }
    }

    /// Whether the base is NF4.
    pub fn is_nf4(&self) -> bool {
        matches!(self.weight, BaseWeight::Nf4(_))
    }
}

impl<B: ModelBackend> Linear<B> {
    /// Applies the projection.
    ///
    /// # Shapes
    /// - `x`: `[n, in_features]`
    /// - output: `[n, out_features]`
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let mut y = self.base_forward(x.clone());
        if let Some(bias) = &self.bias {
            y = y + bias.val().unsqueeze_dim(0);
        }
        if let Some(lora) = &self.lora {
            y = y + lora.forward(x);
        }
        y
    }

    /// `x · Wᵀ` through the base alone, for `x` `[m, in_features]`.
    ///
    /// Through the backend's [`ModelBackend::dense_linear`] / [`ModelBackend::nf4_linear`]: the
    /// weight stays in its stored row-major layout, so no backend copies a transposed weight.
    pub fn base_forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        match &self.weight {
            BaseWeight::Dense(w) => {
                let (x, w) = (
                    x.into_primitive().tensor(),
                    w.val().into_primitive().tensor(),
                );
                Tensor::from_primitive(TensorPrimitive::Float(match &self.block_copy {
                    Some(copy) => B::dense_linear_blocks(
                        x,
                        w,
                        copy.words.clone().into_primitive(),
                        copy.format,
                    ),
                    None => B::dense_linear(x, w),
                }))
            }
            BaseWeight::Nf4(w) => Tensor::from_primitive(TensorPrimitive::Float(B::nf4_linear(
                x.into_primitive().tensor(),
                w.codes.clone().into_primitive(),
                w.absmax.clone().into_primitive().tensor(),
                w.table.clone().into_primitive().tensor(),
                w.rows,
                w.cols,
            ))),
        }
    }

    /// The base weight as a dense `[out, in]` tensor (dequantized if NF4).
    pub fn dense_weight(&self) -> Tensor<B, 2> {
        match &self.weight {
            BaseWeight::Dense(w) => w.val(),
            BaseWeight::Nf4(w) => w.dequantize(),
        }
    }

    /// Folds the adapter into a dense base (`W + scale · B·A`) and drops it; an NF4 base is
    /// dequantized first, so the result is dense.
    pub fn merge(self) -> Self {
        let Some(lora) = &self.lora else { return self };
        let merged = self.dense_weight() + lora.delta_weight();
        Self {
            weight: BaseWeight::Dense(frozen(merged)),
            bias: self.bias,
            lora: None,
            block_copy: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Cpu;
    use burn::tensor::{Distribution, TensorData};

    type B = Cpu;

    #[test]
    fn nf4_and_dense_bases_agree_after_dequantization() {
        let device = Default::default();
        let (rows, cols) = (32, 128);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 13 % 97) as f32 - 48.0) / 200.0)
            .collect();
        let nf4 = Nf4Weight::<B>::quantize(&w, rows, cols, &device);
        let dense = Linear::dense(nf4.dequantize(), None);
        let quant = Linear {
            weight: BaseWeight::Nf4(nf4),
            bias: None,
            lora: None,
            block_copy: None,
        };
        for seq in [1, 20] {
            let x = Tensor::<B, 2>::random([2 * seq, cols], Distribution::Default, &device);
            let diff = (dense.forward(x.clone()) - quant.forward(x))
                .abs()
                .max()
                .into_scalar();
            assert!(diff < 1e-4, "seq {seq}: {diff}");
        }
    }

    #[test]
    fn bias_is_added() {
        let device = Default::default();
        let w = Tensor::<B, 2>::from_data(
            TensorData::new(vec![1.0f32, 0.0, 0.0, 1.0], [2, 2]),
            &device,
        );
        let bias = Tensor::<B, 1>::from_floats([10.0, 20.0], &device);
        let lin = Linear::dense(w, Some(bias));
        let x = Tensor::<B, 2>::from_data(TensorData::new(vec![1.0f32, 2.0], [1, 2]), &device);
        assert_eq!(
            lin.forward(x).into_data().to_vec::<f32>().unwrap(),
            vec![11.0, 22.0]
        );
    }
}
